"""Loads and saves as jobs: what the scheduler half asks each step (`LoadJob`,
`SaveJob`, `FinishJob`), and the one mechanism that runs them (`JobQueue`).

A job is submitted on the model thread: its copies are launched (on CUDA on their own
streams, beside the forward) and an event is recorded behind them. It finishes once
its event has fired: `poll` finishes every job whose copies have landed, in the order
they were submitted, and never waits on the host; `wait` finishes all (shutdown). What
finishing means is the job's: a load gives its pins back, a save commits its objects,
a request's end lets the store drop what it kept for its writes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..stores.base import ChunkWrite


class Record(Protocol):
    """Where a load, save or lookup is written down, one line each (the connector's
    `StatsFile`, which does nothing without a `stats_file`). Never raises."""

    def __call__(self, event: str, req_id: str, start: int, end: int, plan,
                 t0: float = 0.0, seconds: float | None = None) -> None: ...


@dataclass
class LoadJob:
    """Fill tokens [start, hit) of a request from chunks 0 .. ceil(hit / chunk_size) - 1
    (`hashes`), which its lookup pinned as (req_id, `pin`), into vLLM's blocks
    `block_ids` (per group)."""

    req_id: str
    start: int
    hit: int
    hashes: list[bytes]
    block_ids: tuple[list[int], ...]
    pin: int = 0


@dataclass
class SaveJob:
    """Store the chunks `write` names from vLLM's blocks `block_ids` (per group: the live
    block table, where out-of-window sliding blocks are the null block)."""

    write: ChunkWrite
    block_ids: tuple[list[int], ...]


@dataclass
class FinishJob:
    """A request ended: nothing more is saved for it."""

    req_id: str


class JobQueue:
    """Submitted jobs, finished in order once their copies have landed."""

    def __init__(self):
        self._jobs: deque[tuple[Any, Callable[[], None]]] = deque()  # (event | None, finish)

    def _submitted(self, event, finish: Callable[[], None]) -> None:
        """A job whose copies are behind `event` (None: already done) finishes with
        `finish()`."""
        self._jobs.append((event, finish))

    def poll(self) -> None:
        """Finish every job whose copies have landed (and all before it)."""
        while self._jobs and (self._jobs[0][0] is None or self._jobs[0][0].query()):
            self._jobs.popleft()[1]()

    def wait(self) -> None:
        """Finish every job, waiting for their copies."""
        while self._jobs:
            event, finish = self._jobs.popleft()
            if event is not None:
                event.synchronize()
            finish()

    def __len__(self) -> int:
        return len(self._jobs)
