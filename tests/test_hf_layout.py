"""`hf_layout` reproduces vLLM's own grouping and block sizes for Gemma 4 shapes."""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.tools.cli import bundled_config, main
from gemma4_kv.layout.from_hf import hf_layout, layer_specs, load_text_config
from gemma4_kv.layout.groups import AttentionKind
from needs import require

SHAPES = ["gemma4-31b-like", "gemma4-12b-like", "gemma4-e4b-like", "gemma4-e2b-like"]


def vllm_groups(text_config, dtype, block_size):
    """Groups from vLLM's own planner for the specs these layers register."""
    require("vllm")
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    specs, _ = layer_specs(text_config, dtype=dtype, block_size=block_size)
    vspecs = {}
    for name, s in specs.items():
        kw = dict(block_size=block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                  dtype=dtype)
        vspecs[name] = (SlidingWindowSpec(sliding_window=s.window, **kw)
                        if s.kind is AttentionKind.SLIDING else FullAttentionSpec(**kw))
    config = VllmConfig(cache_config=CacheConfig(block_size=block_size))
    config.cache_config.kv_cache_layout = "LBNHC"
    return get_kv_cache_groups(config, vspecs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,block_size", [(torch.bfloat16, 16), (torch.float8_e4m3fn, 32)],
                         ids=["bf16-16", "fp8-32"])
def test_matches_vllm_grouping(shape, dtype, block_size):
    cfg = load_text_config(bundled_config(shape))
    ours = hf_layout(cfg, dtype=dtype, block_size=block_size)
    theirs = vllm_groups(cfg, dtype, block_size)
    assert len(ours.groups) == len(theirs)
    for g, v in zip(ours.groups, theirs):
        spec = v.kv_cache_spec
        assert list(g.layers) == v.layer_names
        assert g.block_size == spec.block_size
        assert g.num_kv_heads == spec.num_kv_heads and g.head_size == spec.head_size
        assert g.page_bytes == spec.page_size_bytes
        assert (g.kind is AttentionKind.SLIDING) == (type(spec).__name__ == "SlidingWindowSpec")


def test_block_sizes_follow_page_unification():
    b31 = hf_layout(load_text_config(bundled_config("gemma4-31b-like")))
    e4b = hf_layout(load_text_config(bundled_config("gemma4-e4b-like")))
    kinds = lambda lay: {g.kind: g.block_size for g in lay.groups}  # noqa: E731
    assert kinds(b31) == {AttentionKind.SLIDING: 16, AttentionKind.FULL: 32}
    assert kinds(e4b) == {AttentionKind.SLIDING: 32, AttentionKind.FULL: 16}


def test_kv_shared_layers_alias_the_last_owning_layer_of_their_type():
    cfg = load_text_config(bundled_config("gemma4-e4b-like"))
    lay = hf_layout(cfg)
    aliases = lay.aliases
    assert len(aliases) == cfg.num_kv_shared_layers
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    owned = {n for g in lay.groups for n in g.layers}
    assert len(owned) == first_shared
    for layer, owner in aliases.items():
        assert owner in owned and layer not in owned
        i, j = (int(n.split(".")[2]) for n in (layer, owner))
        assert cfg.layer_types[i] == cfg.layer_types[j] and j < first_shared


def test_mtp_assistant_layers_alias_targets(tmp_path):
    import transformers

    target = load_text_config(bundled_config("gemma4-31b-like"))
    assistant = transformers.Gemma4TextConfig(
        num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"])
    lay = hf_layout(target, assistant_config=assistant)
    drafts = {a: o for a, o in lay.aliases.items() if a.startswith("draft_model.")}
    assert drafts == {f"draft_model.layers.{j}.self_attn.attn":
                      f"model.layers.{58 if j < 3 else 59}.self_attn.attn" for j in range(4)}


def test_inspect_cli_prints_table(capsys):
    assert main(["inspect", "gemma4-e2b-like"]) == 0
    out = capsys.readouterr().out
    assert "sliding" in out and "full" in out and "aliased" in out
    assert "17,408 bytes of KV per token" in out
