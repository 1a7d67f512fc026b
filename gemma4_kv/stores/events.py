"""What a store's tiers now hold and no longer hold, queued for whoever publishes it
(the connector, as vLLM's KV cache events: `connector/events.py`).

A store reports objects, (chunk hash, group id), per tier:
- `stored`: committed and visible to lookups;
- `removed`: deleted from the tier (evicted, dropped, or garbage no hit needs); a
  removal of what was never reported stored is harmless (the publisher ignores it);
- `cleared`: everything this engine stored there is unreachable now (`reset`).

Producers never wait: reports are appended under a lock held only for the append (no
I/O), from the model thread or the lookup thread. The queue is bounded (`QUEUE_MAX`
reports); when nobody takes them (events off: then no store has a `TierEvents`; or
the engine idles) the oldest go first and are counted in `dropped`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from .base import ChunkKey

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"

TIER_L1 = "L1"
"""The embedded store's CPU tier (LMCache's L1 in this process)."""
TIER_SERVER = "lmcache_server"
"""The shared-memory L1 of a running `lmcache server` (the server store)."""

QUEUE_MAX = 1 << 14
"""Reports kept until taken (one report is one call: a commit's or a deletion's objects)."""

Report = tuple[str, str, tuple[ChunkKey, ...]]
"""(STORED | REMOVED | CLEARED, tier, objects); CLEARED names none."""


class TierEvents:
    def __init__(self, maxlen: int = QUEUE_MAX):
        self._queue: deque[Report] = deque()
        self._lock = threading.Lock()
        self._maxlen = maxlen
        self.dropped = 0

    def stored(self, tier: str, objects: Iterable[ChunkKey]) -> None:
        self._put((STORED, tier, tuple(objects)))

    def removed(self, tier: str, objects: Iterable[ChunkKey]) -> None:
        self._put((REMOVED, tier, tuple(objects)))

    def cleared(self, tier: str) -> None:
        self._put((CLEARED, tier, ()))

    def _put(self, report: Report) -> None:
        if report[0] != CLEARED and not report[2]:
            return
        with self._lock:
            if len(self._queue) >= self._maxlen:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(report)

    def take(self) -> list[Report]:
        """Every report since the last call, oldest first."""
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out
