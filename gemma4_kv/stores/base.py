"""The interface every chunk store implements: the embedded LMCache store
(`embedded.EmbeddedStore`) and a running `lmcache server` (`server.ServerStore`).

A store keeps objects: one per (chunk, KV cache group), the group's KV_2LTD tensor
plus its integrity trailer (`layout/integrity.py`). Chunks are named by their position on a
*chain*, the request's chunk hashes from chunk 0 (`keys.request`), because the KV of a
chunk depends on everything before it; a store may key by the hash alone (embedded) or
by the whole prefix (the server).

Reads are two-step, and what may fail happens before a hit is offered:
- `resident` says what the fast tier holds; `start_prefetch` asks slower tiers to bring
  more up, without waiting (`poll` settles it);
- `pin` holds every object a hit reads and checks them: the load then only copies.
Writes are two-phase: `reserve` hands out empty objects to fill, `commit` makes them
visible (or `abort` drops them).

Threads: reads (`resident` to `pin`, `reset`) run on the worker's lookup thread, writes
(`reserve` to `on_request_finished`) on the model thread; `release` runs on either, so a
store shares what both touch under its own lock. No method raises for a tier that is
down or full: it answers with less (a miss, fewer objects). What it raises otherwise
(a bug, LMCache failing) reaches the caller: on the lookup thread that request misses,
on the model thread the step fails.

What differs between stores is stated by `StoreCapabilities`, never by a method or an
argument one store ignores: the settings and the scheduler half read it from the
store's config (`stores.config`), without opening a store. Optional hooks are concrete
and do nothing (`fetch_bytes`, `in_flight`, `on_request_finished`).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # the settings and the scheduler read this module without torch
    import torch

ChunkKey = tuple[bytes, int]
"""(chunk hash, group id) of one object."""

LOW, HIGH = 0, 1
"""Classes of a hit end (see `capacity.py`): HIGH where a stored prompt or its generated
tokens end; LOW the extra ends kept only so that a hit can stop there."""


@dataclass(frozen=True)
class StoreCapabilities:
    """What a store does, where stores differ. Each field is read by the code that plans
    around the store, so a store never has to ignore part of the interface."""

    slow_tier: bool
    """It has a tier slower than the one `resident` reads, which lookups may wait for
    (`start_prefetch` / `poll`); False: a lookup answers from `resident` alone (the
    lookup service)."""
    ranks_hit_ends: bool
    """It keeps what it stores by the class of each hit end (`ChunkWrite.low`); the
    scheduler names LOW ends only for such a store."""
    stores_generated: bool
    """It can serve a hit ending among generated tokens, so their chunks are worth
    saving (the scheduler)."""
    verifies_always: bool
    """Every object it reads is verified against its trailer, whatever
    `verify_checksums` says (the settings refuse turning it off)."""


H = TypeVar("H")
"""A store's own handle type for what a pin holds."""


@dataclass
class Pinned(Generic[H]):
    """Objects held for one hit: views to load from, until `ChunkStore.release`."""

    views: dict[ChunkKey, torch.Tensor]
    handles: H | None = None
    """What the store gives back on release (its own locks), of a type the store
    defines and checks on entry to `release` (a pin of another store is refused);
    emptied by the release."""
    fresh_until: float = math.inf
    """`time.monotonic()` after which the pin must not be offered to a new load: a
    store whose hold on the objects lapses on its own (the `lmcache server`'s read
    locks have a TTL) says when; the lookup then pins again. Until `held_until` a load
    offered before `fresh_until` may still read it."""
    held_until: float = math.inf
    """When the store's hold may lapse: a load must have finished reading by then."""


@dataclass
class Prefetch:
    """A request to slower tiers in flight (`ChunkStore.start_prefetch`)."""

    started: float
    finished: bool = False
    finished_at: float | None = None
    """When it finished (`time.monotonic()`), if it did."""
    loaded: set[ChunkKey] = field(default_factory=set)
    """Objects it brought up into the fast tier (verified)."""
    loaded_bytes: int = 0
    """Their size: with `finished_at - started`, the tier's throughput."""
    rejected: int = 0
    """Objects it found damaged and dropped."""
    answered: bool = False
    """The slower tier told what it holds for it (then a hit may still fail its
    checks). False while it asks, and if it failed or was given up: a store whose
    `looked_up` draws conclusions from misses sets it; the others may leave it."""
    progress_bytes: int | None = None
    """Bytes brought up so far, for stores that can tell while it runs (None: this store
    cannot): `lookup.wait.WaitPolicy.keep_waiting` then waits for a slow tier as long as
    bytes keep arriving and the hit stays worth it, and gives up on a stalled one after
    `lookup_timeout_s`."""


@dataclass
class ChunkWrite:
    """What a save asks a store to keep: chunks `first`, `first + 1`, ... of a request's
    `chain`, each for the groups in `groups[i]` (a chunk is kept for all of them or
    none). `ends` are the token counts where the hits the request's stored chunks serve
    end: a store keeps only what those hits read."""

    req_id: str
    chain: list[bytes]
    first: int
    groups: list[tuple[int, ...]]
    ends: list[int] = field(default_factory=list)
    low: frozenset[int] = frozenset()
    """Of `ends`, those kept only so that a hit can stop there (class LOW, evicted
    first; the others are HIGH). Named only for a store that ranks by them
    (`StoreCapabilities.ranks_hit_ends`); empty otherwise."""


@dataclass
class Reservation:
    """Empty objects handed out by `reserve`: {(hash, group): (KV tensor, trailer
    tensor, trailer key)}, to fill and `commit` (or `abort`)."""

    objects: dict[ChunkKey, tuple[torch.Tensor, torch.Tensor, int]]


class ChunkStore(abc.ABC):
    """See the module doc. Each method states its thread, whether it may wait, what a
    failure does and whether a second call is harmless."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> StoreCapabilities:
        """What this store does (its config's `capabilities`); fixed for its life."""

    def slow_tier_up(self) -> bool:
        """Whether a lookup should ask the slower tier now (lookup thread, never waits).
        A store whose slower tier it knows to be down (a server that stopped answering)
        says False until it answers again, so lookups miss at once instead of asking."""
        return self.capabilities.slow_tier

    # -- reads (lookup thread) --------------------------------------------------------
    @abc.abstractmethod
    def resident(self, chain: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id (every group of the layout), the chunk indices of `chain` the
        fast tier holds and may offer now: objects still unverified or known bad are
        left out. Never waits; a second call may answer more (a prefetch landed) or
        less (eviction)."""

    @abc.abstractmethod
    def start_prefetch(self, chain: Sequence[bytes], start: int, limit: int) -> Prefetch:
        """Ask slower tiers for what a hit of up to `limit` tokens of `chain` needs, of
        which the engine holds the first `start` itself. Never waits: the tiers answer
        behind `poll`. Always returns a new `Prefetch` (finished at once if nothing is
        asked: no room, tier down), which the caller hands to `finish_prefetch` exactly
        once. The lookup service asks only while `slow_tier_up()`."""

    def fetch_bytes(self, chain: Sequence[bytes], start: int, limit: int) -> int | None:
        """Bytes `start_prefetch(chain, start, limit)` would bring up from slower
        tiers, if the store can tell (None: unknown); with the tier's measured
        throughput it bounds how long a lookup waits. Never waits; asks no tier."""
        return None

    @abc.abstractmethod
    def poll(self) -> None:
        """Move every prefetch in flight on and settle those whose tiers have answered:
        what they brought up is verified before `resident` offers it. Never waits;
        idempotent. A prefetch whose tier fails finishes with nothing."""

    def in_flight(self) -> bool:
        """Whether a prefetch is in flight that `poll` moves on. The lookup thread then
        polls between messages, so a lookup of several phases (ask, verify, hold) runs
        them back to back rather than one per scheduler step."""
        return False

    @abc.abstractmethod
    def finish_prefetch(self, prefetch: Prefetch) -> None:
        """The lookup is done with `prefetch` (it pinned its hit, or gave up, finished
        or not): whatever the store still holds for it goes, now or when it settles.
        Idempotent."""

    def looked_up(self, req_id: str, reach: int) -> None:
        """The slower tier has answered request `req_id`'s lookup for a hit of up to
        `reach` tokens (its chain's keyable chunks, capped by the lookup's limit; 0 when
        the lookup starts): a later save of it towards an end past `reach` is not that
        end "asked again", whatever the hit. A lookup the tier did not answer (down,
        paused, not worth waiting for, given up) reaches 0: a miss the tier was never
        asked about says nothing of what it holds. Lookup thread, never waits. A store
        that infers eviction from what requests miss keeps it; others need not."""

    @abc.abstractmethod
    def pin(self, chain: Sequence[bytes], start: int, hit: int,
            req_id: str = "") -> Pinned | None:
        """Hold and check every object a hit of tokens [start, hit) of `chain` reads, for
        request `req_id`: all or nothing (None, holding nothing). What it returns stays
        valid, through `reset` too, until `release`d exactly once or its `held_until`
        passes, whichever comes first; it is offered to loads only before its
        `fresh_until`; the load only copies from its views. May wait only where the hit
        was not prefetched (a rank asked to pin what another found), for less than the
        scheduler's wait for a rank's answer (`connector.scheduler.RANK_TIMEOUT_S`)."""

    @abc.abstractmethod
    def release(self, pinned: Pinned | None) -> None:
        """Give back what `pin` held. Lookup or model thread; idempotent, and None is a
        no-op. Never raises for a tier that is down (its locks then expire there)."""

    # -- writes (model thread) --------------------------------------------------------
    @abc.abstractmethod
    def reserve(self, write: ChunkWrite) -> Reservation:
        """Empty objects for the chunks of `write` the store should keep: none for those
        it holds already, no hit of `write.ends` needs, or it has no room for (a tier
        down or full gives an empty reservation, never an error). May wait for a remote
        store's answer, up to its call timeout. Every reservation is then `commit`ted
        or `abort`ed exactly once."""

    @abc.abstractmethod
    def commit(self, reservation: Reservation) -> None:
        """The reservation's objects are filled and sealed: make them visible. May wait
        for a remote store's answer, up to its call timeout. Idempotent; after a
        `reset`, what it commits stays unreachable to this engine."""

    @abc.abstractmethod
    def abort(self, reservation: Reservation) -> None:
        """Drop the reservation's objects unseen. Idempotent."""

    def on_request_finished(self, req_id: str) -> None:
        """The request will save nothing more (called after its last `commit` or
        `abort`). A store that keeps state for a request's writes in flight drops it
        here; others need not."""

    # -- misc -------------------------------------------------------------------------
    @abc.abstractmethod
    def reset(self) -> bool:
        """Make everything stored so far unreachable to this engine (its weights
        changed): later lookups find none of it, in any tier. Lookup thread; pins held
        stay valid until released, and reservations made before it commit nothing.
        True once done."""

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """(used, total) bytes of the fast tier, as the store knows them (any thread)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give everything back (pins, prefetches, connections); the store is unusable
        afterwards. Called once, after the lookup and model threads stopped using it."""
