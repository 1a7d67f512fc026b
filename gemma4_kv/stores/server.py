"""The chunk store on a running `lmcache server` (`lmcache_server`): the store interface
over `server_tier.MPServerTier`, so several engines on one host share the server's L1
and its L2 tiers while keeping gemma4-kv's keys, window-aware loads and movers.

What differs from the embedded store:
- Every lookup asks the server without waiting (`start_prefetch`: the server may read
  its L2 tiers); `poll` settles it, and the locks the server took stay held for the
  `pin` that follows (`_ready`), which keeps the hit's objects and frees the rest;
  `finish_prefetch` frees them if no pin came.
- The server keys a chunk by its whole prefix (it rehashes from chunk 0): every call
  sends the chain from chunk 0.
- 0.5.6 reports the leading run of chunks per group, so a sliding group past a missing
  chunk has no hit: the settings store sliding groups densely (`retention_interval` 0).
- Every object read from the server is verified (integrity trailer) before it is
  offered: 0.5.6 makes a dead client's unfinished reservations visible when it reaps the
  client, and other clients may write anything under our names. Bad objects are never
  offered again by this process (`_bad`).
- Locks, reads and sessions go back without the caller waiting for the server's
  answers (`server_wire.Later`); `flush` waits for them.
- A server that does not answer costs one `timeout_s` on the thread that finds out;
  from then on every call is a miss or a skipped save at once, until its heartbeat gets
  answers again (`MPServerTier._beat`).
- What the server keeps is its own LRU's choice: `ChunkWrite.ends` are not used.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..layout.groups import KVLayout
from ..layout.plan import hit_chunks
from . import integrity
from .base import ChunkStore, ChunkWrite, Pinned, Prefetch, Reservation
from .server_tier import Lookup, MPServerTier
from .server_writes import Write
from .server_wire import ServerUnavailable, runs

logger = logging.getLogger(__name__)

ABANDON_S = 60.0
"""A lookup the server has not finished in this long is given up (its locks expire with
the server's read-lock TTL)."""
HELD_MAX = 1 << 16
"""Objects remembered as held by the server (`_held`), oldest forgotten first."""


@dataclass
class _Prefetch(Prefetch):
    lookup: Lookup | None = None
    hashes: tuple[bytes, ...] = ()


@dataclass
class _Reservation(Reservation):
    write: Write | None = None


class ServerStore(ChunkStore):
    """Objects per (chunk, group) in a shared `lmcache server`; see the module doc."""

    def __init__(self, layout: KVLayout, fingerprint: str, chunk_size: int, *, url: str,
                 timeout_s: float = 1.0, cuda: bool = False, stats=None,
                 ping_interval_s: float = 20.0):
        self.layout, self.fingerprint, self.chunk_size = layout, fingerprint, chunk_size
        self.namespace = fingerprint
        self.stats = stats
        self.tier = MPServerTier(url, layout, fingerprint, chunk_size, timeout_s=timeout_s,
                                 ping_interval_s=ping_interval_s, cuda_register=cuda)
        self._inflight: list[_Prefetch] = []  # lookup thread
        # Settled lookups per prefix, newest last (requests with one prefix each get
        # their own): lookup thread only.
        self._ready: dict[tuple[bytes, ...], list[tuple[float, Lookup]]] = {}
        self._bad: set[tuple[str, bytes, int]] = set()
        # Objects a pinned lookup found on the server process now running, (epoch,
        # namespace, hash, group), oldest first: the save after a hit rewrites the hit's
        # last chunk, which the server holds (a reservation would cost the model thread
        # a round trip for nothing). Each is used once (`reserve`): after an eviction
        # the next save stores it.
        self._held: dict[tuple[int, str, bytes, int], bool] = {}
        self._held_lock = threading.Lock()

    @property
    def has_l2(self) -> bool:
        """Lookups go to the server (answered pending) while it answers; misses else."""
        return self.tier.healthy

    # -- lookup -----------------------------------------------------------------------
    def start_prefetch(self, chain: Sequence[bytes], start: int, limit: int) -> Prefetch:
        """One server lookup of `chain` (0.5.6 ignores windows: every group gets its
        leading run)."""
        p = _Prefetch(time.monotonic(), hashes=tuple(chain))
        try:
            p.lookup = self.tier.start_lookup(chain)
            self._inflight.append(p)
        except ServerUnavailable:
            p.finished = True
        return p

    def poll(self) -> None:
        """Settle finished lookups: their locks wait in `_ready` for the pin."""
        now, still = time.monotonic(), []
        for p in self._inflight:
            try:
                done = self.tier.poll_lookup(p.lookup)
            except Exception as e:  # noqa: BLE001 - a lookup that failed finds nothing
                logger.warning("gemma4-kv: lookup on %s failed: %r", self.tier.url, e)
                done = None
            if done is False and self.tier.healthy and now - p.started < ABANDON_S:
                still.append(p)
                continue
            p.finished = True
            if done and p.lookup.space is self.tier.space:
                self._ready.setdefault(p.hashes, []).append((now, p.lookup))
            else:  # unanswered, failed, or asked before a reset: never offered
                self._drop(p.lookup)
        self._inflight = still

    def finish_prefetch(self, prefetch: Prefetch) -> None:
        """Free the locks of the prefetch's lookup unless a pin kept them."""
        if not isinstance(prefetch, _Prefetch) or prefetch.lookup is None:
            return
        entries = self._ready.get(prefetch.hashes, [])
        for i, (_, lk) in enumerate(entries):
            if lk is prefetch.lookup:
                del entries[i]
                self._drop(lk)
                break
        if not entries:
            self._ready.pop(prefetch.hashes, None)

    def _drop(self, lk: Lookup | None) -> None:
        """Free a lookup's locks (when the server answers; else they expire there)."""
        if lk is None:
            return
        try:
            if self.tier.healthy and lk.open:
                self.tier.keep(lk, None)
        except ServerUnavailable:
            pass
        finally:
            self.tier.forget(lk)

    def resident(self, chain: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices the last settled lookup of exactly `chain`
        found (a leading run, cut at the first object known bad); nothing otherwise."""
        entries = self._ready.get(tuple(chain))
        out = {g.group_id: set() for g in self.layout.groups}
        if not entries:
            return out
        lk = entries[-1][1]
        for g, n in lk.found.items():
            for c in range(n):
                if (lk.space.namespace, chain[c], g) in self._bad:
                    break
                out[g].add(c)
        return out

    def pin(self, chain: Sequence[bytes], start: int, hit: int,
            req_id: str = "") -> Pinned | None:
        """Hold the objects of the hit on the server, map them and verify them; all or
        nothing."""
        cells = [(c, g) for g, c in hit_chunks(self.layout, start, hit, self.chunk_size)]
        if not cells or max(c for c, _ in cells) >= len(chain):
            return None
        chunk_keys = [(chain[c], g) for c, g in cells]
        entries = self._ready.get(tuple(chain))
        lk = entries.pop()[1] if entries else None
        if entries is not None and not entries:
            del self._ready[tuple(chain)]
        if lk is not None and lk.space is not self.tier.space:  # asked before a reset
            self._drop(lk)
            lk = None
        pin = None
        found = dict(lk.found) if lk is not None else {}
        try:
            pin = self.tier.keep(lk, cells) if lk else self.tier.lock(chain, cells)
            objects = self.tier.read(pin) if pin is not None else None
        except ServerUnavailable:
            objects = None
        if objects is None:
            self._release_pin(pin)
            return None
        bad = [(pin.space.namespace, h, g) for (h, g), (kv, trailer) in zip(chunk_keys, objects)
               if not integrity.verify(kv, trailer, integrity.key64(pin.space.namespace, h, g))]
        if bad:
            self._bad.update(bad)
            if self.stats is not None:
                self.stats.add("rejected_objects", len(bad))
            logger.warning("gemma4-kv: %d object(s) from %s failed verification (unfinished "
                           "or foreign writes): not loaded, recomputed instead", len(bad),
                           self.tier.url)
            self._release_pin(pin)
            return None
        self._note_held(pin.epoch, pin.space.namespace, chain, found)
        return Pinned({ck: kv for ck, (kv, _) in zip(chunk_keys, objects)}, [pin])

    def _note_held(self, epoch: int, namespace: str, chain: Sequence[bytes],
                   found: dict[int, int]) -> None:
        with self._held_lock:
            for g, n in found.items():
                for c in range(min(n, len(chain))):
                    self._held[(epoch, namespace, chain[c], g)] = True
            while len(self._held) > HELD_MAX:
                del self._held[next(iter(self._held))]

    def _release_pin(self, pin) -> None:
        if pin is not None:
            try:
                self.tier.release(pin)
            except ServerUnavailable:
                pass

    def release(self, pinned: Pinned | None) -> None:
        if pinned is not None and pinned.handles:
            for pin in pinned.handles:
                self._release_pin(pin)
            pinned.handles = []

    # -- write ------------------------------------------------------------------------
    def reserve(self, write: ChunkWrite) -> Reservation:
        """Empty objects in the server's L1 for the chunks of `write`, keyed by its chain
        from chunk 0. Chunks the server holds already, or has no room for, get none (a
        chunk may be stored for some of its groups only: each object stands alone);
        those a pinned lookup found there are not asked for (`_held`)."""
        prefix = write.chain[:write.first + len(write.groups)]
        per_group: dict[int, set[int]] = defaultdict(set)
        epoch, ns = self.tier.epoch, self.tier.space.namespace
        with self._held_lock:
            for i, gids in enumerate(write.groups):
                c = write.first + i
                for g in gids:
                    if not self._held.pop((epoch, ns, prefix[c], g), False):
                        per_group[g].add(c)
        if not per_group or not self.tier.healthy:
            return _Reservation({})
        try:
            w = self.tier.reserve(prefix, {g: runs(cs) for g, cs in per_group.items()})
        except ServerUnavailable:
            return _Reservation({})
        ns = w.space.namespace
        return _Reservation({(prefix[c], g): (kv, trailer, integrity.key64(ns, prefix[c], g))
                             for (c, g), (kv, trailer) in w.objects.items()}, w)

    def commit(self, reservation: Reservation) -> None:
        w = getattr(reservation, "write", None)
        if w is None:
            return
        reservation.write = None
        try:
            if not self.tier.commit(w):
                logger.warning("gemma4-kv: %s did not take a commit", self.tier.url)
        except ServerUnavailable:
            pass

    def abort(self, reservation: Reservation) -> None:
        """Give up the reservation (its objects expire unseen on the server)."""
        w = getattr(reservation, "write", None)
        if w is None:
            return
        reservation.write = None
        try:
            self.tier.abort(w)
        except ServerUnavailable:
            pass

    # -- misc -------------------------------------------------------------------------
    def reset(self) -> bool:
        """A new namespace (new registrations): nothing stored before is reachable by this
        engine. The server's L1 is shared and stays; other engines keep their names."""
        self.namespace = f"{self.fingerprint}-g{uuid.uuid4().hex[:12]}"
        self._drop_ready()
        try:
            self.tier.rename(self.namespace)
        except ServerUnavailable:
            pass  # registered by the heartbeat when the server answers again
        return True

    def usage(self) -> tuple[int, int]:
        """(0, size of the server's L1): 0.5.6 reports its use over HTTP only."""
        return 0, self.tier.pool_size

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the locks and sessions given back so far have been answered (they
        are handed back without waiting: `server_wire.Later`)."""
        return self.tier.flush(timeout)

    def close(self) -> None:
        self._drop_ready()
        self.tier.close()

    def _drop_ready(self) -> None:
        for entries in self._ready.values():
            for _, lk in entries:
                self._drop(lk)
        self._ready.clear()
