"""The chunk store on a running `lmcache server` (`lmcache_server`): several engines on
one host share the server's L1 and its L2 tiers while keeping gemma4-kv's keys,
window-aware loads and movers.

What it stores: full-attention groups every prompt chunk, keyed by the prompt's chain;
sliding groups only the windows before the hit ends the scheduler names, each in a
window chain of its own (`windows.py`), so a hit needs no more bytes on the server than
in the embedded store. Tokens a request generates are not stored (`capabilities`): a
hit ending among them would need a window chain per generated chunk.

A lookup (`start_prefetch`, settled by `poll` on the lookup thread):
1. asks the server for the leading run of the prompt's chain (full groups) and of the
   window chain of the longest end (sliding groups), without waiting;
2. picks the longest end whose every object the server holds, asking the window chains
   of shorter ends (the full run's end, every `retention_interval`) if that one fails;
3. keeps the read locks of that hit's objects (freeing the rest), maps them, and checks
   them against their trailers (`integrity.Verification`: on a GPU by DMA and GPU
   sums). 0.5.6 makes a dead client's unfinished reservations visible when it reaps the
   client, and other clients may write anything under our names: nothing is offered
   before it verified. A bad object is never offered again by this process while the
   same server runs (`_bad`), and a shorter end is tried.
Only then is the prefetch finished; `pin` takes the verified hit.

Locks, reads and sessions go back without the caller waiting for the server's answers
(the connection's `later`; `flush` waits for them). A server that does not answer costs
one `timeout_s` on the thread that finds out; from then on every call is a miss or a
skipped save at once, until its heartbeat gets answers again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...layout.groups import AttentionKind, KVLayout
from ...layout.plan import hit_chunks, needed_chunks
from ...layout import integrity
from ..base import (ChunkKey, ChunkStore, ChunkWrite, Pinned, Prefetch, Reservation,
                    StoreCapabilities)
from ..config import ServerConfig
from ..events import TIER_SERVER, TierEvents
from .admission import Admission
from .connection import ServerConnection, ServerUnavailable, runs
from .reads import ReadLocks, ServerLookup, ServerReads
from .windows import assign, end_chunk, window_hashes, window_need
from .writes import ServerWrites, Write

logger = logging.getLogger(__name__)

ABANDON_S = 60.0
"""A lookup the server has not finished in this long is given up (its locks expire with
the server's read-lock TTL)."""
HELD_MAX = 1 << 16
"""Objects remembered as held by the server (`_held`), oldest forgotten first."""
DEVICE_COPIES_MAX = 16 << 30
"""Bytes of verified hits kept on the GPU at once (beyond it, or beyond half the free
device memory, a hit is verified through a scratch buffer and loaded from the server's
L1: its bytes then cross PCIe twice)."""
MAX_ROUNDS = 3
"""Rounds of window-chain lookups one prefetch may ask (the longest end, then shorter
ones, then the next shorter after a bad object)."""


@dataclass
class _Hit:
    """A verified hit: the server's read locks on its objects and views of them."""

    start: int
    end: int
    pins: list[ReadLocks]
    views: dict[ChunkKey, torch.Tensor]
    """(chain hash, group id) -> KV view in the server's L1, or its verified copy on the
    GPU (`device_bytes`), valid until released."""
    device_bytes: int = 0
    space: object = None
    """The registrations it was looked up in (a reset replaces them)."""
    held_until: float = math.inf
    """While its views are in the server's L1: when the server's read locks on them
    may lapse (the earliest lookup's send time + the read TTL). Past it the server
    may evict the objects and reuse their slots for another engine's KV."""
    fresh_until: float = math.inf
    """Offered to a new load only before this: half the TTL before `held_until`, the
    margin for a load offered just before it."""

    def stale(self, now: float) -> bool:
        return now >= self.fresh_until


@dataclass
class _ServerPrefetch(Prefetch):
    chain: tuple[bytes, ...] = ()
    start: int = 0
    limit: int = 0
    full: ServerLookup | None = None
    windows: dict[int, ServerLookup] = field(default_factory=dict)
    """End chunk -> the lookup of its window chain (sliding groups)."""
    rounds: int = 0
    checking: tuple[_Hit, integrity.Verification, list] | None = None
    """A hit being verified: its objects' keys for `_bad` if it fails."""
    hit: _Hit | None = None
    done_with: bool = False


@dataclass
class _ServerReservation(Reservation):
    writes: list[Write] = field(default_factory=list)


class ServerStore(ChunkStore):
    """Objects per (chunk, group) in a shared `lmcache server`; see the module doc."""

    events: TierEvents | None = None
    """Where commits are reported, if anyone publishes them (the server's evictions
    happen inside it, unseen by this client)."""

    def __init__(self, layout: KVLayout, fingerprint: str, chunk_size: int, *, url: str,
                 timeout_s: float = 1.0, cuda: bool = False, stats=None,
                 ping_interval_s: float = 20.0, retention_interval: int = 0,
                 read_ttl_s: float = 300.0, device: torch.device | str = "cpu"):
        self.layout, self.fingerprint, self.chunk_size = layout, fingerprint, chunk_size
        self.read_ttl_s = read_ttl_s
        self.namespace = fingerprint
        self.stats = stats
        self.retention_interval = retention_interval
        self.device = torch.device(device)
        self.conn = ServerConnection(url, layout, fingerprint, chunk_size,
                                     timeout_s=timeout_s, ping_interval_s=ping_interval_s,
                                     cuda_register=cuda)
        self.reads, self.writes = ServerReads(self.conn), ServerWrites(self.conn)
        self._full = [g.group_id for g in layout.groups if g.kind is AttentionKind.FULL]
        self._sliding = [g.group_id for g in layout.groups
                         if g.kind is AttentionKind.SLIDING]
        self._object_bytes = {g.group_id: chunk_size * g.bytes_per_token
                              for g in layout.groups}
        self._inflight: list[_ServerPrefetch] = []  # lookup thread
        # Verified hits per chain, newest last (requests of one prompt each get their
        # own): lookup thread only.
        self._ready: dict[tuple[bytes, ...], list[_Hit]] = {}
        self._bad: set[tuple[int, str, bytes, int]] = set()
        """(epoch, namespace, server chain key, group) of objects that failed
        verification: a restarted server holds none of them, and may hold good copies."""
        # Objects a verified hit found on the server process now running, (epoch,
        # namespace, server chain key, group), oldest first: the save after a hit
        # rewrites the hit's last chunk, which the server holds (a reservation would
        # cost the model thread a round trip for nothing). Each is used once.
        self._held: dict[tuple[int, str, bytes, int], bool] = {}
        self._held_lock = threading.Lock()
        self._device_bytes = 0  # verified copies on the GPU (under _held_lock)
        self.admission = Admission()
        """Which saves may displace others once the server is full (`admission.py`)."""

    @property
    def capabilities(self) -> StoreCapabilities:
        return ServerConfig.CAPABILITIES

    def slow_tier_up(self) -> bool:
        """Lookups go to the server (answered pending) while it answers; misses else."""
        return self.conn.healthy

    # -- lookup -----------------------------------------------------------------------
    def start_prefetch(self, chain: Sequence[bytes], start: int, limit: int) -> Prefetch:
        p = _ServerPrefetch(time.monotonic(), chain=tuple(chain), start=start, limit=limit)
        n = min(len(chain), -(-limit // self.chunk_size))
        if limit <= start or n == 0:
            p.finished = True
            return p
        try:
            p.full = self.reads.start_lookup(chain[:n], self._full)
            self._ask_windows(p, [min(limit, n * self.chunk_size)])
            self._inflight.append(p)
        except ServerUnavailable:
            self._give_up(p)
        return p

    def _ask_windows(self, p: _ServerPrefetch, ends: list[int]) -> None:
        """Look up the window chains the hits ending at `ends` read."""
        p.rounds += 1
        if not self._sliding:
            return
        for end in ends:
            e = end_chunk(end, self.chunk_size)
            if e in p.windows:
                continue
            k = max(window_need(self.layout, p.start, end, self.chunk_size).values())
            p.windows[e] = self.reads.start_lookup(window_hashes(p.chain, e, k), self._sliding)

    def poll(self) -> None:
        """Advance every prefetch in flight; never waits."""
        still = []
        for p in self._inflight:
            try:
                if not self._advance(p):
                    still.append(p)
            except ServerUnavailable:
                self._give_up(p)
            except Exception:  # noqa: BLE001 - a lookup that failed finds nothing
                logger.exception("gemma4-kv: lookup on %s failed", self.conn.url)
                self._give_up(p)
        self._inflight = still

    def in_flight(self) -> bool:
        return bool(self._inflight)

    def fetch_bytes(self, chain: Sequence[bytes], start: int, limit: int) -> int:
        """Bytes a hit of up to `limit` tokens reads from the server: every object of it
        (this engine keeps none locally), checked and then loaded."""
        c = self.chunk_size
        end = min(limit, min(len(chain), -(-limit // c)) * c)
        return sum(self._object_bytes[g] for g, _ in hit_chunks(self.layout, start, end, c))

    def _advance(self, p: _ServerPrefetch) -> bool:
        """One step of `p`; whether it has finished."""
        if p.checking is not None:
            return self._checked(p) if p.checking[1].done() else False
        lookups = [lk for lk in (p.full, *p.windows.values()) if lk is not None]
        if not all(self.reads.poll_lookup(lk) for lk in lookups):
            if time.monotonic() - p.started > ABANDON_S:
                self._give_up(p)
                return True
            return False
        if p.full.space is not self.conn.space:  # asked before a reset: never offered
            self._give_up(p)
            return True
        end, shorter = self._choose(p)
        if end is None:
            if shorter and p.rounds < MAX_ROUNDS:
                self._ask_windows(p, shorter)
                return False
            self._give_up(p)
            return True
        return self._hold_and_check(p, end)

    def _runs(self, lk: ServerLookup | None, groups) -> dict[int, int]:
        """Per group, the leading run a lookup found, cut at the first object known bad."""
        out = {}
        for g in groups:
            n = lk.found.get(g, 0) if lk is not None else 0
            for i in range(n):
                if (lk.epoch, lk.space.namespace, lk.hashes[i], g) in self._bad:
                    n = i
                    break
            out[g] = n
        return out

    def _choose(self, p: _ServerPrefetch) -> tuple[int | None, list[int]]:
        """(the longest end every object of whose hit the server holds, or None; the
        shorter ends whose window chains were not asked yet)."""
        c = self.chunk_size
        full = min(self._runs(p.full, self._full).values(), default=len(p.chain))
        top = min(p.limit, full * c) if self._full else p.limit
        step = self.retention_interval or c
        ends = sorted({top} | set(range(step, top, step)), reverse=True)
        unasked = []
        for end in ends:
            if end <= p.start:
                break
            e = end_chunk(end, c)
            lk = p.windows.get(e)
            if lk is None:
                if self._sliding:
                    unasked.append(end)
                    continue
                return end, []
            have = self._runs(lk, self._sliding)
            need = window_need(self.layout, p.start, end, c)
            if all(have[g] >= need[g] for g in self._sliding):
                return end, []
        return None, unasked

    def _hold_and_check(self, p: _ServerPrefetch, end: int) -> bool:
        """Keep the locks of the hit ending at `end` (free the others), map its objects
        and start their verification."""
        c, chain = self.chunk_size, p.chain
        e = end_chunk(end, c)
        need = window_need(self.layout, p.start, end, c)
        full_cells = [(ch, g) for g in self._full
                      for ch in needed_chunks(self.layout.groups[g], p.start, end, c)]
        window_cells = [(j, g) for g in self._sliding for j in range(need[g])]
        pins, objects, names = [], [], []
        try:
            for lk, cells in ((p.full, full_cells), (p.windows.get(e), window_cells)):
                if lk is None:
                    continue
                pin = self.reads.keep(lk, cells) if cells else self.reads.drop(lk)
                if cells:
                    if pin is None:
                        raise ServerUnavailable("the server no longer holds the hit")
                    pins.append(pin)
                    got = self.reads.read(pin)
                    if got is None:
                        raise ServerUnavailable("the server no longer holds the hit")
                    for (i, g), (kv, trailer) in zip(cells, got):
                        ch = i if lk is p.full else e - i  # window position i: chunk e - i
                        objects.append(((chain[ch], g), kv, trailer,
                                        integrity.key64(lk.space.namespace, chain[ch], g)))
                        names.append((lk.epoch, lk.space.namespace, lk.hashes[i], g))
            for other, lk in p.windows.items():
                if other != e and lk.open:
                    self.reads.drop(lk)
        except Exception as e:  # noqa: BLE001 - the locks kept so far go back either way
            if not isinstance(e, ServerUnavailable):
                logger.warning("gemma4-kv: a hit on %s could not be held (%s): a miss",
                               self.conn.url, e)
            for pin in pins:
                self.reads.release(pin)
            self._give_up(p)
            return True
        locked = min(pin.locked_at for pin in pins)
        hit = _Hit(p.start, end, pins, {ck: kv for ck, kv, _, _ in objects},
                   space=p.full.space, held_until=locked + self.read_ttl_s,
                   fresh_until=locked + self.read_ttl_s / 2)
        nbytes = sum(kv.numel() * kv.element_size() for _, kv, _, _ in objects)
        keep = self._take_device(nbytes)
        check = integrity.Verification([(kv, t, key) for _, kv, t, key in objects],
                                       self.device, keep=keep)
        if keep:
            hit.device_bytes = nbytes
        p.checking = (hit, check, names)
        p.loaded_bytes = nbytes
        return self._checked(p) if check.done() else False

    @property
    def device_bytes(self) -> int:
        """Bytes of verified hits now held on the GPU."""
        return self._device_bytes

    def _take_device(self, nbytes: int) -> bool:
        """Whether a hit of `nbytes` may keep its verified copy on the GPU (then counted
        in `_device_bytes` until released): at most half the device's free memory, and
        `DEVICE_COPIES_MAX` for all hits together."""
        if self.device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        with self._held_lock:
            if self._device_bytes + nbytes > min(DEVICE_COPIES_MAX, free // 2):
                return False
            self._device_bytes += nbytes
        return True

    def _checked(self, p: _ServerPrefetch) -> bool:
        """The verification of `p`'s hit has finished: offer it, or drop what failed and
        try a shorter end."""
        hit, check, names = p.checking
        p.checking = None
        bad = [n for n, ok in zip(names, check.result()) if not ok]
        if not bad and check.copies is not None:
            # The load reads the verified copies on the GPU: the server's locks go now.
            hit.views = dict(zip(hit.views, check.copies))
            self._release_pins(hit)
            hit.held_until = hit.fresh_until = math.inf
        if not bad:
            p.hit, p.finished, p.finished_at = hit, True, time.monotonic()
            if p.done_with:
                self._release_hit(hit)
            else:
                self._ready.setdefault(p.chain, []).append(hit)
                self._note_held(hit, names)
            return True
        self._bad.update(bad)
        if self.stats is not None:
            self.stats.add("rejected_objects", len(bad))
        logger.warning("gemma4-kv: %d object(s) from %s failed verification (unfinished "
                       "or foreign writes): not loaded, recomputed instead", len(bad),
                       self.conn.url)
        self._release_hit(hit)
        p.rejected += len(bad)
        if p.rounds >= MAX_ROUNDS:
            p.finished = True
            return True
        # A shorter end: look up again (the locks went with the rejected hit).
        try:
            p.full = self.reads.start_lookup(p.full.hashes, self._full)
            p.windows = {}
            self._ask_windows(p, [min(p.limit, len(p.full.hashes) * self.chunk_size)])
        except ServerUnavailable:
            self._give_up(p)
            return True
        return False

    def _give_up(self, p: _ServerPrefetch) -> None:
        """`p` finds nothing: every lock it holds goes (or expires on the server)."""
        for lk in (p.full, *p.windows.values()):
            if lk is not None and lk.open:
                try:
                    if self.conn.healthy and lk.done:
                        self.reads.drop(lk)
                    else:
                        self.reads.forget(lk)
                except ServerUnavailable:
                    self.reads.forget(lk)
        if p.checking is not None:
            self._release_hit(p.checking[0])
            p.checking = None
        p.finished = True

    def finish_prefetch(self, prefetch: Prefetch) -> None:
        """The lookup is done with `prefetch`: its verified hit goes back unless pinned."""
        if not isinstance(prefetch, _ServerPrefetch):
            return
        prefetch.done_with = True
        hit = prefetch.hit
        entries = self._ready.get(prefetch.chain, [])
        if hit is not None and hit in entries:
            entries.remove(hit)
            self._release_hit(hit)
        if not entries:
            self._ready.pop(prefetch.chain, None)

    def resident(self, chain: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices of `chain` the newest verified hit of exactly
        `chain` holds; nothing otherwise."""
        out = {g.group_id: set() for g in self.layout.groups}
        entries = self._drop_stale(tuple(chain))
        if entries:
            index = {h: i for i, h in enumerate(chain)}
            for h, g in entries[-1].views:
                out[g].add(index[h])
        return out

    def looked_up(self, req_id: str, reach: int) -> None:
        self.admission.looked_up(req_id, reach)

    def pin(self, chain: Sequence[bytes], start: int, hit: int,
            req_id: str = "") -> Pinned | None:
        """The objects of tokens [start, hit) from a verified hit of `chain`; without one
        (a rank asked to re-pin, a caller that did not prefetch) the hit is looked up
        and verified here, waiting. All or nothing."""
        cells = [(chain[c], g) for g, c in hit_chunks(self.layout, start, hit, self.chunk_size)
                 if c < len(chain)]
        if not cells or len(cells) != len(hit_chunks(self.layout, start, hit,
                                                     self.chunk_size)):
            return None
        held = self._take_ready(tuple(chain), cells)
        if held is None:
            held = self._fetch_now(chain, start, hit, cells)
        if held is None:
            return None
        self.admission.hit(req_id, (chain[end_chunk(hit, self.chunk_size)], hit),
                           self.conn.epoch)
        return Pinned({ck: held.views[ck] for ck in cells}, [held],
                      fresh_until=held.fresh_until, held_until=held.held_until)

    def _drop_stale(self, chain: tuple) -> list[_Hit]:
        """The verified hits of `chain` still fresh (those past `fresh_until` go back:
        the server's read locks on them may lapse before a load could read them)."""
        entries = self._ready.get(chain)
        if not entries:
            return []
        now = time.monotonic()
        for h in [h for h in entries if h.stale(now)]:
            entries.remove(h)
            self._release_hit(h)
        if not entries:
            self._ready.pop(chain, None)
        return entries

    def _take_ready(self, chain: tuple, cells: list[ChunkKey]) -> _Hit | None:
        entries = self._drop_stale(chain)
        for i in range(len(entries) - 1, -1, -1):
            h = entries[i]
            if all(ck in h.views for ck in cells):
                del entries[i]
                if not entries:
                    self._ready.pop(chain, None)
                if h.space is self.conn.space:
                    return h
                self._release_hit(h)  # asked before a reset
                return None
        return None

    def _fetch_now(self, chain, start: int, hit: int, cells) -> _Hit | None:
        """Look the hit up and verify it, waiting at most `ServerConfig.TIMEOUT_MAX_S`:
        the scheduler waits 2 s for this rank's answer to the Repin that asked it, so a
        slow server makes the request a miss rather than an unanswered rank."""
        p = self.start_prefetch(chain, start, hit)
        deadline = time.monotonic() + ServerConfig.TIMEOUT_MAX_S
        self.poll()
        while not p.finished:
            if time.monotonic() > deadline:
                p.done_with = True  # whatever it holds when it finishes goes
                return None
            time.sleep(0.0005)
            self.poll()
        h = p.hit
        if h is None:
            return None
        entries = self._ready.get(p.chain, [])
        if h in entries:
            entries.remove(h)
        if not entries:
            self._ready.pop(p.chain, None)
        # Verified, but too late to trust for a load (a TTL shorter than the wait).
        if h.stale(time.monotonic()) or not all(ck in h.views for ck in cells):
            self._release_hit(h)
            return None
        return h

    def _note_held(self, hit: _Hit, names) -> None:
        with self._held_lock:
            for name in names:
                self._held[name] = True
            while len(self._held) > HELD_MAX:
                del self._held[next(iter(self._held))]

    def _release_hit(self, hit: _Hit) -> None:
        self._release_pins(hit)
        if hit.device_bytes:
            hit.views = {}
            with self._held_lock:
                self._device_bytes -= hit.device_bytes
            hit.device_bytes = 0

    def _release_pins(self, hit: _Hit) -> None:
        for pin in hit.pins:
            try:
                self.reads.release(pin)
            except ServerUnavailable:
                pass
        hit.pins = []

    def release(self, pinned: Pinned | None) -> None:
        if pinned is not None and pinned.handles:
            for hit in pinned.handles:
                self._release_hit(hit)
            pinned.handles = []

    # -- write ------------------------------------------------------------------------
    def reserve(self, write: ChunkWrite) -> Reservation:
        """Empty objects in the server's L1 for the chunks of `write`: full groups keyed
        by the prompt's chain, sliding groups in the window chains of the write's ends
        (`windows.assign`: chunks no end's window needs are not stored). Chunks the
        server holds already, or has no room for, get none; those a verified hit found
        there are not asked for (`_held`). The server's LRU evicts, so `write.low` is
        empty here (`capabilities.ranks_hit_ends`); once it is full, a save towards an
        end no more frequent than what it would displace gets none (`admission.py`)."""
        chain = write.chain
        cells = [(write.first + i, g) for i, gids in enumerate(write.groups) for g in gids]
        if not cells or not self.conn.healthy:
            return _ServerReservation({})
        full = [(c, g) for c, g in cells if g in self._full]
        # An end past the chain's last chunk has no key to name its window chain: with
        # a draft that owns KV the chain is one hash shorter than the prompt's chunks
        # (`RequestKeys.lookahead`), so the prompt's own end may not be keyable yet.
        ends = [t for t in write.ends if end_chunk(t, self.chunk_size) < len(chain)]
        if ends and not self.admission.admit(
                write.req_id, (chain[end_chunk(max(ends), self.chunk_size)], max(ends)),
                self.conn.epoch):
            return _ServerReservation({})
        windows = assign(self.layout, self.chunk_size, ends,
                         [(c, g) for c, g in cells if g in self._sliding])
        plans = []  # (server chain, {group: positions}, position -> chain chunk)
        if full:
            per_group = defaultdict(set)
            for c, g in full:
                per_group[g].add(c)
            plans.append((list(chain[:max(c for c, _ in full) + 1]), per_group,
                          lambda i: i))
        for e, per_group in windows.items():
            k = max(j for js in per_group.values() for j in js) + 1
            plans.append((window_hashes(chain, e, k), per_group, lambda j, e=e: e - j))
        res = _ServerReservation({})
        epoch, ns = self.conn.epoch, self.conn.space.namespace
        try:
            for keys, per_group, chunk_of in plans:
                with self._held_lock:
                    ask = {g: runs(i for i in idx
                                   if not self._held.pop((epoch, ns, keys[i], g), False))
                           for g, idx in per_group.items()}
                ask = {g: r for g, r in ask.items() if r}
                if not ask:
                    continue
                w = self.writes.reserve(keys, ask)
                res.writes.append(w)
                wns = w.space.namespace
                for (i, g), (kv, trailer) in w.objects.items():
                    h = chain[chunk_of(i)]
                    res.objects[(h, g)] = (kv, trailer, integrity.key64(wns, h, g))
        except BaseException as e:  # what was reserved before it is never left open
            self.abort(res)
            if isinstance(e, ServerUnavailable):
                return _ServerReservation({})
            raise
        return res

    def commit(self, reservation: Reservation) -> None:
        writes = getattr(reservation, "writes", [])
        reservation.writes = []
        taken = bool(writes)
        for w in writes:
            try:
                if not self.writes.commit(w):
                    taken = False
                    logger.warning("gemma4-kv: %s did not take a commit", self.conn.url)
            except ServerUnavailable:
                taken = False
        if taken and self.events is not None:  # reported only if every commit was taken
            self.events.stored(TIER_SERVER, reservation.objects)

    def abort(self, reservation: Reservation) -> None:
        """Give up the reservation (its objects expire unseen on the server)."""
        writes = getattr(reservation, "writes", [])
        reservation.writes = []
        for w in writes:
            try:
                self.writes.abort(w)
            except ServerUnavailable:
                pass

    # -- misc -------------------------------------------------------------------------
    def reset(self) -> bool:
        """A new namespace (new registrations): nothing stored before is reachable by this
        engine. The server's L1 is shared and stays; other engines keep their names."""
        self.namespace = f"{self.fingerprint}-g{uuid.uuid4().hex[:12]}"
        self._drop_ready()
        if self.events is not None:
            self.events.cleared(TIER_SERVER)
        try:
            self.conn.rename(self.namespace)
        except ServerUnavailable:
            pass  # registered by the heartbeat when the server answers again
        return True

    def usage(self) -> tuple[int, int]:
        """(0, size of the server's L1): 0.5.6 reports its use over HTTP only."""
        return 0, self.conn.pool_size

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the locks and sessions given back so far have been answered (they
        are handed back without waiting: the connection's `later`)."""
        return self.conn.flush(timeout)

    def close(self) -> None:
        self._drop_ready()
        for p in self._inflight:
            self._give_up(p)
        self._inflight = []
        self.conn.close()  # hands back everything owed first
        self.reads.close()

    def _drop_ready(self) -> None:
        for entries in self._ready.values():
            for hit in entries:
                self._release_hit(hit)
        self._ready.clear()
