"""Messages between the scheduler half and the worker ranks (typed, never pickled).

Encoded with msgspec as tagged structs: a decoder accepts exactly these types and
nothing else, so bytes from any other sender are an error, never code to run.

A lookup is two-phase across tensor-parallel ranks: every rank answers `Lookup`
with the hit it pinned and every hit length it could serve; the scheduler takes the
largest length all ranks can serve and sends `Repin` to the ranks whose pin differs,
so what each rank pins is exactly what the load will read.

Pins are named by (request, `pin`), the scheduler numbering each lookup of a request:
a load carries the name of the pin it reads, and a `Release` names the pin it drops,
so a request preempted and looked up again never drops (or leaks) the pin of a load
still in flight.
"""

from __future__ import annotations

import msgspec


class Lookup(msgspec.Struct, tag=True, frozen=True):
    """Pin the largest hit (at most `limit` tokens after the local prefix `start`)
    this rank can serve from chunks `hashes` of request `req_id`."""

    req_id: str
    hashes: list[bytes]
    start: int
    limit: int
    spans: list[tuple[int, int]] = []
    """Token ranges [a, b) a hit must not end inside (images: attended both ways, so
    vLLM must compute an image's tokens in one step)."""
    pin: int = 0
    """Which lookup of the request this is: what it pins is named (req_id, pin)."""


class Repin(msgspec.Struct, tag=True, frozen=True):
    """Pin exactly the objects a hit of `hit` tokens needs (releasing the rest)."""

    req_id: str
    hashes: list[bytes]
    start: int
    hit: int
    pin: int = 0


class Release(msgspec.Struct, tag=True, frozen=True):
    """Drop pin (`req_id`, `pin`) and whatever request `req_id` is prefetching."""

    req_id: str
    pin: int = 0


class Reset(msgspec.Struct, tag=True, frozen=True):
    """Make everything stored so far unreachable (weights changed)."""


class LookupReply(msgspec.Struct, tag=True, frozen=True):
    """`pending`: an L2 tier is still being asked, look up again later.
    `pinned`: hit length whose objects are now pinned (0: nothing pinned).
    `candidates`: every hit length this rank could serve, descending.
    `from_l2`: how many of the pinned hit's tokens came up from an L2 tier.
    `fresh_s`: for how many more seconds the pin may be offered to a load (None: as
    long as it is held; see `stores.base.Pinned.fresh_until`)."""

    pending: bool = False
    pinned: int = 0
    candidates: list[int] = []
    from_l2: int = 0
    fresh_s: float | None = None


class Done(msgspec.Struct, tag=True, frozen=True):
    """`ok`: the request was carried out. `fresh_s`: after a `Repin`, as in
    `LookupReply`."""

    ok: bool
    fresh_s: float | None = None


class Failed(msgspec.Struct, tag=True, frozen=True):
    error: str


Request = Lookup | Repin | Release | Reset
Reply = LookupReply | Done | Failed
