"""The embedded store: LMCache's storage layer in this process (`lmcache.StorageLayer`).

One LMCache object per (chunk, group): the group's KV_2LTD tensor plus its integrity
trailer, keyed by `ObjectKey(chunk hash, namespace, kv_rank, group)`, where the
namespace is the layout fingerprint plus a generation that `reset` changes. L1 is
LMCache's CPU pool (pinned when CUDA is present); L2 tiers (local disk `fs_native`,
Redis/Valkey `valkey`, ...) sit behind it through LMCache's own adapters.

What L1 keeps is decided here, not by LMCache's LRU: `capacity.Capacity` admits and
evicts whole servable hits, and objects no hit can use are deleted at once. The store is
the account's one owner: the L2 half returns what the account must learn as decisions
(`l2_prefetch.Decision`), which `_apply` carries out.

What may fail is done before a hit is offered, never during its load:
- an L2 lookup is an LMCache prefetch (`embedded_l2.L2Prefetches`, which the store
  holds); what it brings up is verified against its trailer as it lands, and a bad
  object is dropped and never offered again by this process;
- a hit is served only from objects pinned in L1 (`pin`), checked at pin time.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..layout.groups import KVLayout
from ..layout.plan import hit_chunks
from ..layout import integrity
from .base import (HIGH, LOW, ChunkKey, ChunkStore, ChunkWrite, Pinned, Prefetch,
                   Reservation, StoreCapabilities)
from .capacity import Capacity, EndKey, EndSpec, hit_end
from .config import StoreConfig
from . import lmcache_codec
from .embedded_l2 import L2Prefetches
from .l2_prefetch import Decision, Done, Landed, Rejected
from .events import TIER_L1, TierEvents
from .lmcache import StorageLayer
from .stats import Stats

logger = logging.getLogger(__name__)


PAD_LIMIT = 0.02
"""Most padding an object takes (share of its size) to be a whole multiple of the
smallest (`object_layouts`)."""


def object_layouts(layout: KVLayout, chunk_size: int, allocated) -> dict[int, tuple]:
    """Per group id, the (shapes, dtypes) of its objects in L1: the chunk's KV, the
    integrity trailer and, where it costs at most `PAD_LIMIT`, padding that makes the
    object's allocation (`allocated(shapes, dtypes)`) a whole multiple of the smallest
    group's. L1 allocates first fit from one arena, so a smaller object taking the place
    of a freed larger one leaves the rest; on the 12B shape a sliding object (4 MiB of KV
    and a 4 KiB trailer page) is 4 KiB short of two full-attention ones, and that rest
    fits no object: L1 runs out with room to spare by the account (the tier sweep lost
    a document's worth at every tier size)."""
    plain = {g.group_id: ([torch.Size(g.chunk_shape(chunk_size)),
                           torch.Size(integrity.SEAL_SHAPE)], [g.dtype, integrity.SEAL_DTYPE])
             for g in layout.groups}
    sizes = {gid: allocated(*sd) for gid, sd in plain.items()}
    unit = min(sizes.values())
    out = {}
    for gid, (shapes, dtypes) in plain.items():
        want = -(-sizes[gid] // unit) * unit
        raw = sum(s.numel() * torch.empty((), dtype=d).element_size()
                  for s, d in zip(shapes, dtypes))
        if want > sizes[gid] and want - sizes[gid] <= PAD_LIMIT * sizes[gid]:
            shapes, dtypes = shapes + [torch.Size([want - raw])], dtypes + [torch.uint8]
        out[gid] = (shapes, dtypes)
    return out


@dataclass(frozen=True)
class EmbeddedPin:
    """What `EmbeddedStore.pin` holds for one hit, in its `Pinned.handles` (alone):
    the generation it was pinned in, the keys it read-locked in L1, and the hit's end
    in the account (`Capacity.served`, given back by `Capacity.unpinned`)."""

    namespace: str
    keys: tuple
    end: EndKey


@dataclass
class _Reservation(Reservation):
    keys: list = field(default_factory=list)
    namespace: str = ""


class EmbeddedStore(ChunkStore):
    events: TierEvents | None = None
    """Where L1's stores and removals are reported, if anyone publishes them."""

    def __init__(self, layout: KVLayout, fingerprint: str, chunk_size: int,
                 config: StoreConfig | None = None, kv_rank: int = 0,
                 stats: Stats | None = None):
        config = StoreConfig() if config is None else config
        self.layout, self.fingerprint, self.chunk_size = layout, fingerprint, chunk_size
        self.namespace = fingerprint
        self.kv_rank, self.config, self.stats = kv_rank, config, stats
        objects = object_layouts(layout, chunk_size, StorageLayer.aligned_bytes)
        if config.codec != "none":
            lmcache_codec.register()
        frame = lmcache_codec.frame_bytes(config, objects.values())
        self.tier = StorageLayer(config.cpu_bytes, config.adapter_specs(frame))
        self._groups = [g.group_id for g in layout.groups]
        self._layouts, self._bytes = {}, {}
        for gid, (shapes, dtypes) in objects.items():
            self._layouts[gid] = self.tier.layout(shapes, dtypes)
            self._bytes[gid] = self.tier.allocated_bytes(shapes, dtypes)
        self._total = self.tier.usage()[1]
        self.capacity = Capacity(self._total,
                                 ties_admit=config.capabilities.slow_tier)
        self._warned_untracked = False
        self.l2 = L2Prefetches(self.tier, layout, chunk_size, layouts=self._layouts,
                               sizes=self._bytes, kv_rank=kv_rank,
                               verify=config.verify_checksums)

    @property
    def capabilities(self) -> StoreCapabilities:
        """A slower tier where an L2 adapter (or the disk tier) is configured."""
        return self.config.capabilities

    def slow_tier_up(self) -> bool:
        """Not while L2 is stuck: too many prefetches given up unanswered (`tier_up`)."""
        return self.capabilities.slow_tier and self.l2.tier_up()

    # -- keys -------------------------------------------------------------------------
    def key(self, chunk_hash: bytes, group_id: int, namespace: str | None = None):
        return self.tier.key(chunk_hash, namespace or self.namespace, self.kv_rank, group_id)

    def seal_key(self, chunk_hash: bytes, group_id: int, namespace: str | None = None) -> int:
        """The integrity trailer's key value of an object."""
        return integrity.key64(namespace or self.namespace, chunk_hash, group_id)

    def _end(self, chain: Sequence[bytes], tokens: int, cls: int) -> EndSpec:
        return hit_end(self.layout, self.chunk_size, chain, tokens, cls)

    def _sizes(self, cells) -> dict[ChunkKey, int]:
        return {c: self._bytes[c[1]] for c in cells}

    # -- reads: L2 (`L2Prefetches`) ----------------------------------------------------
    def start_prefetch(self, chain: Sequence[bytes], start: int, limit: int) -> Prefetch:
        """Room is made first for the hit asked for (it may evict what a save of it
        could), set apart for the prefetch until it lands; without room, or while the
        tier is stuck (`L2Prefetches.tier_up`), nothing is asked."""
        owner = f"prefetch-{uuid.uuid4().hex}"
        asked = self._end(chain, limit, HIGH)
        ask = self.l2.tier_up()
        if ask:
            ask, garbage = self.capacity.room(self._missing_bytes(asked), asked.key, owner)
            self._delete(garbage)
        return self.l2.start_prefetch(chain, start, limit, self.namespace, owner, ask)

    def _missing_bytes(self, asked: EndSpec) -> int:
        return sum(self._bytes[cell[1]] for cell in asked.cells
                   if cell not in self.capacity)

    def fetch_bytes(self, chain: Sequence[bytes], start: int, limit: int) -> int:
        """Bytes of the objects a hit of `limit` tokens needs that L1 lacks."""
        return self._missing_bytes(self._end(chain, limit, HIGH))

    def poll(self) -> None:
        self._apply(self.l2.poll(self.namespace))

    def in_flight(self) -> bool:
        return self.l2.in_flight()

    def l2_writes_in_flight(self) -> int:
        """Committed objects whose copy to the L2 tiers has not ended (stored or
        failed), but for a moment of LMCache's (`StorageLayer.l2_writes_in_flight`):
        what a test waits out instead of sleeping."""
        return self.tier.l2_writes_in_flight()

    def finish_prefetch(self, prefetch: Prefetch) -> None:
        self._apply(self.l2.finish_prefetch(prefetch))

    def _apply(self, decisions: list[Decision]) -> None:
        """Carry out, in order, what L2 work decided the account must learn."""
        for d in decisions:
            if isinstance(d, Landed):
                self.capacity.landed(d.owner)
                if d.kept:
                    self.capacity.kept(self._sizes(d.kept))
                if d.held:
                    self.capacity.hold(d.owner, d.held)
                if d.gave_up and self.stats is not None:
                    self.stats.add("hung_l2_prefetches", 1)
            elif isinstance(d, Rejected):
                if self.stats is not None:
                    self.stats.add("rejected_objects", len(d.cells))
                # The other objects of the ends this evicts stay in L1: a prefetch
                # may have brought them up past its hit, and once the engine stores
                # the bad chunk again they serve (tests/test_remote_tier.py).
                self.capacity.dropped(d.cells)
            elif isinstance(d, Done):
                self._delete(self.capacity.finished(d.owner))

    # -- reads: L1 --------------------------------------------------------------------
    def resident(self, chain: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices whose object sits in L1 and may be offered
        (not possibly brought up by an unverified prefetch, not known bad)."""
        out, decided = self.l2.resident(chain, self.namespace)
        self._apply(decided)
        return out

    def pin(self, chain: Sequence[bytes], start: int, hit: int,
            req_id: str = "") -> Pinned | None:
        """Read-lock the objects of the hit in L1 and take views of their KV tensors; all
        or nothing. An object that is missing, untrusted or of another shape is a miss.
        The hit counts as asked for once more by `req_id` (`Capacity.served`)."""
        cells = [(chain[c], g) for g, c in hit_chunks(self.layout, start, hit, self.chunk_size)]
        locked: list = []
        done = None
        try:
            views = self._lock_and_view(cells, locked)
            if views is not None:
                end = self._end(chain, hit, 1)
                handle = EmbeddedPin(self.namespace, tuple(locked), end.key)
                self.capacity.served(end, self._sizes(end.cells), create=start == 0,
                                     req_id=req_id)
                done = Pinned(views, handle)
        finally:  # a miss, or a read that raised: none of its locks stays behind
            if done is None:
                self.tier.unlock(locked)
        return done

    def _lock_and_view(self, cells: list[ChunkKey],
                       locked: list) -> dict[ChunkKey, torch.Tensor] | None:
        """`pin`'s work, the views of a hit's KV; adds every key it read-locks to
        `locked` as soon as it is.

        Chunks are locked in one LMCache call per set of groups that reads them (a
        Gemma 4 hit has two: the sliding window's chunks, read by every group, and the
        full groups' other chunks), not one per group: calls cost most of a lookup."""
        chunks: dict[bytes, list[int]] = {}
        for h, g in cells:
            chunks.setdefault(h, []).append(g)
        by_groups: dict[tuple[int, ...], list[bytes]] = {}
        for h, gids in chunks.items():
            by_groups.setdefault(tuple(gids), []).append(h)
        keys_of: dict[ChunkKey, object] = {}  # -> the tier's key
        for readers, hashes in by_groups.items():
            rows = [(gid, [self.key(h, gid) for h in hashes], self._layouts[gid])
                    for gid in readers]
            hits = self.tier.lock_columns(rows)
            for _, keys, _ in rows:
                locked += [keys[i] for i in hits]
            if len(hits) != len(hashes):
                return None
            for gid, keys, _ in rows:
                keys_of.update(((h, gid), k) for h, k in zip(hashes, keys))
        keys = [keys_of[c] for c in cells]
        if self.l2.withheld(keys):
            return None
        found = self.tier.read(keys, trailers=False)  # a load reads the KV only
        views = {}
        for ck, k in zip(cells, keys):
            obj, want = found.get(k), self._layouts[ck[1]]
            if obj is None or obj.shapes != list(want.shapes) \
                    or obj.dtypes != list(want.dtypes):
                logger.warning("gemma4-kv: stored object for group %d is missing or has "
                               "another shape: treated as a miss", ck[1])
                return None
            views[ck] = obj.kv
        return views

    def release(self, pinned: Pinned | None) -> None:
        """Give back what `pin` held; a `Pinned` of another store is a bug (TypeError)."""
        if pinned is None or pinned.handles is None:
            return
        h = pinned.handles
        if not isinstance(h, EmbeddedPin):
            raise TypeError("gemma4-kv: the embedded store was handed a pin of another "
                            f"store: {h!r}")
        pinned.handles = None
        self.tier.unlock(list(h.keys))
        self.capacity.unpinned(h.end)
        if h.namespace != self.namespace:  # reset while loading: nothing tracks them
            self.tier.delete(list(h.keys))

    # -- writes -----------------------------------------------------------------------
    def reserve(self, write: ChunkWrite) -> Reservation:
        """Empty objects for the chunks of `write` that a hit the store admits needs
        (`Capacity.plan`), in the room `Capacity.grant` makes, as {(hash, group): (KV
        tensor, trailer tensor, trailer key)}; objects in L1 already are skipped."""
        chain = write.chain
        self._fit_limit()
        ends = [self._end(chain, t, LOW if t in write.low else HIGH) for t in write.ends
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
        self.capacity.untracked(extra)
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
        self.l2.stored(keys)  # a fresh copy replaces one that failed
        self.capacity.stored(reservation.objects)
        if self.events is not None:
            self.events.stored(TIER_L1, reservation.objects)

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
        holds go once released. For measuring loads from L2 without restarting the
        engine: benchmarks/bench_ttft.py and the fault tests (tests/faults.py)."""
        self.delete(self.capacity.tracked())
        self.l2.l1_cleared()
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
            self.l2.left_l1(keys)
            left = self.tier.resident(gid, keys, self._layouts[gid], False)
            if left:
                self.capacity.kept({(keys[i].chunk_hash, gid): self._bytes[gid]
                                    for i in left})
            if self.events is not None:  # those a reader holds go later
                kept = set(left)
                self.events.removed(TIER_L1, [(k.chunk_hash, gid) for i, k in enumerate(keys)
                                              if i not in kept])
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
        self.l2.reset()  # keys of the old generation: never looked up again
        if self.events is not None:
            self.events.cleared(TIER_L1)
        return True

    def usage(self) -> tuple[int, int]:
        """(used, total) bytes of the CPU tier."""
        return self.tier.usage()

    def close(self) -> None:
        self.l2.close()  # first: its verifiers read L1
        self.tier.close()
