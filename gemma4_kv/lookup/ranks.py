"""The scheduler's side of a lookup across tensor-parallel ranks: every rank answers the
hit it pinned and every hit it could serve; the longest hit all can serve is offered,
and every rank pins exactly that (`Repin`) or nothing."""

from __future__ import annotations

from . import messages
from .channel import LookupClient


class RanksDown(Exception):
    """A worker rank did not answer (or failed) a lookup."""


def lookup_all_ranks(client: LookupClient, lookup: messages.Lookup) -> tuple[int | None, int]:
    """(hit, tokens of it brought up from L2) that every rank can serve and has pinned
    exactly, (None, 0) while a rank is still asking an L2 tier (its pins, if any, are
    dropped when it is asked again or the request ends), or (0, 0). The ranks that chose
    another hit than the common one re-pin, so no rank reads an object it did not pin,
    nor keeps one pinned that no load reads."""
    replies = client.ask_all(lookup)
    if replies is None or any(not isinstance(r, messages.LookupReply) for r in replies):
        raise RanksDown
    if any(r.pending for r in replies):
        return None, 0
    common = set(replies[0].candidates).intersection(*(r.candidates for r in replies))
    hit = max(common, default=0)
    release = messages.Release(lookup.req_id, lookup.pin)
    if hit <= lookup.start:
        client.ask_all(release)
        return 0, 0
    if any(r.pinned != hit for r in replies):
        done = client.ask_all(messages.Repin(lookup.req_id, lookup.hashes, lookup.start, hit,
                                                  lookup.pin))
        if done is None or not all(isinstance(d, messages.Done) and d.ok for d in done):
            client.ask_all(release)
            return 0, 0
    return hit, replies[0].from_l2
