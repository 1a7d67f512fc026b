"""A fixed GPU buffer for staged saves, reused once the copies out of it are done.

A save gathers a group's blocks into device memory at HBM speed (a short burst of SM
time) and copies them to the store's pinned host memory by DMA on a side stream, so
the model keeps computing. The staging memory lies outside vLLM's GPU memory budget,
so it is one buffer of a fixed size (`staging_mb`), allocated at start-up, used as a
ring: regions are handed out in order and come back in order, when the side stream
has passed the event recorded after their copies. A save that finds no room gathers
straight into pinned host memory instead (slower, never more memory).
"""

from __future__ import annotations

from collections import deque

import torch

_ALIGN = 256


class StagingPool:
    def __init__(self, nbytes: int, device: torch.device):
        self.size = nbytes
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._busy: deque[tuple[int, int, torch.cuda.Event | None]] = deque()
        self._head = 0  # next offset to hand out

    def _reap(self) -> None:
        while self._busy and self._busy[0][2] is not None and self._busy[0][2].query():
            self._busy.popleft()
        if not self._busy:
            self._head = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A region of `nbytes` (a uint8 tensor), or None if the ring has no room now.
        Every region must be given back with `release_after`."""
        self._reap()
        n = -(-nbytes // _ALIGN) * _ALIGN
        tail = self._busy[0][0] if self._busy else None
        start = None
        if tail is None or self._head > tail:  # in use: [tail, head), if anything
            if self._head + n <= self.size:
                start = self._head
            elif n <= (tail if tail is not None else self.size):
                start = 0  # wrap around
        elif self._head + n <= tail:  # wrapped: free is [head, tail)
            start = self._head
        if start is None:
            return None
        self._head = start + n
        self._busy.append((start, start + n, None))
        return self.buffer[start:start + nbytes]

    def release_after(self, region: torch.Tensor, event) -> None:
        """The region comes back once `event` (recorded after its copies; anything with
        `query()`) has fired."""
        start = region.data_ptr() - self.buffer.data_ptr()
        for i, (s, e, ev) in enumerate(self._busy):
            if s == start and ev is None:
                self._busy[i] = (s, e, event)
                return
        raise ValueError("region does not belong to this pool or was released already")
