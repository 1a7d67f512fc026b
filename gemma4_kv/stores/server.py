"""The chunk store on a running `lmcache server` (`lmcache_server`): `store.ChunkStore`'s
interface over `mp_server.MPServerTier`, so several engines on one host share the
server's L1 and its L2 tiers while keeping gemma4-kv's keys, window-aware loads and movers.

What differs from the embedded store:
- Every lookup asks the server without waiting (`start_prefetch`: the server may read
  its L2 tiers) and is answered `pending` once; `poll` settles it, and the locks the
  server took stay held for the `pin` that follows (`_ready`), which keeps the hit's
  objects and frees the rest.
- The server keys a chunk by its whole prefix (it rehashes from chunk 0): `pin` and
  `reserve` take the hashes from chunk 0 (`prefix`).
- 0.5.6 reports the leading run of chunks per group, so a sliding group past a missing
  chunk has no hit: the settings store sliding groups densely (`retention_interval` 0).
- Every object read from the server is verified (integrity trailer) before it is
  offered: 0.5.6 makes a dead client's unfinished reservations visible when it reaps the
  client, and other clients may write anything under our names. Bad objects are never
  offered again by this process (`_bad`).
- A server that does not answer costs one `timeout_s` on the thread that finds out;
  from then on every call is a miss or a skipped save at once, until its heartbeat gets
  answers again (`MPServerTier._beat`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from . import integrity
from ..layout.groups import KVLayout
from .embedded import ChunkKey, Pinned, Prefetch
from .server_tier import Lookup, MPServerTier, ServerUnavailable, Write, _runs

logger = logging.getLogger(__name__)

READY_TTL_S = 10.0
"""How long a settled lookup keeps its locks for the pin that should follow (vLLM asks
again next step); then they are freed and the next lookup asks the server again."""
ABANDON_S = 60.0
"""A lookup the server has not finished in this long is given up (its locks expire with
the server's read-lock TTL)."""


@dataclass
class _Prefetch(Prefetch):
    lookup: Lookup | None = None
    hashes: tuple[bytes, ...] = ()


class ServerStore:
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
        self._open: dict[bytes, Write] = {}  # model thread
        self._left: dict[int, set[bytes]] = {}
        self._bad: set[tuple[str, bytes, int]] = set()

    @property
    def has_l2(self) -> bool:
        """Lookups go to the server (answered pending) while it answers; misses else."""
        return self.tier.healthy

    # -- lookup -----------------------------------------------------------------------
    def start_prefetch(self, hashes: Sequence[bytes], windows: dict[int, int]) -> Prefetch:
        """One server lookup of the prefix `hashes` (0.5.6 ignores windows: every group
        gets its leading run)."""
        p = _Prefetch([], [], time.monotonic(), hashes=tuple(hashes))
        try:
            p.lookup = self.tier.start_lookup(hashes)
            self._inflight.append(p)
        except ServerUnavailable:
            p.finished = True
        return p

    def start_fetch(self, chunk_keys: Iterable[ChunkKey]) -> Prefetch:
        """Nothing to fetch: the server's lookup already brought up the leading runs."""
        return _Prefetch([], [], time.monotonic(), finished=True)

    def poll(self) -> None:
        """Settle finished lookups (their locks wait in `_ready` for the pin), and free
        the locks of settled lookups no pin came for."""
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
            if done:
                self._ready.setdefault(p.hashes, []).append((now, p.lookup))
        self._inflight = still
        for hashes, entries in list(self._ready.items()):
            fresh = [(t, lk) for t, lk in entries
                     if now - t <= READY_TTL_S and lk.space is self.tier._space]
            for t, lk in entries:
                if not any(lk is k for _, k in fresh):
                    self._drop(lk)
            if fresh:
                self._ready[hashes] = fresh
            else:
                del self._ready[hashes]

    def _drop(self, lk: Lookup | None) -> None:
        if lk is not None and self.tier.healthy:
            try:
                self.tier.keep(lk, None)
            except ServerUnavailable:
                pass

    def resident(self, hashes: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices the last settled lookup of exactly `hashes`
        found (a leading run, cut at the first object known bad); nothing otherwise."""
        entries = self._ready.get(tuple(hashes))
        out = {g.group_id: set() for g in self.layout.groups}
        if not entries:
            return out
        lk = entries[-1][1]
        for g, n in lk.found.items():
            for c in range(n):
                if (lk.space.namespace, hashes[c], g) in self._bad:
                    break
                out[g].add(c)
        return out

    def pin(self, chunk_keys: Iterable[ChunkKey], prefix: Sequence[bytes] = ()
            ) -> Pinned | None:
        """Hold these objects on the server, map them and verify them; all or nothing.
        `prefix`: the hashes from chunk 0 (the server keys a chunk by its prefix)."""
        chunk_keys = list(chunk_keys)
        index = {h: i for i, h in enumerate(prefix)}
        if not chunk_keys or any(h not in index for h, _ in chunk_keys):
            return None
        cells = [(index[h], g) for h, g in chunk_keys]
        entries = self._ready.get(tuple(prefix))
        lk = entries.pop()[1] if entries else None
        if entries is not None and not entries:
            del self._ready[tuple(prefix)]
        pin = None
        try:
            pin = self.tier.keep(lk, cells) if lk else self.tier.lock(prefix, cells)
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
        return Pinned([pin], {ck: kv for ck, (kv, _) in zip(chunk_keys, objects)})

    def _release_pin(self, pin) -> None:
        if pin is not None:
            try:
                self.tier.release(pin)
            except ServerUnavailable:
                pass

    def release(self, pinned: Pinned | None) -> None:
        if pinned is not None and pinned.keys:
            for pin in pinned.keys:
                self._release_pin(pin)
            pinned.keys = []

    def touch(self, chunk_keys: Sequence[ChunkKey]) -> None:
        """Nothing: the server touches a lookup's objects when its session ends."""

    # -- write ------------------------------------------------------------------------
    def reserve(self, chunks: Sequence[tuple[bytes, Sequence[int]]],
                prefix: Sequence[bytes] = ()
                ) -> dict[ChunkKey, tuple[object, object, int]]:
        """Empty objects in the server's L1 for `chunks` = [(chunk hash, group ids)], as
        {(hash, group): (KV view, trailer view, trailer key)}; `prefix`: the hashes from
        chunk 0 up to the last of `chunks`. Chunks the server holds already, or has no
        room for, get none (a chunk may be stored for some of its groups only: each
        object stands alone)."""
        index = {h: i for i, h in enumerate(prefix)}
        per_group: dict[int, set[int]] = defaultdict(set)
        for h, gids in chunks:
            if h in index:
                for g in gids:
                    per_group[g].add(index[h])
        if not per_group or not self.tier.healthy:
            return {}
        try:
            write = self.tier.reserve(prefix, {g: _runs(cs) for g, cs in per_group.items()})
        except ServerUnavailable:
            return {}
        ns, out = write.space.namespace, {}
        for (c, g), (kv, trailer) in write.objects.items():
            out[(prefix[c], g)] = (kv, trailer, integrity.key64(ns, prefix[c], g))
        hashes = {h for h, _ in out}
        if hashes:
            self._left[id(write)] = hashes
            self._open.update((h, write) for h in hashes)
        return out

    def commit(self, chunk_hash: bytes) -> None:
        write = self._open.pop(chunk_hash, None)
        if write is None:
            return
        left = self._left[id(write)]
        left.discard(chunk_hash)
        if not left:  # every chunk of the reservation is filled: one commit per range
            del self._left[id(write)]
            try:
                if not self.tier.commit(write):
                    logger.warning("gemma4-kv: %s did not take a commit", self.tier.url)
            except ServerUnavailable:
                pass

    def abort(self, chunk_hash: bytes) -> None:
        """Give up the reservation holding this chunk (and its other chunks)."""
        write = self._open.pop(chunk_hash, None)
        if write is None:
            return
        for h in self._left.pop(id(write), ()):
            self._open.pop(h, None)
        try:
            self.tier.abort(write)
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

    def close(self) -> None:
        for h in list(self._open):
            self.abort(h)
        self._drop_ready()
        self.tier.close()

    def _drop_ready(self) -> None:
        for entries in self._ready.values():
            for _, lk in entries:
                self._drop(lk)
        self._ready.clear()
