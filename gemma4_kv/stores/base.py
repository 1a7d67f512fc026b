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

Threads: reads run on the worker's lookup thread, writes on the model thread.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ChunkKey = tuple[bytes, int]
"""(chunk hash, group id) of one object."""

LOW, HIGH = 0, 1
"""Classes of a hit end (see `capacity.py`): HIGH where a stored prompt or its generated
tokens end; LOW the extra ends kept only so that a hit can stop there."""


@dataclass
class Pinned:
    """Objects held for one hit: views to load from, until `ChunkStore.release`."""

    views: dict[ChunkKey, torch.Tensor]
    handles: list = field(default_factory=list)
    """What the store gives back on release (its own locks)."""


@dataclass(frozen=True)
class StoreCapabilities:
    """What a kind of store does, for the parts that plan around it without holding one
    (the scheduler half runs in another process than the stores)."""

    slow_tier: bool
    """Lookups may need a slower tier (`start_prefetch` / `poll`) before a hit."""
    ranks_hit_ends: bool
    """It keeps what it stores by the hit ends of `ChunkWrite.ends` (their class)."""
    stores_generated: bool
    """Chunks of generated tokens are worth saving (a hit can end among them)."""


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


@dataclass
class ChunkWrite:
    """What a save asks a store to keep: chunks `first`, `first + 1`, ... of a request's
    `chain`, each for the groups in `groups[i]` (a chunk is kept for all of them or
    none). `ends` are the hits the request's stored chunks serve, as (token count,
    HIGH or LOW): a store that ranks what it keeps uses them."""

    req_id: str
    chain: list[bytes]
    first: int
    groups: list[tuple[int, ...]]
    ends: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Reservation:
    """Empty objects handed out by `reserve`: {(hash, group): (KV tensor, trailer
    tensor, trailer key)}, to fill and `commit` (or `abort`)."""

    objects: dict[ChunkKey, tuple[torch.Tensor, torch.Tensor, int]]


class ChunkStore(abc.ABC):
    """See the module doc."""

    @property
    @abc.abstractmethod
    def has_l2(self) -> bool:
        """Whether a lookup should ask a slower tier (`start_prefetch`) at all."""

    # -- reads (lookup thread) --------------------------------------------------------
    @abc.abstractmethod
    def resident(self, chain: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices of `chain` the fast tier holds and may offer."""

    @abc.abstractmethod
    def start_prefetch(self, chain: Sequence[bytes], start: int, limit: int) -> Prefetch:
        """Ask slower tiers for what a hit of up to `limit` tokens (after `start`
        local ones) on `chain` needs, without waiting."""

    def fetch_bytes(self, chain: Sequence[bytes], start: int, limit: int) -> int | None:
        """Bytes a prefetch of the same arguments would bring up from slower tiers, if
        the store can tell (None: unknown)."""
        return None

    @abc.abstractmethod
    def poll(self) -> None:
        """Settle every prefetch that has finished (never waits)."""

    def in_flight(self) -> bool:
        """Whether a prefetch is in flight that `poll` moves on. The lookup thread then
        polls between messages, so a lookup of several phases (ask, verify, hold) runs
        them back to back rather than one per scheduler step."""
        return False

    @abc.abstractmethod
    def finish_prefetch(self, prefetch: Prefetch) -> None:
        """The lookup is done with `prefetch` (it pinned its hit, or gave up): whatever
        the store still holds for it goes."""

    @abc.abstractmethod
    def pin(self, chain: Sequence[bytes], start: int, hit: int,
            req_id: str = "") -> Pinned | None:
        """Hold and check every object a hit of tokens [start, hit) of `chain` reads, for
        request `req_id`; all or nothing (None)."""

    @abc.abstractmethod
    def release(self, pinned: Pinned | None) -> None:
        """Give back what `pin` held (idempotent)."""

    # -- writes (model thread) --------------------------------------------------------
    @abc.abstractmethod
    def reserve(self, write: ChunkWrite) -> Reservation:
        """Empty objects for the chunks of `write` the store should keep (none for those
        it holds already or has no room for)."""

    @abc.abstractmethod
    def commit(self, reservation: Reservation) -> None:
        """The reservation's objects are filled: make them visible."""

    @abc.abstractmethod
    def abort(self, reservation: Reservation) -> None:
        """Drop the reservation's objects unseen."""

    def on_request_finished(self, req_id: str) -> None:
        """The request will save nothing more. A store that keeps state for a request's
        writes in flight drops it here; others need not."""

    # -- misc -------------------------------------------------------------------------
    @abc.abstractmethod
    def reset(self) -> bool:
        """Make everything stored so far unreachable (weights changed)."""

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """(used, total) bytes of the fast tier."""

    @abc.abstractmethod
    def close(self) -> None:
        """Give everything back; the store is unusable afterwards."""
