"""The embedded store: LMCache's storage layer in this process (`lmcache.StorageLayer`).

One LMCache object per (chunk, group): the group's KV_2LTD tensor plus its integrity
trailer, keyed by `ObjectKey(chunk hash, namespace, kv_rank, group)`, where the
namespace is the layout fingerprint plus a generation that `reset` changes. L1 is
LMCache's CPU pool (pinned when CUDA is present); L2 tiers (local disk `fs_native`,
Redis/Valkey `valkey`, ...) sit behind it through LMCache's own adapters.

What L1 keeps is decided here, not by LMCache's LRU: `capacity.Capacity` admits and
evicts whole servable hits, and objects no hit can use are deleted at once.

What may fail is done before a hit is offered, never during its load:
- an L2 lookup is an LMCache prefetch (`start_prefetch` / `poll`); what it brings up is
  verified against its trailer as it lands, and a bad object is dropped and never
  offered again by this process;
- a hit is served only from objects pinned in L1 (`pin`), checked at pin time.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..layout.groups import AttentionKind, KVLayout
from ..layout.plan import hit_chunks, window_chunks
from . import integrity
from .base import ChunkKey, ChunkStore, ChunkWrite, Pinned, Prefetch, Reservation
from .capacity import Capacity, EndSpec
from .lmcache import StorageLayer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    """Sizes and tiers of one rank's embedded store."""

    cpu_bytes: int = 4 << 30
    disk_path: str | None = None
    disk_gb: float = 0.0
    l2_adapters: tuple[dict, ...] = ()
    """More LMCache L2 tiers, as `lmcache server --l2-adapter` JSON objects."""
    verify_checksums: bool = True

    def adapter_specs(self) -> list[dict]:
        specs = list(self.l2_adapters)
        if self.disk_path:
            disk = {"type": "fs_native", "base_path": self.disk_path, "num_workers": 4,
                    "max_capacity_gb": self.disk_gb}
            if self.disk_gb:
                disk["eviction"] = {"eviction_policy": "LRU"}
            specs.insert(0, disk)
        return specs


@dataclass
class _Prefetch(Prefetch):
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
    owner: str = field(default_factory=lambda: f"prefetch-{uuid.uuid4().hex}")
    """Holds what it brought up in `capacity` until `finish_prefetch`."""
    done_with: bool = False


@dataclass
class _Reservation(Reservation):
    keys: list = field(default_factory=list)
    namespace: str = ""


class EmbeddedStore(ChunkStore):
    def __init__(self, layout: KVLayout, fingerprint: str, chunk_size: int,
                 config: StoreConfig = StoreConfig(), kv_rank: int = 0, stats=None):
        self.layout, self.fingerprint, self.chunk_size = layout, fingerprint, chunk_size
        self.namespace = fingerprint
        self.kv_rank, self.config, self.stats = kv_rank, config, stats
        adapters = config.adapter_specs()
        self._has_l2 = bool(adapters)
        self.tier = StorageLayer(config.cpu_bytes, adapters)
        self._groups = [g.group_id for g in layout.groups]
        self._layouts, self._bytes = {}, {}
        for g in layout.groups:
            shapes = [torch.Size(g.chunk_shape(chunk_size)), torch.Size(integrity.SEAL_SHAPE)]
            dtypes = [g.dtype, integrity.SEAL_DTYPE]
            self._layouts[g.group_id] = self.tier.layout(shapes, dtypes)
            self._bytes[g.group_id] = self.tier.allocated_bytes(shapes, dtypes)
        self._windows = {g.group_id: window_chunks(g, chunk_size) for g in layout.groups}
        self._full = [g.group_id for g in layout.groups if g.kind is AttentionKind.FULL]
        self._total = self.tier.usage()[1]
        self.capacity = Capacity(self._total)
        self._warned_untracked = False
        self._inflight: list[_Prefetch] = []  # lookup thread
        self._maybe_untrusted: Counter = Counter()  # keys an unsettled prefetch may load
        self._bad: set = set()  # keys whose L2 copy failed verification

    @property
    def has_l2(self) -> bool:
        return self._has_l2

    # -- keys -------------------------------------------------------------------------
    def key(self, chunk_hash: bytes, group_id: int, namespace: str | None = None):
        return self.tier.key(chunk_hash, namespace or self.namespace, self.kv_rank, group_id)

    def seal_key(self, chunk_hash: bytes, group_id: int, namespace: str | None = None) -> int:
        """The integrity trailer's key value of an object."""
        return integrity.key64(namespace or self.namespace, chunk_hash, group_id)

    def _end(self, chain: Sequence[bytes], tokens: int, cls: int) -> EndSpec:
        cells = [(chain[c], g) for g, c in hit_chunks(self.layout, 0, tokens, self.chunk_size)]
        return EndSpec((chain[-(-tokens // self.chunk_size) - 1], tokens), cls, tuple(cells))

    def _sizes(self, cells) -> dict[ChunkKey, int]:
        return {c: self._bytes[c[1]] for c in cells}

    # -- reads: L1 --------------------------------------------------------------------
    def resident(self, chain: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices whose object sits in L1 and may be offered
        (not possibly brought up by an unverified prefetch, not known bad)."""
        out = {}
        for gid in self._groups:
            keys = [self.key(h, gid) for h in chain]
            out[gid] = {i for i in self.tier.resident(gid, keys, self._layouts[gid], False)
                        if keys[i] not in self._maybe_untrusted and keys[i] not in self._bad}
        return out

    def pin(self, chain: Sequence[bytes], start: int, hit: int,
            req_id: str = "") -> Pinned | None:
        """Read-lock the objects of the hit in L1 and take views of their KV tensors; all
        or nothing. An object that is missing, untrusted or of another shape is a miss.
        The hit counts as asked for once more by `req_id` (`Capacity.served`)."""
        cells = [(chain[c], g) for g, c in hit_chunks(self.layout, start, hit, self.chunk_size)]
        locked: list = []
        pinned = done = None
        try:
            pinned = self._lock_and_view(cells, locked)
            if pinned is not None:
                end = self._end(chain, hit, 1)
                self.capacity.served(end, self._sizes(end.cells), create=start == 0,
                                     req_id=req_id)
                pinned.handles.append(end.key)
            done = pinned
        finally:  # a miss, or a read that raised: none of its locks stays behind
            if done is None:
                self.tier.unlock(locked)
        return done

    def _lock_and_view(self, cells: list[ChunkKey], locked: list) -> Pinned | None:
        """`pin`'s work; adds every key it read-locks to `locked` as soon as it is."""
        for gid in self._groups:
            keys = [self.key(h, gid) for h, g in cells if g == gid]
            hits = self.tier.resident(gid, keys, self._layouts[gid], True)
            locked += [keys[i] for i in hits]
            if len(hits) != len(keys):
                return None
        keys = [self.key(h, g) for h, g in cells]
        if any(k in self._maybe_untrusted or k in self._bad for k in keys):
            return None
        found = self.tier.read(keys)
        views = {}
        for ck, k in zip(cells, keys):
            obj, want = found.get(k), self._layouts[ck[1]]
            if obj is None or obj.shapes != list(want.shapes) \
                    or obj.dtypes != list(want.dtypes):
                logger.warning("gemma4-kv: stored object for group %d is missing or has "
                               "another shape: treated as a miss", ck[1])
                return None
            views[ck] = obj.kv
        return Pinned(views, [self.namespace, list(locked)])

    def release(self, pinned: Pinned | None) -> None:
        if pinned is None or not pinned.handles:
            return
        namespace, keys, end = pinned.handles
        pinned.handles = []
        self.tier.unlock(keys)
        self.capacity.unpinned(end)
        if namespace != self.namespace:  # reset while loading: nothing tracks them now
            self.tier.delete(keys)

    # -- reads: L2 --------------------------------------------------------------------
    def start_prefetch(self, chain: Sequence[bytes], start: int, limit: int) -> Prefetch:
        """Ask the L2 tiers for the longest prefix of `chain` they can serve, without
        waiting: LMCache loads what it needs into L1 (each sliding group only its window
        before each chunk end). Room is made first for the hit asked for (it may evict
        what a save of it could); without room nothing is asked."""
        p = _Prefetch(time.monotonic(), chain=tuple(chain), start=start, limit=limit,
                      namespace=self.namespace)
        asked = self._end(chain, limit, 1)
        if not self._make_room(asked):
            p.finished = True
            return p
        self._submit(p, [([(gid, list(chain)) for gid in self._groups], "prefix")])
        return p

    def _make_room(self, asked: EndSpec) -> bool:
        """Room in L1 for what a prefetch of `asked` may bring up."""
        missing = [c for c in asked.cells if c not in self.capacity]
        ok, garbage = self.capacity.room(sum(self._bytes[g] for _, g in missing), asked.key)
        self._delete(garbage)
        return ok

    def _submit(self, p: _Prefetch, tasks) -> None:
        planned = [(policy, [(gid, hs, [self.key(h, gid) for h in hs]) for gid, hs in rows])
                   for rows, policy in tasks]
        keys = [k for _, rows in planned for _, _, ks in rows for k in ks]
        held = [ks[i] for _, rows in planned for gid, _, ks in rows
                for i in self.tier.resident(gid, ks, self._layouts[gid], True)]
        before = set(held)
        p.held += held
        p.untrusted += [k for k in keys if k not in before]
        self._maybe_untrusted.update(k for k in keys if k not in before)
        for policy, rows in planned:
            handle = self.tier.prefetch(
                [(gid, ks, self._layouts[gid], self._windows[gid] if policy == "prefix"
                  else -1) for gid, _, ks in rows], policy)
            p.tasks.append((handle, rows))
            p.results.append(None)
        if p not in self._inflight:
            self._inflight.append(p)

    def poll(self) -> None:
        """Settle every finished prefetch: verify what it loaded from L2, drop what fails,
        release its locks (also of prefetches whose lookup gave up waiting). LMCache's
        prefix fetch serves chunk ends: a hit ending inside a chunk may need one more
        window chunk, and an object that failed leaves a shorter hit that needs other
        window chunks; up to two targeted fetches follow (`_next_fetch`)."""
        still = []
        for p in self._inflight:
            for i, (handle, _) in enumerate(p.tasks):
                if p.results[i] is None:
                    p.results[i] = self.tier.prefetch_outcome(handle)
            if any(r is None for r in p.results):
                still.append(p)
                continue
            self._settle(p)
            missing = self._next_fetch(p) if p.rounds < 3 else []
            if missing:
                p.rounds += 1
                p.asked.update(missing)
                per_group: dict[int, list[bytes]] = {}
                for h, gid in missing:
                    per_group.setdefault(gid, []).append(h)
                p.tasks, p.results = [], []
                self._submit(p, [([(gid, hs)], "full") for gid, hs in per_group.items()])
                still.append(p)
            else:
                p.finished = True
        self._inflight = still

    def _next_fetch(self, p: _Prefetch) -> list[ChunkKey]:
        """What L1 lacks of the longest hit (at most `p.limit`) still within reach: one
        whose full-attention chunks L1 holds (the prefix fetch brought every one L2 had)
        and none of whose objects is known bad or was asked for in vain. Nothing if that
        hit is servable already."""
        resident = self.resident(p.chain)
        c = self.chunk_size
        for end in sorted({p.limit} | set(range(c, p.limit, c)), reverse=True):
            if end <= p.start:
                break
            cells = hit_chunks(self.layout, p.start, end, c)
            if any(ch not in resident[g] for g, ch in cells if g in self._full):
                continue
            keys = [(p.chain[ch], g) for g, ch in cells if ch not in resident[g]]
            if any(k in p.asked or self.key(*k) in self._bad for k in keys):
                continue
            return keys
        return []

    def _settle(self, p: _Prefetch) -> None:
        locked, bad, strays, held, landed = [], [], {}, set(p.held), {}
        for (_, rows), result in zip(p.tasks, p.results):
            for row, (gid, hashes, keys) in enumerate(rows):
                loaded = set(result.from_l2[row])
                hit = result.hit[row]
                for i in hit:
                    key = keys[i]  # as submitted: the namespace may have changed since
                    locked.append(key)
                    if i in loaded:
                        if self._verified(key, hashes[i], gid):
                            p.loaded.add((hashes[i], gid))
                            landed[(hashes[i], gid)] = self._bytes[gid]
                        else:
                            bad.append(key)
                hit = set(hit)
                strays.setdefault(gid, []).extend(
                    (keys[i], hashes[i]) for i in range(len(keys))
                    if i not in hit and keys[i] not in held)
        more, stray_landed = self._verify_strays(strays)
        bad += more
        if p.namespace == self.namespace:
            # Tracked from now on: the hit's objects are held for the lookup's pin (if
            # it still waits), what no hit needs is deleted (strays at once).
            self.capacity.kept({**landed, **stray_landed})
            if not p.done_with:
                self.capacity.hold(p.owner, landed)
        self.tier.unlock(locked)
        self.tier.unlock(p.held)
        if bad:
            self._bad.update(bad)
            self.tier.delete_everywhere(bad)
            self.capacity.dropped([(k.chunk_hash, k.object_group_id) for k in bad])
            p.rejected += len(bad)
            if self.stats is not None:
                self.stats.add("rejected_objects", len(bad))
            logger.warning("gemma4-kv: %d object(s) from an L2 tier failed verification "
                           "(corrupt, truncated or foreign): dropped, recomputed instead",
                           len(bad))
        self._maybe_untrusted.subtract(p.untrusted)
        self._maybe_untrusted += Counter()  # drop zero counts
        p.held, p.untrusted = [], []

    def _verify_strays(self, strays: dict[int, list]) -> tuple[list, dict]:
        """Objects a prefetch brought into L1 but left out of the hit it reports: LMCache
        keeps them there unlocked (e.g. those past a value that failed to load, which ends
        a prefix). Verified like the hit: (bad keys, sizes of the good ones)."""
        bad, good = [], {}
        for gid, pairs in strays.items():
            keys = [k for k, _ in pairs]
            held = self.tier.resident(gid, keys, self._layouts[gid], True)  # locked:
            try:                                            # not deleted while we read
                for i in held:
                    if self._verified(keys[i], pairs[i][1], gid):
                        good[(pairs[i][1], gid)] = self._bytes[gid]
                    else:
                        bad.append(keys[i])
            finally:
                self.tier.unlock([keys[i] for i in held])
        return bad, good

    def _verified(self, key, chunk_hash: bytes, gid: int) -> bool:
        if not self.config.verify_checksums:
            return True
        obj = self.tier.read([key]).get(key)
        return obj is not None and integrity.verify(
            obj.kv, obj.trailer, integrity.key64(key.model_name, chunk_hash, gid))

    def finish_prefetch(self, prefetch: Prefetch) -> None:
        """The lookup is done with this prefetch (it pinned its hit, or gave up): what it
        brought up and no hit holds goes."""
        if isinstance(prefetch, _Prefetch):
            prefetch.done_with = True
            self._delete(self.capacity.finished(prefetch.owner))

    # -- writes -----------------------------------------------------------------------
    def reserve(self, write: ChunkWrite) -> Reservation:
        """Empty objects for the chunks of `write` that a hit the store admits needs
        (`Capacity.plan`), in the room `Capacity.grant` makes, as {(hash, group): (KV
        tensor, trailer tensor, trailer key)}; objects in L1 already are skipped."""
        chain = write.chain
        self._fit_limit()
        ends = [self._end(chain, t, cls) for t, cls in write.ends
                if -(-t // self.chunk_size) <= len(chain)]
        self.capacity.plan(write.req_id, ends, self._sizes({c for e in ends for c in e.cells}))
        cells = [(chain[write.first + i], g) for i, gids in enumerate(write.groups)
                 for g in gids]
        self._reconcile(cells)
        granted, garbage = self.capacity.grant(write.req_id,
                                               self._sizes(self.capacity.wanted(cells)))
        self._delete(garbage)
        res = _Reservation({}, namespace=self.namespace)
        for gid in self._groups:
            mine = [h for h, g in granted if g == gid]
            got = self.tier.reserve([self.key(h, gid) for h in mine], self._layouts[gid])
            for key, (kv, trailer) in got.items():
                res.objects[(key.chunk_hash, gid)] = (kv, trailer,
                                                      self.seal_key(key.chunk_hash, gid))
                res.keys.append(key)
        self.capacity.reserved(self._sizes(res.objects))
        short = [c for c in granted if c not in res.objects]
        if short:  # L1 had less room than counted: their hits cannot complete
            logger.warning("gemma4-kv: the CPU tier had no room for %d of %d objects its "
                           "account made room for (L1 %d of %d bytes used, %d accounted)",
                           len(short), len(granted), *self.tier.usage(), self.capacity.used)
            self._delete(self.capacity.dropped(short))
        return res

    def _fit_limit(self) -> None:
        """What L1 holds beyond the account (objects not yet deleted that a reader holds,
        allocation overhead) is room the account cannot give: its limit shrinks by it."""
        used = self.tier.usage()[0]
        extra = max(0, used - self.capacity.used)
        self.capacity.limit = self._total - extra
        if extra > 0.01 * self._total and not self._warned_untracked:
            self._warned_untracked = True
            logger.warning("gemma4-kv: the CPU tier holds %d bytes more than its account "
                           "(%d of %d used); the account's limit leaves them out", extra,
                           used, self._total)

    def _reconcile(self, cells: list[ChunkKey]) -> None:
        """Objects the account holds as stored that L1 no longer has (deleted behind the
        store's back) leave the account, with the hits that needed them: a save stores
        them again."""
        gone, stored = [], self.capacity.stored_among(cells)
        for gid in self._groups:
            mine = [h for h, g in stored if g == gid]
            if mine:
                keys = [self.key(h, gid) for h in mine]
                here = set(self.tier.resident(gid, keys, self._layouts[gid], False))
                gone += [(h, gid) for i, h in enumerate(mine) if i not in here]
        if gone:
            self._delete(self.capacity.dropped(gone))

    def commit(self, reservation: Reservation) -> None:
        if not isinstance(reservation, _Reservation) or not reservation.keys:
            return
        keys, reservation.keys = reservation.keys, []
        if reservation.namespace != self.namespace:  # reset while it was being written
            self.tier.discard(keys)
            return
        self.tier.publish(keys)
        self._bad.difference_update(keys)  # a fresh copy replaces one that failed
        self.capacity.stored(reservation.objects)

    def abort(self, reservation: Reservation) -> None:
        if not isinstance(reservation, _Reservation) or not reservation.keys:
            return
        keys, reservation.keys = reservation.keys, []
        self.tier.discard(keys)
        if reservation.namespace == self.namespace:
            self._delete(self.capacity.dropped(reservation.objects))

    def on_request_finished(self, req_id: str) -> None:
        """Hits only this request was completing are given up (it was aborted, or its
        prompt ended elsewhere than planned), and what they held goes."""
        self._delete(self.capacity.finished(req_id))

    def delete(self, cells: Sequence[ChunkKey]) -> None:
        """Delete these objects from L1 (hits needing them go too); read-locked ones go
        once released."""
        self._delete(list(cells) + self.capacity.dropped(cells))

    def drop_l1(self) -> None:
        """Empty L1, as a fresh engine's is (the L2 tiers keep theirs); objects a reader
        holds go once released."""
        self.delete(self.capacity.tracked())
        self.tier.clear()

    def _delete(self, cells: Sequence[ChunkKey]) -> None:
        """Delete objects L1 keeps for no hit; those a reader still holds are kept and
        deleted later (`Capacity.kept`)."""
        if not cells:
            return
        for gid in self._groups:
            keys = [self.key(h, gid) for h, g in cells if g == gid]
            if not keys:
                continue
            self.tier.delete(keys)
            left = self.tier.resident(gid, keys, self._layouts[gid], False)
            if left:
                self.capacity.kept({(keys[i].chunk_hash, gid): self._bytes[gid]
                                    for i in left})
        if self.stats is not None:
            self.stats.add("evicted_objects", len(cells))

    # -- misc -------------------------------------------------------------------------
    def reset(self) -> bool:
        """Make everything stored so far unreachable: a new generation in every key, so
        nothing of the old one can be found in any tier, and L1 cleared of it (objects
        still pinned by a load in flight go when released)."""
        self.namespace = f"{self.fingerprint}-g{uuid.uuid4().hex[:12]}"
        self.tier.clear()
        self.capacity.clear()
        return True

    def usage(self) -> tuple[int, int]:
        """(used, total) bytes of the CPU tier."""
        return self.tier.usage()

    def close(self) -> None:
        self.tier.close()
