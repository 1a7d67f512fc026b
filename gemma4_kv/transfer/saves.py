"""Saves: the chunks a step completed, from vLLM's cache into the store, as jobs.

`submit` runs in `wait_for_save`, on the model thread, while the blocks are certainly
still the request's: it reserves the objects, starts the copies (`DeviceStreams.save`) and
queues the commit behind a fence event; the commit runs once the copies have landed
(trailers still owed are written on the host first). A request's end is queued behind
its saves, so the store learns it only after its last objects are committed.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

from ..layout.plan import save_blocks
from ..layout import integrity
from ..stores.base import ChunkStore, Reservation
from ..stores.stats import Stats
from .jobs import FinishJob, JobQueue, Record, SaveJob

logger = logging.getLogger(__name__)


class Saves(JobQueue):
    def __init__(self, store: ChunkStore, layout, caches, transfer, pool, chunk_size: int,
                 stats: Stats, record: Record):
        super().__init__()
        self.store, self.layout, self.caches = store, layout, caches
        self.transfer, self.pool, self.chunk_size = transfer, pool, chunk_size
        self.stats, self.record = stats, record
        self._warned_until = 0.0

    def submit(self, job: SaveJob) -> None:
        t0 = time.perf_counter()
        write = job.write
        plans = {}
        for i, groups in enumerate(write.groups):
            blocks = save_blocks(self.layout, write.first + i, self.chunk_size,
                                 job.block_ids, groups)
            plans[write.chain[write.first + i]] = blocks
        # Groups whose blocks were already freed (the null block) cannot be stored.
        write.groups = [tuple(cb.group_id for cb in plans[write.chain[write.first + i]])
                        for i in range(len(write.groups))]
        try:
            reservation = self.store.reserve(write) if any(write.groups) else Reservation({})
        except Exception:  # noqa: BLE001 - a save is never worth the engine
            self._failed(write)
            return
        per_group = defaultdict(list)
        for h, blocks in plans.items():
            for cb in blocks:
                if (h, cb.group_id) in reservation.objects:
                    per_group[cb.group_id].append((cb, reservation.objects[(h, cb.group_id)]))
        if not per_group:
            self.store.abort(reservation)
            return
        keep, host_seals, planned = [], [], []
        for gid, items in per_group.items():
            group = self.layout.groups[gid]
            k, s = self.transfer.save(group, self.caches[gid], [o for _, o in items],
                                      [cb for cb, _ in items], self.pool)
            keep += k
            host_seals += s
            planned += [cb for cb, _ in items]
            nblocks = sum(len(cb.block_ids) for cb, _ in items)
            self.stats.add("save_blocks", nblocks)
            self.stats.add("save_bytes", nblocks * group.page_bytes * len(group.layers), gid)

        def commit(keep=keep) -> None:  # `keep`: tensors the copies read until they land
            for kv, trailer, key in host_seals:
                integrity.seal(kv, trailer, key)
            self.store.commit(reservation)
            self.stats.add("saves_committed", 1)

        self.stats.add("saves", 1)
        self._submitted(self.transfer.fence(), commit)
        end = (write.first + len(write.groups)) * self.chunk_size
        self.record("save", write.req_id, write.first * self.chunk_size, end, planned, t0)

    def _failed(self, write) -> None:
        """The store raised on a save (a bug, LMCache failing): nothing of it is
        stored, which costs later requests a recomputation and nothing else. Logged
        with its traceback at most every 10 s."""
        self.stats.add("saves_failed", 1)
        now = time.monotonic()
        if now >= self._warned_until:
            self._warned_until = now + 10.0
            logger.exception("gemma4-kv: the store failed a save of request %s (chunks "
                             "%d-%d): not stored", write.req_id, write.first,
                             write.first + len(write.groups) - 1)

    def finish(self, job: FinishJob) -> None:
        """The request ended: once its saves are committed, the store may drop what it
        kept for writes of it still to come."""
        self._submitted(None, lambda: self.store.on_request_finished(job.req_id))
