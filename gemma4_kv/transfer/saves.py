"""Saves: the chunks a step completed, from vLLM's cache into the store.

`save` runs in `wait_for_save`, on the model thread, while the blocks are certainly
still the request's: it reserves the objects, starts the copies (`Transfer.save`) and
queues a commit behind a fence event. `commit_ready` commits every save whose copies
have landed (trailers still owed are written on the host first), never waiting for
one unless asked to (shutdown). When a request ends its chunks are touched in order,
so LRU eviction takes a prefix's tail before the head the rest depends on.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from ..stores import integrity
from ..connector.metadata import SaveRequest, TouchRequest
from ..layout.plan import save_blocks

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    event: object  # torch.cuda.Event, or None when the copies were synchronous
    hashes: list[bytes]
    keep: list  # tensors the copies read until the event fires
    host_seals: list  # (KV, trailer, key) whose trailer is written once copied


class Saver:
    def __init__(self, store, layout, caches, transfer, pool, chunk_size: int, stats,
                 record):
        self.store, self.layout, self.caches = store, layout, caches
        self.transfer, self.pool, self.chunk_size = transfer, pool, chunk_size
        self.stats, self.record = stats, record
        self._pending: list[_Pending] = []

    def save(self, save: SaveRequest) -> None:
        t0 = time.perf_counter()
        wanted, plans = [], {}
        for i, (h, groups) in enumerate(zip(save.hashes, save.groups)):
            blocks = save_blocks(self.layout, save.first_chunk + i, self.chunk_size,
                                 save.block_ids, groups)
            if blocks:
                plans[h] = blocks
                wanted.append((h, [cb.group_id for cb in blocks]))
        objects = self.store.reserve(wanted, save.prefix + save.hashes) if wanted else {}
        per_group = defaultdict(list)
        for h, blocks in plans.items():
            for cb in blocks:
                if (h, cb.group_id) in objects:
                    per_group[cb.group_id].append((cb, objects[(h, cb.group_id)]))
        committed = [h for h, gids in wanted if any((h, g) in objects for g in gids)]
        if not committed:
            return
        keep, host_seals, planned = [], [], []
        for gid, items in per_group.items():
            group = self.layout.groups[gid]
            k, s = self.transfer.save(group, self.caches[gid], [o for _, o in items],
                                      [cb for cb, _ in items], self.pool)
            keep += k
            host_seals += s
            planned += [cb for cb, _ in items]
            blocks = sum(len(cb.block_ids) for cb, _ in items)
            self.stats.add("save_blocks", blocks)
            self.stats.add("save_bytes", blocks * group.page_bytes * len(group.layers), gid)
        self._pending.append(_Pending(self.transfer.fence(), committed, keep, host_seals))
        end = (save.first_chunk + len(save.hashes)) * self.chunk_size
        self.record("save", save.req_id, save.first_chunk * self.chunk_size, end, planned, t0)

    def commit_ready(self, wait: bool = False) -> None:
        still = []
        for p in self._pending:
            if p.event is not None and not wait and not p.event.query():
                still.append(p)
                continue
            if p.event is not None:
                p.event.synchronize()
            for kv, trailer, key in p.host_seals:
                integrity.seal(kv, trailer, key)
            for h in p.hashes:
                self.store.commit(h)
        self._pending = still

    def touch(self, touch: TouchRequest) -> None:
        """A finished request's stored objects, in chunk order (see `ChunkStore.touch`)."""
        keys = [(h, g) for h, groups in zip(touch.hashes, touch.groups) for g in groups]
        self.store.touch(keys)
