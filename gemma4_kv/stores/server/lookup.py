"""A lookup on the server as a job: `LookupJob`, whose `Phase` only its `advance`
changes, and the `HitFinder` its jobs share (the reads, the objects known bad, the GPU
budget of verified copies).

A job (`ServerStore.start_prefetch`, moved on by `poll` on the lookup thread):

    ASKING ---> CHECKING ---> FOUND
      |  ^         |
      |  '---------'  (a bad object: a shorter end, while rounds are left)
      '-----------------------> MISSED  (from either, whenever nothing can be found)

- ASKING: the server's lookups of the prompt's chain (full groups) and of the window
  chains of the ends tried (sliding groups) are in flight. Once all are answered, the
  longest end whose every object the server holds is chosen, the window chains of
  shorter ends asked if none is (`MAX_ROUNDS` rounds at most), or the job misses.
- CHECKING: the read locks of that hit's objects are kept (the rest freed), the objects
  mapped and verified against their trailers (`integrity.Verification`: on a GPU by DMA
  and GPU sums). A bad object is never offered again by this process while the same
  server runs (`HitFinder.bad`), and a shorter end is tried.
- FOUND: `hit` holds the verified `ServerHit`, which the store offers (`pin`).
- MISSED: nothing; every lock the job took went back (or expires on the server).
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...layout import integrity
from ...layout.groups import AttentionKind, KVLayout
from ...layout.plan import needed_chunks
from ..base import ChunkKey, Prefetch
from .connection import ServerConnection, ServerUnavailable
from .reads import ReadLocks, ServerLookup, ServerReads
from .space import Space
from .windows import end_chunk, window_hashes, window_need

logger = logging.getLogger(__name__)

ABANDON_S = 60.0
"""A lookup the server has not finished in this long is given up (its locks expire with
the server's read-lock TTL)."""
DEVICE_COPIES_MAX = 16 << 30
"""Bytes of verified hits kept on the GPU at once (beyond it, or beyond half the free
device memory, a hit is verified through a scratch buffer and loaded from the server's
L1: its bytes then cross PCIe twice)."""
MAX_ROUNDS = 3
"""Rounds of window-chain lookups one job may ask (the longest end, then shorter ones,
then the next shorter after a bad object)."""

ObjectName = tuple[int, str, bytes, int]
"""(epoch, namespace, server chain key, group) of one object on the server."""


class Phase(enum.Enum):
    """Where a `LookupJob` is; see the module doc."""

    ASKING = "asking"
    CHECKING = "checking"
    FOUND = "found"
    MISSED = "missed"


@dataclass(eq=False)
class ServerHit:
    """A verified hit: the server's read locks on its objects and views of them. The
    handle of a server pin (`Pinned.handles`), given back by `HitFinder.release`."""

    start: int
    end: int
    pins: list[ReadLocks]
    views: dict[ChunkKey, torch.Tensor]
    """(chain hash, group id) -> KV view in the server's L1, or its verified copy on the
    GPU (`device_bytes`), valid until released."""
    space: Space
    """The registrations it was looked up in (a reset replaces them)."""
    found: list[ObjectName] = field(default_factory=list)
    """Its objects as the server names them: a save after the hit need not ask for them."""
    device_bytes: int = 0
    held_until: float = math.inf
    """While its views are in the server's L1: when the server's read locks on them
    may lapse (the earliest lookup's send time + the read TTL). Past it the server
    may evict the objects and reuse their slots for another engine's KV."""
    fresh_until: float = math.inf
    """Offered to a new load only before this: half the TTL before `held_until`, the
    margin for a load offered just before it."""

    def stale(self, now: float) -> bool:
        return now >= self.fresh_until


@dataclass(eq=False)
class _Check:
    """A hit being verified (`Phase.CHECKING`)."""

    hit: ServerHit
    verification: integrity.Verification


class DeviceBudget:
    """Bytes of verified hits kept on the GPU, under a lock of its own: taken on the
    lookup thread, given back wherever a hit is released."""

    def __init__(self, device: torch.device):
        self.device = device
        self._lock = threading.Lock()
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    def take(self, nbytes: int) -> bool:
        """Whether a hit of `nbytes` may keep its verified copy on the GPU (then counted
        until `give`n back): at most half the device's free memory, and
        `DEVICE_COPIES_MAX` for all hits together."""
        if self.device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        with self._lock:
            if self._used + nbytes > min(DEVICE_COPIES_MAX, free // 2):
                return False
            self._used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes


class HitFinder:
    """What the lookup jobs of one store share: its reads, the layout's groups, the
    objects known bad and the GPU budget. Lookup thread, except `release`."""

    def __init__(self, reads: ServerReads, conn: ServerConnection, layout: KVLayout,
                 chunk_size: int, *, retention_interval: int, read_ttl_s: float,
                 device: torch.device, stats=None):
        self.reads, self.conn, self.layout, self.chunk_size = reads, conn, layout, chunk_size
        self.retention_interval, self.read_ttl_s = retention_interval, read_ttl_s
        self.stats = stats
        self.full = [g.group_id for g in layout.groups if g.kind is AttentionKind.FULL]
        self.sliding = [g.group_id for g in layout.groups if g.kind is AttentionKind.SLIDING]
        self.bad: set[ObjectName] = set()
        """Objects that failed verification: a restarted server holds none of them, and
        may hold good copies."""
        self.device = DeviceBudget(device)

    def start(self, chain: Sequence[bytes], start: int, limit: int) -> LookupJob:
        """A job for a hit of up to `limit` tokens of `chain`, its lookups sent (or
        MISSED at once: nothing to ask, the server down)."""
        job = LookupJob(time.monotonic(), chain=tuple(chain), start=start, limit=limit,
                        finder=self)
        job.begin()
        return job

    def release(self, hit: ServerHit) -> None:
        """Give back what `hit` holds: its read locks and its GPU copies (any thread)."""
        self.release_locks(hit)
        if hit.device_bytes:
            hit.views = {}
            self.device.give(hit.device_bytes)
            hit.device_bytes = 0

    def release_locks(self, hit: ServerHit) -> None:
        for pin in hit.pins:
            try:
                self.reads.release(pin)
            except ServerUnavailable:
                pass
        hit.pins = []


@dataclass(eq=False)
class LookupJob(Prefetch):
    """One lookup on the server; see the module doc. `advance` alone moves its `phase`
    on (`cancel` ends it when the store closes)."""

    chain: tuple[bytes, ...] = ()
    start: int = 0
    limit: int = 0
    finder: HitFinder = field(kw_only=True, repr=False)
    phase: Phase = Phase.ASKING
    full: ServerLookup | None = None
    windows: dict[int, ServerLookup] = field(default_factory=dict)
    """End chunk -> the lookup of its window chain (sliding groups)."""
    rounds: int = 0
    check: _Check | None = None
    hit: ServerHit | None = None
    """The verified hit, once FOUND (until the store hands it on)."""
    abandoned: bool = False
    """The caller is done with it (`ChunkStore.finish_prefetch`): a hit it finds goes
    back at once."""

    @property
    def _full_lookup(self) -> ServerLookup:
        """`full` once asked: `begin` sends it, or ends the job MISSED."""
        assert self.full is not None
        return self.full

    @property
    def _checking(self) -> _Check:
        """`check` while CHECKING: `_hold` sets it on entering, leaving clears it."""
        assert self.check is not None
        return self.check

    def begin(self) -> None:
        """Send the first lookups (`HitFinder.start`)."""
        f = self.finder
        n = min(len(self.chain), -(-self.limit // f.chunk_size))
        if self.limit <= self.start or n == 0:
            self._end(Phase.MISSED)
            return
        try:
            self.full = f.reads.start_lookup(self.chain[:n], f.full)
            self._ask_windows([min(self.limit, n * f.chunk_size)])
        except ServerUnavailable:
            self._end(self._give_up())

    def advance(self) -> Phase:
        """Move on as far as the server's answers and the verification allow, without
        waiting; the phase it is in then. Whatever fails ends it MISSED."""
        try:
            if self.phase is Phase.ASKING:
                self.phase = self._asked()
            if self.phase is Phase.CHECKING and self._checking.verification.done():
                self.phase = self._checked()
        except ServerUnavailable:
            self.phase = self._give_up()
        except Exception:  # noqa: BLE001 - a lookup that failed finds nothing
            logger.exception("gemma4-kv: lookup on %s failed", self.finder.conn.url)
            self.phase = self._give_up()
        if self.phase in (Phase.FOUND, Phase.MISSED) and not self.finished:
            self._end(self.phase)
        return self.phase

    def cancel(self) -> None:
        """End it now, giving back everything it holds (the store closes)."""
        if not self.finished:
            self._end(self._give_up())

    def _end(self, phase: Phase) -> None:
        self.phase, self.finished = phase, True
        if phase is Phase.FOUND:
            self.finished_at = time.monotonic()

    # -- ASKING -----------------------------------------------------------------------
    def _ask_windows(self, ends: list[int]) -> None:
        """Look up the window chains the hits ending at `ends` read."""
        f, c = self.finder, self.finder.chunk_size
        self.rounds += 1
        if not f.sliding:
            return
        for end in ends:
            e = end_chunk(end, c)
            if e in self.windows:
                continue
            k = max(window_need(f.layout, self.start, end, c).values())
            self.windows[e] = f.reads.start_lookup(window_hashes(self.chain, e, k),
                                                   f.sliding)

    def _asked(self) -> Phase:
        f = self.finder
        lookups = [lk for lk in (self.full, *self.windows.values()) if lk is not None]
        if not all(f.reads.poll_lookup(lk) for lk in lookups):
            if time.monotonic() - self.started > ABANDON_S:
                return self._give_up()
            return Phase.ASKING
        if self._full_lookup.space is not f.conn.space:  # asked before a reset: never offered
            return self._give_up()
        self.answered = True
        end, shorter = self._choose()
        if end is not None:
            return self._hold(end)
        if shorter and self.rounds < MAX_ROUNDS:
            self._ask_windows(shorter)
            return Phase.ASKING
        return self._give_up()

    def _runs(self, lk: ServerLookup | None, groups: Sequence[int]) -> dict[int, int]:
        """Per group, the leading run a lookup found, cut at the first object known bad."""
        if lk is None:  # not asked: nothing found
            return dict.fromkeys(groups, 0)
        out = {}
        for g in groups:
            n = lk.found.get(g, 0)
            for i in range(n):
                if (lk.epoch, lk.space.namespace, lk.hashes[i], g) in self.finder.bad:
                    n = i
                    break
            out[g] = n
        return out

    def _choose(self) -> tuple[int | None, list[int]]:
        """(the longest end every object of whose hit the server holds, or None; the
        shorter ends whose window chains were not asked yet)."""
        f, c = self.finder, self.finder.chunk_size
        full = min(self._runs(self.full, f.full).values(), default=len(self.chain))
        top = min(self.limit, full * c) if f.full else self.limit
        step = f.retention_interval or c
        ends = sorted({top} | set(range(step, top, step)), reverse=True)
        unasked = []
        for end in ends:
            if end <= self.start:
                break
            lk = self.windows.get(end_chunk(end, c))
            if lk is None:
                if f.sliding:
                    unasked.append(end)
                    continue
                return end, []
            have = self._runs(lk, f.sliding)
            need = window_need(f.layout, self.start, end, c)
            if all(have[g] >= need[g] for g in f.sliding):
                return end, []
        return None, unasked

    def _hold(self, end: int) -> Phase:
        """Keep the locks of the hit ending at `end` (free the others), map its objects
        and start their verification."""
        f, c, chain = self.finder, self.finder.chunk_size, self.chain
        e = end_chunk(end, c)
        need = window_need(f.layout, self.start, end, c)
        full_cells = [(ch, g) for g in f.full
                      for ch in needed_chunks(f.layout.groups[g], self.start, end, c)]
        window_cells = [(j, g) for g in f.sliding for j in range(need[g])]
        pins, objects, names = [], [], []
        try:
            for lk, cells in ((self.full, full_cells), (self.windows.get(e), window_cells)):
                if lk is None:
                    continue
                if not cells:
                    f.reads.drop(lk)
                    continue
                pin = f.reads.keep(lk, cells)
                if pin is None:
                    raise ServerUnavailable("the server no longer holds the hit")
                pins.append(pin)
                got = f.reads.read(pin)
                if got is None:
                    raise ServerUnavailable("the server no longer holds the hit")
                for (i, g), (kv, trailer) in zip(cells, got):
                    ch = i if lk is self.full else e - i  # window position i: chunk e - i
                    objects.append(((chain[ch], g), kv, trailer,
                                    integrity.key64(lk.space.namespace, chain[ch], g)))
                    names.append((lk.epoch, lk.space.namespace, lk.hashes[i], g))
            for other, lk in self.windows.items():
                if other != e and lk.open:
                    f.reads.drop(lk)
        except Exception as err:  # noqa: BLE001 - the locks kept so far go back either way
            if not isinstance(err, ServerUnavailable):
                logger.warning("gemma4-kv: a hit on %s could not be held (%s): a miss",
                               f.conn.url, err)
            for pin in pins:
                f.reads.release(pin)
            return self._give_up()
        locked = min(pin.locked_at for pin in pins)
        hit = ServerHit(self.start, end, pins, {ck: kv for ck, kv, _, _ in objects},
                        self._full_lookup.space, names, held_until=locked + f.read_ttl_s,
                        fresh_until=locked + f.read_ttl_s / 2)
        nbytes = sum(kv.numel() * kv.element_size() for _, kv, _, _ in objects)
        keep = f.device.take(nbytes)
        check = integrity.Verification([(kv, t, key) for _, kv, t, key in objects],
                                       f.device.device, keep=keep)
        if keep:
            hit.device_bytes = nbytes
        self.check = _Check(hit, check)
        self.loaded_bytes = nbytes
        return Phase.CHECKING

    # -- CHECKING ---------------------------------------------------------------------
    def _checked(self) -> Phase:
        """The verification has finished: the hit is found, or what failed is dropped
        and a shorter end tried."""
        f, hit, check = self.finder, self._checking.hit, self._checking.verification
        self.check = None
        bad = [n for n, ok in zip(hit.found, check.result()) if not ok]
        if not bad:
            if check.copies is not None:
                # The load reads the verified copies on the GPU: the server's locks go now.
                hit.views = dict(zip(hit.views, check.copies))
                f.release_locks(hit)
                hit.held_until = hit.fresh_until = math.inf
            self.hit = hit
            return Phase.FOUND
        f.bad.update(bad)
        if f.stats is not None:
            f.stats.add("rejected_objects", len(bad))
        logger.warning("gemma4-kv: %d object(s) from %s failed verification (unfinished "
                       "or foreign writes): not loaded, recomputed instead", len(bad),
                       f.conn.url)
        f.release(hit)
        self.rejected += len(bad)
        if self.rounds >= MAX_ROUNDS:
            return Phase.MISSED
        # A shorter end: look up again (the locks went with the rejected hit).
        self.full = f.reads.start_lookup(self._full_lookup.hashes, f.full)
        self.windows = {}
        self._ask_windows([min(self.limit, len(self.full.hashes) * f.chunk_size)])
        return Phase.ASKING

    # -- MISSED -----------------------------------------------------------------------
    def _give_up(self) -> Phase:
        """Nothing is found: every lock the job holds goes (or expires on the server)."""
        f = self.finder
        for lk in (self.full, *self.windows.values()):
            if lk is not None and lk.open:
                try:
                    if f.conn.healthy and lk.done:
                        f.reads.drop(lk)
                    else:
                        f.reads.forget(lk)
                except ServerUnavailable:
                    f.reads.forget(lk)
        if self.check is not None:
            f.release(self.check.hit)
            self.check = None
        return Phase.MISSED
