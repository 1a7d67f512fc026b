"""Descriptors from what vLLM really builds: its planner's KVCacheConfig for a tiny
Gemma 4 with KV-shared layers, and its allocator's per-layer views (groups overlaying
the same memory, kernel block splitting). Then a round trip through those views."""

from __future__ import annotations

import pytest
import torch

from needs import require

from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
from gemma4_kv.layout.from_hf import hf_layout, layer_specs
from gemma4_kv.layout.groups import UnsupportedLayout, from_vllm
from gemma4_kv.transfer.mover import BlockMoves, torch_gather, torch_scatter
from paged import bits

require("vllm")


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """(text config, vLLM config, KVCacheConfig) for a 12-layer model, 4 KV-shared."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    cfg = tiny_gemma4_config(kv_shared=4, window=100)
    model = save_config(cfg, tmp_path_factory.mktemp("model"))
    vc = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=2048),
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=KVTransferConfig(kv_connector="Gemma4KVConnector",
                                            kv_connector_module_path="gemma4_kv.connector",
                                            kv_role="kv_both"))
    specs = {}
    for name, s in layer_specs(cfg, dtype=torch.bfloat16, block_size=16)[0].items():
        kw = dict(block_size=16, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                  dtype=torch.bfloat16)
        specs[name] = (SlidingWindowSpec(sliding_window=s.window, **kw) if s.window
                       else FullAttentionSpec(**kw))

    def plan(layout: str):
        vc.cache_config.kv_cache_layout = layout
        return get_kv_cache_configs(vc, [specs], [8 << 20])[0]
    return cfg, plan


def allocate(kv_cache_config, layout, kernel_block_sizes, cfg):
    """vLLM's own allocator, then KV-shared layers point at their targets (as the
    model runner does)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout],
                           kernel_block_sizes)
    for shared, target in layer_specs(cfg)[1].items():
        kv[shared] = kv[target]
    return kv


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("split", [False, True], ids=["whole-blocks", "kernel-blocks"])
def test_descriptors_and_round_trip_on_vllm_allocation(planned, layout, split):
    cfg, plan = planned
    kcc = plan(layout)
    kernel = [16] * len(kcc.kv_cache_groups) if split else None  # 32-token blocks -> 2 x 16
    kv = allocate(kcc, layout, kernel, cfg)
    lay = from_vllm(kcc, kv)

    want = hf_layout(cfg, dtype=torch.bfloat16, block_size=16)
    assert [(g.kind, g.window, g.block_size, g.layers, g.aliases) for g in lay.groups] == \
           [(g.kind, g.window, g.block_size, g.layers, g.aliases) for g in want.groups]
    assert len(lay.aliases) == 4 and not lay.unknown_layers
    # Head dims 32 / 64: sliding pages are half the full ones, so sliding blocks are 32.
    sliding = lay.groups[0]
    assert (sliding.block_size, lay.groups[-1].block_size) == (32, 16)
    assert sliding.strides.kernel_block_size == (16 if split else 32)

    # Groups overlay one allocation; a block id belongs to one group at a time.
    buf = kv[lay.groups[0].layers[0]]
    base = buf.untyped_storage()
    assert all(kv[n].untyped_storage().data_ptr() == base.data_ptr()
               for g in lay.groups for n in g.layers)
    raw = torch.empty(0, dtype=torch.int8).set_(base).view(torch.int16)
    raw.copy_(torch.randint(-2**15, 2**15, raw.shape, dtype=torch.int16))
    before = raw.clone()
    gen = torch.Generator().manual_seed(0)
    ids = (torch.randperm(kcc.num_blocks - 1, generator=gen) + 1).split(3)
    saved = []
    for g, blocks in zip(lay.groups, ids):
        caches = [kv[n] for n in g.layers]
        moves = BlockMoves(blocks, torch.zeros(3, dtype=torch.int64), torch.arange(3))
        obj = torch.empty(g.chunk_shape(3 * g.block_size), dtype=g.dtype)
        torch_gather(g, caches, [obj], moves)
        saved.append((g, caches, moves, obj))
    raw.copy_(torch.randint(-2**15, 2**15, raw.shape, dtype=torch.int16))  # poison
    for g, caches, moves, obj in saved:
        torch_scatter(g, caches, [obj], moves)
    for g, caches, moves, _ in saved:
        for c in caches:
            for b in moves.block_ids.tolist():
                pieces = c.shape[0] // kcc.num_blocks
                rows = slice(b * pieces, (b + 1) * pieces)
                # the original bytes, read through the same view
                view = torch.as_strided(before.view(torch.bfloat16), c.shape, c.stride(),
                                        c.storage_offset())
                assert torch.equal(bits(c[rows]), bits(view[rows]))


def test_block_outermost_layout_is_refused_clearly(planned):
    cfg, plan = planned
    kcc = plan("BLHNC")  # vLLM packs layers per block: one uniform-type group per layer
    with pytest.raises(UnsupportedLayout, match="not supported"):
        from_vllm(kcc)
