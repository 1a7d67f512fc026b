"""One Triton kernel that moves the blocks of all owning layers of a KV cache group
between vLLM's paged per-layer tensors and LMCache-shaped chunk objects.

Paged side: layer `l` is a strided view, logical [block, head, token, K|V]; a block
may be split into `piece_tokens`-token pieces `s_piece` apart (vLLM's kernel blocks).
Chunk side: object `c` is KV_2LTD, [2, layers, tokens, heads * head_size], contiguous;
it may live in device memory or in pinned host memory (UVA: the kernel reads or
writes it directly over PCIe).

Work unit = (block move, K or V, layer): it copies `block_size * heads` rows of
`head_size` contiguous elements. A launch may move a range of the group's layers only
(loads go layer by layer so the forward can start on the first layers). A persistent
grid of `num_programs` programs strides over the units, so the SM budget is a launch
argument. Elements are moved as
integers of the same width: bit-exact for every dtype (fp8, bf16, fp16, fp32).
Addresses are int64 element offsets from the first layer / first object, so the
kernel knows the base pointers' 16-byte alignment and can vectorise.
"""

import triton
import triton.language as tl

# Tuned on the H200 (benchmarks/results/sweep_kernel_h200.json, 31B-like shape, 8K
# tokens): 16 KiB per iteration with 8 warps keeps enough loads in flight; 8 KiB with
# 4 warps left the device-buffer gather at 1228-1286 GB/s instead of 1845.
TILE_BYTES = 16384
"""Bytes a program moves per loop iteration (rows x head_size)."""
NUM_WARPS = 8
NOT_SPECIALISED = ("n_units", "first_layer", "moved_layers")


# Sizes that change from launch to launch are not specialised on (no recompiles).
@triton.jit(do_not_specialize=list(NOT_SPECIALISED))
def copy_blocks_kernel(
    cache_base, layer_offsets,  # first layer's tensor; int64 [L] element offsets
    chunk_base, chunk_offsets,  # first chunk object; int64 [C] element offsets
    block_ids, chunk_index, slots,  # int64 [n]: block -> (chunk, block slot)
    n_units, first_layer, moved_layers, num_layers, chunk_tokens,
    s_block, s_head, s_token, s_piece, piece_tokens,
    HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, TO_CHUNK: tl.constexpr, ALIGNED: tl.constexpr,
):
    rows_per_block: tl.constexpr = BLOCK_SIZE * HEADS
    width: tl.constexpr = HEADS * HEAD_SIZE
    cols = tl.arange(0, HEAD_SIZE)
    r = tl.arange(0, BLOCK_ROWS)
    for unit in range(tl.program_id(0), n_units, tl.num_programs(0)):
        move = unit // (2 * moved_layers)
        kv = (unit // moved_layers) % 2
        layer = first_layer + unit % moved_layers
        block = tl.load(block_ids + move)
        chunk = tl.load(chunk_index + move)
        slot = tl.load(slots + move)
        src0 = tl.load(layer_offsets + layer) + block * s_block + kv * HEAD_SIZE
        dst0 = (tl.load(chunk_offsets + chunk)
                + ((kv * num_layers + layer) * chunk_tokens + slot * BLOCK_SIZE) * width)
        if ALIGNED:
            src0 = tl.multiple_of(src0, 16)
            dst0 = tl.multiple_of(dst0, 16)
        for r0 in range(0, rows_per_block, BLOCK_ROWS):
            row = r0 + r
            tok = row // HEADS
            head = row % HEADS
            paged = (src0 + (tok // piece_tokens) * s_piece + (tok % piece_tokens) * s_token
                     + head * s_head)
            dense = dst0 + tok * width + head * HEAD_SIZE
            mask = (row < rows_per_block)[:, None]
            p = cache_base + paged[:, None] + cols[None, :]
            d = chunk_base + dense[:, None] + cols[None, :]
            if TO_CHUNK:
                tl.store(d, tl.load(p, mask=mask), mask=mask)
            else:
                tl.store(p, tl.load(d, mask=mask), mask=mask)
