"""Smoke test of benchmarks/bench_serving.py on vLLM's CPU build: the tiny Gemma 4, every
scenario at a tiny size, systems none and gemma4-kv (the OffloadingConnector needs CUDA
and must be skipped with a message). Checks the benchmark's bookkeeping against what the
connector must do, not its timings."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from e2e_common import run_group

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py"


def test_serving_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "serving"
    cmd = [sys.executable, str(BENCH), "--tiny", "--inproc", "--parallel", "--out", str(out),
           "--systems", "none,gemma4-kv,offloading", "--fits-rounds", "2", "--over-docs", "3",
           "--over-rounds", "2", "--chat-turns", "2", "--settle-s", "0.1"]
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    proc = run_group(cmd, env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "target fits_cold_vs_none" in proc.stdout  # the table and the targets
    summary = json.loads((out / "serving.json").read_text())
    systems = summary["systems"]
    assert "skipped" in systems["offloading"]["skipped"]
    assert "needs CUDA" in systems["offloading"]["skipped"]
    none, ours = systems["none"], systems["gemma4-kv"]
    assert none["done"] and ours["done"]
    sizes = ours["sizes"]

    for r in (none, ours):
        for name, n in (("fits", 2), ("over", 2), ("chat", 2)):
            rounds = r["scenarios"][name]["rounds"]
            assert [x["kind"] for x in rounds] == ["cold"] + ["warm"] * (n - 1)
            assert rounds[0]["store_share"] == 0
            assert all(x["requests"] == len(x["req"]) > 0 for x in rounds)
            assert all(q["ttft_from_metrics"] for x in rounds for q in x["req"])
    assert all(x["store_tokens"] == 0 for sc in none["scenarios"].values()
               for x in sc["rounds"])

    # Cold long-doc round: each document stored once, as the planner retains it.
    fits = ours["scenarios"]["fits"]["rounds"]
    assert fits[0]["stored_bytes"] == sizes["fits_docs"] * sizes["doc_retained_bytes"]
    # Warm: the whole document is a hit (store and vLLM's own cache together), and the
    # store's share agrees with the connector's own load records.
    doc = summary["meta"]["args"]["doc_len"]
    warm = fits[1]
    assert warm["store_share"] > 0
    assert warm["store_tokens"] + warm["gpu_tokens"] == warm["requests"] * doc
    assert warm["store_tokens"] == warm["store_tokens_from_loads"]
    assert warm["stored_bytes"] == 0 and warm["loaded_bytes"] > 0

    # Chat: the second turn's hit reaches into the first turn's answer.
    chat = ours["scenarios"]["chat"]["rounds"]
    assert chat[1]["includes_answer"] == 1.0 and chat[1]["covers_history"] == 1.0
    assert summary["targets"]["chat_turns_hit_answers"]["met"]

    # First tokens: the same as without a connector (CPU float32), and repeated prompts
    # give the token they gave the first time.
    ex = summary["exactness"]["gemma4-kv"]
    assert ex["compared_with_none"] > 0 and ex["differ_from_none"] == 0
    assert ex["repeated_prompts"] == 0 or ex["differ_from_first_time"] == 0
