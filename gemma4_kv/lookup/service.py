"""Worker side of a lookup: which hit this rank can serve, and the pins behind it.

Runs on the lookup server's thread (`channel.LookupServer`), answering the scheduler's
`messages`. A lookup never waits: if a slower tier might extend the hit by enough to be
worth it, it starts the store's prefetch and answers `pending` (the scheduler returns None
to vLLM, which asks again next step); once the prefetch has landed and been verified, or its
budget has passed (`wait.WaitPolicy`: at most the prefill time of the tokens it would add),
it answers from the fast tier alone. The objects of the answered hit stay pinned, named
(request, pin number), until the worker has loaded them (`take` / `done`) or the scheduler
releases that pin.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from ..layout.groups import KVLayout
from ..layout.plan import hit_chunks, servable_hits
from ..stores.base import ChunkStore, Pinned, Prefetch
from ..stores.stats import Stats
from ..transfer.jobs import Record
from . import messages
from .wait import Rates, Wait, WaitPolicy

logger = logging.getLogger(__name__)

MAX_PINNED = 4096
"""Requests that may hold a pinned hit at once: a lookup beyond it is a miss (vLLM
loads or releases every hit within a step or two, so this bounds only a peer that pins
and never loads)."""


@dataclass
class Hit:
    """What a rank pinned for one request."""

    start: int
    hit: int
    pinned: Pinned
    from_l2: int = 0


@dataclass
class _Pending:
    prefetch: Prefetch
    wait: Wait
    asked: float
    """When the lookup first asked the slower tier (its time counts from there)."""


class LookupStats(Stats, Protocol):
    """The counters a lookup adds to (`connector.metrics.Gemma4KVStats`)."""

    def lookup(self, tokens: int, from_l2: int, seconds: float) -> None:
        """One lookup answered: `tokens` of hit, `from_l2` of them from a slower tier."""


class LookupService:
    def __init__(self, store: ChunkStore, layout: KVLayout, chunk_size: int,
                 timeout_s: float, stats: LookupStats | None = None,
                 record: Record | None = None, rates: Rates | None = None,
                 clock=time.monotonic):
        self.store, self.layout, self.chunk_size = store, layout, chunk_size
        self.stats, self.record = stats, record
        self.wait = WaitPolicy(timeout_s, rates, stats)
        self._clock = clock
        self._hits: dict[tuple[str, int], Hit] = {}  # by (req_id, pin)
        self._pending: dict[str, _Pending] = {}
        self._warned_until = 0.0
        self._lock = threading.Lock()  # _hits: the model thread takes them to load

    # -- messages ---------------------------------------------------------------------
    def handle(self, msg: messages.Request) -> messages.Reply:
        if isinstance(msg, (messages.Lookup, messages.Repin)):
            try:
                if isinstance(msg, messages.Lookup):
                    return self.lookup(msg)
                h = self.repin(msg)
                return messages.Done(h is not None, self._fresh_s(h))
            except Exception:  # noqa: BLE001 - a store read that failed: this request misses
                return self._missed(msg)
        if isinstance(msg, messages.Release):
            self.release(msg.req_id, msg.pin)
            self._drop_pending(msg.req_id)
            return messages.Done(True)
        if isinstance(msg, messages.Reset):
            for req_id in list(self._pending):
                self._drop_pending(req_id)
            return messages.Done(self.store.reset())
        return messages.Failed(f"unexpected message {type(msg).__name__}")

    def lookup(self, msg: messages.Lookup) -> messages.LookupReply:
        t0 = self._clock()
        self.store.poll()
        self.release(msg.req_id, msg.pin)
        if msg.start < 0:
            return messages.LookupReply()
        now = self._clock()
        n = min(len(msg.hashes), -(-msg.limit // self.chunk_size))
        chain = msg.hashes[:n]
        target = min(msg.limit, n * self.chunk_size)
        # Nothing of this lookup answered yet: a save of the request is no sign of
        # what the slower tier holds until it has answered (`ChunkStore.looked_up`).
        self.store.looked_up(msg.req_id, 0)
        pending = self._pending.pop(msg.req_id, None)
        candidates = None
        if pending is None and self.store.slow_tier_up() and self.wait.allows(now):
            candidates = self._candidates(chain, msg.start, msg.limit, msg.spans)
            have = candidates[0] if candidates else msg.start
            if have >= target:  # a verified hit of all of it: the tier has answered
                self.store.looked_up(msg.req_id, target)
            wait = self.wait.start(now, target - have, self.store.fetch_bytes(
                chain, msg.start, msg.limit), have) if have < target else None
            if wait is not None:  # a slower tier may hold a longer hit worth waiting for
                prefetch = self.store.start_prefetch(chain, msg.start, msg.limit)
                self._pending[msg.req_id] = _Pending(prefetch, wait, now)
                return messages.LookupReply(pending=True)
        loaded = set()
        if pending is not None:
            t0 = pending.asked
            p = pending.prefetch
            if p.finished:
                self.wait.fetched(p.loaded_bytes, (p.finished_at or p.started) - p.started)
                loaded = p.loaded
                if p.answered:
                    self.store.looked_up(msg.req_id, target)
            elif self.wait.keep_waiting(pending.wait, now, p.progress_bytes):
                self._pending[msg.req_id] = pending
                return messages.LookupReply(pending=True)
            else:
                self.wait.gave_up(now)  # LMCache finishes it; poll() releases its locks
            candidates = None
        try:
            if candidates is None:
                candidates = self._candidates(chain, msg.start, msg.limit, msg.spans)
            for hit in candidates[:2]:  # the next one if an object went between check and pin
                h = self._pin(msg.req_id, msg.pin, chain, msg.start, hit, loaded)
                if h is not None:
                    self._count(msg, hit, h.from_l2, t0)
                    return messages.LookupReply(pinned=hit, candidates=candidates,
                                                from_l2=h.from_l2, fresh_s=self._fresh_s(h))
        finally:
            if pending is not None:
                self.store.finish_prefetch(pending.prefetch)
        self._count(msg, 0, 0, t0)
        return messages.LookupReply(candidates=candidates)

    def _missed(self, msg: messages.Lookup | messages.Repin) -> messages.Reply:
        """A lookup whose store call raised is this request's miss, not the rank's
        failure: nothing stays pinned or pending for it, and other requests (and the
        next lookup of this one) are served as before."""
        self.release(msg.req_id, msg.pin)
        self._drop_pending(msg.req_id)
        now = self._clock()
        if now >= self._warned_until:
            self._warned_until = now + 10.0
            logger.warning("gemma4-kv: a lookup of request %s failed in the store; it is "
                           "a miss (further failures for 10 s are logged at debug level)",
                           msg.req_id, exc_info=True)
        else:
            logger.debug("gemma4-kv: a lookup of request %s failed in the store",
                         msg.req_id, exc_info=True)
        if isinstance(msg, messages.Lookup):
            return messages.LookupReply()
        return messages.Done(False)

    def repin(self, msg: messages.Repin) -> Hit | None:
        """Pin exactly what a hit of `msg.hit` tokens reads (the scheduler's choice over
        all ranks), releasing what this rank pinned for its own longer answer. A hit
        the chunks named cannot hold, or an empty one, is a miss (None), never a pin."""
        self.release(msg.req_id, msg.pin)
        if not 0 <= msg.start < msg.hit <= len(msg.hashes) * self.chunk_size:
            return None
        return self._pin(msg.req_id, msg.pin, msg.hashes, msg.start, msg.hit, set())

    def _fresh_s(self, h: Hit | None) -> float | None:
        """Seconds `h` may still be offered to a load (None: no limit)."""
        if h is None or math.isinf(h.pinned.fresh_until):
            return None
        return h.pinned.fresh_until - self._clock()

    def advance(self) -> bool:
        """Between messages (lookup thread): move the store's prefetches on; whether any
        is still in flight."""
        self.store.poll()
        return self.store.in_flight()

    def release(self, req_id: str, pin: int) -> None:
        h = self._take_hit(req_id, pin)
        if h is not None:
            self.store.release(h.pinned)

    def pinned_requests(self) -> set[str]:
        """Requests holding a pinned hit on this rank."""
        with self._lock:
            return {req_id for req_id, _ in self._hits}

    def _drop_pending(self, req_id: str) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            self.store.finish_prefetch(pending.prefetch)

    # -- the model thread -------------------------------------------------------------
    def take(self, req_id: str, pin: int) -> Hit | None:
        """Pin `pin` of a request about to be loaded (the caller releases it with `done`
        once the copies have finished)."""
        return self._take_hit(req_id, pin)

    def done(self, hit: Hit) -> None:
        self.store.release(hit.pinned)

    # -- helpers ----------------------------------------------------------------------
    def _candidates(self, chain: list[bytes], start: int, limit: int,
                    spans=()) -> list[int]:
        """Hit lengths this rank can serve, longest first, none ending inside a span."""
        if limit <= start or not chain:
            return []
        resident = self.store.resident(chain)
        hits = servable_hits(self.layout, self.chunk_size, len(chain),
                             lambda g, c: c in resident[g], start, limit)
        return [h for h in hits if not any(a < h < b for a, b in spans)]

    def _pin(self, req_id: str, pin: int, chain: list[bytes], start: int, hit: int,
             loaded: set) -> Hit | None:
        with self._lock:
            full = len(self._hits) >= MAX_PINNED
        if full:
            logger.warning("gemma4-kv: %d requests hold pinned hits: request %s misses",
                           MAX_PINNED, req_id)
            return None
        pinned = self.store.pin(chain, start, hit, req_id)
        if pinned is None:
            return None
        cells = hit_chunks(self.layout, start, hit, self.chunk_size)
        l2_chunks = {c for g, c in cells if (chain[c], g) in loaded}
        from_l2 = sum(min(hit, (c + 1) * self.chunk_size) - max(start, c * self.chunk_size)
                      for c in l2_chunks)
        h = Hit(start, hit, pinned, from_l2)
        with self._lock:
            self._hits[(req_id, pin)] = h
        return h

    def _take_hit(self, req_id: str, pin: int) -> Hit | None:
        with self._lock:
            return self._hits.pop((req_id, pin), None)

    def _count(self, msg: messages.Lookup, hit: int, from_l2: int, t0: float) -> None:
        seconds = self._clock() - t0  # since it first asked L2, if it had to
        if self.stats is not None:
            self.stats.lookup(max(0, hit - msg.start), from_l2, seconds)
        if self.record is not None:
            self.record("lookup", msg.req_id, msg.start, hit, [], seconds=seconds)

    def close(self) -> None:
        with self._lock:
            hits, self._hits = list(self._hits.values()), {}
        for h in hits:
            self.store.release(h.pinned)
        for req_id in list(self._pending):
            self._drop_pending(req_id)
