"""The chunk store: LMCache's storage layer, embedded in-process.

One LMCache object per (chunk, group), KV_2LTD-shaped for that group, keyed by
`ObjectKey(chunk_hash, fingerprint, kv_rank, object_group_id=group_id)`. L1 is
LMCache's CPU pool (pinned when CUDA is present) with LRU eviction; an optional
local-disk L2 (`fs_native`) catches what L1 evicts. This is the same storage
manager `lmcache server` runs, so nothing here is a home-made store.

Writes are two-phase: `reserve` every group's object of a chunk, fill them,
`commit` them together (or `abort`): a chunk is stored for all groups or none.
Reads pin objects with read locks until `release`, so eviction cannot pull KV
from under a load.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layout import KVLayout

logger = logging.getLogger(__name__)

ChunkKey = tuple[bytes, int]
"""(chunk hash, group id)."""


@dataclass(frozen=True)
class StoreConfig:
    """Sizes and tiers of the embedded store (`kv_connector_extra_config` keys)."""

    cpu_bytes: int = 4 << 30
    disk_path: str | None = None
    disk_gb: float = 0.0
    l2_adapters: tuple[dict, ...] = ()
    """More LMCache L2 tiers, as `lmcache server --l2-adapter` JSON objects (e.g.
    {"type": "resp", ...} for Redis/Valkey, "fs_native" on a shared mount, "p2p")."""
    eviction_policy: str = "LRU"
    lookup_timeout_s: float = 5.0

    def adapter_specs(self) -> list[dict]:
        specs = list(self.l2_adapters)
        if self.disk_path:
            disk = {"type": "fs_native", "base_path": self.disk_path, "num_workers": 4,
                    "max_capacity_gb": self.disk_gb}
            if self.disk_gb:
                disk["eviction"] = {"eviction_policy": "LRU"}
            specs.insert(0, disk)
        return specs


def _lmcache():
    from lmcache.v1.distributed import api, config
    from lmcache.v1.distributed.storage_manager import StorageManager

    return api, config, StorageManager


def object_layouts(layout: KVLayout, chunk_size: int) -> dict:
    """LMCache's description of each group's object: one KV_2LTD tensor."""
    api, _, _ = _lmcache()
    return {g.group_id: api.MemoryLayoutDesc(shapes=[torch.Size(g.chunk_shape(chunk_size))],
                                            dtypes=[g.dtype])
            for g in layout.groups}


class ChunkStore:
    """KV_2LTD objects per (chunk, group) in an in-process LMCache storage manager."""

    def __init__(self, layout: KVLayout, fingerprint: str, chunk_size: int,
                 config: StoreConfig = StoreConfig(), kv_rank: int = 0):
        api, cfg, StorageManager = _lmcache()
        self._api = api
        self.layout, self.fingerprint, self.chunk_size = layout, fingerprint, chunk_size
        self.kv_rank = kv_rank
        self.config = config
        from lmcache.v1.distributed.l2_adapters import config as l2

        # The same parser as `lmcache server --l2-adapter JSON`.
        adapters = config.adapter_specs()
        self._has_l2 = bool(adapters)
        l2_config = l2.parse_args_to_l2_adapters_config(argparse.Namespace(**{
            l2._L2_ADAPTER_ARG_DEST: [json.dumps(d) for d in adapters]}))

        self._sm = StorageManager(cfg.StorageManagerConfig(
            l1_manager_config=cfg.L1ManagerConfig(memory_config=cfg.L1MemoryManagerConfig(
                size_in_bytes=config.cpu_bytes, use_lazy=False, shm_name="")),
            eviction_config=cfg.EvictionConfig(eviction_policy=config.eviction_policy),
            l2_adapter_config=l2_config))
        self._layouts = object_layouts(layout, chunk_size)
        self._reserved: dict[bytes, list] = {}

    # -- keys -------------------------------------------------------------------------
    def key(self, chunk_hash: bytes, group_id: int):
        return self._api.ObjectKey(chunk_hash=chunk_hash, model_name=self.fingerprint,
                                   kv_rank=self.kv_rank, object_group_id=group_id)

    def _spec(self, group_id: int, keys, lock: bool):
        api = self._api
        return api.PrefetchTaskSpec(
            key_groups=[api.GroupedObjectKeys(keys=keys, object_group_id=group_id,
                                              layout_desc=self._layouts[group_id])],
            fetching_policy="full",
            lock_mode=api.PrefetchLockMode.LOCK if lock else api.PrefetchLockMode.NO_LOCK)

    def _prefetch(self, group_id: int, keys, lock: bool) -> set[int]:
        """Indices of `keys` resident in L1 (pulled up from disk first when there is one)."""
        if not keys:
            return set()
        handle = self._sm.submit_prefetch_task(self._spec(group_id, keys, lock),
                                               skip_l2=not self._has_l2)
        if self._has_l2:
            self._sm.wait_prefetch_status(handle, self.config.lookup_timeout_s)
        result = self._sm.query_prefetch_status(handle)
        return set(result.hit_cells[0].get_indices_list()) if result else set()

    # -- lookup -----------------------------------------------------------------------
    def present(self, hashes: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices whose object is stored."""
        return {g.group_id: self._prefetch(g.group_id, [self.key(h, g.group_id) for h in hashes],
                                           lock=False)
                for g in self.layout.groups}

    # -- write ------------------------------------------------------------------------
    def reserve(self, chunk_hash: bytes) -> dict[int, torch.Tensor] | None:
        """Empty objects to fill for every group of a chunk not stored yet.

        Returns {} when the chunk is fully stored already, None when the store has no
        room (nothing stays reserved then).
        """
        out, keys = {}, []
        for g in self.layout.groups:
            key = self.key(chunk_hash, g.group_id)
            if self._prefetch(g.group_id, [key], lock=False):
                continue
            got = self._sm.reserve_write([key], self._layouts[g.group_id])
            if key not in got:
                self._discard(keys)
                return None
            keys.append(key)
            out[g.group_id] = got[key].tensor
        if keys:
            self._reserved[chunk_hash] = keys
        return out

    def commit(self, chunk_hash: bytes) -> None:
        self._sm.finish_write(self._reserved.pop(chunk_hash, []))

    def abort(self, chunk_hash: bytes) -> None:
        self._discard(self._reserved.pop(chunk_hash, []))

    def _discard(self, keys) -> None:
        if keys:
            # LMCache has no public abort; this is what its own prefetch controller calls.
            self._sm._l1_manager.finish_write_and_delete(keys, tag="storage_manager")

    # -- read -------------------------------------------------------------------------
    def lock(self, chunk_keys: Sequence[ChunkKey]) -> bool:
        """Pin these objects against eviction; all or nothing."""
        locked = []
        for g in self.layout.groups:
            keys = [self.key(h, gid) for h, gid in chunk_keys if gid == g.group_id]
            hits = self._prefetch(g.group_id, keys, lock=True)
            locked += [keys[i] for i in hits]
            if len(hits) != len(keys):
                self._sm.finish_read_prefetched(locked)
                return False
        return True

    def read(self, chunk_keys: Sequence[ChunkKey]) -> list[torch.Tensor] | None:
        """Views of locked objects (valid until `release`), or None if any is missing or
        does not have the shape and dtype this layout expects."""
        keys = [self.key(h, gid) for h, gid in chunk_keys]
        found = dict(zip(*self._sm.unsafe_read(keys)))
        if any(k not in found for k in keys):
            return None
        tensors = [found[k].tensor for k in keys]
        for (h, gid), t in zip(chunk_keys, tensors):
            want = self._layouts[gid]
            if tuple(t.shape) != tuple(want.shapes[0]) or t.dtype != want.dtypes[0]:
                logger.warning("stored object for group %d has %s %s, expected %s %s: "
                               "treated as a miss", gid, tuple(t.shape), t.dtype,
                               tuple(want.shapes[0]), want.dtypes[0])
                return None
        return tensors

    def release(self, chunk_keys: Sequence[ChunkKey]) -> None:
        if chunk_keys:
            self._sm.finish_read_prefetched([self.key(h, gid) for h, gid in chunk_keys])

    # -- misc -------------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        """(used, total) bytes of the CPU tier."""
        return self._sm.get_l1_usage()

    def close(self) -> None:
        for h in list(self._reserved):
            self.abort(h)
        self._sm.close()
