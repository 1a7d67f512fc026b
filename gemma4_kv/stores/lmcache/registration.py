"""What gemma4-kv registers with LMCache: the `resp` L2 adapter built over
`resp_client.RespClient` (`RESP_TYPE`), and serdes (`register_serde`). Each is
registered once per process, before LMCache's parsers or factories look for it.
"""

from __future__ import annotations

import functools
import os

RESP_TYPE = "gemma4_kv_resp"
"""The adapter type a `"type": "resp"` spec is built as in this process: LMCache's
`NativeConnectorL2Adapter` over `resp_client.RespClient`, which wraps LMCache's C++
client (`lmcache_redis`) and survives what it does not (see that module)."""


def l2_config():
    from lmcache.v1.distributed.l2_adapters import config

    _register_resp(config)
    return config


@functools.cache
def _register_resp(config) -> None:
    from lmcache.v1.distributed.l2_adapters.factory import register_l2_adapter_factory
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig

    class RespConfig(RESPL2AdapterConfig):
        """LMCache's `resp` fields, and `request_timeout` (seconds a batch may take,
        plus 10 s per GB it moves, before its connection is retired: a miss)."""

        request_timeout: float = 5.0

        @classmethod
        def from_dict(cls, d: dict) -> RespConfig:
            base = RESPL2AdapterConfig.from_dict(d)
            t = d.get("request_timeout", 5.0)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
                raise ValueError("request_timeout must be a number of seconds in (0, 3600]")
            cfg = cls(base.host, base.port, base.num_workers, base.username, base.password,
                      base.max_capacity_gb)
            cfg.request_timeout = float(t)
            return cfg

        @classmethod
        def help(cls) -> str:
            return (RESPL2AdapterConfig.help() + "\n- request_timeout (float): seconds a "
                    "batch may take, plus 10 s per GB it moves (default 5)")

    if RESP_TYPE not in config.get_registered_l2_adapter_types():
        config.register_l2_adapter_type(RESP_TYPE, RespConfig)
        register_l2_adapter_factory(RESP_TYPE, _create_resp_adapter)


def _create_resp_adapter(config, l1_memory_desc=None):
    """LMCache's factory signature: the adapter of one `resp` spec."""
    from lmcache.lmcache_redis import LMCacheRedisClient
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter)

    from ..resp_client import RespClient

    # As LMCache's own resp factory: the spec first, its environment variables after.
    host = config.host or os.environ.get("LMCACHE_RESP_HOST", "")
    port = config.port or int(os.environ.get("LMCACHE_RESP_PORT", "0"))
    user = config.username or os.environ.get("LMCACHE_RESP_USERNAME", "")
    password = config.password or os.environ.get("LMCACHE_RESP_PASSWORD", "")
    client = RespClient(
        lambda: LMCacheRedisClient(host, port, config.num_workers, user, password),
        request_timeout_s=config.request_timeout, name=f"resp {host}:{port}")
    return NativeConnectorL2Adapter(client, max_capacity_gb=config.max_capacity_gb,
                                    type_name="resp")


def built_type(type_name):
    """The adapter type a spec of `type_name` is built as here."""
    return RESP_TYPE if type_name == "resp" else type_name


def built_as(spec: dict) -> dict:
    built = built_type(spec.get("type"))
    return spec if built == spec.get("type") else {**spec, "type": built}


def register_serde(name: str, make) -> None:
    """Register a serde with LMCache's factory, once per process: `make(kwargs)` gives
    (serializer, deserializer), objects with the methods of LMCache's `Serializer` and
    `Deserializer`; LMCache runs them on one worker thread per tier."""
    from lmcache.v1.distributed.serde import (AsyncSerdeProcessor,
                                              get_registered_serde_types,
                                              register_serde_factory)

    if name not in get_registered_serde_types():
        register_serde_factory(name, lambda kw: AsyncSerdeProcessor(*make(kw)))
