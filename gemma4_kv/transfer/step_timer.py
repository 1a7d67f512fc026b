"""How long each step's forward took, for the lookups' measured prefill cost
(`lookup.wait.Rates.prefill`).

The forward runs between vLLM's `bind_connector_metadata` and `wait_for_save` (vLLM
calls `start_load_kv` after the forward when the step loads nothing synchronously). On
a GPU those calls return before the kernels have run, so the time is taken by CUDA
events and read once they have fired (never waiting for them); elsewhere the forward
has finished when `wait_for_save` is called and host time is exact.
"""

from __future__ import annotations

import time
from collections import deque

from typing import Any

import torch

MAX_OPEN = 8
"""Steps whose events have not fired yet that are kept; older ones are dropped."""


class StepTimer:
    def __init__(self, cuda: bool, observe):
        """`observe(tokens, seconds)` is called once per timed step."""
        self.cuda, self.observe = cuda, observe
        self._start: Any = None  # a recorded torch.cuda.Event, or perf_counter()
        self._open: deque = deque(maxlen=MAX_OPEN)

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self, tokens: int) -> None:
        """The step's forward, computing `tokens` tokens, has been queued or run."""
        start, self._start = self._start, None
        if start is None or tokens <= 0:
            return
        if not self.cuda:
            self.observe(tokens, time.perf_counter() - start)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((start, end, tokens))
        self.poll()

    def poll(self) -> None:
        """Report the steps whose events have fired, in order."""
        while self._open and self._open[0][1].query():
            start, end, tokens = self._open.popleft()
            self.observe(tokens, start.elapsed_time(end) / 1000.0)
