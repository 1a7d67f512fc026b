"""What a store counts into: the lowest layer that counts, so its contract lives here
(`Stats`); the connector's `Gemma4KVStats` (`connector/metrics.py`) fulfils it, and the
transfer and lookup layers take the same contract."""

from __future__ import annotations

from typing import Protocol


class Stats(Protocol):
    """A thread-safe counter sink: any thread, never waits, never raises."""

    def add(self, name: str, value: float, group: int | None = None) -> None:
        """Add `value` to the counter `name` (per KV cache group, if `group`)."""
