"""The one module that imports LMCache: its storage layer (the embedded store's L1 and L2
tiers), its L2 adapter configuration parser with what 0.5.6 gets wrong about a spec
(`check_l2_adapter`), and the client of a running `lmcache server`. Everything gemma4-kv
needs of LMCache goes through the names here, so a new LMCache version is checked and
adapted in one place (`check_version`).

Supported: LMCache 0.5.6 exactly (its storage layer's API and the engine-driven wire
format of its server change between releases).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SUPPORTED_VERSION = "0.5.6"
KEY_CACHE = 1 << 14
"""ObjectKeys kept for reuse (16 documents of 32 chunks in 6 groups are 3072)."""


class UnsupportedLMCache(RuntimeError):
    """The installed LMCache is not the version this package speaks."""


def check_version() -> str:
    """The installed LMCache version; raises if it is not the supported one."""
    try:
        version = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        raise UnsupportedLMCache("gemma4-kv needs LMCache, which is not installed; fix: "
                                 "pip install 'gemma4-kv[lmcache]'") from None
    if version != SUPPORTED_VERSION:
        raise UnsupportedLMCache(
            f"gemma4-kv speaks LMCache {SUPPORTED_VERSION}'s storage API, found {version}; "
            f"fix: pip install lmcache=={SUPPORTED_VERSION}")
    return version


def set_log_level(level: str) -> None:
    """Keep LMCache's own logs (one INFO line per prefetch) at `level`. LMCache reads
    LMCACHE_LOG_LEVEL when it creates a logger and gives each its own handler, so set
    both the variable (for loggers still to come) and every existing one."""
    os.environ["LMCACHE_LOG_LEVEL"] = level
    for name, log in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("lmcache") and isinstance(log, logging.Logger):
            log.setLevel(level)
            for handler in log.handlers:
                handler.setLevel(level)


# -- L2 adapter configuration (what `lmcache server --l2-adapter JSON` accepts) -----------

RESP_TYPE = "gemma4_kv_resp"
"""The adapter type a `"type": "resp"` spec is built as in this process: LMCache's
`NativeConnectorL2Adapter` over `resp_client.RespClient`, which wraps LMCache's C++
client (`lmcache_redis`) and survives what it does not (see that module)."""


def _l2():
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

    from .resp_client import RespClient

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


def _built_type(type_name):
    """The adapter type a spec of `type_name` is built as here."""
    return RESP_TYPE if type_name == "resp" else type_name


def _built_as(spec: dict) -> dict:
    built = _built_type(spec.get("type"))
    return spec if built == spec.get("type") else {**spec, "type": built}


def parse_l2_adapters(specs: Sequence[dict]):
    """LMCache's parsed configuration of these adapter specs, through the same argument
    parser as `lmcache server --l2-adapter JSON` (raises what LMCache raises); a `resp`
    spec is built as `RESP_TYPE`."""
    l2 = _l2()
    parser = l2.add_l2_adapters_args(argparse.ArgumentParser(add_help=False))
    args = parser.parse_args([a for s in specs
                              for a in ("--l2-adapter", json.dumps(_built_as(s)))])
    return l2.parse_args_to_l2_adapters_config(args)


def l2_adapter_types() -> list[str]:
    return list(_l2().get_registered_l2_adapter_types())


def l2_adapter_class(type_name: str):
    """LMCache's config class of an adapter type (ImportError / ValueError if none)."""
    l2 = _l2()
    type_name = _built_type(type_name)
    # LMCache's loader imports every adapter module before this one until the name
    # registers; importing `<type>_l2_adapter` first (its naming rule) saves seconds.
    module = f"{l2.__name__.rsplit('.', 1)[0]}.{type_name.replace('-', '_')}_l2_adapter"
    if type_name.replace("-", "_").isidentifier() and importlib.util.find_spec(module):
        importlib.import_module(module)
    return l2.get_l2_adapter_config_class(type_name)


class L2AdapterRejected(ValueError):
    """An adapter spec that cannot be used here: what is wrong (`problem`) and what to
    write instead (`fix`), phrased for the user (the settings add where it sits)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


_ONE_TENSOR_SERDES = ("fp8", "turboquant")
"""LMCache 0.5.6 serdes whose serializer reads an object as one tensor: on our objects
(KV and checksum trailer) it raises, so every store into that tier fails."""
_GENERIC_BOOLS = ("shared", "persist_enabled")  # read with bool() by LMCache: "false" is True


def check_l2_adapter(spec: dict) -> None:
    """Refuse an adapter spec (a JSON object) that LMCache 0.5.6's own parser rejects,
    that it would misread (values it coerces or checks no range of), or whose tier would
    store nothing of ours; raises `L2AdapterRejected`. Needs LMCache only for a spec
    that passes gemma4-kv's own checks."""
    type_name = spec.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise L2AdapterRejected('needs a "type" string (the LMCache adapter type)',
                                'add "type": "valkey" (or "fs_native", "p2p", ...)')
    serde = spec.get("serde")
    serde_type = serde.get("type") if isinstance(serde, dict) else None
    if serde_type in _ONE_TENSOR_SERDES:
        raise L2AdapterRejected(
            f'(type "{type_name}") field "serde" (type "{serde_type}") cannot be used: '
            f"LMCache 0.5.6's {serde_type} serde reads an object as one tensor, and "
            "gemma4-kv's objects carry their checksum trailer as a second one: every "
            "store into this tier fails, so nothing is ever stored (and a lossy copy "
            "could not pass the checksum)", 'remove "serde"')
    if serde_type == "gemma4_kv":
        raise L2AdapterRejected(
            f'(type "{type_name}") field "serde" (type "gemma4_kv") is set by l2_codec, '
            "which also puts the codec in the key fingerprint", 'remove "serde" and set '
            '"l2_codec" instead')
    where = _non_finite(spec)
    if where is not None:
        raise L2AdapterRejected(f'(type "{type_name}") holds a NaN or infinity at {where}',
                                "write a finite number")
    for k in _GENERIC_BOOLS:
        if k in spec and not isinstance(spec[k], bool):
            raise L2AdapterRejected(f'(type "{type_name}") field "{k}" must be true or '
                                    "false (LMCache reads any non-empty value as true)",
                                    f'write "{k}": true or false, unquoted')
    eviction = spec.get("eviction")
    for k in ("trigger_watermark", "eviction_ratio") if isinstance(eviction, dict) else ():
        x = eviction.get(k, 0.5)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x <= 1:
            raise L2AdapterRejected(
                f'(type "{type_name}") field "eviction"["{k}"] must be a number in (0, 1] '
                "(LMCache converts it with float() and checks no range)",
                f'write e.g. "{k}": 0.8')
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise L2AdapterRejected(f'(type "{type_name}") is not JSON ({e})',
                                "use only JSON values") from None
    _parsed(spec, type_name)


def l2_adapter_endpoints(spec: dict) -> tuple[list[tuple[str, int]], bool]:
    """(host, port) pairs a checked network adapter spec connects to, as LMCache parses
    them, and whether one reachable pair is enough (a Valkey cluster finds the rest from
    any seed); ([], True) for a tier that is not on the network."""
    kind = spec.get("type")
    if kind == "resp":
        cfg = _parsed(spec, kind)
        return [(cfg.host, cfg.port)], False
    if kind != "valkey":
        return [], True
    cfg = _parsed(spec, kind)
    if cfg.cluster_mode:
        return list(cfg.startup_nodes), True
    return list(cfg.startup_nodes[:1]), False  # standalone Valkey uses the first node only


def _parsed(spec: dict, type_name: str):
    """LMCache's parsed config of one adapter (the `lmcache server --l2-adapter`
    parser), or `L2AdapterRejected` with LMCache's reason and its help for the fields."""
    config_cls = _adapter_class(type_name)
    quiet = logging.getLogger(_l2().__name__)
    was, quiet.disabled = quiet.disabled, True  # it logs the error and help; we raise them
    try:
        return parse_l2_adapters([spec]).adapters[0]
    except Exception as e:  # LMCache raises ValueError, and TypeError/KeyError from fields
        msg = re.sub(r"^--l2-adapter #\d+ \([^)]*\): ", "", str(e)) or type(e).__name__
        fields_help = " ".join(config_cls.help().split())
        raise L2AdapterRejected(f'(type "{type_name}") is rejected by LMCache: {msg}',
                                f"correct that field; {fields_help}") from None
    finally:
        quiet.disabled = was


def _adapter_class(type_name: str):
    """LMCache's config class for an adapter type, or `L2AdapterRejected` saying why
    there is none."""
    try:
        return l2_adapter_class(type_name)
    except ImportError as e:
        raise L2AdapterRejected(
            f'(type "{type_name}") cannot be used here: LMCache\'s adapter module fails '
            f"to import ({e})", f"install what it needs (pip install "
            f"{e.name or 'the missing package'}) or remove this adapter") from None
    except ValueError:
        pass
    known = [t for t in l2_adapter_types() if t != RESP_TYPE]
    close = ["valkey"] if type_name.lower() == "redis" else \
        difflib.get_close_matches(type_name, known, n=2, cutoff=0.6)
    hint = f'did you mean "{close[0]}"? ' if close else ""
    raise L2AdapterRejected(f'has an adapter type LMCache does not know: "{type_name}"',
                            f"{hint}types available here: {', '.join(known)}")


def _non_finite(v, path: str = "") -> str | None:
    """Where inside `v` a NaN or infinity sits (LMCache's range checks let them through)."""
    if isinstance(v, float) and not math.isfinite(v):
        return path
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        found = _non_finite(x, f"{path}[{_json(k)}]")
        if found is not None:
            return found
    return None


def _json(v) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def register_serde(name: str, make) -> None:
    """Register a serde with LMCache's factory, once per process: `make(kwargs)` gives
    (serializer, deserializer), objects with the methods of LMCache's `Serializer` and
    `Deserializer`; LMCache runs them on one worker thread per tier."""
    from lmcache.v1.distributed.serde import (AsyncSerdeProcessor,
                                              get_registered_serde_types,
                                              register_serde_factory)

    if name not in get_registered_serde_types():
        register_serde_factory(name, lambda kw: AsyncSerdeProcessor(*make(kw)))


# -- the storage layer ------------------------------------------------------------------

@dataclass(frozen=True)
class Stored:
    """One object read from L1: its KV tensor and integrity trailer (None where not
    asked for), as laid out."""

    kv: torch.Tensor
    trailer: torch.Tensor | None
    shapes: list
    dtypes: list


@dataclass(frozen=True)
class PrefetchOutcome:
    """Per key row of a prefetch: indices now resident (and read-locked), and those of
    them brought up from L2."""

    hit: list[list[int]]
    from_l2: list[list[int]]


class StorageLayer:
    """LMCache's StorageManager: pinned (with CUDA) CPU L1, L2 adapters behind it. The
    eviction policy is "noop": the embedded store decides what leaves L1
    (`capacity.py`) and deletes it itself."""

    def __init__(self, cpu_bytes: int, l2_specs: Sequence[dict] = (),
                 prefetch_policy: str = "retain"):
        check_version()
        from lmcache.v1.distributed import api, config as cfg
        from lmcache.v1.distributed.storage_manager import StorageManager

        self._api = api
        # A lookup names every group's object of every chunk of its prompt, and the
        # same prompts come back: building an ObjectKey (a frozen dataclass) costs
        # tens of times a cache hit. Keys are immutable, so sharing them is safe.
        self._key = functools.lru_cache(maxsize=KEY_CACHE)(self._new_key)
        memory = cfg.L1MemoryManagerConfig(size_in_bytes=cpu_bytes, use_lazy=False,
                                           shm_name="")
        self.align = memory.align_bytes
        self._sm = StorageManager(cfg.StorageManagerConfig(
            l1_manager_config=cfg.L1ManagerConfig(memory_config=memory),
            eviction_config=cfg.EvictionConfig(eviction_policy="noop"),
            prefetch_policy=prefetch_policy,
            l2_adapter_config=parse_l2_adapters(l2_specs)))

    def key(self, chunk_hash: bytes, namespace: str, kv_rank: int, group_id: int):
        return self._key(chunk_hash, namespace, kv_rank, group_id)

    def _new_key(self, chunk_hash: bytes, namespace: str, kv_rank: int, group_id: int):
        return self._api.ObjectKey(chunk_hash=chunk_hash, model_name=namespace,
                                   kv_rank=kv_rank, object_group_id=group_id)

    def layout(self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]):
        return self._api.MemoryLayoutDesc(shapes=list(shapes), dtypes=list(dtypes))

    @staticmethod
    def aligned_bytes(shapes, dtypes) -> int:
        """`allocated_bytes` before a storage layer exists (LMCache's default alignment,
        the one `__init__` uses)."""
        from lmcache.v1.distributed import config as cfg

        align = cfg.L1MemoryManagerConfig(size_in_bytes=1 << 20, use_lazy=False,
                                          shm_name="").align_bytes
        n = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                for s, d in zip(shapes, dtypes))
        return -(-n // align) * align

    def allocated_bytes(self, shapes, dtypes) -> int:
        """Bytes L1 spends on one object of this layout (tensors plus alignment)."""
        n = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                for s, d in zip(shapes, dtypes))
        return -(-n // self.align) * self.align

    def _spec(self, rows, policy: str, lock: bool):
        api = self._api
        return api.PrefetchTaskSpec(
            key_groups=[api.GroupedObjectKeys(keys=keys, object_group_id=gid,
                                              layout_desc=layout, sliding_window_size=window)
                        for gid, keys, layout, window in rows],
            fetching_policy=policy,
            lock_mode=api.PrefetchLockMode.LOCK if lock else api.PrefetchLockMode.NO_LOCK)

    def resident(self, group_id: int, keys: list, layout, lock: bool) -> list[int]:
        """Indices of `keys` in L1 now (read-locked if `lock`); L1 only, no wait."""
        if not keys:
            return []
        result = self._query([(group_id, keys, layout)], lock)
        return result.hit_cells[0].get_indices_list() if result else []

    def resident_rows(self, rows: Sequence[tuple[int, list, object]]) -> list[list[int]]:
        """Per row of (group id, keys, layout), all rows of one length: the indices of
        its keys in L1 now, each row on its own. One LMCache call for all rows (its
        cost is mostly per call, not per key); L1 only, no locks, no wait."""
        if not rows or not rows[0][1]:
            return [[] for _ in rows]
        result = self._query(rows, False)
        return [r.get_indices_list() for r in result.found_cells] if result else \
            [[] for _ in rows]

    def lock_columns(self, rows: Sequence[tuple[int, list, object]]) -> list[int]:
        """Rows of (group id, keys, layout), all of one length: the columns (key
        indices) whose object sits in L1 in every row, those objects read-locked (a
        column missing in any row is locked in none: LMCache's "full" rule). One call."""
        if not rows or not rows[0][1]:
            return []
        result = self._query(rows, True)
        return result.hit_cells[0].get_indices_list() if result else []

    def _query(self, rows, lock: bool):
        sm = self._sm
        return sm.query_prefetch_status(sm.submit_prefetch_task(
            self._spec([(*r, -1) for r in rows], "full", lock), skip_l2=True))

    def prefetch(self, rows: list[tuple[int, list, object, int]], policy: str):
        """Start bringing objects up from L2, read-locking what lands: rows of (group
        id, keys, layout, sliding window in chunks or -1), policy "prefix" or "full"."""
        return self._sm.submit_prefetch_task(self._spec(rows, policy, lock=True))

    def prefetch_outcome(self, handle) -> PrefetchOutcome | None:
        result = self._sm.query_prefetch_status(handle)
        if result is None:
            return None
        return PrefetchOutcome([r.get_indices_list() for r in result.hit_cells],
                               [r.get_indices_list() for r in result.l2_hit_cells])

    def read(self, keys: list, trailers: bool = True) -> dict:
        """{key: Stored} of these read-locked keys (those still in L1); without
        `trailers`, no trailer views (a pin needs the KV only, and views cost host time)."""
        found = self._sm.unsafe_read(keys)
        return {k: Stored(o.get_tensor(0), o.get_tensor(1) if trailers else None,
                          list(o.get_shapes()), list(o.get_dtypes()))
                for k, o in zip(*found)}

    def unlock(self, keys: list) -> None:
        if keys:
            self._sm.finish_read_prefetched(keys)

    def reserve(self, keys: list, layout) -> dict:
        """{key: (KV tensor, trailer tensor)} of the objects L1 could allocate."""
        got = self._sm.reserve_write(keys, layout)
        return {k: (o.get_tensor(0), o.get_tensor(1)) for k, o in got.items()}

    def publish(self, keys: list) -> None:
        """Make reserved, written objects visible (and hand them to the L2 tiers)."""
        if keys:
            self._sm.finish_write(keys)

    def discard(self, keys: list) -> None:
        """Drop reserved objects never published (no reader can hold them)."""
        if keys:
            self._sm.delete_l1_keys(keys, force=True)

    def delete(self, keys: list) -> None:
        """Delete objects from L1; read-locked ones stay (see `resident` afterwards)."""
        if keys:
            self._sm.delete_l1_keys(keys)

    def delete_everywhere(self, keys: list) -> None:
        """Delete objects from L1 and from every L2 tier (they are bad)."""
        self._sm.delete_l1_keys(keys)
        for _, adapter in self._sm.l2_adapters():
            adapter.delete(keys)

    def usage(self) -> tuple[int, int]:
        return self._sm.get_l1_usage()

    def status(self) -> dict:
        """LMCache's own account of L1: object, read- and write-locked counts, bytes.
        The store decides nothing on it; it is how an outside check sees what L1 holds
        (the soak benchmark's snapshots, through tests/faults.py, and the tests)."""
        return self._sm.report_status()["l1_manager"]

    @property
    def storage_manager(self):
        """LMCache's StorageManager itself, the one way to it from outside this module:
        fault injection (tests/faults.py, tests/test_store.py replace its reads and its
        L2 adapters' answers) reaches it here. The store uses the methods above only."""
        return self._sm

    def l2_writes_in_flight(self) -> int:
        """Published objects waiting for LMCache's store thread, plus its L2 store tasks
        that have not ended (stored or failed); 0 without an L2 tier. Objects that
        thread has just taken off its queue are in neither count until it has
        read-locked them (`status`), once it has picked their tier: a caller can read
        0 in between (seen on a loaded machine). LMCache reports nothing that closes
        that gap."""
        return sum(c["pending_keys_count"] + c["in_flight_task_count"]
                   for c in self._sm.report_status()["store_controllers"].values())

    def clear(self) -> None:
        """Delete every object no reader or writer holds."""
        self._sm.clear(force=False)

    def close(self) -> None:
        self._sm.close()


# -- the client of a running `lmcache server` (engine-driven mode) ------------------------

def server_client(url: str):
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    check_version()
    return RequestClientFactory.create(url)


def server_registration(**fields):
    from lmcache.v1.multiprocess.custom_types import RegisterEngineDrivenContextPayload

    return RegisterEngineDrivenContextPayload(**fields)


def server_key(**fields):
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    return IPCCacheServerKey(**fields)
