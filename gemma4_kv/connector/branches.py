"""Where prompts branch: the intermediate hit ends worth a sliding window.

A hit may only end where every sliding group's window before it is stored. A prompt's
own ends (its last whole chunk, and where the same prompt asked again stops) always get
one. An intermediate end (every `retention_interval` tokens) costs a window too: on the
12B shape the tier sweep of 2026-12-03 kept 235 MB per 8K-token document against the
OffloadingConnector's 151 MB, the window of the end at 4096 tokens making the difference.
It serves only a prompt that shares this one's prefix up to there and then goes on
differently, and most never do (a document asked again with another question shares all
of it).

So an intermediate end is kept once a second prompt has shown that the prefix branches
there: the prefix up to the end was seen before, and the prefix up to this prompt's next
end was not. The prompt that shows it stores the window; a third prompt with that prefix
hits it. The scheduler's one thread owns this memory."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

CAPACITY = 1 << 16
"""Prefixes remembered (a chunk hash each; about 8 MiB): the least recently seen go."""


class BranchMemory:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def branch_points(self, chain: Sequence[bytes], chunk_size: int,
                      candidates: Sequence[int], last: int) -> frozenset[int]:
        """Of `candidates` (intermediate ends, in tokens, ascending, each below `last`,
        this prompt's last stored end), those where this prompt branches from one seen
        before; then remembers this prompt's prefixes at each of them and at `last`.
        `chain[i]` is the key of chunk i, which names the whole prefix up to its end."""
        points = [*candidates, last]
        keys = [chain[e // chunk_size - 1] for e in points]
        seen = [k in self._seen for k in keys]
        out = frozenset(e for i, e in enumerate(candidates) if seen[i] and not seen[i + 1])
        for k in keys:
            self._seen[k] = None
            self._seen.move_to_end(k)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return out
