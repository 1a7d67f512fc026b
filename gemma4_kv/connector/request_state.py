"""What the scheduler half knows of one request: its chunk keys, the pin of its latest
lookup, what it stored so far, and which of its chunks a step completes and saves."""

from __future__ import annotations

import math
from typing import Any
from dataclasses import dataclass, field

from ..keys.request import RequestKeys
from ..layout.drafts import DraftPolicy
from ..layout.groups import KVLayout
from ..layout.plan import Retention, retention
from ..stores.base import HIGH, LOW, ChunkWrite
from .branches import BranchMemory


@dataclass
class RequestState:
    request: Any
    """vLLM's `Request` (untyped here: vLLM is followed as Any)."""
    keys: RequestKeys
    drafts: DraftPolicy
    prompt_len: int
    next_chunk: int = 0
    """First chunk not yet stored or loaded."""
    pin: int = 0
    """Number of its latest lookup: the workers name what it pinned (req_id, pin)."""
    offered: tuple[int, int] | None = None
    """(start, end) of the hit offered to vLLM under pin `pin`, while the scheduler owns
    that pin: released there unless a load takes it over (the workers free a load's
    pins once loaded, in step order)."""
    offered_until: float = math.inf
    """`time.monotonic()` until which the offered hit may be offered again (the
    ranks' `fresh_s`, counted from when the lookup was sent)."""
    from_l2: int = 0
    pending: bool = False
    """Its latest lookup was answered pending: a rank may hold a prefetch for it."""
    stored: list[tuple[int, ...]] = field(default_factory=list)
    """Groups stored for each chunk so far (to touch them when the request ends)."""
    impure: set[int] = field(default_factory=set)
    """Chunks holding draft KV that a one-step prefill would not have computed
    (`DraftPolicy.impure_chunks`): never stored."""
    retention: Retention | None = None
    """What its prompt's saves keep (`plan.retention`), planned at its first save."""
    ends: list[tuple[int, int]] = field(default_factory=list)
    """The prompt's hit ends (`retention.ends`) and their class."""

    @property
    def prompt_chunks(self) -> int:
        """Prompt chunks whose keys the prompt alone determines (drafts that own KV key a
        chunk with the token after it)."""
        return (self.prompt_len - self.drafts.lookahead) // self.drafts.chunk_size

    def hashes(self, num_tokens: int) -> list[bytes]:
        """Keys of the first `num_tokens // chunk_size` chunks. With drafts that own KV,
        chunk c's key also names token (c + 1) * chunk_size (`RequestKeys.lookahead`)."""
        n = num_tokens // self.drafts.chunk_size
        if self.drafts.lookahead:
            return self.keys.lookahead(self.request, n)
        self.keys.extend(self.request, num_tokens)
        return self.keys.hashes[:n]

    def chunks_done(self, computed: int, scheduled: int, save_generated: bool) -> int:
        """Chunks whose KV is final after this step: prompt chunks this step computes,
        and (with `save_generated`) generated chunks computed in earlier steps."""
        c = self.drafts.chunk_size
        known = len(self.request.all_token_ids) - self.drafts.lookahead
        done = min(computed + scheduled, self.prompt_len, known) // c
        if save_generated and computed >= self.prompt_len:
            done = max(done, min(computed - self.drafts.decode_margin, known) // c)
        return done

    def write(self, req_id: str, done: int, layout: KVLayout, interval: int,
              name_low: bool, branches: BranchMemory | None = None) -> ChunkWrite:
        """The save of chunks [`next_chunk`, `done`), which it then counts as stored: the
        groups the retention keeps of each (none of an impure chunk) and the hit ends
        they serve, with a HIGH end where generated tokens end; the LOW ends are named
        only if `name_low` (a store that ranks by hit ends). With `branches`, an
        intermediate end is kept only where this prompt branches from one seen before
        (`BranchMemory`)."""
        c = self.drafts.chunk_size
        if self.retention is None:
            kept = retention(layout, c, self.prompt_len, interval, self.drafts.lookahead)
            if branches is not None and max(kept.main) > 0:
                last = max(kept.main)
                at = branches.branch_points(self.hashes(last), c,
                                            [e for e in kept.ends if e not in kept.main], last)
                kept = retention(layout, c, self.prompt_len, interval, self.drafts.lookahead,
                                 intermediate=at)
            self.retention = kept
            self.ends = [(e, HIGH if e in kept.main else LOW) for e in kept.ends]
        chain = self.hashes(max(done, self.prompt_chunks) * c)
        groups = [() if i in self.impure else self.retention.groups(i)
                  for i in range(self.next_chunk, done)]
        ends = list(self.ends)
        if done > self.prompt_len // c:  # a generated chunk ends here
            ends.append((done * c, HIGH))
        low = frozenset(e for e, k in ends if k == LOW) if name_low else frozenset()
        write = ChunkWrite(req_id, chain, self.next_chunk, groups, [e for e, _ in ends], low)
        self.stored += [()] * (self.next_chunk - len(self.stored)) + groups
        self.next_chunk = done
        return write
