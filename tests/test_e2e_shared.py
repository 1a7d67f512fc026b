"""Engines sharing one real Redis/Valkey server (LMCache's `valkey` tier), in real vLLM.

One recomputation run (tests/tiny_reference.py) gives the tokens every engine must
produce. Engine A (empty
server) runs the usual prompts; engine B, another process with an empty CPU tier, hits
what A stored; A restarted (a new process) hits too. Then, in that engine, the server
is killed between two steps and the engine keeps serving: misses beyond its CPU tier,
no lookup held beyond its own budget (the connector's counters), identical tokens; the
server comes back empty, the engine stores into it again and, with its CPU tier
emptied, hits from it. Nothing is timed: the test waits for events (the engine's L2
copies ended, the engine's clients connected again).

The test stops the server from a thread of its own, at a point the engine waits for:
a harness step runs `rendezvous` on the worker, which writes `<name>.ready` and waits
for `<name>.go`.

Engines A, B and A restarted start side by side (tests/conftest.py `engine_pool`,
`start_engines`), each waiting at its gate, and then run one after the other, alone:
B's lookups come after A has finished, and A restarted is another process than A.
"""

from __future__ import annotations

import hashlib
import random
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from e2e_common import (CHUNK, RETENTION, check_against_plan, counted, finish_engine,
                        prompts, save_config, start_engine, tiny_gemma4_config)
from gemma4_kv.layout.from_hf import hf_layout
from gemma4_kv.layout.plan import hit_chunks, hit_ends, retained_chunks
from keyer import chunk_keys
from model_keys import max_servable_hit
from needs import require
from tier_servers import TierServer, require_server
from tiny_reference import REFERENCE, want
import tiny_reference

require("vllm")
pytestmark = pytest.mark.vllm

BLOCK = 32
ENGINE = {"dtype": "float32", "block_size": BLOCK}
# what start_engine runs (max_tokens 6) is what the reference engine runs
assert {"enforce_eager": True, "max_model_len": 4096, **ENGINE} == tiny_reference.ENGINE
assert tiny_reference.MAX_TOKENS == 6
REQUEST_TIMEOUT = 0.5  # the valkey adapter's per-request timeout
LOOKUP_TIMEOUT = 2.0  # the connector's lookup_timeout_s (its default)
HANG_S = 120.0
"""Hang guard of the waits for events below: one that has not come by then fails."""
SOURCES = "vllm:prompt_tokens_cached_by_source"
WAITS = ("vllm:gemma4_kv_l2_waits_given_up", "vllm:gemma4_kv_lookups_unanswered")
"""The connector's counters of lookups that stopped waiting for the L2 tier at their
budget, and of lookups a worker rank did not answer in time (scheduler.RANK_TIMEOUT_S)."""


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


BASE, OTHER = prompts()[0], prompts()[-1][1100:]
THIRD, FOURTH, FIFTH = _tokens(1, 800), _tokens(2, 700), _tokens(3, 600)
B_PROMPTS = [BASE, BASE + OTHER, THIRD]
want(prompts() + [THIRD, FOURTH, FIFTH])


# -- on the worker (harness "call" steps) ---------------------------------------------------
def rendezvous(worker, marker_dir: str, name: str, drop_cpu_tier: bool = False) -> int:
    """Once this rank's L2 copies and prefetches have ended (`l2_settled`), tell the test
    this engine has reached `name` and wait for it to act; then, if asked, empty this
    rank's CPU tier (so the next hits can only come from the server). The CPU tier's
    bytes in use after that."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    store = get_kv_transfer_group()._worker.store
    l2_settled(store, name)
    d = Path(marker_dir)
    (d / f"{name}.ready").touch()
    deadline = time.monotonic() + HANG_S
    while not (d / f"{name}.go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never answered rendezvous {name!r}")
        time.sleep(0.02)
    if drop_cpu_tier:
        store.drop_l1()
    return store.usage()[0]


def l2_settled(store, name: str) -> None:
    """Wait until no copy to the server is in flight (`EmbeddedStore.
    l2_writes_in_flight`, and no object read-locked: between steps only LMCache's copies
    hold one, from taking it off their queue) and no prefetch from it is unsettled:
    what the server holds is final until the next step, and a server killed before
    now has failed every request to it, so none reaches the one restarted after. (It
    can return early while LMCache's store thread is between taking objects off its
    queue and locking them: `StorageLayer.l2_writes_in_flight`.) The engine's lookup
    thread settles the prefetches (`ChunkStore.poll` is that thread's alone)."""
    deadline = time.monotonic() + HANG_S
    while True:
        l2 = store.l2.counts()
        if not (store.l2_writes_in_flight() or store.tier.status()["read_locked_count"]
                or l2["inflight"] or l2["hung"]):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rendezvous {name!r}: L2 still busy after {HANG_S} s: "
                               f"{store.l2_writes_in_flight()} copies, {l2}")
        time.sleep(0.02)


class Conductor(threading.Thread):
    """The test's side of `rendezvous`: when the engine is ready at `name`, run
    `actions[name]` (in order), then let it go on."""

    def __init__(self, marker_dir: Path, actions: dict):
        super().__init__(daemon=True)
        self.dir, self.actions = marker_dir, actions
        self.results, self.error = {}, None
        self.done = threading.Event()

    def run(self):
        for name, act in self.actions.items():
            while not (self.dir / f"{name}.ready").exists():
                if self.done.wait(0.02):
                    return
            try:
                self.results[name] = act()
            except BaseException as e:  # reported by the test, after the engine exits
                self.error = self.error or e
            (self.dir / f"{name}.go").touch()


def step(name: str, marker_dir: Path, **kw) -> dict:
    return {"call": "test_e2e_shared:rendezvous",
            "kwargs": {"marker_dir": str(marker_dir), "name": name, **kw}}


# -- a model of what each tier holds ---------------------------------------------------------
def key_hashes(prompt) -> list[bytes]:
    """The connector's chunk keys of a plain token prompt (from vLLM's own Request)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return chunk_keys(Request("r", list(prompt), SamplingParams(max_tokens=6), None),
                      CHUNK).hashes


class Tiers:
    """What one engine's CPU tier and the server hold ((chunk hash, group) objects), and
    the hit each prompt gets: the planner's functions, as e2e_common.expected_store, over
    the connector's own keys (so that the server's key names can be predicted)."""

    def __init__(self, layout, server: set):
        self.layout, self.server, self.cpu = layout, server, set()

    def run(self, prompt, *, server_up: bool = True) -> int:
        layout, hashes = self.layout, key_hashes(prompt)
        m = layout.chunk_multiple
        limit = (len(prompt) - 1) // m * m
        have = self.cpu | self.server if server_up else self.cpu
        hit = max_servable_hit(layout, CHUNK, len(hashes),
                               lambda g, c: (hashes[c], g) in have, limit=limit)
        self.cpu |= {(hashes[c], g) for g, c in hit_chunks(layout, 0, hit, CHUNK)}  # loaded
        ends = hit_ends(len(hashes), CHUNK, limit, RETENTION)
        saved = {(hashes[c], g.group_id) for g in layout.groups
                 for c in retained_chunks(g, CHUNK, ends) if c >= hit // CHUNK}
        if server_up:
            self.server |= saved - self.cpu  # objects in the CPU tier are not written again
        self.cpu |= saved
        return hit


def after_a(r) -> set:
    """What the server holds once engine A has run `prompts()`."""
    tiers = Tiers(r["layout"], set())
    for p in prompts():
        tiers.run(p)
    return tiers.server


def after_b(r) -> set:
    """What the server holds once engine B has run `B_PROMPTS` after A."""
    tiers = Tiers(r["layout"], after_a(r))
    for p in B_PROMPTS:
        tiers.run(p)
    return tiers.server


def wire_keys(fingerprint: str, objects: set) -> set[str]:
    return {f"{fingerprint}@{0:08x}@{g:x}@{h.hex()}" for h, g in objects}


# -- what the server holds, derived by hand ---------------------------------------------------
def spec_keys(prompt) -> list[bytes]:
    """Chunk keys of a plain token prompt, written from the encoding that
    gemma4_kv/keys/request.py documents (generation "", no salt, adapter, multimodal
    items or embeddings), not from its code."""
    def f(tag: int, payload: bytes) -> bytes:
        return struct.pack("<BQ", tag, len(payload)) + payload

    prev = hashlib.sha256(b"gemma4-kv:request-keys:1\n" + f(1, b"") + f(2, b"")
                          + f(3, b"")).digest()
    keys = []
    for start in range(0, len(prompt) // CHUNK * CHUNK, CHUNK):
        ids = struct.pack(f"<{CHUNK}q", *prompt[start:start + CHUNK])
        prev = hashlib.sha256(prev + f(16, ids) + f(17, b"") + f(18, b"")).digest()
        keys.append(prev)
    return keys


def hand_objects(events, full, sliding) -> set:
    """(key, group) objects: chunks `full` ((prompt, chunk) pairs) in every
    full-attention group, `sliding` in every sliding one; the kinds of the groups as
    the worker reports vLLM's KVCacheConfig."""
    (layout,) = [e for e in events if e["event"] == "layout"]
    out = set()
    for gid, g in enumerate(layout["groups"]):
        for prompt, c in (full if g["window"] is None else sliding):
            out.add((spec_keys(prompt)[c], gid))
    return out


P = prompts()
# The stored chunks of engine A's prompts, from e2e_common.HITS' derivation (window 100,
# retention 512): full groups base + other's 0-6 (0-3 are base's), P[3]'s 2 and P[5]'s
# 0 and 1; sliding groups 0 (base[:256]), 1 and 3 (base), 2 (base[:768]), 5 and 6
# (base + other), P[3]'s 2 and P[5]'s 1: 10 objects per full group, 8 per sliding one.
A_FULL = [(P[7], c) for c in range(7)] + [(P[3], 2), (P[5], 0), (P[5], 1)]
A_SLIDING = [(P[7], c) for c in (0, 1, 2, 3, 5, 6)] + [(P[3], 2), (P[5], 1)]
A_OBJECTS = 10 + 5 * 8  # the tiny model: 1 full group, 5 sliding ones
# B hits BASE and BASE + OTHER entirely; THIRD (800 tokens: 3 chunks, L = 768, hit
# ends 512 and 768) misses and stores full 0-2, sliding 1 and 2.
B_FULL, B_SLIDING = [(THIRD, c) for c in range(3)], [(THIRD, 1), (THIRD, 2)]
# The restarted server (empty) receives FIFTH's objects (600 tokens: 2 chunks, L = 576,
# hit end 512: full 0-1, sliding 1); FOURTH's were stored while it was down, into the
# CPU tier, and are not written again.
RESTART_FULL, RESTART_SLIDING = [(FIFTH, 0), (FIFTH, 1)], [(FIFTH, 1)]


def by_source(out: dict) -> list[dict]:
    """Per prompt, the tokens vLLM counted as cached by each source (`SOURCES` deltas)."""
    rows, last = [], {}
    for snapshot in out["metrics"]:
        rows.append({k.split("source=")[1].rstrip("}"): v - last.get(k, 0)
                     for k, v in snapshot.items() if k.startswith(SOURCES) and v != last.get(k, 0)})
        last = snapshot
    return rows


class Engines:
    """A, B and A restarted, started side by side on an empty server; each waits at its
    gate. A restarted's script stops the server from the test's side (`Conductor`)."""

    def __init__(self, tmp_path_factory):
        self.server, self.engines = None, {}
        try:
            require_server()
            tmp = tmp_path_factory.mktemp("shared")
            cfg = tiny_gemma4_config(window=100)
            model = save_config(cfg, tmp / "model")
            self.r = {"cfg": cfg, "layout": hf_layout(cfg, dtype=torch.float32,
                                                      block_size=BLOCK)}
            self.server = TierServer(workdir=tmp / "server").start()
            self.r["server"] = self.server
            REFERENCE.start(tmp_path_factory)  # one engine starting at a time in this slot
            REFERENCE.ready()
            extra = {"lookup_timeout_s": LOOKUP_TIMEOUT,
                     "l2_adapters": [self.server.valkey_spec(request_timeout=REQUEST_TIMEOUT,
                                                             connection_timeout=1.0)]}
            self.marks = tmp / "marks"
            self.marks.mkdir()
            a2_steps = [{"prompts": [BASE, THIRD]}, step("down", self.marks),
                        {"prompts": [BASE + OTHER, FOURTH]}, step("up", self.marks),
                        {"prompts": [FIFTH, FOURTH]},
                        step("check", self.marks, drop_cpu_tier=True),
                        {"prompts": [FIFTH, FOURTH]}]
            for name, steps in (("a", None), ("b", [{"prompts": B_PROMPTS}]), ("a2", a2_steps)):
                self.engines[name] = start_engine(tmp, name, model, connector=True,
                                                  engine=ENGINE, extra=extra, steps=steps,
                                                  metrics=[SOURCES, *WAITS], gate=True)
                self.engines[name][0].wait_ready()
        except BaseException:
            self.close()
            raise

    def close(self):
        for harness, _ in self.engines.values():
            harness.kill()
        if self.server:
            self.server.kill()


def start_engines(tmp_path_factory, selected):
    return Engines(tmp_path_factory)


@pytest.fixture(scope="module")
def runs(engine_pool):
    """Every engine of this file, once: recomputation, A, B, A restarted with the server
    killed and restarted mid-run, one after the other, no other engine running. Each
    check below reads these runs."""
    state = engine_pool.result((__name__, "start"))
    engine_pool.drain()
    r, server = state.r, state.server
    try:
        ref = REFERENCE.run()
        r["expected"] = {p: o for p, (o, _) in ref.items()}

        r["a"], r["a_events"] = finish_engine(state.engines["a"])
        r["keys_after_a"] = set(wire_keys_wait(server, A_OBJECTS))
        r["b"], r["b_events"] = finish_engine(state.engines["b"])
        r["keys_after_b"] = set(server.keys())

        clients = {}

        def down():
            clients["before"] = server.clients()  # A restarted's (its adapter's workers)
            server.kill()

        def up():  # the engine's copies and prefetches to the dead server have failed
            server.start()
            deadline = time.monotonic() + HANG_S  # glide reconnects in the background
            while server.clients() < clients["before"]:
                assert time.monotonic() < deadline, "the engine never reconnected"
                time.sleep(0.05)

        def check():  # the engine's copies into the restarted server have ended
            r["keys_after_restart"] = set(server.keys())

        conductor = Conductor(state.marks, {"down": down, "up": up, "check": check})
        conductor.start()
        try:
            r["a2"], r["a2_events"] = finish_engine(state.engines["a2"])
        finally:
            conductor.done.set()
            conductor.join(10)
        if conductor.error:
            raise conductor.error
        yield r
    finally:
        state.close()


def wire_keys_wait(server: TierServer, n: int) -> list[str]:
    """The server's keys once it holds at least `n`: the copies of an engine that has
    exited (it gives no count of them any more) may still be landing."""
    deadline = time.monotonic() + HANG_S
    while len(keys := server.keys()) < n:
        assert time.monotonic() < deadline, f"{len(keys)} keys in the server, not {n}"
        time.sleep(0.05)
    return keys


def fingerprint_of(events) -> str:
    (layout,) = [e for e in events if e["event"] == "layout"]
    return layout["fingerprint"]


def tokens_match(r, out, prompt_list) -> list:
    return [i for i, (p, o) in enumerate(zip(prompt_list, out["outputs"]))
            if o != r["expected"][tuple(p)]]


# -- the checks ------------------------------------------------------------------------------
def test_engine_a_stores_every_planned_object_in_the_server(runs):
    r = runs
    base = {"outputs": [r["expected"][tuple(p)] for p in prompts()],
            "cached": [0] * len(prompts())}
    check_against_plan(r["cfg"], r["a_events"], r["a"], base, dtype=torch.float32,
                       block_size=BLOCK, page_bytes=16384)  # as in test_e2e_vllm.py
    tiers = Tiers(r["layout"], set())
    assert [tiers.run(p) for p in prompts()] == r["a"]["cached"]
    after_a = hand_objects(r["a_events"], A_FULL, A_SLIDING)
    assert len(after_a) == A_OBJECTS
    assert r["keys_after_a"] == wire_keys(fingerprint_of(r["a_events"]), after_a)


def test_engine_b_hits_what_a_stored_from_the_shared_tier(runs):
    r = runs
    tiers = Tiers(r["layout"], after_a(r))
    want = [tiers.run(p) for p in B_PROMPTS]
    assert want[0] == 1024 and want[1] == 1792 and want[2] == 0
    assert r["b"]["cached"] == want
    assert not tokens_match(r, r["b"], B_PROMPTS)
    assert fingerprint_of(r["b_events"]) == fingerprint_of(r["a_events"])
    # vLLM's own accounting: B's CPU tier was empty, so the first hit came from the
    # server (reported as DISK, the connector's L2 source), none of it from HOST.
    sources = by_source(r["b"])
    assert sources[0] == {"disk": 1024}
    assert sources[1] == {"host": 1024, "disk": 768}  # chunks 0-3 were brought up before
    assert sources[2] == {}
    after_b = (hand_objects(r["a_events"], A_FULL, A_SLIDING)
               | hand_objects(r["b_events"], B_FULL, B_SLIDING))
    assert r["keys_after_b"] == wire_keys(fingerprint_of(r["a_events"]), after_b)


def test_engine_a_restarted_still_hits(runs):
    r = runs
    tiers = Tiers(r["layout"], after_b(r))
    first = r["a2"]["steps"][0]
    assert first["cached"] == [tiers.run(p) for p in (BASE, THIRD)] == [1024, 768]
    assert not tokens_match(r, first, [BASE, THIRD])
    assert by_source(r["a2"])[:2] == [{"disk": 1024}, {"disk": 768}]


def test_server_killed_mid_run_misses_without_stalling_then_serves_again(runs):
    r = runs
    tiers = Tiers(r["layout"], after_b(r))
    for p in (BASE, THIRD):
        tiers.run(p)
    steps = r["a2"]["steps"]
    # Server killed: only what this engine's CPU tier holds hits (BASE's 1024 tokens,
    # not the 1792 the server held); tokens identical; no lookup waits for the server
    # beyond its own budget (at most one give-up each), and every rank answers each
    # lookup in time (none unanswered: the scheduler is never held up).
    down = steps[2]
    assert down["cached"] == [tiers.run(p, server_up=False) for p in (BASE + OTHER, FOURTH)]
    assert down["cached"] == [1024, 0]
    assert not tokens_match(r, down, [BASE + OTHER, FOURTH])
    waits = counted(r["a2"], WAITS)
    assert waits[:2] == [{}, {}]  # the server up: nothing given up
    assert all(w.get(WAITS[0], 0) <= 1 and WAITS[1] not in w for w in waits[2:4]), waits
    assert by_source(r["a2"])[2:4] == [{"host": 1024}, {}]
    # Server back (empty): new chunks are stored in it again; FOURTH, stored while it was
    # gone, hits from the CPU tier only.
    tiers.server = set()
    back = steps[4]
    assert back["cached"] == [tiers.run(p) for p in (FIFTH, FOURTH)] == [0, 512]
    assert not tokens_match(r, back, [FIFTH, FOURTH])
    assert r["keys_after_restart"] == wire_keys(
        fingerprint_of(r["a2_events"]),
        hand_objects(r["a2_events"], RESTART_FULL, RESTART_SLIDING))
    # CPU tier emptied: FIFTH hits from the server, FOURTH (never in it) misses.
    assert steps[5]["result"] == [0]
    tiers.cpu = set()
    again = steps[6]
    assert again["cached"] == [tiers.run(p) for p in (FIFTH, FOURTH)] == [512, 0]
    assert not tokens_match(r, again, [FIFTH, FOURTH])
    assert by_source(r["a2"])[-2:] == [{"disk": 512}, {}]
