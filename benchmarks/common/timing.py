"""GPU timing shared by the benchmarks: CUDA events around each run, the median."""

from __future__ import annotations

import statistics
import time


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
