"""Move a group's blocks between vLLM's paged caches and LMCache chunk objects.

Chunk object format: LMCache's KV_2LTD, `[2, layers, tokens, kv_heads * head_size]`
(K at index 0, V at 1, split out of vLLM's concatenated last dimension; token-major,
heads then channels inside a token), so our objects are interchangeable with
LMCache's own (`lmcache/v1/memory_management.py`, `MemoryFormat.KV_2LTD`).

`torch_gather` / `torch_scatter` are the plain-torch reference: the oracle of the
Triton kernel and the path on any device but CUDA. `gather` / `scatter` pick the
Triton kernel when the caches are CUDA tensors. Either way they tell `Launches` the
signature of the launch (the key Triton compiles under), so what the start-up warm-up
leaves to compile in a request's time is counted, on CUDA and off it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..layout.groups import KVGroup
from ..layout.plan import ChunkBlocks

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class BlockMoves:
    """One launch's work for one group: block `block_ids[i]` <-> block slot
    `slots[i]` of chunk object number `chunk_index[i]`."""

    block_ids: torch.Tensor
    chunk_index: torch.Tensor
    slots: torch.Tensor
    max_slot: int | None = None
    """Largest slot, known on the host when built from a plan (no device sync to check)."""

    @classmethod
    def from_chunks(cls, chunk_blocks: Sequence[ChunkBlocks],
                    device: torch.device | str = "cpu") -> BlockMoves:
        """Moves for `chunk_blocks[k]` address chunk object number `k`."""
        rows = [(b, k, s) for k, cb in enumerate(chunk_blocks)
                for b, s in zip(cb.block_ids, cb.slots)]
        t = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).t().contiguous()
        if torch.device(device).type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
        # each row contiguous: the kernel indexes them flat
        return cls(t[0], t[1], t[2], max((r[2] for r in rows), default=-1))

    def __len__(self) -> int:
        return self.block_ids.numel()


class Launches:
    """Signatures of the kernel launches made (or, off CUDA, that would be made).
    Those seen while `warming` are covered; a later launch of another signature makes
    Triton compile in a request's time, and counts in `stats` as `cold_launches`."""

    def __init__(self, stats=None):
        self.stats = stats
        self.covered: set[tuple] = set()
        self._warming = False

    @contextmanager
    def warming(self):
        self._warming = True
        try:
            yield
        finally:
            self._warming = False

    def record(self, signature: tuple) -> None:
        if self._warming:
            self.covered.add(signature)
        elif signature not in self.covered and self.stats is not None:
            self.stats.add("cold_launches", 1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as an integer tensor: copies are bit-exact and work for fp8."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


def _blocks_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """View a layer cache as [blocks, pieces, tokens, heads, K|V], whatever its strides.

    vLLM may split a block into kernel blocks: `cache` is then
    [blocks * pieces, heads, block_size / pieces, K|V] with uniform strides.
    """
    nb_pieces, heads, piece_tokens, width = cache.shape
    pieces = block_size // piece_tokens
    v = cache.unflatten(0, (nb_pieces // pieces, pieces))  # [B, P, H, N, C]
    return v.permute(0, 1, 3, 2, 4)  # [B, P, N, H, C]


def _check(group: KVGroup, caches: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor],
           moves: BlockMoves) -> None:
    if len(caches) != len(group.layers):
        raise ValueError(f"group {group.group_id} has {len(group.layers)} layers, "
                         f"got {len(caches)} caches")
    tokens = chunks[0].shape[2] if chunks else 0
    for ch in chunks:
        if tuple(ch.shape) != group.chunk_shape(tokens) or ch.dtype != group.dtype:
            raise ValueError(f"chunk object {tuple(ch.shape)} {ch.dtype} does not match "
                             f"group {group.group_id}: {group.chunk_shape(tokens)} {group.dtype}")
    if not len(moves):
        return
    top = moves.max_slot if moves.max_slot is not None else int(moves.slots.max())
    if top >= tokens // group.block_size:
        raise ValueError("a block slot lies outside the chunk object")


def torch_gather(group: KVGroup, caches: Sequence[torch.Tensor],
                 chunks: Sequence[torch.Tensor], moves: BlockMoves) -> None:
    """Reference: copy the moved blocks of every layer into the chunk objects."""
    _check(group, caches, chunks, moves)
    hd, bs = group.head_size, group.block_size
    for layer, cache in enumerate(caches):
        blocks = _blocks_view(_bits(cache), bs)[moves.block_ids.to(cache.device)]
        blocks = blocks.reshape(len(moves), bs, group.num_kv_heads, 2 * hd)
        for kv in range(2):
            part = blocks[..., kv * hd:(kv + 1) * hd].reshape(len(moves), bs, -1)
            for i in range(len(moves)):
                c, s = int(moves.chunk_index[i]), int(moves.slots[i])
                _bits(chunks[c])[kv, layer, s * bs:(s + 1) * bs] = part[i].to(chunks[c].device)


def torch_scatter(group: KVGroup, caches: Sequence[torch.Tensor],
                  chunks: Sequence[torch.Tensor], moves: BlockMoves) -> None:
    """Reference: copy the moved blocks of every layer back into vLLM's caches."""
    _check(group, caches, chunks, moves)
    hd, bs, heads = group.head_size, group.block_size, group.num_kv_heads
    for layer, cache in enumerate(caches):
        view = _blocks_view(_bits(cache), bs)  # [B, P, N, H, C]
        pieces = view.shape[1]
        for i in range(len(moves)):
            c, s, b = int(moves.chunk_index[i]), int(moves.slots[i]), int(moves.block_ids[i])
            for kv in range(2):
                src = _bits(chunks[c])[kv, layer, s * bs:(s + 1) * bs].reshape(
                    pieces, bs // pieces, heads, hd)
                view[b, :, :, :, kv * hd:(kv + 1) * hd] = src.to(cache.device)


def _kernel_fits(group: KVGroup) -> bool:
    hd = group.head_size
    return hd & (hd - 1) == 0


def _use_triton(caches: Sequence[torch.Tensor], group: KVGroup) -> bool:
    return caches[0].is_cuda and _kernel_fits(group)


def gather(group: KVGroup, caches: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor],
           moves: BlockMoves, num_programs: int | None = None,
           launches: Launches | None = None) -> None:
    """Caches -> chunk objects; the Triton kernel on CUDA, the reference elsewhere."""
    _move(group, caches, chunks, moves, num_programs, launches, to_chunk=True)


def scatter(group: KVGroup, caches: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor],
            moves: BlockMoves, num_programs: int | None = None,
            launches: Launches | None = None) -> None:
    """Chunk objects -> caches; the Triton kernel on CUDA, the reference elsewhere."""
    _move(group, caches, chunks, moves, num_programs, launches, to_chunk=False)


def scatter_by_layer(group: KVGroup, caches: Sequence[torch.Tensor],
                     chunks: Sequence[torch.Tensor], moves: BlockMoves,
                     num_programs: int | None = None, launches: Launches | None = None):
    """Chunk objects -> caches, one layer at a time: returns `load(position)` that
    queues layer `caches[position]`'s copy on the current stream. Without the Triton
    kernel, the first call scatters every layer."""
    if not len(moves):
        return lambda position: None
    if not _use_triton(caches, group):
        done: list[int] = []

        def load_all(position: int) -> None:
            if not done:
                scatter(group, caches, chunks, moves, launches=launches)
                done.append(position)
        return load_all
    copy = _block_copy(group, caches, chunks, moves, num_programs, to_chunk=False)
    # The layer range is not specialised on: one signature for every layer's launch.
    signature = copy.signature(range(0, 1)) if launches is not None else ()

    def load(position: int) -> None:
        if launches is not None:
            launches.record(signature)
        copy.launch(range(position, position + 1))
    return load


def _block_copy(group, caches, chunks, moves, num_programs, *, to_chunk: bool):
    """The checked Triton launch between a group's caches and chunk objects."""
    from gemma4_kv.kernels import BlockCopy

    _check(group, caches, chunks, moves)
    kw = {} if num_programs is None else {"num_programs": num_programs}
    return BlockCopy(caches, chunks, moves.block_ids, moves.chunk_index, moves.slots,
                     block_size=group.block_size, head_size=group.head_size,
                     to_chunk=to_chunk, **kw)


def _move(group, caches, chunks, moves, num_programs, launches, *, to_chunk: bool) -> None:
    if not len(moves):
        return
    copy = None
    if _kernel_fits(group) and (launches is not None or caches[0].is_cuda):
        copy = _block_copy(group, caches, chunks, moves, num_programs, to_chunk=to_chunk)
        if launches is not None:
            launches.record(copy.signature())
    if copy is None or not _use_triton(caches, group):  # (_use_triton: copy is built)
        (torch_gather if to_chunk else torch_scatter)(group, caches, chunks, moves)
        return
    copy.launch()
