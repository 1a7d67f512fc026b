"""The one package that imports LMCache (its public names only). Everything gemma4-kv
needs of LMCache goes through the names here, so a new LMCache version is checked and
adapted in this package alone (`check_version`):

- `version`: which LMCache is installed and supported, and its log level;
- `server`: the wire of a running `lmcache server`, a typed facade (`ServerWire`) with
  one method per call the server store makes;
- `storage`: LMCache's storage layer (`StorageLayer`), the embedded store's tiers;
- `l2_specs`: L2 adapter specs, parsed by LMCache's own parser and checked for what
  0.5.6 gets wrong (`check_l2_adapter`);
- `registration`: what gemma4-kv registers with LMCache (the `resp` adapter over
  `resp_client.RespClient`, serdes).
"""

from .l2_specs import (L2AdapterRejected, check_l2_adapter, l2_adapter_class,
                       l2_adapter_endpoints, l2_adapter_types, parse_l2_adapters)
from .registration import RESP_TYPE, register_serde
from .server import GroupShape, Pending, Registration, ServerKey, ServerWire, Slots
from .storage import KEY_CACHE, PrefetchOutcome, StorageLayer, Stored
from .version import SUPPORTED_VERSION, UnsupportedLMCache, check_version, set_log_level

__all__ = ["KEY_CACHE", "RESP_TYPE", "SUPPORTED_VERSION", "GroupShape", "L2AdapterRejected",
           "Pending", "PrefetchOutcome", "Registration", "ServerKey", "ServerWire", "Slots",
           "StorageLayer", "Stored", "UnsupportedLMCache", "check_l2_adapter",
           "check_version", "l2_adapter_class", "l2_adapter_endpoints", "l2_adapter_types",
           "parse_l2_adapters", "register_serde", "set_log_level"]
