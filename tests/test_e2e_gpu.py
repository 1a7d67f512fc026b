"""End to end on a CUDA GPU: vLLM (bf16, Triton attention) with the connector, the
Triton kernels moving the blocks layer by layer beside the forward, and the embedded
LMCache store. Run on the H200 by benchmarks/run_e2e_gpu.sh; skipped without a GPU.

Both engines run in vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1): in bf16 a
token's numbers otherwise depend on how many tokens share its step (cuBLAS split-K,
attention split-KV), so any prefix reuse - vLLM's own prefix cache included - can flip
the near-ties of a random-weight model's greedy tokens (measured by
benchmarks/numerics_gpu.py). With it, a hit must reproduce recomputation bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from needs import require
from e2e_common import (check_against_plan, run_engine, run_mtp_case, save_config,
                        tiny_gemma4_config)

pytestmark = [pytest.mark.cuda, pytest.mark.vllm]

BLOCK = 16
# A fixed 4 GiB KV cache (no memory profiling): the cases run side by side on one GPU.
ENGINE = {"dtype": "bfloat16", "block_size": BLOCK, "gpu_memory_utilization": 0.1,
          "kv_cache_memory_bytes": 4 << 30}
ENV = {"VLLM_BATCH_INVARIANT": "1"}
PRELOAD = ["vllm_standins"]  # benchmarks/: an op batch-invariant mode asks for
CHECK = {"dtype": torch.bfloat16, "block_size": BLOCK}
# Every group's page, by hand (vLLM makes them equal; K and V, 2 bytes a channel):
# tiny: full 16 tokens x 1 head x 64 = 4096 bytes, sliding (head 32) at 32 tokens;
# medium: sliding 16 x 4 heads x 256 = 65536, full (1 head of 512) at 32 tokens.
PAGE_BYTES = {"tiny": 4096, "tiny_kv_shared_chunked": 4096, "medium": 65536}
VARIANTS = {
    # head dims 32/64, window 100: sliding 32-token blocks, full 16
    "tiny": dict(window=100),
    # KV-shared layers, prefill split into 512-token steps
    "tiny_kv_shared_chunked": dict(window=100, kv_shared=4),
    # Gemma 4 head dims 256 / 512, 4 KV heads sliding, 1 full (31B-like ratio of pages)
    "medium": dict(window=512, hidden=1024, head_dim=256, global_head_dim=512, kv_heads=4,
                   attention_k_eq_v=True, num_global_key_value_heads=1),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpu_connector_matches_recomputation(tmp_path, variant):
    require("vllm")
    cfg = tiny_gemma4_config(**VARIANTS[variant])
    model = save_config(cfg, tmp_path / "model")
    engine = {**ENGINE, **({"max_num_batched_tokens": 512} if "chunked" in variant else {})}
    kw = dict(engine=engine, env=ENV, preload=PRELOAD)
    base, _ = run_engine(tmp_path, "base", model, connector=False, **kw)
    out, events = run_engine(tmp_path, "conn", model, connector=True, **kw)
    check_against_plan(cfg, events, out, base, page_bytes=PAGE_BYTES[variant], **CHECK)
    if variant != "medium":
        return
    # Negative control: the same hits with the blocks left unfilled must change tokens.
    broken, _ = run_engine(tmp_path, "broken", model, connector=True,
                           connector_class="SkipLoadConnector", **kw)
    assert broken["cached"] == out["cached"]
    assert any(broken["outputs"][i] != base["outputs"][i]
               for i, c in enumerate(out["cached"]) if c)


def test_gpu_mtp_outputs_and_acceptance_identical(tmp_path):
    require("vllm")
    run_mtp_case(tmp_path, engine=ENGINE, check={**CHECK, "page_bytes": PAGE_BYTES["tiny"]},
                 env=ENV, preload=PRELOAD)
