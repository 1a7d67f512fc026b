"""End to end in real vLLM (CPU build) on one shared `lmcache server` that the test starts:

1. engines A and B (two processes, both alive) share it: B hits what A stored, A hits
   what B stored, greedy tokens identical to A's cold run (a recomputation: no hits);
2. A restarted (a new process, same configuration) still hits everything;
3. the server is killed while A serves: every later prompt is a miss, tokens are still
   identical, and at most one lookup and one save wait out the server's timeout before
   it counts as down (`ServerConnection.waited_out`); every call after that fails at
   once. No clock is read.

The three engines (A, B, A restarted) start side by side (tests/conftest.py
`engine_pool`, `start_engines`) and wait at their gates; then they run their steps as
described, with no other engine computing meanwhile (B waits until A has stored, A
restarted until A and B have exited).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from needs import require

from e2e_common import CHUNK, Harness, save_config, stats_events, tiny_gemma4_config
from gemma4_kv.layout.from_hf import hf_layout
from lmcache_servers import Server
from tiny_reference import ENGINE as REF_ENGINE, REFERENCE, want

require("vllm")
pytestmark = pytest.mark.vllm

BLOCK = 32
WINDOW = 100
ENGINE = {"enforce_eager": True, "max_model_len": 4096, "dtype": "float32",
          "block_size": BLOCK}
TIMEOUT = 1.0  # lmcache_server_timeout_s

_rng = random.Random(11)
P = [[_rng.randrange(3, 500) for _ in range(1100)] for _ in range(2)]  # stored by A
Q = [[_rng.randrange(3, 500) for _ in range(800)] for _ in range(2)]  # stored by B


want(P + Q)  # the recomputation engine (no connector) answers them too


def hit(n: int) -> int:
    """Hit of a prompt of n tokens when all its chunks are stored (64: block multiple)."""
    return min(n // CHUNK * CHUNK, (n - 1) // 64 * 64)


def launch(tmp_path: Path, name: str, model: str, url: str, steps: list) -> tuple:
    """An engine on the server, started; it waits at its gate (`finish` opens it)."""
    stats = tmp_path / f"{name}.stats.jsonl"
    spec = {"model": model, "connector": True, "max_tokens": 6, "engine": ENGINE,
            "extra_config": {"lmcache_server": url, "lmcache_server_timeout_s": TIMEOUT,
                             "stats_file": str(stats)},
            "steps": steps}
    return Harness(tmp_path, name, spec, gate=True, timeout=600), stats


def finish(run: tuple) -> tuple[dict, list]:
    harness, stats = run
    if not harness.gate.exists():
        harness.open()
    out, _ = harness.result()
    return out, stats_events(stats)


def wait_for(path: Path, run: tuple, timeout: float = 600) -> None:
    harness = run[0]
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert harness.running(), harness.tail()
        assert time.monotonic() < deadline
        time.sleep(0.2)


class Engines:
    """The server, and A, B and A restarted on it, each waiting at its gate."""

    def __init__(self, tmp_path_factory):
        self.server, self.runs = None, {}
        try:
            tmp = self.tmp = tmp_path_factory.mktemp("mp-server")
            self.cfg = cfg = tiny_gemma4_config(window=WINDOW)
            model = save_config(cfg, tmp / "model")
            assert ENGINE == REF_ENGINE  # the same engine, only without the connector
            REFERENCE.start(tmp_path_factory)
            REFERENCE.ready()
            self.server = server = Server(l1_gb=0.5, log_dir=str(tmp))
            self.ready, self.go = tmp / "a.ready", tmp / "b.done"
            kind = {"call": "mp_server_steps:store_kind"}
            scripts = {
                "a": [kind, {"prompts": P},
                      {"call": "mp_server_steps:signal_and_wait",
                       "kwargs": {"ready": str(self.ready), "go": str(self.go)}},
                      {"prompts": Q}],
                "b": [{"prompts": P}, {"prompts": Q}],
                "a2": [{"prompts": P + Q},
                       {"call": "mp_server_steps:waited_out"},
                       {"call": "mp_server_steps:kill_server",
                        "kwargs": {"pid": server.proc.pid}},
                       {"prompts": P + Q[:1]},
                       {"call": "mp_server_steps:waited_out"}]}
            for name, steps in scripts.items():  # one starting at a time in this slot
                self.runs[name] = launch(tmp, name, model, server.url, steps)
                self.runs[name][0].wait_ready()
        except BaseException:
            self.close()
            raise

    def close(self):
        for harness, _ in self.runs.values():
            harness.kill()
        if self.server:
            self.server.stop()


def start_engines(tmp_path_factory, selected):
    return Engines(tmp_path_factory)


def test_engines_share_one_lmcache_server(engine_pool):
    engines = engine_pool.result((__name__, "start"))
    engine_pool.drain()  # no other engine runs from here on
    cfg, runs = engines.cfg, engines.runs
    recomputed = {p: out for p, (out, _) in REFERENCE.run().items()}
    layout = hf_layout(cfg, dtype=torch.float32, block_size=BLOCK)
    try:
        a = runs["a"]
        a[0].open()
        wait_for(engines.ready, a)
        b_out, b_events = finish(runs["b"])
        engines.go.touch()
        a_out, a_events = finish(a)
        assert a_out["steps"][0]["result"] == ["ServerStore"]
        a_cold, a_q = a_out["steps"][1], a_out["steps"][3]
        b_p, b_cold = b_out["steps"]
        ref = dict(zip(map(tuple, P + Q), a_cold["outputs"] + b_cold["outputs"]))
        assert ref == {tuple(p): recomputed[tuple(p)] for p in P + Q}  # no connector
        assert a_cold["cached"] == [0, 0] and b_cold["cached"] == [0, 0]
        assert b_p["cached"] == [hit(len(p)) for p in P]  # B hits what A stored
        assert a_q["cached"] == [hit(len(q)) for q in Q]  # and A what B stored
        assert b_p["outputs"] == a_cold["outputs"] and a_q["outputs"] == b_cold["outputs"]

        # Stored as in the embedded store: by hand, each 1100-token prompt's one hit end
        # is 1024 (retention 4096 > 1024); the full group keeps its 4 chunks (32-token
        # blocks: 8 each), a sliding group (window 100, 64-token blocks) only chunk 3,
        # which holds tokens 925-1023 (4 blocks). Loaded only in the window.
        saved = Counter()
        for e in a_events:
            if e["event"] == "save":
                for gid, v in e["groups"].items():
                    saved[int(gid)] += v["blocks"]
        assert {g.block_size for g in layout.groups if g.window} == {64}
        assert saved == {g.group_id: 2 * 4 if g.window else 2 * 4 * 8 for g in layout.groups}
        loads = [e for e in b_events if e["event"] == "load"]
        assert [e["end"] for e in loads] == [hit(len(p)) for p in P]
        for e in loads:
            for g in layout.groups:
                blocks = e["groups"][str(g.group_id)]["blocks"]
                if g.window:
                    # By hand: the next token (position `end`) attends back to token
                    # end - WINDOW + 1 = 925 (vLLM frees blocks wholly before it), so
                    # the blocks of tokens [925, 1024): 925 // 64 = 14 to 15, two.
                    first, last = (e["end"] - WINDOW + 1) // g.block_size, \
                        (e["end"] - 1) // g.block_size
                    assert (e["end"], first, last) == (1024, 14, 15)
                    assert blocks == last - first + 1 == 2
                else:
                    assert blocks == e["end"] // g.block_size

        # A restarted keeps its hits; then the server dies under it.
        again_out, _ = finish(runs["a2"])
        warm, before, _, down, after = again_out["steps"]
        assert warm["cached"] == [hit(len(p)) for p in P + Q]
        assert warm["outputs"] == [ref[tuple(p)] for p in P + Q]
        assert down["cached"] == [0, 0, 0]  # misses, and the engine keeps serving
        assert down["outputs"] == [ref[tuple(p)] for p in P + Q[:1]]
        # No stall: one lookup and one save may each wait out TIMEOUT before the server
        # counts as down (none if the heartbeat found it gone first); then none waits.
        (waited,) = after["result"]
        assert waited - before["result"][0] <= 2, (before["result"], waited)
        print(f"\nTTFT (s): cold {a_cold['ttft']} {b_cold['ttft']}, hits {b_p['ttft']} "
              f"{a_q['ttft']}, restart hits {warm['ttft']}, server down {down['ttft']}")
    finally:
        engines.close()
