"""How bytes travel between vLLM's caches and the store's objects, per device.

CPU (and any non-CUDA device): the torch mover copies straight into / out of the
store's objects (`load`, `save`).

CUDA:
- save = staged: the Triton kernel gathers all chunks of a group into a region of the
  fixed staging buffer (`staging.py`) at device bandwidth (a short burst of SM time),
  their integrity trailers are computed there, then a side stream copies each object
  to the store's pinned memory by DMA (no SMs) while the model keeps computing. The
  objects are committed when the copy's event has fired. Without room in the staging
  buffer the kernel writes the objects straight into pinned memory (UVA) and their
  trailers are computed on the host before the commit.
- load = direct, layer by layer: the kernel reads the needed blocks straight from the
  store's pinned memory (UVA), so a sliding-window group moves only its window's
  blocks, in one pass over PCIe. One launch per layer on a load stream, in the
  forward's layer order, each followed by an event; the forward waits for a layer's
  event just before that layer's attention, so the load of layer l+1 overlaps the
  compute of layer l.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import integrity
from ..layout.groups import KVGroup
from .mover import BlockMoves, Launches, gather, scatter, scatter_by_layer
from ..layout.plan import ChunkBlocks
from .staging import StagingPool


@dataclass
class QueuedLoads:
    """Loads queued layer by layer: `ready[i]` fires once entry i of the order (and all
    before it) is in vLLM's cache; `done` once all are."""

    ready: list
    started: torch.cuda.Event
    done: torch.cuda.Event

    def seconds(self) -> float:
        """GPU time from the first copy to the last (waits for them if still running)."""
        self.done.synchronize()
        return self.started.elapsed_time(self.done) / 1e3


class DeviceStreams:
    """One device's copy streams and the loads and saves that run on them."""

    def __init__(self, device: torch.device, num_programs: int, stats=None):
        self.device = device
        self.num_programs = num_programs
        self.cuda = device.type == "cuda"
        self.launches = Launches(stats)
        # Any: a torch.cuda.Stream on CUDA (only used there), None elsewhere
        self.side_stream: Any = torch.cuda.Stream(device) if self.cuda else None
        # Separate from the save stream: a load must not queue behind earlier saves.
        self.load_stream: Any = torch.cuda.Stream(device) if self.cuda else None

    def load(self, group: KVGroup, caches: Sequence[torch.Tensor],
             objects: Sequence[torch.Tensor], plan: Sequence[ChunkBlocks]) -> None:
        """Not CUDA: fill the planned blocks from store objects (`objects[k]` for
        `plan[k]`) now, with the torch mover."""
        scatter(group, caches, objects, BlockMoves.from_chunks(plan, self.device),
                launches=self.launches)

    def load_by_layer(self, loads: dict[int, tuple],
                      order: Sequence[tuple[int, int]]) -> QueuedLoads:
        """CUDA: queue the loads on the load stream one layer at a time.

        `loads[group_id] = (group, caches, objects, plan)`; `order` lists (group id,
        layer position) in the forward's order."""
        self.load_stream.wait_stream(torch.cuda.current_stream(self.device))
        events = []
        started = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.load_stream):
            started.record()
            layer_loaders = {}
            for gid, (group, caches, objects, plan) in loads.items():
                if not all(o.is_pinned() for o in objects):
                    objects = [o.to(self.device, non_blocking=True) for o in objects]
                layer_loaders[gid] = scatter_by_layer(
                    group, caches, objects, BlockMoves.from_chunks(plan, self.device),
                    self.num_programs, self.launches)
            for gid, position in order:
                if gid in layer_loaders:
                    layer_loaders[gid](position)
                events.append(self.load_stream.record_event())
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        return QueuedLoads(events, started, done)

    def save(self, group: KVGroup, caches: Sequence[torch.Tensor],
             objects: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
             plan: Sequence[ChunkBlocks], pool: StagingPool | None) -> tuple[list, list]:
        """Start copying the planned blocks into store objects (`objects[k]` = (KV
        tensor, trailer tensor, trailer key) for `plan[k]`). Returns what must stay
        alive until `fence()` has fired, and the objects whose trailers are still to be
        written on the host (`integrity.seal`) once it has."""
        moves = BlockMoves.from_chunks(plan, self.device)
        kv = [o[0] for o in objects]
        if not self.cuda:
            gather(group, caches, kv, moves, launches=self.launches)
            return [], list(objects)
        shape, dtype = kv[0].shape, kv[0].dtype
        nbytes = len(kv) * kv[0].numel() * kv[0].element_size()
        region = pool.take(nbytes) if pool is not None else None
        if region is None:  # no staging room: the kernel writes pinned memory directly
            gather(group, caches, kv, moves, launches=self.launches)
            # on the compute stream: `fence` (the side stream's) must come after it too
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
            return [moves], list(objects)
        staging = region.view(dtype).view(len(kv), *shape)
        # device bandwidth: the full grid
        gather(group, caches, list(staging), moves, launches=self.launches)
        seals = integrity.seal_many(staging, [o[2] for o in objects])
        gathered = torch.cuda.current_stream(self.device).record_event()
        self.side_stream.wait_event(gathered)
        with torch.cuda.stream(self.side_stream):
            for (obj, trailer, _), buf, seal in zip(objects, staging, seals):
                obj.copy_(buf, non_blocking=True)
                trailer.copy_(seal, non_blocking=True)
            copied = self.side_stream.record_event()
        assert pool is not None  # the region is the pool's
        pool.release_after(region, copied)
        return [moves, seals], []

    def fence(self) -> torch.cuda.Event | None:
        """An event that fires once every save started so far has reached the store."""
        return self.side_stream.record_event() if self.cuda else None
