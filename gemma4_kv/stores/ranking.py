"""The ranking half of the capacity policy: W-TinyLFU over hit ends (see `capacity.py`).

A recency window (`window_share` of the tier) for new HIGH ends, a segmented LRU
(probation, protected) for the main part, a LOW segment that always goes first, and
frequencies counted per end and halved every `sample` counts. `victims` is the whole
admission and eviction rule: which ends to evict so that a new end fits, or None.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .base import LOW

SEGMENTS = ("low", "window", "probation", "protected")


class Ranking:
    """Where every live end ranks. Each segment keeps the ends it holds (their size and
    pins are read from them); the tier's size, `limit`, is the account's and is passed
    in by every call that weighs a segment against it (`Capacity` owns both)."""

    def __init__(self, *, window_share: float, protected_share: float, min_sample: int,
                 ties_admit: bool = False):
        self.window_share, self.protected_share = window_share, protected_share
        self.ties_admit = ties_admit
        """Whether a new end may displace main ends asked as often as itself (`victims`)."""
        self.min_sample = min_sample
        self._segments: dict[str, OrderedDict] = {s: OrderedDict() for s in SEGMENTS}
        self.where: dict = {}
        self._freq: dict = {}
        self._counted = 0
        self._asked: OrderedDict = OrderedDict()  # (request, end) already counted by a hit

    # -- frequencies --------------------------------------------------------------------
    def frequency(self, key) -> int:
        return self._freq.get(key, 0)

    def count(self, key, req_id: str = "") -> None:
        """`key` was asked for once more; with `req_id`, once per request at most."""
        if req_id:
            if (req_id, key) in self._asked:
                return
            self._asked[(req_id, key)] = None
            while len(self._asked) > 8192:
                self._asked.popitem(last=False)
        self._freq[key] = self._freq.get(key, 0) + 1
        self._counted += 1
        if self._counted >= max(self.min_sample, 10 * len(self.where)):
            self._freq = {k: f // 2 for k, f in self._freq.items() if f > 1}
            self._counted //= 2

    # -- segments -------------------------------------------------------------------------
    def enter(self, end, limit: int) -> None:
        """A live end joins: LOW ends their segment; a HIGH end the window if it fits
        there, else main's probation."""
        if end.cls == LOW:
            self.place(end, "low")
            return
        self.place(end, "window" if end.size <= self.window_share * limit
                   else "probation")
        self.balance_window(limit)

    def touch(self, end, limit: int) -> None:
        where = self.where.get(end.key)
        if where == "probation":
            self.place(end, "protected")
            self._overflow("protected", self.protected_share * (1 - self.window_share)
                           * limit)
        elif where is not None:
            self._segments[where].move_to_end(end.key)

    def balance_window(self, limit: int) -> None:
        """Move the window's oldest ends on to main's probation while it holds more than
        its share (eviction made room for them already, see `victims`)."""
        self._overflow("window", self.window_share * limit)

    def _overflow(self, segment: str, cap: float) -> None:
        ends = self._segments[segment]
        total = sum(end.size for end in ends.values())
        while total > cap and len(ends) > 1:
            end = next(iter(ends.values()))
            total -= end.size
            self.place(end, "probation")

    def place(self, end, segment: str) -> None:
        old = self.where.get(end.key)
        if old is not None:
            del self._segments[old][end.key]
        self._segments[segment][end.key] = end
        self.where[end.key] = segment

    def remove(self, key) -> None:
        where = self.where.pop(key, None)
        if where is not None:
            del self._segments[where][key]

    # -- admission and eviction ------------------------------------------------------------
    def victims(self, short: int, cls: int, freq: int, size: int,
                alone: Callable[[Any, dict], int], limit: int) -> list | None:
        """Ends to evict, in order, so that `short` more bytes fit for a new end of
        class `cls`, asked for `freq` times, of `size` bytes; None if not possible.

        LOW ends go first (least recent first); a LOW end may take nothing else. A HIGH
        end that fits the window enters it: the window's oldest ends leave, each either
        displacing the least recent main end asked for less often than itself, or
        evicted if there is none. Beyond that (or for an end too large for the window),
        main ends asked for less often than the new end go, least recent first,
        probation before protected. Pinned ends are never taken.

        With `ties_admit` (a store with an L2 tier, which holds what L1 evicts) main ends
        asked exactly as often as the new end may go too: a document asked once is then
        brought up from L2 and served rather than refused on a tie with documents also
        asked once (which L2 still holds), while ends asked more often stay. Without an
        L2 tier an evicted end is lost, and a tie keeps what is there (scan resistance)."""
        taken: list = []
        out = set()
        freed = 0
        released: dict = {}  # `alone`'s own tally

        def take(end) -> None:
            nonlocal freed
            taken.append(end)
            out.add(end.key)
            freed += alone(end, released)

        def main_victim(below: int):
            for segment in ("probation", "protected"):
                for key, end in self._segments[segment].items():
                    if key not in out and not end.pins and self.frequency(key) < below:
                        return end
            return None

        for end in self._segments["low"].values():
            if freed >= short:
                return taken
            if not end.pins:
                take(end)
        if freed >= short:
            return taken
        if cls == LOW:
            return None
        cap = self.window_share * limit
        if size <= cap:
            window = self._segments["window"]
            held = size + sum(w.size for w in window.values())
            for key, w in list(window.items()):  # oldest first
                if freed >= short or held <= cap:
                    break
                held -= w.size
                if not w.pins:
                    take(main_victim(self.frequency(key)) or w)
        while freed < short:
            end = main_victim(freq + 1 if self.ties_admit else freq)
            if end is None:
                return None
            take(end)
        return taken
