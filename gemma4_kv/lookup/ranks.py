"""The scheduler's side of a lookup across tensor-parallel ranks: every rank answers the
hit it pinned and every hit it could serve; the longest hit all can serve is offered,
and every rank pins exactly that (`Repin`) or nothing."""

from __future__ import annotations

import logging
import time

from . import messages
from .channel import LookupClient

logger = logging.getLogger(__name__)


class RanksDown(Exception):
    """A worker rank did not answer (or failed) a lookup."""


def lookup_all_ranks(client: LookupClient, lookup: messages.Lookup
                     ) -> tuple[int | None, int, float | None]:
    """(hit, tokens of it brought up from L2, seconds it may still be offered to a
    load: None for no limit) that every rank can serve and has pinned exactly; hit None
    while a rank is still asking an L2 tier (what the others pinned stays named
    (req_id, pin): the next lookup of the request reuses that name, and a rank
    releases it before it pins again), or 0. The ranks that chose another hit than the
    common one re-pin, so no rank reads an object it did not pin, nor keeps one pinned
    that no load reads. A rank that does not answer, the re-pin included, raises
    `RanksDown`; releases are told, never waited for."""
    answers = client.ask_all(lookup)
    if answers is None:
        raise RanksDown
    replies = [r for r in answers if isinstance(r, messages.LookupReply)]
    if len(replies) != len(answers):
        raise RanksDown
    if any(r.pending for r in replies):
        return None, 0, None
    common = set(replies[0].candidates).intersection(*(r.candidates for r in replies))
    hit = max(common, default=0)
    release = messages.Release(lookup.req_id, lookup.pin)
    if hit <= lookup.start:
        client.tell_all(release)
        return 0, 0, None
    fresh = [r.fresh_s for r in replies]
    if any(r.pinned != hit for r in replies):
        repinned = client.ask_all(messages.Repin(lookup.req_id, lookup.hashes, lookup.start,
                                                 hit, lookup.pin))
        if repinned is None:
            raise RanksDown
        done = [d for d in repinned if isinstance(d, messages.Done)]
        if len(done) != len(repinned):
            raise RanksDown
        if not all(d.ok for d in done):
            client.tell_all(release)
            return 0, 0, None
        fresh = [d.fresh_s if r.pinned != hit else r.fresh_s for r, d in zip(replies, done)]
    limits = [f for f in fresh if f is not None]
    return hit, replies[0].from_l2, min(limits) if limits else None


class RankLookups:
    """The scheduler's lookups on every rank, which never stall it: a rank that has not
    answered within `timeout_s` makes that lookup a miss, and after `down_after`
    unanswered lookups in a row none is asked for `backoff_s` (a dead rank pauses
    lookups; one slow answer pauses nothing)."""

    def __init__(self, addresses: list[str], stats, *, timeout_s: float, down_after: int,
                 backoff_s: float):
        self.client = LookupClient(addresses, timeout_ms=int(timeout_s * 1000))
        self.stats, self.timeout_s = stats, timeout_s
        self.down_after, self.backoff_s = down_after, backoff_s
        self._down_until = 0.0
        self._unanswered = 0  # lookups in a row a rank did not answer

    def paused(self) -> bool:
        return time.monotonic() < self._down_until

    def lookup(self, lookup: messages.Lookup) -> tuple[int | None, int, float | None]:
        """`lookup_all_ranks`, or (0, 0, None) if a rank did not answer: the other ranks
        then drop the lookup's pins, told without waiting (the rank that did not answer
        would hold the scheduler again)."""
        try:
            out = lookup_all_ranks(self.client, lookup)
        except RanksDown:
            self._unanswered += 1
            self.stats.add("lookups_unanswered", 1)
            if self._unanswered >= self.down_after:
                logger.warning("gemma4-kv: a worker rank did not answer %d lookups in a "
                               "row; no lookups for %.0f s", self._unanswered, self.backoff_s)
                self._down_until = time.monotonic() + self.backoff_s
                self._unanswered = 0
            else:
                logger.warning("gemma4-kv: a worker rank did not answer a lookup within "
                               "%.0f s: a miss", self.timeout_s)
            self.client.tell_all(messages.Release(lookup.req_id, lookup.pin))
            return 0, 0, None
        self._unanswered = 0
        return out
