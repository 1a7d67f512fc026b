"""Preemption in real vLLM (CPU build): two prompts batched into a KV cache too small
for both, so vLLM's scheduler preempts one mid-prefill (it frees the request's blocks
and later computes it again from token 0, asking the connector for a hit). The
resumed request loads the chunks it stored before it was preempted; its greedy tokens
must equal those of the same prompt computed alone, and no rank may hold a pin when
the engine is idle."""

from __future__ import annotations

import random

import pytest

from e2e_common import run_engine, save_config, tiny_gemma4_config
from needs import require

require("vllm")
pytestmark = pytest.mark.vllm

BLOCK = 32  # sliding groups get 64-token blocks, full ones 32 (6 groups of 2 layers)
ENGINE = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 1280,
          "max_num_batched_tokens": 512, "long_prefill_token_threshold": 256,
          "num_gpu_blocks_override": 100, "scheduler_reserve_full_isl": False}
"""Both prompts prefill side by side, 256 tokens a step each (vLLM admits a request
when its first step fits), from one pool of 100 blocks: one 1280-token request fits
(vLLM checks), two 1100-token prompts do not, so vLLM preempts the later one while
they prefill (vLLM's KVCacheManager alone, driven 256 tokens at a time, runs out
when the first grows past 512)."""
MAX_TOKENS = 8
PREEMPTIONS = "vllm:num_preemptions"

_rng = random.Random(25)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(1100)] for _ in range(2)]
STEPS = [
    {"prompts": PROMPTS, "max_tokens": MAX_TOKENS},  # each alone: recomputed, no hit
    {"reset": True},                                  # what they stored cannot hit now
    {"prompts": PROMPTS, "batch": True, "max_tokens": MAX_TOKENS},  # one is preempted
    {"metrics": True},
    {"call": "engine_pins:pinned_requests"},
]


def engine_jobs(tmp_path_factory, selected):
    tmp = tmp_path_factory.mktemp("preemption")
    model = save_config(tiny_gemma4_config(window=100), tmp / "model")
    return [("conn", 60.0, lambda: run_engine(
        tmp, "conn", model, connector=True, engine=ENGINE, steps=STEPS,
        metrics=[PREEMPTIONS]))]


def test_a_preempted_request_loads_its_own_chunks_and_matches_recomputation(engine_pool):
    out, events = engine_pool.result((__name__, "conn"))
    alone, _, together, counters, pins = out["steps"]
    assert together["outputs"] == alone["outputs"]  # greedy tokens, exactly
    preemptions = sum(v for name, _, v in counters["result"] if name == PREEMPTIONS)
    assert preemptions >= 1
    # After the reset nothing the first step stored can hit, and the two prompts share
    # no chunk: every load is a preempted request reading what it saved itself. A hit
    # of an 1100-token prompt ends where sliding-window chunks are kept (RETENTION 512:
    # 512 and 1024, the longest): the longest of those its saves reached.
    loads = [e for e in events if e["event"] == "load"]
    assert loads, "no request was loaded after its preemption"
    for load in loads:
        rid = load["req_id"]
        saved = max((e["end"] for e in events[:events.index(load)]
                     if e["event"] == "save" and e["req_id"] == rid), default=0)
        ends = [e for e in (512, 1024) if e <= saved]
        assert ends, f"request {rid} loaded {load['end']} tokens but saved only {saved}"
        assert (load["start"], load["end"]) == (0, max(ends))
    assert pins["result"] == [[]]  # the one rank holds no pin
