"""End to end in real vLLM (CPU build) on one shared `lmcache server` that the test starts:

1. engines A and B (two processes, both alive) share it: B hits what A stored, A hits
   what B stored, greedy tokens identical to A's cold run (a recomputation: no hits);
2. A restarted (a new process, same configuration) still hits everything;
3. the server is killed while A serves: every later prompt is a miss, tokens are still
   identical, and no request stalls beyond LATENCY_SLACK_S over a cold one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from e2e_common import CHUNK, harness_command, save_config, stats_events, tiny_gemma4_config
from gemma4_kv.layout.from_hf import hf_layout
from lmcache_servers import Server

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

BLOCK = 32
WINDOW = 100
ENGINE = {"enforce_eager": True, "max_model_len": 4096, "dtype": "float32",
          "block_size": BLOCK}
TIMEOUT = 1.0  # lmcache_server_timeout_s
LATENCY_SLACK_S = 2 * TIMEOUT + 5.0
"""Stated bound: a request once the server is gone takes at most this much longer than
the slowest cold request of the same engine set-up (one lookup and one save may each
wait TIMEOUT once before the server counts as down; 5 s of noise on a shared 2-core
CI machine)."""

_rng = random.Random(11)
P = [[_rng.randrange(3, 500) for _ in range(1100)] for _ in range(2)]  # stored by A
Q = [[_rng.randrange(3, 500) for _ in range(800)] for _ in range(2)]  # stored by B


def hit(n: int) -> int:
    """Hit of a prompt of n tokens when all its chunks are stored (64: block multiple)."""
    return min(n // CHUNK * CHUNK, (n - 1) // 64 * 64)


def launch(tmp_path: Path, name: str, model: str, url: str, steps: list) -> tuple:
    stats = tmp_path / f"{name}.stats.jsonl"
    spec = {"model": model, "connector": True, "max_tokens": 6, "engine": ENGINE,
            "extra_config": {"lmcache_server": url, "lmcache_server_timeout_s": TIMEOUT,
                             "stats_file": str(stats)},
            "steps": steps}
    cmd, env, out_path = harness_command(tmp_path, name, spec)
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, out_path, stats, tmp_path / f"{name}.log"


def finish(run: tuple, timeout: float = 600) -> tuple[dict, list]:
    proc, out_path, stats, log = run
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, log.read_text()[-8000:]
    return json.loads(out_path.read_text()), stats_events(stats)


def wait_for(path: Path, run: tuple, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert run[0].poll() is None, run[3].read_text()[-8000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_engines_share_one_lmcache_server(tmp_path):
    cfg = tiny_gemma4_config(window=WINDOW)
    model = save_config(cfg, tmp_path / "model")
    layout = hf_layout(cfg, dtype=torch.float32, block_size=BLOCK)
    server = Server(l1_gb=0.5, log_dir=str(tmp_path))
    try:
        ready, go = tmp_path / "a.ready", tmp_path / "b.done"
        kind = {"call": "mp_server_steps:store_kind"}
        a = launch(tmp_path, "a", model, server.url, [
            kind, {"prompts": P},
            {"call": "mp_server_steps:signal_and_wait",
             "kwargs": {"ready": str(ready), "go": str(go)}},
            {"prompts": Q}])
        wait_for(ready, a)
        b_out, b_events = finish(launch(tmp_path, "b", model, server.url,
                                        [{"prompts": P}, {"prompts": Q}]))
        go.touch()
        a_out, a_events = finish(a)
        assert a_out["steps"][0]["result"] == ["ServerStore"]
        a_cold, a_q = a_out["steps"][1], a_out["steps"][3]
        b_p, b_cold = b_out["steps"]
        ref = dict(zip(map(tuple, P + Q), a_cold["outputs"] + b_cold["outputs"]))
        assert a_cold["cached"] == [0, 0] and b_cold["cached"] == [0, 0]
        assert b_p["cached"] == [hit(len(p)) for p in P]  # B hits what A stored
        assert a_q["cached"] == [hit(len(q)) for q in Q]  # and A what B stored
        assert b_p["outputs"] == a_cold["outputs"] and a_q["outputs"] == b_cold["outputs"]

        # Sliding groups are stored for every chunk (0.5.6: leading-run hits only) and
        # loaded only in their window.
        saved = Counter()
        for e in a_events:
            if e["event"] == "save":
                for gid, v in e["groups"].items():
                    saved[int(gid)] += v["blocks"]
        chunks = sum(len(p) // CHUNK for p in P)
        assert saved == {g.group_id: chunks * (CHUNK // g.block_size) for g in layout.groups}
        loads = [e for e in b_events if e["event"] == "load"]
        assert [e["end"] for e in loads] == [hit(len(p)) for p in P]
        for e in loads:
            for g in layout.groups:
                blocks = e["groups"][str(g.group_id)]["blocks"]
                if g.window:
                    assert blocks <= -(-(WINDOW - 1) // g.block_size) + 1
                else:
                    assert blocks == e["end"] // g.block_size

        # A restarted keeps its hits; then the server dies under it.
        again_out, _ = finish(launch(tmp_path, "a2", model, server.url, [
            {"prompts": P + Q},
            {"call": "mp_server_steps:kill_server", "kwargs": {"pid": server.proc.pid}},
            {"prompts": P + Q[:1]}]))
        warm, _, down = again_out["steps"]
        assert warm["cached"] == [hit(len(p)) for p in P + Q]
        assert warm["outputs"] == [ref[tuple(p)] for p in P + Q]
        assert down["cached"] == [0, 0, 0]  # misses, and the engine keeps serving
        assert down["outputs"] == [ref[tuple(p)] for p in P + Q[:1]]
        cold = max(a_cold["ttft"] + b_cold["ttft"])
        assert max(down["ttft"]) <= cold + LATENCY_SLACK_S, (down["ttft"], cold)
        print(f"\nTTFT (s): cold {a_cold['ttft']} {b_cold['ttft']}, hits {b_p['ttft']} "
              f"{a_q['ttft']}, restart hits {warm['ttft']}, server down {down['ttft']}")
    finally:
        server.stop()
