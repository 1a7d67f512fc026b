"""Timing shared by the benchmarks: CUDA events around each run (the median), and host
seconds per named phase of a profiled call path (`Timers`)."""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict


def cuda_median(fn, min_reps: int, max_reps: int | None = None,
                budget_s: float = 0.0) -> tuple[float, int]:
    """(median seconds, runs) of `fn` timed by CUDA events after one untimed run:
    `min_reps` runs, and more up to `max_reps` while under `budget_s` seconds."""
    import torch

    fn()
    torch.cuda.synchronize()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (
            len(times) < (max_reps or min_reps) and time.perf_counter() - start < budget_s):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times), len(times)


class Timers:
    """Host seconds and calls per named phase (wrapped functions); only one lookup runs at
    a time, so the sums do not interleave. `unwrap` puts the original functions back."""

    def __init__(self):
        self.seconds, self.calls = defaultdict(float), Counter()
        self._undo = []

    def wrap(self, owner, name: str, label: str):
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[label] += time.perf_counter() - t
                self.calls[label] += 1

        self._undo.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, timed)

    def unwrap(self):
        for owner, name, old in reversed(self._undo):
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._undo = []

    def reset(self):
        self.seconds.clear()
        self.calls.clear()
