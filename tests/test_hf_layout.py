"""`hf_layout` reproduces vLLM's own grouping and block sizes for Gemma 4 shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


MODEL_SHAPES = ["gemma4-e4b-like", "gemma4-31b-like"]
"""KV-shared layers (e4b) and K = V full layers with their own KV head count (31b)."""


def _vllm_model_layers(tmp) -> dict:
    dirs = {}
    for shape in MODEL_SHAPES:
        cfg = load_text_config(bundled_config(shape))
        cfg.architectures = ["Gemma4ForCausalLM"]
        cfg.save_pretrained(tmp / shape)
        dirs[shape] = str(tmp / shape)
    tests = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "vllm_model_layers", "bfloat16", "16",
                           *dirs.values()], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(proc.stdout)
    return {shape: out[d] for shape, d in dirs.items()}


def engine_jobs(tmp_path_factory, selected):
    """vLLM's model, built in a process of its own (tests/vllm_model_layers.py), beside
    the engines of other modules (tests/conftest.py `engine_pool`): it computes no KV
    and meets no timeout, and alone it held the run up for ~45 s."""
    if "test_layer_specs_match_vllms_gemma4_model" not in selected:
        return []
    return [("layers", 30.0,
             lambda: _vllm_model_layers(tmp_path_factory.mktemp("vllm-model")))]


@pytest.fixture(scope="module")
def vllm_model_layers(engine_pool):
    """{shape: {layer: ...}} as vLLM's own Gemma 4 model registers them."""
    require("vllm")
    return engine_pool.result((__name__, "layers"))


@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_layer_specs_match_vllms_gemma4_model(vllm_model_layers, shape):
    """`layer_specs` (which every layout here starts from) against the specs and
    KV-sharing targets vLLM's own Gemma 4 model builds from the same config: windows,
    KV heads, head sizes, which layers share whose KV."""
    theirs = vllm_model_layers[shape]
    cfg = load_text_config(bundled_config(shape))
    specs, shared = layer_specs(cfg, dtype=torch.bfloat16, block_size=16)
    assert set(theirs) == set(specs) | set(shared)
    assert {n: v["target"] for n, v in theirs.items() if v["target"]} == shared
    for name, s in specs.items():
        v = theirs[name]
        assert v["target"] is None
        assert v["spec"] == ("SlidingWindowSpec" if s.kind is AttentionKind.SLIDING
                             else "FullAttentionSpec"), name
        assert (v["window"], v["num_kv_heads"], v["head_size"], v["dtype"]) == \
            (s.window, s.num_kv_heads, s.head_size, str(s.dtype)), name
    # The shapes exercise what differs between layers (not vacuous).
    kinds = {v["spec"] for v in theirs.values()}
    assert kinds == {"SlidingWindowSpec", "FullAttentionSpec"}
    assert len({v["head_size"] for v in theirs.values()}) == 2
    assert bool(shared) == (shape == "gemma4-e4b-like")


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
