"""Host side of `copy_blocks_kernel`: checks, offsets and the launch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .copy_blocks import NUM_WARPS, TILE_BYTES, copy_blocks_kernel

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

DEFAULT_PROGRAMS = 528
"""Four programs per SM of an H200: device-buffer gathers peak there (1845 GB/s one way,
87% of the device-to-device copy, against 1619 with 132). Reading or writing pinned host
memory is PCIe-bound from 32 programs on; callers that overlap compute pass fewer."""


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_WIDTH[t.element_size()])


def copy_blocks(caches: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor],
                block_ids: torch.Tensor, chunk_index: torch.Tensor, slots: torch.Tensor,
                *, block_size: int, head_size: int, to_chunk: bool,
                num_programs: int = DEFAULT_PROGRAMS, tile_bytes: int = TILE_BYTES,
                num_warps: int = NUM_WARPS) -> None:
    """Copy blocks `block_ids[i]` of every layer in `caches` to / from block slot
    `slots[i]` of chunk object `chunks[chunk_index[i]]` ([2, L, T, heads*head_size]).

    All caches share shape, strides and dtype (one vLLM group); all chunk objects
    share shape and dtype. Index tensors are int64 on the device of `caches`.
    """
    first = caches[0]
    nb, heads, piece_tokens, width2 = first.shape
    if width2 != 2 * head_size:
        raise ValueError(f"cache last dim {width2} != K + V of head size {head_size}")
    for c in caches:
        if c.shape != first.shape or c.stride() != first.stride() or c.dtype != first.dtype:
            raise ValueError("all layers of a group must share shape, strides and dtype")
    if first.stride(3) != 1:
        raise ValueError("the K|V channel dimension must be contiguous")
    pieces = block_size // piece_tokens
    shape = (2, len(caches), chunks[0].shape[2], heads * head_size)
    for ch in chunks:
        if tuple(ch.shape) != shape or ch.dtype != first.dtype or not ch.is_contiguous():
            raise ValueError(f"chunk objects must be contiguous {shape} {first.dtype}, "
                             f"got {tuple(ch.shape)} {ch.dtype}")
    n = block_ids.numel()
    if n == 0:
        return
    for t in (block_ids, chunk_index, slots):
        if t.dtype != torch.int64 or not t.is_contiguous() or t.numel() != n:
            raise ValueError("block_ids, chunk_index and slots must be contiguous int64 "
                             "tensors of one length")
    elt = first.element_size()
    cache_base, chunk_base = _as_int(first), _as_int(chunks[0])
    layer_off = [(c.data_ptr() - first.data_ptr()) // elt for c in caches]
    chunk_off = [(c.data_ptr() - chunks[0].data_ptr()) // elt for c in chunks]
    if any((c.data_ptr() - first.data_ptr()) % elt for c in caches):
        raise ValueError("layer tensors are not element-aligned to each other")
    s_block = first.stride(0) * pieces
    ints = layer_off + chunk_off + [s_block, first.stride(1), first.stride(2),
                                    first.stride(0), head_size]
    aligned = (all(v % 16 == 0 for v in ints) and first.data_ptr() % 16 == 0
               and chunks[0].data_ptr() % 16 == 0)
    dev = first.device
    layer_off_t = torch.tensor(layer_off, dtype=torch.int64).to(dev, non_blocking=True)
    chunk_off_t = torch.tensor(chunk_off, dtype=torch.int64).to(dev, non_blocking=True)
    n_units = n * 2 * len(caches)
    rows = max(1, min(block_size * heads, tile_bytes // (head_size * elt)))
    rows = 1 << (rows.bit_length() - 1)  # a power of two for tl.arange
    grid = (max(1, min(num_programs, n_units)),)
    copy_blocks_kernel[grid](
        cache_base, layer_off_t, chunk_base, chunk_off_t,
        block_ids, chunk_index, slots,
        n_units, len(caches), shape[2],
        s_block, first.stride(1), first.stride(2), first.stride(0), piece_tokens,
        HEADS=heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
        BLOCK_ROWS=rows, TO_CHUNK=to_chunk, ALIGNED=aligned, num_warps=num_warps,
    )
