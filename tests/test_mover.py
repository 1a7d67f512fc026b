"""Movers against a per-token oracle: random bits, poisoned destinations, every layout
and dtype, kernel blocks, repeated source blocks, null blocks left alone."""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.layout.groups import AttentionKind, KVGroup
from gemma4_kv.transfer.mover import (BlockMoves, gather, scatter, scatter_by_layer, torch_gather,
                             torch_scatter)
from paged import DTYPES, LAYOUTS, bits, make_paged, random_bits


def make_group(layers, heads, block_size, head_size, dtype, kind=AttentionKind.FULL):
    return KVGroup(group_id=0, kind=kind, window=None if kind is AttentionKind.FULL else 64,
                   block_size=block_size, num_kv_heads=heads, head_size=head_size,
                   head_size_v=head_size, dtype=dtype,
                   layers=tuple(f"l{i}" for i in range(layers)))


def oracle_block(cache, b, pieces, kv, head_size):
    """[block_size, heads * head_size] of block b, token by token."""
    piece_tokens = cache.shape[2]
    rows = []
    for n in range(piece_tokens * pieces):
        tok = cache[b * pieces + n // piece_tokens, :, n % piece_tokens,
                    kv * head_size:(kv + 1) * head_size]
        rows.append(bits(tok).reshape(-1))
    return torch.stack(rows)


def random_moves(num_blocks, n, chunks, slots_per_chunk, gen, distinct=False):
    """Random block ids (never the null block 0) to random distinct (chunk, slot)s."""
    blocks = (torch.randperm(num_blocks - 1, generator=gen)[:n] + 1 if distinct
              else torch.randint(1, num_blocks, (n,), generator=gen))
    places = torch.randperm(chunks * slots_per_chunk, generator=gen)[:n]
    return BlockMoves(blocks, places // slots_per_chunk, places % slots_per_chunk)


def run_case(layout, dtype, pieces, device, gather_fn, scatter_fn, chunk_device=None,
             layers=3, heads=2, block_size=8, head_size=16, num_blocks=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    chunk_device = chunk_device or device
    group = make_group(layers, heads, block_size, head_size, dtype)
    caches = make_paged(layers, num_blocks, heads, block_size, head_size, dtype, layout,
                        device, pieces, gen)
    slots_per_chunk, n_chunks = 4, 3
    moves = random_moves(num_blocks, 7, n_chunks, slots_per_chunk, gen)
    shape = group.chunk_shape(slots_per_chunk * block_size)
    chunks = [random_bits(shape, dtype, "cpu", gen) for _ in range(n_chunks)]  # poison
    chunks = [c.pin_memory() if chunk_device == "pinned" else c.to(chunk_device)
              for c in chunks]
    before = [bits(c).clone().cpu() for c in chunks]
    dev_moves = BlockMoves(*(t.to(device) for t in (moves.block_ids, moves.chunk_index,
                                                     moves.slots)))
    gather_fn(group, caches, chunks, dev_moves)
    if device == "cuda":
        torch.cuda.synchronize()
    written = torch.zeros(n_chunks, slots_per_chunk, dtype=torch.bool)
    for b, c, s in zip(*(t.tolist() for t in (moves.block_ids, moves.chunk_index, moves.slots))):
        written[c, s] = True
        for l, cache in enumerate(caches):
            for kv in range(2):
                want = oracle_block(cache.cpu(), b, pieces, kv, head_size)
                got = bits(chunks[c])[kv, l, s * block_size:(s + 1) * block_size].cpu()
                assert torch.equal(got, want), (layout, dtype, b, c, s, l, kv)
    for c in range(n_chunks):  # slots nobody moved keep the poison
        for s in range(slots_per_chunk):
            if not written[c, s]:
                sl = slice(s * block_size, (s + 1) * block_size)
                assert torch.equal(bits(chunks[c])[:, :, sl].cpu(), before[c][:, :, sl])

    # Scatter back into poisoned caches: moved blocks come back, others keep the poison.
    targets = random_moves(num_blocks, 7, n_chunks, slots_per_chunk, gen, distinct=True)
    poisoned = make_paged(layers, num_blocks, heads, block_size, head_size, dtype, layout,
                          device, pieces, gen)
    ref = [bits(p).clone().cpu() for p in poisoned]
    dev_targets = BlockMoves(*(t.to(device) for t in (targets.block_ids, targets.chunk_index,
                                                       targets.slots)))
    scatter_fn(group, poisoned, chunks, dev_targets)
    if device == "cuda":
        torch.cuda.synchronize()
    moved = set(targets.block_ids.tolist())
    for b, c, s in zip(*(t.tolist() for t in (targets.block_ids, targets.chunk_index,
                                               targets.slots))):
        for l in range(layers):
            for kv in range(2):
                got = oracle_block(poisoned[l].cpu(), b, pieces, kv, head_size)
                want = bits(chunks[c])[kv, l, s * block_size:(s + 1) * block_size].cpu()
                assert torch.equal(got, want)
    for l in range(layers):
        for b in set(range(num_blocks)) - moved:
            rows = slice(b * pieces, (b + 1) * pieces)
            assert torch.equal(bits(poisoned[l]).cpu()[rows], ref[l][rows])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pieces", [1, 2])
def test_reference_mover(layout, dtype, pieces):
    run_case(layout, dtype, pieces, "cpu", torch_gather, torch_scatter)


def _triton(to_chunk):
    from gemma4_kv.kernels import copy_blocks

    def fn(group, caches, chunks, moves):
        copy_blocks(caches, chunks, moves.block_ids, moves.chunk_index, moves.slots,
                    block_size=group.block_size, head_size=group.head_size,
                    to_chunk=to_chunk, num_programs=4)
    return fn


def _triton_by_layer(group, caches, chunks, moves):
    """The kernel launched one layer at a time, in a shuffled order (layer-wise loads)."""
    from gemma4_kv.kernels import BlockCopy

    copy = BlockCopy(caches, chunks, moves.block_ids, moves.chunk_index, moves.slots,
                     block_size=group.block_size, head_size=group.head_size, to_chunk=False,
                     num_programs=3)
    for layer in torch.randperm(len(caches), generator=torch.Generator().manual_seed(1)):
        copy.launch(range(int(layer), int(layer) + 1))


def _scatter_by_layer(group, caches, chunks, moves):
    load = scatter_by_layer(group, caches, chunks, moves, num_programs=5)
    for layer in reversed(range(len(caches))):
        load(layer)


TRITON_CASES = ([(lay, torch.bfloat16, 1) for lay in sorted(LAYOUTS)]
                + [("LBNHC", dt, 2) for dt in DTYPES] + [("BHLNC", torch.float8_e4m3fn, 2)])


@pytest.mark.parametrize("layout,dtype,pieces", TRITON_CASES, ids=str)
def test_triton_kernel_cpu_interpreter(layout, dtype, pieces):
    """The kernel itself, on CPU tensors under TRITON_INTERPRET=1 (CI has no GPU)."""
    if torch.cuda.is_available():
        pytest.skip("covered by the CUDA tests on GPU machines")
    run_case(layout, dtype, pieces, "cpu", _triton(True), _triton(False))


@pytest.mark.parametrize("layout,dtype",
                         [("LBNHC", torch.bfloat16), ("BHLNC", torch.float8_e4m3fn)], ids=str)
def test_triton_kernel_by_layer_cpu_interpreter(layout, dtype):
    if torch.cuda.is_available():
        pytest.skip("covered by the CUDA tests on GPU machines")
    run_case(layout, dtype, 2, "cpu", _triton(True), _triton_by_layer, layers=4)


def test_reference_by_layer_scatters_everything_once():
    run_case("LBNHC", torch.bfloat16, 1, "cpu", torch_gather, _scatter_by_layer)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_device", ["cuda", "pinned"])
@pytest.mark.parametrize("block_size,head_size,pieces", [(16, 256, 1), (32, 512, 2), (64, 256, 1)])
def test_triton_kernel_cuda(layout, dtype, chunk_device, block_size, head_size, pieces):
    run_case(layout, dtype, pieces, "cuda", gather, scatter, chunk_device=chunk_device,
             block_size=block_size, head_size=head_size, heads=2, layers=3, num_blocks=20)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernel_by_layer_cuda(layout, dtype):
    """Layer-wise loads from pinned memory, as the connector runs them."""
    run_case(layout, dtype, 2, "cuda", gather, _scatter_by_layer, chunk_device="pinned",
             block_size=32, head_size=512, heads=2, layers=4, num_blocks=20)


def test_reference_rejects_mismatched_chunk():
    group = make_group(2, 2, 8, 16, torch.bfloat16)
    caches = make_paged(2, 4, 2, 8, 16, torch.bfloat16)
    bad = [torch.empty(2, 2, 8, 16, dtype=torch.bfloat16)]  # width 16 != 2 heads * 16
    moves = BlockMoves(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="does not match"):
        torch_gather(group, caches, bad, moves)


def test_moves_built_from_a_plan_drive_the_kernel():
    """The connector's path: ChunkBlocks -> BlockMoves -> kernel (flat index tensors)."""
    from gemma4_kv.layout.plan import ChunkBlocks

    device = "cuda" if torch.cuda.is_available() else "cpu"
    group = make_group(2, 2, 8, 16, torch.bfloat16)
    caches = make_paged(2, 10, 2, 8, 16, torch.bfloat16, "LBNHC", device)
    plan = [ChunkBlocks(0, 0, (0, 1, 3), (5, 2, 7)), ChunkBlocks(0, 1, (2,), (9,))]
    moves = BlockMoves.from_chunks(plan, device)
    assert all(t.is_contiguous() for t in (moves.block_ids, moves.chunk_index, moves.slots))
    shape = group.chunk_shape(32)
    got = [random_bits(shape, torch.bfloat16).to(device) for _ in range(2)]
    want = [c.clone() for c in got]
    _triton(True)(group, caches, got, moves)
    torch_gather(group, caches, want, moves)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


@pytest.mark.parametrize("n,layers,pieces,offset", [(1, 3, 1, 0), (2, 3, 2, 0), (3, 1, 1, 0),
                                                    (4, 2, 1, 1)])
def test_launch_signature_is_tritons_key(n, layers, pieces, offset):
    """`BlockCopy.signature` gives every argument what Triton's own specialisation gives
    it (the oracle: triton's native_specialize_impl, as its launcher calls it): an odd
    number of moves leaves the chunk numbers unaligned, one layer is a constant, a chunk
    object off a 16-byte boundary is unaligned."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from gemma4_kv.kernels import BlockCopy
    from gemma4_kv.kernels.copy_blocks import NOT_SPECIALISED
    from gemma4_kv.kernels.launch import KERNEL_PARAMETERS
    from gemma4_kv.layout.plan import ChunkBlocks

    group = make_group(layers, 2, 8, 16, torch.bfloat16)
    caches = make_paged(layers, 10, 2, 8, 16, torch.bfloat16, "LBNHC", "cpu", pieces)
    moves = BlockMoves.from_chunks([ChunkBlocks(0, 0, tuple(range(1, n + 1)), tuple(range(n)))])
    shape = group.chunk_shape(32)
    flat = torch.empty(torch.Size(shape).numel() + 8, dtype=torch.bfloat16)
    chunk = flat[offset:offset + torch.Size(shape).numel()].view(shape)
    copy = BlockCopy(caches, [chunk], moves.block_ids, moves.chunk_index, moves.slots,
                     block_size=8, head_size=16, to_chunk=True)
    for sub in (None, range(layers - 1, layers)):
        args = copy.arguments(sub)
        want = [native_specialize_impl(BaseBackend, a, False, name not in NOT_SPECIALISED,
                                       True) for name, a in zip(KERNEL_PARAMETERS, args)]
        assert list(copy.signature(sub)[0]) == want
        assert copy.signature(sub) == copy.signature()  # the layer range is not keyed on
    assert (want[KERNEL_PARAMETERS.index("chunk_index")][1] == "D") == (n % 2 == 0)
    assert (want[KERNEL_PARAMETERS.index("chunk_base")][1] == "D") == (offset == 0)
    assert (want[KERNEL_PARAMETERS.index("num_layers")] == ("constexpr", 1)) == (layers == 1)
