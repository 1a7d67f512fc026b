"""One L2 prefetch of the embedded store (`embedded_l2.L2Prefetches`): the LMCache
tasks of one lookup, what it holds until it settles, and where it is (`Stage`); and the
decisions L2 work hands back to the store, the one owner of its account (`Decision`)."""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

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
    """Where a prefetch is; only `L2Prefetch.advance` moves it on:
    FETCHING -> VERIFYING -> DONE, or back to FETCHING for a targeted round;
    FETCHING -> GIVEN_UP (its tasks did not answer in time) -> DONE once they answer."""

    FETCHING = "fetching"  # its LMCache tasks are out
    VERIFYING = "verifying"  # they answered: what they brought up is being verified
    DONE = "done"  # settled: what verified may be offered, its locks are gone
    GIVEN_UP = "given up"  # its tasks did not answer in time; polled until they do


@dataclass
class Check:
    """What a prefetch's verification holds: the keys its tasks locked (their hit), the
    strays locked to verify them, and the objects being verified, in `batch` order."""

    locked: list
    strays: list
    items: list  # (key, chunk hash, group id, is a stray)
    batch: Batch


@dataclass(frozen=True)
class Round:
    """One round of LMCache tasks as submitted (`Rounds.submit`): each task's handle and
    rows of (group id, hashes, keys); of its keys, those L1 held (read-locked until the
    round settles) and the others (withheld until then)."""

    tasks: list
    held: list
    untrusted: list


@dataclass(frozen=True)
class Settled:
    """A round's verdicts taken (`Rounds.settle`): the objects it brought up verified,
    their bytes, and how many it rejected."""

    loaded: dict[ChunkKey, int]
    rejected: int


class Rounds(Protocol):
    """What a prefetch asks of the L2 half that holds it (`embedded_l2.L2Prefetches`),
    which owns L1, the verifier and the keys withheld across prefetches. Lookup thread;
    none of it waits."""

    def submit(self, tasks: list, namespace: str) -> Round:
        """Submit tasks, each (rows of (group id, hashes), policy)."""

    def outcome(self, handle) -> object | None:
        """A task's result, None while it runs."""

    def can_verify(self) -> bool:
        """Whether the verifier takes another batch now."""

    def check(self, job: L2Prefetch) -> Check:
        """Hand what the job's answered round brought up to the verifier."""

    def settle(self, job: L2Prefetch, namespace: str) -> Settled:
        """Take the verdicts of the job's check (done); release its round's locks."""

    def next_fetch(self, job: L2Prefetch, namespace: str) -> list[ChunkKey]:
        """What a targeted round should ask for; nothing if the hit is servable."""

    def give_up(self, job: L2Prefetch, held: list, untrusted: list) -> None:
        """Stop waiting for the job's round: `held` unlocked, what it may bring up
        verified before it is offered (`job.hung_keys`)."""

    def hung_answered(self, job: L2Prefetch) -> None:
        """A given-up job's tasks answered at last: unlock what they locked."""


@dataclass
class L2Prefetch(Prefetch):
    """LMCache prefetch tasks of one lookup, what they hold until they settle, and where
    it is (`stage`). Its fields are its own: `advance` and `ask` write them, the
    `Rounds` it is handed only reads them."""

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
    """Once given up: every key its tasks may still bring up from L2 (`give_up`)."""
    owner: str = field(default_factory=lambda: f"prefetch-{uuid.uuid4().hex}")
    """Holds what it brought up in the store's account until its lookup is done."""
    done_with: bool = False
    stage: Stage = Stage.FETCHING
    check: Check | None = None

    @property
    def verifying(self) -> Check:
        """`check` while VERIFYING: set on entering that stage, cleared on leaving it."""
        assert self.check is not None
        return self.check

    def ask(self, rounds: Rounds, tasks: list, namespace: str) -> None:
        """Start a round: submit `tasks` (each (rows of (group id, hashes), policy))."""
        r = rounds.submit(tasks, namespace)
        self.tasks, self.results = r.tasks, [None] * len(r.tasks)
        self.held, self.untrusted = self.held + r.held, self.untrusted + r.untrusted

    def finish(self) -> Done:
        """Its lookup is done with it: what it holds in the account may go."""
        self.done_with = True
        return Done(self.owner)

    def advance(self, rounds: Rounds, now: float, namespace: str, limit_s: float) -> None:
        """Move on as far as it goes without waiting: its tasks answered (or, past
        `limit_s`, given up), its objects handed to the verifier (once it has room),
        their verdicts taken, the next round asked (at most three) or done. The one
        place its stage changes."""
        if self.stage in (Stage.FETCHING, Stage.GIVEN_UP):
            for i, (handle, _) in enumerate(self.tasks):
                if self.results[i] is None:
                    self.results[i] = rounds.outcome(handle)
            if any(r is None for r in self.results):
                if self.stage is Stage.FETCHING and now - self.started > limit_s:
                    held, untrusted = self.held, self.untrusted
                    self.hung_keys, self.held, self.untrusted = held + untrusted, [], []
                    self.finished, self.stage = True, Stage.GIVEN_UP
                    rounds.give_up(self, held, untrusted)
                return
            if self.stage is Stage.GIVEN_UP:
                rounds.hung_answered(self)
                self.stage = Stage.DONE
                return
            if not rounds.can_verify():
                return  # asked again at the next poll
            self.check, self.stage = rounds.check(self), Stage.VERIFYING
        if self.stage is Stage.VERIFYING:
            if not self.verifying.batch.done():
                return
            settled = rounds.settle(self, namespace)
            self.loaded.update(settled.loaded)
            self.loaded_bytes += sum(settled.loaded.values())
            self.rejected += settled.rejected
            self.held, self.untrusted, self.check = [], [], None
            missing = rounds.next_fetch(self, namespace) if self.rounds < 3 else []
            if missing:
                self.rounds += 1
                self.asked.update(missing)
                per_group: dict[int, list[bytes]] = {}
                for h, gid in missing:
                    per_group.setdefault(gid, []).append(h)
                self.ask(rounds, [([(gid, hs)], "full") for gid, hs in per_group.items()],
                         namespace)
                self.stage = Stage.FETCHING
            else:
                self.finished, self.finished_at = True, time.monotonic()
                self.stage = Stage.DONE
