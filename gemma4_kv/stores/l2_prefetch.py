"""One L2 prefetch of the embedded store (`embedded_l2.L2Prefetches`): the LMCache
tasks of one lookup, what it holds until it settles, and where it is (`Stage`); and the
decisions L2 work hands back to the store, the one owner of its account (`Decision`)."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

from .base import ChunkKey, Prefetch
from .verifier import Batch


@dataclass(frozen=True)
class Landed:
    """A prefetch settled or was given up: the room promised to `owner` is no longer set
    apart. `kept`: objects it brought into L1, tracked from now on; `held`: those kept
    for its lookup's pin until `Done`. Both empty if it was given up (`gave_up`: what
    lands later stays untracked) or the store moved to a new generation meanwhile."""

    owner: str
    kept: tuple[ChunkKey, ...] = ()
    held: tuple[ChunkKey, ...] = ()
    gave_up: bool = False


@dataclass(frozen=True)
class Rejected:
    """Objects whose L2 copy failed verification, deleted from every tier already: the
    hits that need them cannot serve."""

    cells: tuple[ChunkKey, ...]


@dataclass(frozen=True)
class Done:
    """The lookup is done with the prefetch of `owner`: what it holds for it may go."""

    owner: str


Decision = Landed | Rejected | Done
"""What L2 work decided that the store's account (`capacity.Capacity`) must learn."""


class Stage(enum.Enum):
    """Where a prefetch is; `L2Prefetches._advance` moves it on."""

    FETCHING = "fetching"  # its LMCache tasks are out
    VERIFYING = "verifying"  # they answered: what they brought up is being verified
    DONE = "done"  # settled: what verified may be offered, its locks are gone
    GIVEN_UP = "given up"  # its tasks did not answer in time (`_give_up`)


@dataclass
class Check:
    """What a prefetch's verification holds: the keys its tasks locked (their hit), the
    strays locked to verify them, and the objects being verified, in `batch` order."""

    locked: list
    strays: list
    items: list  # (key, chunk hash, group id, is a stray)
    batch: Batch


@dataclass
class L2Prefetch(Prefetch):
    """LMCache prefetch tasks of one lookup, and what they hold until they settle."""

    chain: tuple[bytes, ...] = ()
    start: int = 0
    limit: int = 0
    tasks: list = field(default_factory=list)  # (handle, rows of (gid, hashes, keys))
    results: list = field(default_factory=list)
    held: list = field(default_factory=list)
    """Its keys that were in L1 when it started, read-locked until it settles: they stay
    offered meanwhile, and cannot be evicted and come up again from L2 unverified."""
    untrusted: list = field(default_factory=list)
    """The others: not offered until it settles (it may bring them up from L2)."""
    rounds: int = 1
    asked: set = field(default_factory=set)
    """Objects targeted fetches of it asked for (those that did not come are not asked
    again)."""
    namespace: str = ""
    hung_keys: list = field(default_factory=list)
    """Once given up: every key its tasks may still bring up from L2 (`_give_up`)."""
    owner: str = field(default_factory=lambda: f"prefetch-{uuid.uuid4().hex}")
    """Holds what it brought up in `capacity` until `finish_prefetch`."""
    done_with: bool = False
    stage: Stage = Stage.FETCHING
    check: Check | None = None
