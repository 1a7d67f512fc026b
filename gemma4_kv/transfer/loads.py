"""Loads: the hits vLLM allocated blocks for, from the objects their lookups pinned
into vLLM's cache, as jobs.

`start` queues a step's loads (`start_load_kv`): on CUDA one copy per layer on the load
stream, in the forward's layer order, each followed by an event the forward waits for
just before that layer's attention (`wait_for_layer`), so the load of layer l+1
overlaps the compute of layer l; elsewhere the torch mover copies at once. After the
forward (`end_of_forward`), later work is ordered behind every load and the job
finishes (its pins go back to the store) once the copies have run.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict
from typing import Any, Protocol, TypeVar

import torch

from ..layout.plan import load_blocks
from ..stores.base import Pinned
from ..stores.stats import Stats
from .jobs import JobQueue, LoadJob, Record

logger = logging.getLogger(__name__)


def forward_order(layout) -> list[tuple[int, int, str]]:
    """(group id, position in the group, layer name) of every owning layer, in the
    order the forward runs them: target layers by index, then draft layers."""
    def key(item):
        name = item[2]
        index = re.search(r"\.(\d+)\.", name)
        return (name in drafts, int(index.group(1)) if index else -1, name)

    drafts = {n for g in layout.groups for n in g.draft_layers}
    return sorted(((g.group_id, p, n) for g in layout.groups for p, n in enumerate(g.layers)),
                  key=key)


class HeldHit(Protocol):
    """A hit a lookup pinned: tokens [start, hit) of its request, and the pin."""

    start: int
    hit: int
    pinned: Pinned


H = TypeVar("H", bound=HeldHit)


class HeldHits(Protocol[H]):
    """Where the lookup layer keeps the hits it pinned (`lookup.service.LookupService`):
    a load takes its hit by (request, pin) and hands that same hit back once copied.
    Any thread."""

    def take(self, req_id: str, pin: int) -> H | None: ...

    def done(self, hit: H) -> None: ...


class Loads(JobQueue):
    def __init__(self, layout, caches, transfer, lookups: HeldHits[Any], chunk_size: int,
                 stats: Stats, record: Record, rank: int = 0):
        super().__init__()
        self.layout, self.caches, self.transfer = layout, caches, transfer
        self.lookups, self.chunk_size = lookups, chunk_size
        self.stats, self.record, self.rank = stats, record, rank
        self.order = forward_order(layout)
        self._layer_ready: dict[str, torch.cuda.Event] = {}  # this step's queued layers
        self._in_flight: tuple[Any, list] | None = None
        """(QueuedLoads, [(LoadJob, hit, plan)]) of this step."""
        self._forward_waits = True  # vLLM calls wait_for_layer_load before each layer

    def start(self, jobs: list[LoadJob]) -> None:
        """Queue this step's loads. Every object was pinned and checked by the lookup:
        nothing here can fail but a bug, which is raised rather than leaving blocks
        unfilled."""
        self.end_of_forward()
        t0 = time.perf_counter()
        items, loaded = defaultdict(list), []
        for job in jobs:
            hit = self.lookups.take(job.req_id, job.pin)
            if hit is None or (hit.start, hit.hit) != (job.start, job.hit):
                raise RuntimeError(f"gemma4-kv: request {job.req_id} was offered a hit of "
                                   f"[{job.start}, {job.hit}) that rank {self.rank} did "
                                   f"not pin ({hit and (hit.start, hit.hit)})")
            if time.monotonic() >= hit.pinned.held_until:
                # Offered before its `fresh_until`, loaded after the store's hold may have
                # lapsed: only a step longer than that margin gets here. Its objects may
                # be another engine's KV by now, and vLLM cannot recompute a failed
                # synchronous load of a hybrid model: stop rather than load them.
                self.lookups.done(hit)
                raise RuntimeError(f"gemma4-kv: request {job.req_id}'s hit was loaded after "
                                   "the store's hold on it may have lapsed (the step took "
                                   "longer than half of lmcache_server_read_ttl_s)")
            plan = load_blocks(self.layout, job.start, job.hit, self.chunk_size, job.block_ids)
            for cb in plan:
                items[cb.group_id].append((cb, hit.pinned.views[(job.hashes[cb.chunk],
                                                                 cb.group_id)]))
            loaded.append((job, hit, plan))
        if not items:
            self._loaded(loaded, 0.0)
            return
        loads = {gid: (self.layout.groups[gid], self.caches[gid], [o for _, o in its],
                       [cb for cb, _ in its]) for gid, its in items.items()}
        if not self.transfer.cuda:
            for args in loads.values():
                self.transfer.load(*args)
            self._loaded(loaded, time.perf_counter() - t0)
            return
        queued = self.transfer.load_by_layer(loads, [(g, p) for g, p, _ in self.order])
        self._in_flight = (queued, loaded)
        if self._forward_waits:
            self._layer_ready = dict(zip((n for _, _, n in self.order), queued.ready))
        else:
            torch.cuda.current_stream().wait_event(queued.done)

    def wait_for_layer(self, layer_name: str) -> None:
        event = self._layer_ready.pop(layer_name, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def end_of_forward(self) -> None:
        """After the forward: later work (the drafter, the next step) is ordered after
        every load of this step, which finishes once its copies have run."""
        self.poll()
        if self._in_flight is None:
            return
        queued, loaded = self._in_flight
        self._in_flight = None
        if self._layer_ready and len(self._layer_ready) == len(self.order):
            # This model's attention does not call wait_for_layer_load: from now on the
            # forward waits for all loads before it starts.
            logger.error("gemma4-kv: the forward waited for no layer load; loading "
                         "before the forward from now on")
            self._forward_waits = False
        self._layer_ready = {}
        torch.cuda.current_stream().wait_event(queued.done)
        self._submitted(queued.done, lambda: self._loaded(loaded, queued.seconds()))

    def _loaded(self, loaded: list, seconds: float) -> None:
        for job, hit, plan in loaded:
            self.lookups.done(hit)
            for cb in plan:
                g = self.layout.groups[cb.group_id]
                self.stats.add("load_blocks", len(cb.block_ids))
                self.stats.add("load_bytes", len(cb.block_ids) * g.page_bytes * len(g.layers),
                               cb.group_id)
            self.record("load", job.req_id, job.start, job.hit, plan, seconds=seconds)
        if loaded:
            self.stats.add("load_seconds", seconds)

    def wait(self) -> None:
        self.end_of_forward()
        super().wait()
