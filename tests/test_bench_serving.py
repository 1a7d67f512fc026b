"""Smoke test of benchmarks/bench_serving.py on vLLM's CPU build: the tiny Gemma 4, every
scenario at a tiny size, systems none and gemma4-kv (the OffloadingConnector needs CUDA
and must be skipped with a message). Checks the benchmark's bookkeeping against what the
connector must do, not its timings: both runs go beside other modules' engines
(tests/conftest.py `engine_pool`), in the test run's vLLM cache (VLLM_CACHE_ROOT). The
chat and zipf run is the repeats check: `--repeats 2 --prime`, engines one at a time,
an untimed first engine, then none, gemma4-kv, none, gemma4-kv, every figure a median
with its range and the per-repeat values."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from needs import require

from e2e_common import run_group

require("vllm")
pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py"


SERVING_TEST = "test_serving_benchmark_runs_on_cpu"
REPEATS_TEST = "test_repeats_run_interleaved_after_an_untimed_engine"
LOOP_TEST = "test_a_loop_larger_than_the_cpu_tier_keeps_hitting_on_a_stable_subset"
ZIPF_TEST = "test_a_zipf_order_keeps_the_hot_documents"
RUNS = ("fits,over", "chat,zipf")
"""Scenario runs of the serving smoke test; `zipf` repeats prompts. "chat,zipf" runs
with 2 repeats after an untimed engine, its engines one at a time (REPEATED)."""
REPEATED = "chat,zipf"


def _bench(tmp_path, args):
    """bench_serving.py with `args`: (the finished process, its --out folder)."""
    out = tmp_path / "out"
    env = dict(os.environ)
    env.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    return run_group([sys.executable, str(BENCH), *args, "--out", str(out)], env=env,
                     timeout=400), out


def _loop_cpu_gb() -> float:
    doc = 2 * 270_336 + 5 * 135_168
    return 2.5 * doc / (1 << 30)


def engine_jobs(tmp_path_factory, selected):
    jobs = []
    for run in RUNS:
        if SERVING_TEST not in selected and not (run == REPEATED and REPEATS_TEST in selected):
            continue
        # Runs side by side (each starts its own engines): one run of all five
        # scenarios was the longest job of the test run (585 s on 2 cores).
        mode = (["--repeats", "2", "--prime"] if run == REPEATED  # 5 engines, one at a time
                else ["--parallel"])  # --parallel: 2 engines at once
        jobs.append((("serving", run), 130.0 if run == REPEATED else 70.0,
                     lambda run=run, mode=mode: _bench(
            tmp_path_factory.mktemp(f"serving-{run.replace(',', '-')}"), [
                "--tiny", "--inproc", *mode, "--systems",
                "none,gemma4-kv,offloading", "--scenarios", run, "--fits-rounds", "2",
                "--over-docs", "3", "--over-rounds", "2", "--chat-turns", "2",
                "--settle-s", "0.1"]), 1 if run == REPEATED else 2))
    if LOOP_TEST in selected:
        jobs.append(("loop", 60.0, lambda: _bench(tmp_path_factory.mktemp("loop"), [
            "--tiny", "--inproc", "--systems", "gemma4-kv", "--scenarios", "loop",
            "--docs", "4", "--loop-rounds", "3", "--cpu-gb", f"{_loop_cpu_gb():.9f}",
            "--warmup-docs", "1", "--settle-s", "0.1"])))
    if ZIPF_TEST in selected:
        # max_model_len 640 (one short chat turn): 81 blocks of GPU KV are then enough
        # for one request and hold nothing a later request can reuse
        jobs.append(("zipf-hot", 60.0, lambda: _bench(tmp_path_factory.mktemp("zipf"), [
            "--tiny", "--inproc", "--systems", "gemma4-kv", "--scenarios", "zipf",
            "--docs", "4", "--zipf-requests", "8", "--seed", "12",
            "--cpu-gb", f"{_loop_cpu_gb():.9f}", "--kv-cache-gb", "0.0025",
            "--chat-turns", "1", "--chat-history", "64", "--warmup-docs", "1",
            "--settle-s", "0.1"])))
    return jobs


def _summary(engine_pool, run) -> dict:
    proc, out = engine_pool.result((__name__, ("serving", run)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "serving.json").read_text())
    summary["stdout"] = proc.stdout
    return summary


def test_serving_benchmark_runs_on_cpu(engine_pool):
    by_run = {run: _summary(engine_pool, run) for run in RUNS}
    runs = {sc: s for run, s in by_run.items() for sc in run.split(",")}
    assert "target fits_cold_vs_none" in runs["fits"]["stdout"]  # the table and targets
    for summary in by_run.values():
        # First tokens: the same as without a connector (CPU float32), and a prompt
        # asked again gives the token it gave the first time.
        ex = summary["exactness"]["gemma4-kv"]
        assert ex["compared_with_none"] > 0 and ex["differ_from_none"] == 0
        assert ex["differ_from_first_time"] == 0
    assert by_run[REPEATED]["exactness"]["gemma4-kv"]["repeated_prompts"] > 0
    for sc in ("fits", "over", "chat"):
        summary = runs[sc]
        systems = summary["systems"]
        assert "skipped" in systems["offloading"]["skipped"]
        assert "needs CUDA" in systems["offloading"]["skipped"]
        none, ours = systems["none"], systems["gemma4-kv"]
        assert none["done"] and ours["done"]
        for run in none["runs"] + ours["runs"]:  # each repeat's own rounds
            rounds = run["scenarios"][sc]["rounds"]
            assert [x["kind"] for x in rounds] == ["cold", "warm"]
            assert rounds[0]["store_share"] == 0
            assert all(x["requests"] == len(x["req"]) > 0 for x in rounds)
            assert all(q["ttft_from_metrics"] for x in rounds for q in x["req"])
        assert all(x["store_tokens"] == 0 for run in none["runs"]
                   for x in run["scenarios"][sc]["rounds"])
    summary = runs["fits"]
    ours = summary["systems"]["gemma4-kv"]

    # Cold long-doc round: each document stored once. By hand, --tiny: 12 float32
    # layers of 1 KV head, 10 sliding (head 32, window 256: K and V, 256 bytes a token)
    # and 2 full (head 64: 512 bytes a token); a document of 512 + 16 tokens has 2
    # whole chunks and its hit ends at 512 (the retention interval 4096 adds no end), so
    # full layers keep both chunks, sliding ones the chunk holding tokens 257-511:
    # 2 * 256 * 2 * 512 + 1 * 256 * 10 * 256 = 1,179,648 bytes. Documents: 92 % of the
    # 0.01 GiB tier over the dense 512 * (10 * 256 + 2 * 512) bytes: floor(5.38) = 5.
    assert ours["sizes"]["fits_docs"] == 5
    fits = ours["runs"][0]["scenarios"]["fits"]["rounds"]
    assert fits[0]["stored_bytes"] == 5 * 1_179_648
    # Warm: the whole document is a hit (store and vLLM's own cache together), and the
    # store's share agrees with the connector's own load records.
    doc = summary["meta"]["args"]["doc_len"]
    warm = fits[1]
    assert warm["store_share"] > 0
    assert warm["store_tokens"] + warm["gpu_tokens"] == warm["requests"] * doc
    assert warm["store_tokens"] == warm["store_tokens_from_loads"]
    assert warm["stored_bytes"] == 0 and warm["loaded_bytes"] > 0

    # Chat: the second turn's hit reaches into the first turn's answer.
    for run in runs["chat"]["systems"]["gemma4-kv"]["runs"]:
        chat = run["scenarios"]["chat"]["rounds"]
        assert chat[1]["includes_answer"] == 1.0 and chat[1]["covers_history"] == 1.0
    assert runs["chat"]["targets"]["chat_turns_hit_answers"]["met"]


def _is_stat(x, raw: list) -> bool:
    """A figure over the repeats: its median and range, and the repeats' raw values."""
    return (set(x) >= {"median", "min", "max", "values"} and x["values"] == raw
            and x["min"] <= x["median"] <= x["max"]
            and x["min"] == min(raw) and x["max"] == max(raw))


def test_repeats_run_interleaved_after_an_untimed_engine(engine_pool):
    """`--repeats 2 --prime` for none and gemma4-kv (the OffloadingConnector is skipped
    on CPU): one untimed connector-free engine first, then the systems interleaved,
    A B A B, each a fresh engine; every reported figure a median with its [min, max]
    and the per-repeat values beside it, in the JSON and the printed table."""
    summary = _summary(engine_pool, REPEATED)
    out = summary["stdout"]
    started = re.findall(r"^== engine (\d+) \(([^)]*)\): (\S+):", out, re.M)
    assert [(what, s) for _, what, s in started] == [
        ("untimed warm-up", "none"), ("repeat 1/2", "none"), ("repeat 1/2", "gemma4-kv"),
        ("repeat 2/2", "none"), ("repeat 2/2", "gemma4-kv")]
    assert [int(n) for n, _, _ in started] == list(range(5))
    assert [(e["system"], e["repeat"], e["timed"]) for e in summary["engines"]] == [
        ("none", None, False), ("none", 0, True), ("gemma4-kv", 0, True), ("none", 1, True),
        ("gemma4-kv", 1, True)]
    prime = summary["prime"]
    assert prime["timed"] is False and prime["done"] and prime["system"] == "none"
    assert summary["meta"]["repeats"] == 2 and "median [min-max]" in out
    for s in ("none", "gemma4-kv"):
        r = summary["systems"][s]
        assert r["done"] and r["repeats"] == 2
        assert [x["repeat"] for x in r["runs"]] == [0, 1]
        assert [x["engine"] for x in r["runs"]] == ([1, 3] if s == "none" else [2, 4])
        for key in ("startup_s", "warmup_s", "process_s"):
            assert _is_stat(r[key], [x[key] for x in r["runs"]]), key
        for sc in ("chat", "zipf"):
            rounds = r["scenarios"][sc]["rounds"]
            raw = [x["scenarios"][sc]["rounds"] for x in r["runs"]]
            assert len(rounds) == len(raw[0]) == len(raw[1]) > 1
            for k, rd in enumerate(rounds):
                assert rd["repeats"] == 2
                for key in ("wall_s", "ttft_mean_s", "ttft_p90_s", "store_share",
                            "gpu_share", "stored_bytes", "loaded_bytes"):
                    assert _is_stat(rd[key], [x[k][key] for x in raw]), (s, sc, k, key)
                host = rd.get("connector_ms_per_step")
                if s == "gemma4-kv":  # the connector's host time per step kind
                    assert host and "worker" in host and "scheduler" in host
                    for kind, v in host.items():
                        assert v["values"] == [(x[k]["connector_ms_per_step"] or {}).get(kind)
                                                for x in raw], kind
                else:
                    assert not host
    assert summary["exactness"]["gemma4-kv"]["repeats"] == 2
    hits = summary["targets"]["chat_turns_hit_answers"]
    assert hits["met"] and hits["value"]["values"] == [1.0, 1.0]
    assert re.search(r"^chat +gemma4-kv +0 cold +\S+( \[\S+-\S+\])? ", out, re.M)


def test_a_loop_larger_than_the_cpu_tier_keeps_hitting_on_a_stable_subset(engine_pool):
    """The tier sweep's looping order through vLLM's CPU build (bench_serving `loop`):
    4 tiny documents of 512 tokens + a 16-token question, 3 rounds in one order, a CPU
    tier of 2.5 documents as this connector keeps them. Worked out by hand: each
    document's hit is its 2 full chunks (512 tokens) and needs, in LMCache's L1 (4 KiB
    allocation units), 2 full-attention objects (266,240 bytes, padded to twice the
    sliding object: 270,336) and one window chunk of each of the 5 sliding groups,
    135,168 bytes each: 1,216,512 bytes. Two fit; the
    third and fourth, asked as often as those, evict nothing. So every warm round serves
    2 x 512 of its 4 x 528 prompt tokens from the store, and always the same two
    documents (LRU, in the same loop, would serve none)."""
    proc, out = engine_pool.result((__name__, "loop"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rounds = json.loads((out / "serving.json").read_text())[
        "systems"]["gemma4-kv"]["runs"][0]["scenarios"]["loop"]["rounds"]
    assert [r["kind"] for r in rounds] == ["cold", "warm", "warm"]
    for r in rounds[1:]:
        assert r["gpu_tokens"] == 0  # vLLM's GPU cache (LRU) holds less than the loop
        assert r["store_tokens"] == 2 * 512 and r["prompt_tokens"] == 4 * 528
    served = [{q["label"].split("q")[0] for q in r["req"] if q["cached"]} for r in rounds[1:]]
    assert served[0] == served[1] and len(served[0]) == 2  # the same two documents


def test_a_zipf_order_keeps_the_hot_documents(engine_pool):
    """bench_serving's `zipf` order through vLLM's CPU build: 8 requests over 4 tiny
    documents (512 tokens + a 16-token question), drawn with weights 1, 1/2, 1/3, 1/4
    (seed 12: documents 1 0 1 3 | 0 1 3 0, 2 in flight), a CPU tier of 2.5 documents
    as this connector keeps them (two fit, see the loop test), and a GPU KV cache of 81
    blocks that holds nothing a later request can reuse. Worked out by hand: documents
    1 and 0 are stored (room); document 1 hits (asked twice now); document 3, asked once
    as often as document 0, evicts nothing. Round 1: document 0 hits (twice now), 1 hits
    (three times), 3 is asked a second time but 0 and 1 are asked as often or more:
    nothing to evict; 0 hits. So the store serves 512 tokens to requests 3, 5, 6 and 8
    and the hot documents stay. (LRU keeping two documents evicts 0 for 3, then each
    document before it comes back: no hit in round 1.)"""
    proc, out = engine_pool.result((__name__, "zipf-hot"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rounds = json.loads((out / "serving.json").read_text())[
        "systems"]["gemma4-kv"]["runs"][0]["scenarios"]["zipf"]["rounds"]
    assert [[q["label"] for q in r["req"]] for r in rounds] == [
        ["d1q0", "d0q1", "d1q0", "d3q1"], ["d0q0", "d1q1", "d3q0", "d0q1"]]
    assert [[q["cached"] for q in r["req"]] for r in rounds] == [
        [0, 0, 512, 0], [512, 512, 0, 512]]
    for r in rounds:
        assert r["gpu_tokens"] == 0 and r["store_tokens"] == sum(q["cached"] for q in r["req"])
