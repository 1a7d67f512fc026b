"""The chunk store: LMCache's storage layer, embedded in-process.

One LMCache object per (chunk, group): the group's KV_2LTD tensor plus a small
integrity trailer (`integrity.py`), keyed by `ObjectKey(chunk_hash, namespace,
kv_rank, object_group_id=group_id)`, where the namespace is the layout fingerprint
plus a generation that `reset` changes. L1 is LMCache's CPU pool (pinned when CUDA is
present); L2 tiers (local disk `fs_native`, Redis/Valkey `valkey`, ...) sit behind it
through LMCache's own adapters. Nothing here is a home-made store.

What may fail is done before a hit is offered, never during its load:
- an L2 lookup is an asynchronous LMCache prefetch (`start_prefetch` / `poll`); its
  objects are verified against their trailers when they land in L1, and a bad one is
  dropped and never offered again by this process;
- a hit is served only from objects pinned in L1 (`pin`), whose views are taken and
  checked at pin time; the load then only copies memory.
Writes are two-phase (`reserve` / `commit`): a chunk is stored for all the groups it
carries or for none.

Threads: `start_prefetch`, `poll`, `resident`, `pin`, `release` and `reset` run on
the worker's lookup thread; `reserve`, `commit`, `abort` and `touch` on the model
thread. LMCache's storage manager is thread-safe; each thread owns its own state here.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from . import integrity
from ..layout.groups import KVLayout

logger = logging.getLogger(__name__)

ChunkKey = tuple[bytes, int]
"""(chunk hash, group id)."""


@dataclass(frozen=True)
class StoreConfig:
    """Sizes and tiers of one rank's embedded store."""

    cpu_bytes: int = 4 << 30
    disk_path: str | None = None
    disk_gb: float = 0.0
    l2_adapters: tuple[dict, ...] = ()
    """More LMCache L2 tiers, as `lmcache server --l2-adapter` JSON objects."""
    eviction_policy: str = "LRU"
    trigger_watermark: float = 0.97
    """LMCache's background eviction starts here (its default, 0.8, left a fifth of the
    tier unused); a write that finds no room evicts at once (`_evict_now`)."""
    eviction_ratio: float = 0.03
    verify_checksums: bool = True

    def adapter_specs(self) -> list[dict]:
        specs = list(self.l2_adapters)
        if self.disk_path:
            disk = {"type": "fs_native", "base_path": self.disk_path, "num_workers": 4,
                    "max_capacity_gb": self.disk_gb}
            if self.disk_gb:
                disk["eviction"] = {"eviction_policy": "LRU"}
            specs.insert(0, disk)
        return specs


def set_lmcache_log_level(level: str) -> None:
    """Keep LMCache's own logs (one INFO line per prefetch) at `level`. LMCache reads
    LMCACHE_LOG_LEVEL when it creates a logger and gives each its own handler, so set
    both the variable (for loggers still to come) and every existing one."""
    os.environ["LMCACHE_LOG_LEVEL"] = level
    for name, log in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("lmcache") and isinstance(log, logging.Logger):
            log.setLevel(level)
            for handler in log.handlers:
                handler.setLevel(level)


def _lmcache():
    from lmcache.v1.distributed import api, config
    from lmcache.v1.distributed.storage_manager import StorageManager

    return api, config, StorageManager


def object_layouts(layout: KVLayout, chunk_size: int) -> dict:
    """LMCache's description of each group's object: KV_2LTD tensor + trailer."""
    api, _, _ = _lmcache()
    return {g.group_id: api.MemoryLayoutDesc(
        shapes=[torch.Size(g.chunk_shape(chunk_size)), torch.Size(integrity.SEAL_SHAPE)],
        dtypes=[g.dtype, integrity.SEAL_DTYPE]) for g in layout.groups}


@dataclass
class Prefetch:
    """L2 prefetch tasks in flight: (LMCache handle, rows of (group id, chunk hashes,
    keys)), and once all have finished the (chunk hash, group) cells loaded from L2."""

    tasks: list[tuple[object, list[tuple[int, list[bytes], list]]]]
    keys: list
    started: float
    finished: bool = False
    loaded: set[ChunkKey] = field(default_factory=set)
    rejected: int = 0
    held: list = field(default_factory=list)
    """Its keys that were in L1 when it started (verified already, or written here),
    read-locked until it settles: they stay offered meanwhile, and cannot be evicted
    and brought up again from L2 unverified."""
    untrusted: list = field(default_factory=list)
    """The others: not offered until it settles (it may bring them up from L2)."""


@dataclass
class Pinned:
    """Objects pinned for one hit: LMCache keys to release, views to load from."""

    keys: list
    views: dict[ChunkKey, torch.Tensor]


class ChunkStore:
    def __init__(self, layout: KVLayout, fingerprint: str, chunk_size: int,
                 config: StoreConfig = StoreConfig(), kv_rank: int = 0, stats=None):
        api, cfg, StorageManager = _lmcache()
        from lmcache.v1.distributed.l2_adapters import config as l2

        self._api = api
        self.layout, self.fingerprint, self.chunk_size = layout, fingerprint, chunk_size
        self.namespace = fingerprint
        self.kv_rank, self.config = kv_rank, config
        adapters = config.adapter_specs()
        self.has_l2 = bool(adapters)
        # The same parser as `lmcache server --l2-adapter JSON`.
        l2_config = l2.parse_args_to_l2_adapters_config(argparse.Namespace(**{
            l2._L2_ADAPTER_ARG_DEST: [json.dumps(d) for d in adapters]}))
        self._sm = StorageManager(cfg.StorageManagerConfig(
            l1_manager_config=cfg.L1ManagerConfig(memory_config=cfg.L1MemoryManagerConfig(
                size_in_bytes=config.cpu_bytes, use_lazy=False, shm_name="")),
            eviction_config=cfg.EvictionConfig(
                eviction_policy=config.eviction_policy,
                trigger_watermark=config.trigger_watermark,
                eviction_ratio=config.eviction_ratio),
            # Objects brought up from L2 stay in L1 (LMCache's default makes them
            # read-once), so later hits on a shared prefix need no second L2 read.
            prefetch_policy="retain",
            l2_adapter_config=l2_config))
        self._layouts = object_layouts(layout, chunk_size)
        self._groups = [g.group_id for g in layout.groups]
        self._reserved: dict[bytes, list] = {}  # model thread
        self._inflight: list[Prefetch] = []  # lookup thread
        self._maybe_untrusted: Counter = Counter()  # keys an unpolled prefetch may load
        self._bad: set = set()  # keys whose L2 copy failed verification
        self.stats = stats  # metrics.Gemma4KVStats, if any

    # -- keys -------------------------------------------------------------------------
    def key(self, chunk_hash: bytes, group_id: int):
        return self._api.ObjectKey(chunk_hash=chunk_hash, model_name=self.namespace,
                                   kv_rank=self.kv_rank, object_group_id=group_id)

    def seal_key(self, chunk_hash: bytes, group_id: int, namespace: str | None = None) -> int:
        """The integrity trailer's key value of an object."""
        return integrity.key64(namespace or self.namespace, chunk_hash, group_id)

    def _l1_prefetch(self, group_id: int, keys: list, lock: bool) -> list[int]:
        """Indices of `keys` resident in L1 (read-locked if `lock`); L1 only, no wait."""
        if not keys:
            return []
        api = self._api
        spec = api.PrefetchTaskSpec(
            key_groups=[api.GroupedObjectKeys(keys=keys, object_group_id=group_id,
                                              layout_desc=self._layouts[group_id])],
            fetching_policy="full",
            lock_mode=api.PrefetchLockMode.LOCK if lock else api.PrefetchLockMode.NO_LOCK)
        result = self._sm.query_prefetch_status(
            self._sm.submit_prefetch_task(spec, skip_l2=True))
        return result.hit_cells[0].get_indices_list() if result else []

    # -- lookup: L1 -------------------------------------------------------------------
    def resident(self, hashes: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices whose object sits in L1 and may be offered
        (not possibly brought up by an unverified prefetch, not known bad)."""
        out = {}
        for gid in self._groups:
            keys = [self.key(h, gid) for h in hashes]
            out[gid] = {i for i in self._l1_prefetch(gid, keys, lock=False)
                        if keys[i] not in self._maybe_untrusted and keys[i] not in self._bad}
        return out

    def pin(self, chunk_keys: Iterable[ChunkKey], prefix: Sequence[bytes] = ()
            ) -> Pinned | None:
        """Read-lock these objects in L1 and take views of their KV tensors; all or
        nothing. An object that is missing, untrusted or of another shape is a miss.
        (`prefix`, the hashes from chunk 0, is for stores that key by it: not this one.)"""
        chunk_keys = list(chunk_keys)
        locked: list = []
        pinned = None
        try:
            pinned = self._lock_and_view(chunk_keys, locked)
            return pinned
        finally:  # a miss, or a read that raised: none of its locks stays behind
            if pinned is None and locked:
                self._sm.finish_read_prefetched(locked)

    def _lock_and_view(self, chunk_keys: list[ChunkKey], locked: list) -> Pinned | None:
        """`pin`'s work; adds every key it read-locks to `locked` as soon as it is."""
        for gid in self._groups:
            mine = [ck for ck in chunk_keys if ck[1] == gid]
            keys = [self.key(h, gid) for h, _ in mine]
            hits = self._l1_prefetch(gid, keys, lock=True)
            locked += [keys[i] for i in hits]
            if len(hits) != len(keys):
                return None
        keys = [self.key(h, g) for h, g in chunk_keys]
        if any(k in self._maybe_untrusted or k in self._bad for k in keys):
            return None
        found = dict(zip(*self._sm.unsafe_read(keys)))
        views = {}
        for ck, k in zip(chunk_keys, keys):
            obj = found.get(k)
            want = self._layouts[ck[1]]
            if obj is None or list(obj.get_shapes()) != list(want.shapes) \
                    or list(obj.get_dtypes()) != list(want.dtypes):
                logger.warning("gemma4-kv: stored object for group %d is missing or has "
                               "another shape: treated as a miss", ck[1])
                return None
            views[ck] = obj.get_tensor(0)
        return Pinned(list(locked), views)

    def release(self, pinned: Pinned | None) -> None:
        if pinned is not None and pinned.keys:
            self._sm.finish_read_prefetched(pinned.keys)
            pinned.keys = []

    def touch(self, chunk_keys: Sequence[ChunkKey]) -> None:
        """Mark objects as used, in a prefix's chunk order: LMCache's LRU makes the first
        key the most recent, so it evicts a prefix's tail before the head the tail
        depends on, and a working set slightly larger than the tier still hits on most
        of each prefix instead of on none."""
        if chunk_keys:
            self._sm.touch_l1_keys([self.key(h, g) for h, g in chunk_keys])

    # -- lookup: L2 -------------------------------------------------------------------
    def start_prefetch(self, hashes: Sequence[bytes], windows: dict[int, int]) -> Prefetch:
        """Ask the L2 tiers for the longest prefix of `hashes` they can serve, without
        waiting: LMCache loads what that prefix needs into L1 (`windows[group]`: the
        trailing chunks a sliding group needs at a chunk end, -1 for full attention)."""
        rows = [(gid, list(hashes)) for gid in self._groups]
        return self._submit([(rows, "prefix", windows)])

    def start_fetch(self, chunk_keys: Iterable[ChunkKey]) -> Prefetch:
        """Ask the L2 tiers for exactly these objects (one LMCache task per group)."""
        per_group: dict[int, list[bytes]] = {}
        for h, gid in chunk_keys:
            per_group.setdefault(gid, []).append(h)
        return self._submit([([(gid, hs)], "full", {gid: -1}) for gid, hs in per_group.items()])

    def _submit(self, tasks) -> Prefetch:
        api = self._api
        planned = [(policy, windows, [(gid, hs, [self.key(h, gid) for h in hs])
                                      for gid, hs in rows]) for rows, policy, windows in tasks]
        keys = [k for _, _, keyed in planned for _, _, ks in keyed for k in ks]
        held = [ks[i] for _, _, keyed in planned for gid, _, ks in keyed
                for i in self._l1_prefetch(gid, ks, lock=True)]
        before = set(held)
        untrusted = [k for k in keys if k not in before]
        submitted = []
        for policy, windows, keyed in planned:
            groups = [api.GroupedObjectKeys(
                keys=ks, object_group_id=gid, layout_desc=self._layouts[gid],
                sliding_window_size=windows[gid] if policy == "prefix" else -1)
                for gid, _, ks in keyed]
            spec = api.PrefetchTaskSpec(key_groups=groups, fetching_policy=policy,
                                        lock_mode=api.PrefetchLockMode.LOCK)
            submitted.append((self._sm.submit_prefetch_task(spec), keyed))
        p = Prefetch(submitted, keys, time.monotonic(), held=held, untrusted=untrusted)
        self._maybe_untrusted.update(untrusted)
        self._inflight.append(p)
        return p

    def poll(self) -> None:
        """Settle every finished prefetch: verify what it loaded from L2, drop what fails,
        release its locks (also of prefetches whose lookup gave up waiting)."""
        still = []
        for p in self._inflight:
            results = getattr(p, "_results", None) or [None] * len(p.tasks)
            for i, (handle, _) in enumerate(p.tasks):
                if results[i] is None:
                    results[i] = self._sm.query_prefetch_status(handle)
            p._results = results
            if any(r is None for r in results):
                still.append(p)
                continue
            self._settle(p, results)
        self._inflight = still

    def _settle(self, p: Prefetch, results) -> None:
        locked, bad, strays, held = [], [], {}, set(p.held)
        for (_, rows), result in zip(p.tasks, results):
            for row, (gid, hashes, keys) in enumerate(rows):
                loaded = set(result.l2_hit_cells[row].get_indices_list())
                hit = result.hit_cells[row].get_indices_list()
                for i in hit:
                    key = keys[i]  # as submitted: the namespace may have changed since
                    locked.append(key)
                    if i in loaded:
                        if self._verified(key, hashes[i], gid):
                            p.loaded.add((hashes[i], gid))
                        else:
                            bad.append(key)
                hit = set(hit)
                strays.setdefault(gid, []).extend(
                    (keys[i], hashes[i]) for i in range(len(keys))
                    if i not in hit and keys[i] not in held)
        if locked:
            self._sm.finish_read_prefetched(locked)
        bad += self._verify_strays(strays)
        if p.held:
            self._sm.finish_read_prefetched(p.held)
        if bad:
            self._bad.update(bad)
            self._sm.delete_l1_keys(bad)
            for adapter in self._l2():
                adapter.delete(bad)
            p.rejected = len(bad)
            if self.stats is not None:
                self.stats.add("rejected_objects", len(bad))
            logger.warning("gemma4-kv: %d object(s) from an L2 tier failed verification "
                           "(corrupt, truncated or foreign): dropped, recomputed instead",
                           len(bad))
        self._maybe_untrusted.subtract(p.untrusted)
        self._maybe_untrusted += Counter()  # drop zero counts
        p.held, p.finished = [], True

    def _verify_strays(self, strays: dict[int, list]) -> list:
        """Objects a prefetch brought into L1 but left out of the hit it reports: LMCache
        keeps them there unlocked (e.g. those past a value that failed to load, which ends
        a prefix). Verified like the hit; the keys of those that fail."""
        bad = []
        for gid, pairs in strays.items() if self.config.verify_checksums else ():
            keys = [k for k, _ in pairs]
            held = self._l1_prefetch(gid, keys, lock=True)  # locked: eviction may not
            try:                                            # free them while we read
                bad += [keys[i] for i in held if not self._verified(keys[i], pairs[i][1], gid)]
            finally:
                if held:
                    self._sm.finish_read_prefetched([keys[i] for i in held])
        return bad

    def _verified(self, key, chunk_hash: bytes, gid: int) -> bool:
        if not self.config.verify_checksums:
            return True
        _, objs = self._sm.unsafe_read([key])
        if not objs:
            return False
        obj = objs[0]
        return integrity.verify(obj.get_tensor(0), obj.get_tensor(1),
                                integrity.key64(key.model_name, chunk_hash, gid))

    def _l2(self) -> list:
        return [adapter for _, adapter in self._sm.l2_adapters()]

    # -- write ------------------------------------------------------------------------
    def reserve(self, chunks: Sequence[tuple[bytes, Sequence[int]]],
                prefix: Sequence[bytes] = ()
                ) -> dict[ChunkKey, tuple[torch.Tensor, torch.Tensor, int]]:
        """Empty objects to fill for `chunks` = [(chunk hash, group ids to store)], as
        {(hash, group): (KV tensor, trailer tensor, trailer key)}. Objects already in
        L1 are skipped; a chunk that cannot get all its missing objects gets none.
        (`prefix` as in `pin`: unused here.)"""
        wanted = {gid: [] for gid in self._groups}
        for h, gids in chunks:
            for gid in gids:
                wanted[gid].append(h)
        for gid, hs in wanted.items():
            keys = [self.key(h, gid) for h in hs]
            stored = set(self._l1_prefetch(gid, keys, lock=False))
            wanted[gid] = [h for i, h in enumerate(hs) if i not in stored]
        got: dict[ChunkKey, object] = {}
        for gid, hs in wanted.items():
            if hs:
                got.update(self._reserve_group(gid, hs))
        out = {}
        for h, gids in chunks:
            missing = [g for g in gids if h in wanted[g]]
            if all((h, g) in got for g in missing):
                if missing:
                    self._reserved[h] = [self.key(h, g) for g in missing]
                for g in missing:
                    obj = got[(h, g)]
                    out[(h, g)] = (obj.get_tensor(0), obj.get_tensor(1),
                                   self.seal_key(h, g))
            else:
                self._discard([self.key(h, g) for g in missing if (h, g) in got])
        return out

    def _reserve_group(self, gid: int, hashes: list[bytes]) -> dict[ChunkKey, object]:
        keys = [self.key(h, gid) for h in hashes]
        got = self._sm.reserve_write(keys, self._layouts[gid])
        need = self._object_bytes(gid)
        for attempt in range(3):  # no room: evict now rather than wait for LMCache's tick
            short = [k for k in keys if k not in got]
            if not short or not self._evict_now(len(short) * need * 2 ** attempt):
                break
            got.update(self._sm.reserve_write(short, self._layouts[gid]))
        return {(k.chunk_hash, gid): got[k] for k in keys if k in got}

    def _object_bytes(self, gid: int) -> int:
        want = self._layouts[gid]
        return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                   for s, d in zip(want.shapes, want.dtypes))

    def _evict_now(self, nbytes: int) -> bool:
        """Run one pass of LMCache's L1 eviction policy for about `nbytes`. LMCache evicts
        only from a background loop once a second; this calls the same policy and action
        on the same controller (private attributes of its StorageManager)."""
        try:
            controller = self._sm._eviction_controller
            used, total = self._sm.get_l1_usage()
            if used <= 0:
                return False
            ratio = min(1.0, 1.2 * nbytes / used + 0.01)
            actions = controller._eviction_policy.get_eviction_actions(
                ratio, key_eligible_filter=controller._l1_manager.is_key_evictable)
            for action in actions:
                controller.execute_eviction_action(action)
            return bool(actions)
        except AttributeError:  # another LMCache: fall back to its background loop
            logger.warning("gemma4-kv: cannot evict on demand with this LMCache version")
            return False

    def commit(self, chunk_hash: bytes) -> None:
        keys = self._reserved.pop(chunk_hash, [])
        self._sm.finish_write(keys)
        self._bad.difference_update(keys)  # a fresh copy replaces one that failed

    def abort(self, chunk_hash: bytes) -> None:
        self._discard(self._reserved.pop(chunk_hash, []))

    def _discard(self, keys) -> None:
        if keys:
            # LMCache has no public abort; this is what its own prefetch controller calls.
            self._sm._l1_manager.finish_write_and_delete(keys, tag="storage_manager")

    # -- misc -------------------------------------------------------------------------
    def reset(self) -> bool:
        """Make everything stored so far unreachable: a new generation in every key, so
        nothing of the old one can be found in any tier, and L1 cleared of it (objects
        still pinned by a load in flight stay until released)."""
        self.namespace = f"{self.fingerprint}-g{uuid.uuid4().hex[:12]}"
        self._sm.clear(force=False)
        return True

    def usage(self) -> tuple[int, int]:
        """(used, total) bytes of the CPU tier."""
        return self._sm.get_l1_usage()

    def close(self) -> None:
        for h in list(self._reserved):
            self.abort(h)
        self._sm.close()
