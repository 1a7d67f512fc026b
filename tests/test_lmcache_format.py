"""Our chunk objects are LMCache's KV_2LTD objects: the same bytes as LMCache 0.5.6's
pure-torch reference (`mp_mem_kernels.multi_layer_block_kv_transfer`) produces, both
ways, from vLLM's per-layer cache [blocks, heads, tokens, K|V]."""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.transfer.mover import BlockMoves, torch_gather, torch_scatter
from paged import bits, make_paged, random_bits
from test_mover import make_group
from needs import require

lmc = require("lmcache.v1.platform.torch_ops.mp_mem_kernels")
native = require("lmcache.lmcache_native")


def shape_desc(layers, blocks, heads, block_size, head_size, dtype):
    sd = native.PageBufferShapeDesc()
    sd.nl, sd.nb, sd.bs, sd.nh, sd.hs = layers, blocks, block_size, heads, head_size
    sd.kv_size, sd.element_size = 2, torch.empty((), dtype=dtype).element_size()
    return sd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_objects_match_lmcache_reference(dtype):
    L, NB, H, BS, HS, CHUNK = 3, 12, 2, 8, 16, 32
    gen = torch.Generator().manual_seed(0)
    caches = make_paged(L, NB, H, BS, HS, dtype, "LBHNC", generator=gen)
    block_ids = [7, 2, 5, 9, 1, 11, 3, 4]  # a request's blocks, token order: 2 chunks
    per_chunk = CHUNK // BS
    group = make_group(L, H, BS, HS, dtype)

    # LMCache: K/V-split objects from a no-copy view [NB, 2, NH, BS, HS] of each layer.
    views = [c.view(NB, H, BS, 2, HS).permute(0, 3, 1, 2, 4) for c in caches]
    theirs = [random_bits(group.chunk_shape(CHUNK), dtype, generator=gen) for _ in range(2)]
    lmc.multi_layer_block_kv_transfer(
        views, theirs, block_ids, "cpu", native.TransferDirection.D2H,
        shape_desc(L, NB, H, BS, HS, dtype), CHUNK, native.EngineKVFormat.NL_X_NB_TWO_NH_BS_HS, 0)

    ours = [random_bits(group.chunk_shape(CHUNK), dtype, generator=gen) for _ in range(2)]
    idx = torch.arange(len(block_ids))
    moves = BlockMoves(torch.tensor(block_ids), idx // per_chunk, idx % per_chunk)
    torch_gather(group, caches, ours, moves)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ours, theirs))

    # And back: LMCache scatters our objects into fresh caches exactly as we do.
    fresh_theirs = make_paged(L, NB, H, BS, HS, dtype, "LBHNC", generator=gen)
    fresh_ours = [c.clone() for c in fresh_theirs]
    lmc.multi_layer_block_kv_transfer(
        [c.view(NB, H, BS, 2, HS).permute(0, 3, 1, 2, 4) for c in fresh_theirs], ours,
        block_ids, "cpu", native.TransferDirection.H2D, shape_desc(L, NB, H, BS, HS, dtype),
        CHUNK, native.EngineKVFormat.NL_X_NB_TWO_NH_BS_HS, 0)
    torch_scatter(group, fresh_ours, ours, moves)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(fresh_ours, fresh_theirs))
