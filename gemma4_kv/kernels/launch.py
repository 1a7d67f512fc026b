"""Host side of `copy_blocks_kernel`: checks, offsets and the launch."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from .copy_blocks import NOT_SPECIALISED, NUM_WARPS, TILE_BYTES, copy_blocks_kernel

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
KERNEL_PARAMETERS = tuple(inspect.signature(copy_blocks_kernel.fn).parameters)
_SPECIALISED = tuple(name not in NOT_SPECIALISED for name in KERNEL_PARAMETERS)
_TRITON_TYPE = {torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}

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
    `slots[i]` of chunk object `chunks[chunk_index[i]]` ([2, L, T, heads*head_size])."""
    BlockCopy(caches, chunks, block_ids, chunk_index, slots, block_size=block_size,
              head_size=head_size, to_chunk=to_chunk, num_programs=num_programs,
              tile_bytes=tile_bytes, num_warps=num_warps).launch()


def specialisation(value, specialise: bool = True) -> tuple:
    """What Triton 3.x keys a compiled variant on for one argument, in its own terms
    (`triton._C.libtriton.native_specialize_impl` with the base backend's rules, which
    the NVIDIA backend keeps): a tensor's element type and whether its address is a
    multiple of 16 bytes; an integer's width and, where specialised, 1 (a constant) or
    divisibility by 16. Our kernel takes only integer tensors and integers."""
    if isinstance(value, torch.Tensor):
        return (f"*{_TRITON_TYPE[value.dtype]}", "D" if value.data_ptr() % 16 == 0 else "")
    width = ("i32" if -2**31 <= value < 2**31 else "i64" if -2**63 <= value < 2**63
             else "u64")
    if not specialise:
        return (width, None)
    if value == 1:
        return ("constexpr", 1)
    return (width, "D" if value % 16 == 0 else "")


class BlockCopy:
    """A checked copy between one group's caches and chunk objects, launched for all
    layers at once or for one range of layers at a time (layer-by-layer loads).

    All caches share shape, strides and dtype (one vLLM group); all chunk objects
    share shape and dtype. Index tensors are int64 on the device of `caches`.
    """

    def __init__(self, caches: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor],
                 block_ids: torch.Tensor, chunk_index: torch.Tensor, slots: torch.Tensor,
                 *, block_size: int, head_size: int, to_chunk: bool,
                 num_programs: int = DEFAULT_PROGRAMS, tile_bytes: int = TILE_BYTES,
                 num_warps: int = NUM_WARPS):
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
        self.n = n = block_ids.numel()
        for t in (block_ids, chunk_index, slots):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.numel() != n:
                raise ValueError("block_ids, chunk_index and slots must be contiguous int64 "
                                 "tensors of one length")
        elt = first.element_size()
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
        rows = max(1, min(block_size * heads, tile_bytes // (head_size * elt)))
        self.num_layers, self.num_programs, self.chunk_tokens = len(caches), num_programs, shape[2]
        self._args = (  # keeps the offset tensors alive until the launches are queued
            _as_int(first), torch.tensor(layer_off, dtype=torch.int64).to(dev, non_blocking=True),
            _as_int(chunks[0]),
            torch.tensor(chunk_off, dtype=torch.int64).to(dev, non_blocking=True),
            block_ids, chunk_index, slots)
        self._strides = (s_block, first.stride(1), first.stride(2), first.stride(0), piece_tokens)
        self._meta = dict(HEADS=heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
                          BLOCK_ROWS=1 << (rows.bit_length() - 1),  # a power of two for tl.arange
                          TO_CHUNK=to_chunk, ALIGNED=aligned, num_warps=num_warps)
        self._meta_key = tuple(sorted(self._meta.items()))

    def arguments(self, layers: range | None = None) -> tuple:
        """The kernel's positional arguments (all but the constexprs) for
        `launch(layers)`, in its order."""
        layers = range(self.num_layers) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start <= layers.stop <= self.num_layers:
            raise ValueError(f"layers must be a contiguous range within {self.num_layers}")
        return (*self._args, self.n * 2 * len(layers), layers.start, len(layers),
                self.num_layers, self.chunk_tokens, *self._strides)

    def signature(self, layers: range | None = None) -> tuple:
        """The key Triton compiles `launch(layers)` under: (every argument's
        `specialisation`, the constexprs and num_warps). Computed from the arguments
        alone, so it is known on any device, launched or not."""
        return (tuple(map(specialisation, self.arguments(layers), _SPECIALISED)),
                self._meta_key)

    def launch(self, layers: range | None = None) -> None:
        """Queue the copy of `layers` (positions in `caches`; default all) on the
        current stream."""
        args = self.arguments(layers)
        n_units = args[len(self._args)]
        if n_units == 0:
            return
        grid = (max(1, min(self.num_programs, n_units)),)
        copy_blocks_kernel[grid](*args, **self._meta)
