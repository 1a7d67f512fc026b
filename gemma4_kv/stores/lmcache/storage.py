"""LMCache's storage layer (`StorageLayer`, its `StorageManager`), the embedded store's
L1 and L2 tiers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .l2_specs import parse_l2_adapters
from .version import check_version

KEY_CACHE = 1 << 14
"""ObjectKeys kept for reuse (16 documents of 32 chunks in 6 groups are 3072)."""


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
