"""Verification of objects that came up from an L2 tier, off the lookup thread.

Checking an object against its trailer (`layout/integrity.py`) reads every byte of it:
about 0.4 s per GiB on one core, and one prefetch of a long prompt brings up several
GiB. On the lookup thread that held every other lookup (and the scheduler, which waits
for them) for as long. A `Verifier` runs it on a few threads of its own instead, one
prefetch's objects spread over them (torch's integer kernels release the GIL, so they
run in parallel), and the lookup thread picks the verdicts up at its next poll without
waiting (`Batch.done`). The caller keeps the objects read-locked, and withheld from
lookups, until it has taken the verdicts.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

from ..layout import integrity

logger = logging.getLogger(__name__)

WORKERS = max(1, min(4, os.cpu_count() or 1))
"""Threads verifying at once: a few, enough for the host's memory bandwidth."""
MAX_BATCHES = 16
"""Batches queued or running at most (`has_room`): the pool's queue stays bounded."""

Entry = tuple | bool | None
"""An object to verify, (KV tensor, trailer tensor, key value), or its verdict known
already: False (gone), None (could not be read)."""


class Batch:
    """One caller's objects being verified. `done` never waits; `result` once done."""

    def __init__(self, entries: list[Entry], parts: list[tuple[list[int], Future]]):
        self._entries, self._parts = entries, parts

    def done(self) -> bool:
        return all(f.done() for _, f in self._parts)

    def result(self) -> list[bool | None]:
        """Per entry, in order: True (intact, under its key), False (damaged, foreign
        or gone), None (not verified: it could not be read, or verifying it raised)."""
        out = [e if not isinstance(e, tuple) else None for e in self._entries]
        for idx, f in self._parts:
            try:
                verdicts = f.result(timeout=0)
            except Exception:  # noqa: BLE001 - cancelled at close, or a bug: unverified
                logger.warning("gemma4-kv: verifying %d object(s) failed; they are not "
                               "offered until verified", len(idx), exc_info=True)
                continue
            for i, ok in zip(idx, verdicts):
                out[i] = ok
        return out


def _verify_all(objects: list[tuple]) -> list[bool]:
    return [integrity.verify(kv, trailer, key) for kv, trailer, key in objects]


class Verifier:
    """A bounded pool of verifying threads, created on first use. `submit` and
    `has_room` run on one thread (the lookup thread), which owns the batch count."""

    def __init__(self, workers: int = WORKERS, max_batches: int = MAX_BATCHES):
        self._workers, self._max = workers, max_batches
        self._pool: ThreadPoolExecutor | None = None
        self._batches: list[Batch] = []  # submitted, not yet seen done

    def has_room(self) -> bool:
        """Whether `submit` may be called now (fewer than `max_batches` unfinished)."""
        self._batches = [b for b in self._batches if not b.done()]
        return len(self._batches) < self._max

    def submit(self, entries: list[Entry]) -> Batch:
        """Start verifying the objects among `entries`, spread over the threads; never
        waits. The tensors must stay valid (read-locked) until the batch is done."""
        todo = [i for i, e in enumerate(entries) if isinstance(e, tuple)]
        objects = [e for e in entries if isinstance(e, tuple)]  # entries[i] for i in todo
        parts = []
        if todo:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers,
                                                thread_name_prefix="gemma4kv-verify")
            for w in range(min(self._workers, len(todo))):
                idx = todo[w::self._workers]
                parts.append((idx, self._pool.submit(_verify_all,
                                                     objects[w::self._workers])))
        batch = Batch(entries, parts)
        self._batches.append(batch)
        return batch

    def close(self) -> None:
        """Wait for the verifications running (they read L1's memory), drop the rest."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
