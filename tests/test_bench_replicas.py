"""Smoke test of benchmarks/bench_replicas.py on vLLM's CPU build (`--smoke`: the tiny
Gemma 4, 4 documents of 2048 + 16 tokens, 2 replicas serving at once), systems `alone` and
`server` only. Checks the benchmark's bookkeeping, not its timings: the JSON's structure,
round 2 (each replica asks the other's documents) served from the shared `lmcache server`
and not at all when each replica has only its own tier (the negative control), and the
round-2 greedy tokens equal to the cold ones (float32 on the CPU). One run of ~45 s on 2
cores (75 s when they were busy), beside other modules' engines (tests/conftest.py
`engine_pool`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from needs import require

from e2e_common import run_group

require("vllm")
pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_replicas.py"
TEST = "test_replicas_benchmark_runs_on_cpu"


def engine_jobs(tmp_path_factory, selected):
    def job():
        tmp = tmp_path_factory.mktemp("replicas")
        env = dict(os.environ)
        env.setdefault("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
        out = tmp / "out"
        proc = run_group([sys.executable, str(BENCH), "--smoke", "--systems", "alone,server",
                          "--out", str(out)], env=env, timeout=300)
        return proc, out

    def valkey_job():
        tmp = tmp_path_factory.mktemp("replicas-valkey")
        env = dict(os.environ)
        env.setdefault("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
        out = tmp / "out"
        proc = run_group([sys.executable, str(BENCH), "--smoke", "--systems", "resp",
                          *VALKEY_ARGS, "--out", str(out)], env=env, timeout=300)
        return proc, out

    jobs = [("smoke", 40.0, job, 2)] if TEST in selected else []  # 2 engines at once
    if VALKEY_TEST in selected:
        jobs.append(("valkey", 30.0, valkey_job, 2))
    return jobs


VALKEY_TEST = "test_replicas_share_through_resp_when_their_cpu_tier_is_tight"
VALKEY_ARGS = ("--doc-len", "7936", "--docs", "8", "--batch", "4", "--kv-cache-gb", "0.1",
               "--valkey-cpu-gb", "0.055")
"""Each replica's 4 documents (31 chunks, 9.06 MB of hit each) fill 37 MB of its 59 MB
CPU tier, and each asks for 4 of the other's at once: 36 MB more, so 3 of its own
(each asked as often as the new ones) must go for the 4 hits to be brought up."""


def test_replicas_benchmark_runs_on_cpu(engine_pool):
    proc, out = engine_pool.result((__name__, "smoke"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "replicas.json").read_text())
    meta = summary["meta"]
    for key in ("device", "date", "command", "git_commit", "sizes", "replicas"):
        assert key in meta
    assert meta["replicas"] == 2 and meta["device"] == "CPU"
    assert "tiny" in meta["sizes"]
    assert "r2 tokens = cold" in proc.stdout  # the table
    runs = {r["system"]: r for r in summary["runs"]}
    assert set(runs) == {"alone", "server"}
    for system, run in runs.items():
        assert run["done"], run.get("error")
        rounds = run["rounds"]
        assert [r["round"] for r in rounds] == [1, 2, 3]
        for r in rounds:
            assert len(r["replicas"]) == 2
            assert r["prompt_tokens"] == sum(x["prompt_tokens"] for x in r["replicas"]) > 0
            assert r["store_tokens"] == sum(x["store_tokens"] for x in r["replicas"])
            assert r["wall_s"] == max(x["wall_s"] for x in r["replicas"])
            assert all(len(x["requests_detail"]) == 2 for x in r["replicas"])
        assert rounds[0]["store_tokens"] == 0  # cold
        # Round 2 asks each replica the other's round-1 prompts: the same greedy tokens.
        assert run["tokens"] == dict(compared=4, differ=0, identical=True)
        cell = summary["cells"]["tiny"][system]
        assert cell["runs"] == 1 and cell["tokens_identical"]
        assert [c["hit_share"]["n"] for c in cell["rounds"]] == [1, 1, 1]
    # The shared server serves the other replica's documents; alone, nothing does.
    server2 = runs["server"]["rounds"][1]
    assert server2["store_tokens"] > 0, [r["counters"] for r in server2["replicas"]]
    assert runs["alone"]["rounds"][1]["store_tokens"] == 0
    # Alone, a replica's own documents come back from its own tier in round 3.
    assert runs["alone"]["rounds"][2]["store_tokens"] > 0


def test_replicas_share_through_resp_when_their_cpu_tier_is_tight(engine_pool):
    """The `resp` row (each replica's embedded store, one shared Valkey as its L2 tier
    through the `resp` adapter: LMCache's C++ client under gemma4-kv's RespClient; the
    `valkey` adapter's row differs only in the client, and test_e2e_hosts runs it
    through vLLM) with CPU tiers too small for both halves (`VALKEY_ARGS`): round 2 asks
    each replica the other's documents, 4 in flight. Every hit must come up from Valkey
    into a full CPU tier, its objects of two sizes in one batch. On e51c6e5 the `valkey`
    row hit 24.9 %: the 4 lookups in flight were each told the same free room (one
    landed), and in a fuller tier a tie with the replica's own documents refused the
    room outright (0 %, as on the H200 on 2026-12-04). The control that nothing else
    serves round 2 is the `alone` row above (0 tokens)."""
    proc, out = engine_pool.result((__name__, "valkey"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run, = json.loads((out / "replicas.json").read_text())["runs"]
    assert run["done"], run.get("error")
    cold, second = run["rounds"][0], run["rounds"][1]
    assert cold["store_tokens"] == 0
    # 4 documents of 7936 + 16 tokens per replica; a hit ends at the last full chunk
    # boundary before the question (7936 - 256 = 7680, or the prompt's last multiple of
    # 64 below it): at least 7680 of each 7952-token prompt.
    assert second["prompt_tokens"] == 8 * 7952
    assert second["store_tokens"] >= 8 * 7680, [r["counters"] for r in second["replicas"]]
    assert run["tokens"] == dict(compared=8, differ=0, identical=True)
