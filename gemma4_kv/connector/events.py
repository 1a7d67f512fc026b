"""KV cache events for routers: what gemma4-kv's tiers hold, published through vLLM's
own KV-events API (`--kv-events-config`), beside the GPU prefix cache's events.

How they flow (vLLM's contract for a connector whose storage lives in the workers,
as LMCache's connector does):
1. worker, model and lookup threads: the rank's store reports what it committed and
   deleted (`stores/events.py` `TierEvents`, a bounded queue; nothing waits);
2. worker, after each forward: vLLM asks `get_kv_connector_kv_cache_events`; the
   rank's reports go out as a `TierReports` in its `KVConnectorOutput` (vLLM combines
   the ranks' into one);
3. engine core: `update_connector_output` hands them to `RouterEvents`, which turns
   them into `BlockStored` / `BlockRemoved`; vLLM's scheduler takes them
   (`take_events`) with its own and publishes the batch (ZMQ, ...).

What the events say, per object (one KV cache group of one 256-token chunk):
- `block_hashes`: vLLM's own block hashes of the chunk's blocks at the group's block
  size (`request.block_hashes`, as its GPU prefix-cache events and the
  OffloadingConnector's publish them; vLLM computes them whenever a connector is
  configured), `parent_block_hash` the block before the chunk, `token_ids` the chunk's
  tokens, `block_size` the group's, `group_idx` vLLM's group index with its
  `kv_cache_spec_kind` / `kv_cache_spec_sliding_window`, `lora_id` / `lora_name`.
  A router that hashes token blocks itself (vLLM's scheme: sha256 or sha256_cbor
  chained from the seed) matches them as it matches the GPU's. `extra_keys` is left
  None (multimodal and salt keys are inside the hashes), as vLLM's offloading
  events do.
- `medium` "CPU" for both tiers (vLLM's names: the embedded L1 is host memory, so is
  an `lmcache server`'s shared-memory L1), `locality` "LOCAL"; `ownership` None for
  the embedded L1 (the connector's own tier) and "lmcache_server" for the server.
- Stored: once every tensor-parallel rank committed the object (a hit needs every
  rank's share). Removed: once the first rank deleted it, or on a reset (the ranks'
  `cleared`): every object published for that tier.

Limits: a chunk is published per group, and a Gemma 4 hit needs more than one chunk:
the full groups' chunks from 0 and the sliding groups' window before the hit's end, so
the longest run of stored chunks of a full group bounds a hit from above. Objects an
L2 prefetch brings up into L1 and the L2 tiers' own contents are not published; nor
are the server's evictions (they happen inside the server: its events show only what
this engine committed there). The hashes of a chunk are remembered from its save
(`PENDING_MAX` chunks) and, once published, until its removal (`PUBLISHED_MAX`
objects): beyond those, the oldest go unpublished. Reports of the last step before
the engine idles are published with its next step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.distributed.kv_events import (MEDIUM_CPU, BlockRemoved, BlockStored,
                                        KVCacheEvent, KVConnectorKVEvents)

from ..stores.base import ChunkWrite
from ..stores.events import CLEARED, REMOVED, STORED, TIER_L1, TIER_SERVER, TierEvents

logger = logging.getLogger(__name__)

MEDIA = {TIER_L1: (MEDIUM_CPU, "LOCAL", None),
         TIER_SERVER: (MEDIUM_CPU, "LOCAL", "lmcache_server")}
"""tier -> (medium, locality, ownership) of its events."""
PENDING_MAX = 4096
"""Chunks whose hashes and tokens are kept from their save until their commit."""
PUBLISHED_MAX = 1 << 18
"""Objects remembered (ranks holding them, hashes) until removed; oldest forgotten."""


def events_enabled(vllm_config) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events)


# -- worker ---------------------------------------------------------------------------
class TierReports(KVConnectorKVEvents):
    """One step's store reports of the ranks, [(rank, kind, tier, objects)], as vLLM
    carries them from the workers to the engine core (it combines the ranks' with
    `add_events` / `increment_workers`)."""

    def __init__(self, reports: list | None = None):
        self.reports = list(reports or [])
        self.workers = 1

    def add_events(self, events: list) -> None:
        self.reports.extend(events)

    def aggregate(self) -> "TierReports":
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list:
        return self.reports

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.reports = []


def attach(vllm_config, store) -> TierEvents | None:
    """Give the rank's store a report queue where vLLM publishes KV events."""
    if not events_enabled(vllm_config):
        return None
    store.events = TierEvents()
    return store.events


def take_reports(events: TierEvents | None, rank: int) -> TierReports | None:
    """The rank's reports since the last step (None: nothing to send)."""
    if events is None:
        return None
    reports = events.take()
    return TierReports([(rank, *r) for r in reports]) if reports else None


# -- engine core ----------------------------------------------------------------------
@dataclass
class _Chunk:
    """What vLLM names a chunk's blocks by, taken from its request at its save."""

    hashes: dict[int, list]
    """block size -> the chunk's block hashes at it, the one before it first (or None)."""
    tokens: list[int]
    lora_id: int | None
    lora_name: str | None


@dataclass
class _Object:
    ranks: set[int]
    published: list | None = None
    """The block hashes published as stored (None: not published)."""


class RouterEvents:
    """Turns the ranks' store reports into vLLM KV events (engine-core thread)."""

    def __init__(self, kv_cache_config, layout, chunk_size: int, world: int):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
            get_offloading_event_group_spec)

        self.chunk_size, self.world = chunk_size, world
        self.hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or \
            min(g.block_size for g in layout.groups)
        self.block_size = {g.group_id: g.block_size for g in layout.groups}
        self.spec = {gid: get_offloading_event_group_spec(g)
                     for gid, g in enumerate(kv_cache_config.kv_cache_groups)}
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._objects: OrderedDict[tuple[str, bytes, int], _Object] = OrderedDict()
        self._events: list[KVCacheEvent] = []

    @classmethod
    def from_vllm(cls, vllm_config, kv_cache_config, layout, chunk_size: int):
        if not events_enabled(vllm_config):
            return None
        return cls(kv_cache_config, layout, chunk_size,
                   vllm_config.parallel_config.tensor_parallel_size)

    def record(self, write: ChunkWrite, request) -> None:
        """A save of `request` was planned: remember how vLLM names its chunks' blocks."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

        raw = request.block_hashes
        sizes = set(self.block_size.values())
        lora = request.lora_request
        for i in range(len(write.groups)):
            c = write.first + i
            h = write.chain[c] if c < len(write.chain) else None
            if h is None or (c + 1) * self.chunk_size > len(raw) * self.hash_block_size:
                continue
            if h in self._chunks:
                self._chunks.move_to_end(h)
                continue
            hashes = {}
            for bs in sizes:
                view = resolve_block_hashes(raw, self.hash_block_size, bs)
                a, b = c * self.chunk_size // bs, (c + 1) * self.chunk_size // bs
                hashes[bs] = [maybe_convert_block_hash(view[j]) if j >= 0 else None
                              for j in range(a - 1, b)]
            tokens = list(request.all_token_ids[c * self.chunk_size:(c + 1) * self.chunk_size])
            self._chunks[h] = _Chunk(hashes, tokens, lora.adapter_id if lora else None,
                                     lora.name if lora else None)
            if len(self._chunks) > PENDING_MAX:
                self._chunks.popitem(last=False)

    def add(self, reports: KVConnectorKVEvents | None) -> None:
        """The ranks' reports of a step (`KVConnectorOutput.kv_cache_events`)."""
        if not isinstance(reports, TierReports):
            return
        for rank, kind, tier, objects in reports.reports:
            if kind == STORED:
                self._stored(rank, tier, objects)
            elif kind == REMOVED:
                self._removed(rank, tier, objects)
            elif kind == CLEARED:
                self._removed(rank, tier, [(h, g) for t, h, g in self._objects if t == tier])

    def take(self) -> list[KVCacheEvent]:
        out, self._events = self._events, []
        return out

    def _stored(self, rank: int, tier: str, objects: Iterable) -> None:
        medium, locality, owner = MEDIA[tier]
        for h, g in objects:
            key = (tier, h, g)
            obj = self._objects.get(key)
            if obj is None:
                obj = self._objects[key] = _Object(set())
                if len(self._objects) > PUBLISHED_MAX:
                    self._objects.popitem(last=False)
            obj.ranks.add(rank)
            chunk = self._chunks.get(h)
            if obj.published is not None or len(obj.ranks) < self.world or chunk is None:
                continue
            hashes = chunk.hashes[self.block_size[g]]
            obj.published = hashes[1:]
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockStored) and last.group_idx == g \
                    and last.medium == medium and last.ownership == owner \
                    and last.lora_id == chunk.lora_id and last.block_hashes[-1] == hashes[0]:
                last.block_hashes.extend(hashes[1:])  # the next chunk of the same run
                last.token_ids.extend(chunk.tokens)
                continue
            spec = self.spec.get(g)
            self._events.append(BlockStored(
                block_hashes=list(hashes[1:]), parent_block_hash=hashes[0],
                token_ids=list(chunk.tokens), block_size=self.block_size[g],
                lora_id=chunk.lora_id, medium=medium, lora_name=chunk.lora_name,
                group_idx=g, kv_cache_spec_kind=spec.kv_cache_spec_kind if spec else None,
                kv_cache_spec_sliding_window=spec.kv_cache_spec_sliding_window if spec
                else None, locality=locality, ownership=owner))

    def _removed(self, rank: int, tier: str, objects: Iterable) -> None:
        medium, locality, owner = MEDIA[tier]
        by_group: dict[int, list] = {}
        for h, g in objects:
            key = (tier, h, g)
            obj = self._objects.get(key)
            if obj is None:
                continue
            obj.ranks.discard(rank)
            if obj.published is not None:
                by_group.setdefault(g, []).extend(obj.published)
                obj.published = None
            if not obj.ranks:
                del self._objects[key]
        for g, hashes in by_group.items():
            self._events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=g,
                                             locality=locality, ownership=owner))
