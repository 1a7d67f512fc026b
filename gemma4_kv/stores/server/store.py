"""The chunk store on a running `lmcache server` (`lmcache_server`): several engines on
one host share the server's L1 and its L2 tiers while keeping gemma4-kv's keys,
window-aware loads and movers.

What it stores: full-attention groups every prompt chunk, keyed by the prompt's chain;
sliding groups only the windows before the hit ends the scheduler names, each in a
window chain of its own (`windows.py`), so a hit needs no more bytes on the server than
in the embedded store. Tokens a request generates are not stored (`capabilities`): a
hit ending among them would need a window chain per generated chunk.

A lookup is a `lookup.LookupJob` (`start_prefetch`), moved on by `poll` on the lookup
thread until it has FOUND a verified hit or MISSED: 0.5.6 makes a dead client's
unfinished reservations visible when it reaps the client, and other clients may write
anything under our names, so nothing is offered before it verified. The store keeps
the hits found (`_ready`), offers them (`resident`) and hands them to `pin`.

Locks, reads and sessions go back without the caller waiting for the server's answers
(the connection's `later`; `flush` waits for them). A server that does not answer costs
one `timeout_s` on the thread that finds out; from then on every call is a miss or a
skipped save at once, until its heartbeat gets answers again.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from ...layout.groups import KVLayout
from ...layout.plan import hit_chunks
from ...layout import integrity
from ..base import (ChunkKey, ChunkStore, ChunkWrite, Pinned, Prefetch, Reservation,
                    StoreCapabilities)
from ..config import ServerConfig
from ..events import TIER_SERVER, TierEvents
from .admission import Admission
from .connection import ServerConnection, ServerUnavailable, runs
from .lookup import HitFinder, LookupJob, ObjectName, Phase, ServerHit
from .reads import ServerReads
from .windows import assign, end_chunk, window_hashes
from .writes import ServerWrites, Write

logger = logging.getLogger(__name__)

HELD_MAX = 1 << 16
"""Objects remembered as held by the server (`_held`), oldest forgotten first."""


@dataclass
class ServerReservation(Reservation):
    """A reservation of `ServerStore.reserve`: the server's writes its objects lie in."""

    writes: list[Write] = field(default_factory=list)
    """Committed or aborted once: emptied by either."""


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
        self.finder = HitFinder(self.reads, self.conn, layout, chunk_size,
                                retention_interval=retention_interval,
                                read_ttl_s=read_ttl_s, device=self.device, stats=stats)
        self._full, self._sliding = self.finder.full, self.finder.sliding
        self._object_bytes = {g.group_id: chunk_size * g.bytes_per_token
                              for g in layout.groups}
        self._inflight: list[LookupJob] = []  # lookup thread
        # Verified hits per chain, newest last (requests of one prompt each get their
        # own): lookup thread only.
        self._ready: dict[tuple[bytes, ...], list[ServerHit]] = {}
        # Objects a verified hit found on the server process now running, oldest
        # first: the save after a hit rewrites the hit's last chunk, which the server
        # holds (a reservation would cost the model thread a round trip for nothing).
        # Each is used once. Written on the lookup thread, read on the model thread.
        self._held: dict[ObjectName, bool] = {}
        self._held_lock = threading.Lock()
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
        job = self.finder.start(chain, start, limit)
        if not job.finished:
            self._inflight.append(job)
        return job

    def poll(self) -> None:
        """Advance every lookup job in flight; never waits. A hit found is offered, or
        goes back at once if its lookup was given up meanwhile."""
        still = []
        for job in self._inflight:
            phase = job.advance()
            if phase is Phase.FOUND:
                self._offer(job)
            elif phase is not Phase.MISSED:
                still.append(job)
        self._inflight = still

    def _offer(self, job: LookupJob) -> None:
        hit = job.hit
        assert hit is not None  # FOUND: `advance` set it
        if job.abandoned:
            self.finder.release(hit)
            return
        self._ready.setdefault(job.chain, []).append(hit)
        with self._held_lock:
            for name in hit.found:
                self._held[name] = True
            while len(self._held) > HELD_MAX:
                del self._held[next(iter(self._held))]

    def in_flight(self) -> bool:
        return bool(self._inflight)

    def fetch_bytes(self, chain: Sequence[bytes], start: int, limit: int) -> int:
        """Bytes a hit of up to `limit` tokens reads from the server: every object of it
        (this engine keeps none locally), checked and then loaded."""
        c = self.chunk_size
        end = min(limit, min(len(chain), -(-limit // c)) * c)
        return sum(self._object_bytes[g] for g, _ in hit_chunks(self.layout, start, end, c))

    @property
    def device_bytes(self) -> int:
        """Bytes of verified hits now held on the GPU."""
        return self.finder.device.used

    def finish_prefetch(self, prefetch: Prefetch) -> None:
        """The lookup is done with `prefetch`: its verified hit goes back unless pinned."""
        job = self._own_job(prefetch)
        job.abandoned = True
        hit = job.hit
        entries = self._ready.get(job.chain, [])
        if hit is not None and hit in entries:
            entries.remove(hit)
            self.finder.release(hit)
        if not entries:
            self._ready.pop(job.chain, None)

    @staticmethod
    def _own_job(prefetch: Prefetch) -> LookupJob:
        if not isinstance(prefetch, LookupJob):
            raise TypeError(f"not a prefetch of a ServerStore: {type(prefetch).__name__}")
        return prefetch

    def resident(self, chain: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices of `chain` the newest verified hit of exactly
        `chain` holds; nothing otherwise."""
        out: dict[int, set[int]] = {g.group_id: set() for g in self.layout.groups}
        entries = self._drop_stale(tuple(chain))
        if entries:
            index = {h: i for i, h in enumerate(chain)}
            for h, g in entries[-1].views:
                out[g].add(index[h])
        return out

    def looked_up(self, req_id: str, reach: int) -> None:
        self.admission.looked_up(req_id, reach)

    def pin(self, chain: Sequence[bytes], start: int, hit: int,
            req_id: str = "") -> Pinned[ServerHit] | None:
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
        return Pinned({ck: held.views[ck] for ck in cells}, held,
                      fresh_until=held.fresh_until, held_until=held.held_until)

    def _drop_stale(self, chain: tuple) -> list[ServerHit]:
        """The verified hits of `chain` still fresh (those past `fresh_until` go back:
        the server's read locks on them may lapse before a load could read them)."""
        entries = self._ready.get(chain)
        if not entries:
            return []
        now = time.monotonic()
        for h in [h for h in entries if h.stale(now)]:
            entries.remove(h)
            self.finder.release(h)
        if not entries:
            self._ready.pop(chain, None)
        return entries

    def _take_ready(self, chain: tuple, cells: list[ChunkKey]) -> ServerHit | None:
        entries = self._drop_stale(chain)
        for i in range(len(entries) - 1, -1, -1):
            h = entries[i]
            if all(ck in h.views for ck in cells):
                del entries[i]
                if not entries:
                    self._ready.pop(chain, None)
                if h.space is self.conn.space:
                    return h
                self.finder.release(h)  # asked before a reset
                return None
        return None

    def _fetch_now(self, chain, start: int, hit: int, cells) -> ServerHit | None:
        """Look the hit up and verify it, waiting at most `ServerConfig.TIMEOUT_MAX_S`:
        the scheduler waits 2 s for this rank's answer to the Repin that asked it, so a
        slow server makes the request a miss rather than an unanswered rank."""
        p = self._own_job(self.start_prefetch(chain, start, hit))
        deadline = time.monotonic() + ServerConfig.TIMEOUT_MAX_S
        self.poll()
        while not p.finished:
            if time.monotonic() > deadline:
                p.abandoned = True  # whatever it holds when it finishes goes
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
            self.finder.release(h)
            return None
        return h

    def release(self, pinned: Pinned[ServerHit] | None) -> None:
        if pinned is None or pinned.handles is None:
            return
        hit = pinned.handles
        if not isinstance(hit, ServerHit):
            raise TypeError(f"not a pin of a ServerStore: {type(hit).__name__}")
        pinned.handles = None
        self.finder.release(hit)

    # -- write ------------------------------------------------------------------------
    def reserve(self, write: ChunkWrite) -> ServerReservation:
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
            return ServerReservation({})
        full = [(c, g) for c, g in cells if g in self._full]
        # An end past the chain's last chunk has no key to name its window chain: with
        # a draft that owns KV the chain is one hash shorter than the prompt's chunks
        # (`RequestKeys.lookahead`), so the prompt's own end may not be keyable yet.
        ends = [t for t in write.ends if end_chunk(t, self.chunk_size) < len(chain)]
        if ends and not self.admission.admit(
                write.req_id, (chain[end_chunk(max(ends), self.chunk_size)], max(ends)),
                self.conn.epoch):
            return ServerReservation({})
        windows = assign(self.layout, self.chunk_size, ends,
                         [(c, g) for c, g in cells if g in self._sliding])
        # (server chain, {group: positions}, position -> chain chunk)
        plans: list[tuple[list[bytes], dict[int, set[int]], Callable[[int], int]]] = []
        if full:
            per_group: dict[int, set[int]] = defaultdict(set)
            for c, g in full:
                per_group[g].add(c)
            plans.append((list(chain[:max(c for c, _ in full) + 1]), per_group,
                          lambda i: i))
        for e, per_group in windows.items():
            k = max(j for js in per_group.values() for j in js) + 1
            # position j -> chunk e - j (mypy cannot type a lambda with a default)
            plans.append((window_hashes(chain, e, k), per_group, partial(operator.sub, e)))
        res = ServerReservation({})
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
                return ServerReservation({})
            raise
        return res

    @staticmethod
    def _take_writes(reservation: Reservation) -> list[Write]:
        """The writes of one of this store's reservations (emptied: a second commit or
        abort does nothing). An empty plain `Reservation` (a caller's own, for a save
        with nothing to store) has none; any other is refused."""
        if isinstance(reservation, ServerReservation):
            writes, reservation.writes = reservation.writes, []
            return writes
        if type(reservation) is Reservation and not reservation.objects:
            return []
        raise TypeError(f"not a reservation of a ServerStore: {type(reservation).__name__}")

    def commit(self, reservation: Reservation) -> None:
        writes = self._take_writes(reservation)
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
        for w in self._take_writes(reservation):
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
        for job in self._inflight:
            job.cancel()
        self._inflight = []
        self.conn.close()  # hands back everything owed first
        self.reads.close()

    def _drop_ready(self) -> None:
        for entries in self._ready.values():
            for hit in entries:
                self.finder.release(hit)
        self._ready.clear()
