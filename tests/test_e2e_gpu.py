"""End to end on a CUDA GPU: vLLM (bf16, Triton attention) with the connector, the
Triton kernels moving the blocks and the embedded LMCache store. Run on the H200 by
benchmarks/run_e2e_gpu.sh; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from e2e_common import (check_against_plan, run_engine, run_mtp_case, save_config,
                        tiny_gemma4_config)

pytestmark = [pytest.mark.cuda, pytest.mark.vllm]

BLOCK = 16
ENGINE = {"dtype": "bfloat16", "block_size": BLOCK, "gpu_memory_utilization": 0.3}
CHECK = {"dtype": torch.bfloat16, "block_size": BLOCK}
VARIANTS = {
    # head dims 32/64, window 100: sliding 32-token blocks, full 16
    "tiny": dict(window=100),
    "tiny_kv_shared": dict(window=100, kv_shared=4),
    # Gemma 4 head dims 256 / 512, 4 KV heads sliding, 1 full (31B-like ratio of pages)
    "medium": dict(window=512, hidden=1024, head_dim=256, global_head_dim=512, kv_heads=4,
                   attention_k_eq_v=True, num_global_key_value_heads=1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpu_connector_matches_recomputation(tmp_path, variant):
    pytest.importorskip("vllm")
    cfg = tiny_gemma4_config(**VARIANTS[variant])
    model = save_config(cfg, tmp_path / "model")
    base, _ = run_engine(tmp_path, "base", model, connector=False, engine=ENGINE)
    out, events = run_engine(tmp_path, "conn", model, connector=True, engine=ENGINE)
    check_against_plan(cfg, events, out, base, **CHECK)


def test_gpu_mtp_outputs_and_acceptance_identical(tmp_path):
    pytest.importorskip("vllm")
    base, out = run_mtp_case(tmp_path, engine=ENGINE, check=CHECK)
    assert out["spec_decode"] == base["spec_decode"]
    assert any(v for step in base["spec_decode"] for v in step.values())
