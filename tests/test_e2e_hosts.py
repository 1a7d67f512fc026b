"""End to end in real vLLM (CPU build): one `lmcache server` per host, the servers
sharing one Valkey as their L2 (issue 33 item 4; docs/scale-out.md "One server per
host"). Two servers stand for two hosts: each has its own L1 segment, and nothing
passes between them but Valkey.

Engine A on server 1 stores prompts P1, then P2. Engine B on server 2 then asks for
both: P1 hits (server 2 brings it up from Valkey, our client verifies it), with greedy
tokens identical to the recomputation engine's (no connector). Negative control: P2's
objects are deleted from Valkey before B asks, and B misses P2 (tokens still identical).

Sizes by hand (tests/tiny_reference.py's model: 5 sliding groups, window 100; 1 full
group; chunk 256): a 600-token prompt hits 512 tokens (two whole chunks, a 64-token
block multiple), and stores 2 full-group objects and, per sliding group, the one chunk
whose tokens the window before token 512 reads: 2 + 5 = 7 objects, 7 Valkey keys.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from needs import require

from e2e_common import Harness, save_config, tiny_gemma4_config
from lmcache_servers import Server
from tier_servers import TierServer, require_server
from tiny_reference import ENGINE, REFERENCE, want

require("vllm")
pytestmark = pytest.mark.vllm

HIT = 512  # by hand (module doc)
OBJECTS = 7  # Valkey keys per prompt, by hand (module doc)
STORED_BOUND_S = 60.0  # Valkey holds what server 1 committed (milliseconds when idle)

_rng = random.Random(33)
P1, P2 = ([_rng.randrange(3, 500) for _ in range(600)] for _ in range(2))
want([P1, P2])


def launch(tmp: Path, name: str, model: str, url: str, steps: list) -> Harness:
    spec = {"model": model, "connector": True, "max_tokens": 6, "engine": ENGINE,
            "extra_config": {"lmcache_server": url}, "steps": steps}
    return Harness(tmp, name, spec, gate=True, timeout=600)


def valkey_holds(valkey: TierServer, n: int, harness: Harness) -> None:
    """Wait (bounded) until Valkey holds exactly `n` keys."""
    deadline = time.monotonic() + STORED_BOUND_S
    while len(valkey.keys()) < n:
        assert time.monotonic() < deadline, (valkey.keys(), harness.tail())
        time.sleep(0.1)
    assert len(valkey.keys()) == n, valkey.keys()


class Hosts:
    """Valkey, two servers on it, and engines A (server 1) and B (server 2) at their
    gates."""

    def __init__(self, tmp_path_factory):
        self.valkey, self.servers, self.engines = None, [], {}
        try:
            tmp = self.tmp = tmp_path_factory.mktemp("hosts")
            model = save_config(tiny_gemma4_config(window=100), tmp / "model")
            REFERENCE.start(tmp_path_factory)
            REFERENCE.ready()
            self.valkey = TierServer(require_server(), workdir=tmp / "valkey").start()
            spec = self.valkey.valkey_spec()
            self.servers = [Server(l1_gb=0.25, log_dir=str(tmp), l2_adapters=(spec,))
                            for _ in range(2)]
            self.ready, self.go = tmp / "a.ready", tmp / "a.go"
            kind = {"call": "mp_server_steps:store_kind"}
            wait = {"call": "mp_server_steps:signal_and_wait",
                    "kwargs": {"ready": str(self.ready), "go": str(self.go)}}
            scripts = {"a": (0, [kind, {"prompts": [P1]}, wait, {"prompts": [P2]}]),
                       "b": (1, [kind, {"prompts": [P1, P2]}])}
            for name, (i, steps) in scripts.items():
                self.engines[name] = launch(tmp, name, model, self.servers[i].url, steps)
                self.engines[name].wait_ready()
        except BaseException:
            self.close()
            raise

    def close(self):
        for harness in self.engines.values():
            harness.kill()
        for server in self.servers:
            server.stop()
        if self.valkey is not None:
            self.valkey.kill()


def start_engines(tmp_path_factory, selected):
    return Hosts(tmp_path_factory)


def test_an_engine_on_another_host_hits_through_the_shared_valkey(engine_pool):
    hosts = engine_pool.result((__name__, "start"))
    engine_pool.drain()  # no other engine runs from here on
    recomputed = {p: out for p, (out, _) in REFERENCE.run().items()}
    valkey, (s1, s2) = hosts.valkey, hosts.servers
    a, b = hosts.engines["a"], hosts.engines["b"]
    try:
        a.open()
        deadline = time.monotonic() + 600
        while not hosts.ready.exists():
            assert a.running() and time.monotonic() < deadline, a.tail()
            time.sleep(0.2)
        valkey_holds(valkey, OBJECTS, a)
        p1_keys = set(valkey.keys())
        hosts.go.touch()
        a_out, _ = a.result()
        valkey_holds(valkey, 2 * OBJECTS, a)
        valkey.cli("DEL", *sorted(set(valkey.keys()) - p1_keys))  # the control: P2 gone
        assert set(valkey.keys()) == p1_keys
        l1 = s2.status()["storage_manager"]["l1_manager"]["total_object_count"]
        assert l1 == 0  # server 2 holds nothing of A's: only Valkey does

        b_out, _ = b.open().result()
        assert a_out["steps"][0]["result"] == b_out["steps"][0]["result"] == ["ServerStore"]
        a_p1, a_p2 = a_out["steps"][1], a_out["steps"][3]
        b_both = b_out["steps"][1]
        assert a_p1["cached"] == a_p2["cached"] == [0]  # A computed both
        assert b_both["cached"] == [HIT, 0]  # P1 through Valkey; P2 deleted there
        want_tokens = [recomputed[tuple(P1)], recomputed[tuple(P2)]]
        assert a_p1["outputs"] + a_p2["outputs"] == want_tokens
        assert b_both["outputs"] == want_tokens
        assert s1.locks() == (0, 0, 0) and s2.locks() == (0, 0, 0)
    finally:
        hosts.close()
