"""The one module that imports LMCache: its storage layer (the embedded store's L1 and L2
tiers), its L2 adapter configuration parser, and the client of a running
`lmcache server`. Everything gemma4-kv needs of LMCache goes through the names here,
so a new LMCache version is checked and adapted in one place (`check_version`).

Supported: LMCache 0.5.6 exactly (its storage layer's API and the engine-driven wire
format of its server change between releases).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SUPPORTED_VERSION = "0.5.6"


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

def _l2():
    from lmcache.v1.distributed.l2_adapters import config

    return config


def parse_l2_adapters(specs: Sequence[dict]):
    """LMCache's parsed configuration of these adapter specs, through the same argument
    parser as `lmcache server --l2-adapter JSON` (raises what LMCache raises)."""
    l2 = _l2()
    parser = l2.add_l2_adapters_args(argparse.ArgumentParser(add_help=False))
    args = parser.parse_args([a for s in specs for a in ("--l2-adapter", json.dumps(s))])
    return l2.parse_args_to_l2_adapters_config(args)


def l2_logger() -> logging.Logger:
    return logging.getLogger(_l2().__name__)


def l2_adapter_types() -> list[str]:
    return list(_l2().get_registered_l2_adapter_types())


def l2_adapter_class(type_name: str):
    """LMCache's config class of an adapter type (ImportError / ValueError if none)."""
    l2 = _l2()
    # LMCache's loader imports every adapter module before this one until the name
    # registers; importing `<type>_l2_adapter` first (its naming rule) saves seconds.
    module = f"{l2.__name__.rsplit('.', 1)[0]}.{type_name.replace('-', '_')}_l2_adapter"
    if type_name.replace("-", "_").isidentifier() and importlib.util.find_spec(module):
        importlib.import_module(module)
    return l2.get_l2_adapter_config_class(type_name)


# -- the storage layer ------------------------------------------------------------------

@dataclass(frozen=True)
class Stored:
    """One object read from L1: its KV tensor and integrity trailer, as laid out."""

    kv: torch.Tensor
    trailer: torch.Tensor
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
        memory = cfg.L1MemoryManagerConfig(size_in_bytes=cpu_bytes, use_lazy=False,
                                           shm_name="")
        self.align = memory.align_bytes
        self._sm = StorageManager(cfg.StorageManagerConfig(
            l1_manager_config=cfg.L1ManagerConfig(memory_config=memory),
            eviction_config=cfg.EvictionConfig(eviction_policy="noop"),
            prefetch_policy=prefetch_policy,
            l2_adapter_config=parse_l2_adapters(l2_specs)))

    def key(self, chunk_hash: bytes, namespace: str, kv_rank: int, group_id: int):
        return self._api.ObjectKey(chunk_hash=chunk_hash, model_name=namespace,
                                   kv_rank=kv_rank, object_group_id=group_id)

    def layout(self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]):
        return self._api.MemoryLayoutDesc(shapes=list(shapes), dtypes=list(dtypes))

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
        sm = self._sm
        result = sm.query_prefetch_status(sm.submit_prefetch_task(
            self._spec([(group_id, keys, layout, -1)], "full", lock), skip_l2=True))
        return result.hit_cells[0].get_indices_list() if result else []

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

    def read(self, keys: list) -> dict:
        """{key: Stored} of these read-locked keys (those still in L1)."""
        found = self._sm.unsafe_read(keys)
        return {k: Stored(o.get_tensor(0), o.get_tensor(1), list(o.get_shapes()),
                          list(o.get_dtypes())) for k, o in zip(*found)}

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
        """LMCache's own account of L1: object, read- and write-locked counts, bytes."""
        return self._sm.report_status()["l1_manager"]

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
