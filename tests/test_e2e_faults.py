"""Faults never kill the engine or change a token (real vLLM, CPU build).

One connector engine goes through a script of faults, each its own case, injected into
the running engine (tests/faults.py through collective_rpc) or into its disk tier
(LMCache `fs_native` under LMCache's `fault_inject` adapter); a second one has a real
Valkey/Redis server as its tier and the server is frozen mid-run. One recomputation
engine (no connector, tests/tiny_reference.py) answers the same prompts. For every case: every request is
answered, its tokens are those of recomputation, and the cached counts (or what the
fault recorded) show that the fault was on the request's path. Waits are shown by
counters (the connector's own, and how often vLLM's scheduler asked: `faults.
FaultsConnector`), never by clocks.

The three engines start side by side (tests/conftest.py `engine_pool`, `start_engines`)
and wait at their gates; then each runs its steps alone, one after the other, with no
other engine running.
"""

from __future__ import annotations

import json
import random

import pytest

from needs import require

from e2e_common import Harness
from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

require("vllm")
pytestmark = pytest.mark.vllm

import faults  # noqa: E402  (tests/faults.py: the worker side of the faults)
import tiny_reference  # noqa: E402
from tiny_reference import REFERENCE, want  # noqa: E402

CHUNK = 256
RETENTION = 512  # sliding-window chunks kept before hits ending at 512 and 1024
FULL = 1024  # a 1100-token prompt's whole hit (4 chunks; one token is left to compute)
LOOKUP_TIMEOUT = 1.0  # lookup_timeout_s: how long a lookup waits for the L2 tier
TIER_DELAY = 30.0  # the slow tier would answer this late (disarmed long before)
L2_PAUSE = 60.0  # skip L2 this long after PAUSE_AFTER give-ups (lookup/wait.py: 5 s,
# doubling): longer than any prompt on a loaded machine, so the pause cannot end early
MAX_TOKENS = 6
ENGINE = {"enforce_eager": True, "max_model_len": 4096, "dtype": "float32", "block_size": 32}


def documents():
    rng = random.Random(1)
    return {name: [rng.randrange(3, 500) for _ in range(1100)] for name in "ABCDEFG"}


class Script:
    """The connector engine's steps, each step's result found by a label; `requests`
    gives the engine's request numbers of a prompt step (vLLM counts them from 0)."""

    def __init__(self):
        self.steps, self.labels, self.requests = [], {}, {}
        self._next = 0

    def prompts(self, label, *names, batch=False):
        self.labels[label] = len(self.steps)
        self.requests[label] = list(range(self._next, self._next + len(names)))
        self._next += len(names)
        self.steps.append({"prompts": [DOCS[n] for n in names], "names": list(names),
                           "batch": batch})

    def call(self, label, fn, **kwargs):
        self.labels[label] = len(self.steps)
        self.steps.append({"call": f"faults:{fn}", "kwargs": kwargs})

    def fault(self, label, fault, **params):
        self.call(f"{label}:arm", "arm", fault=fault, **params)

    def unfault(self, label, fault):
        self.call(f"{label}:disarm", "disarm", fault=fault)


DOCS = documents()
want(DOCS.values())  # first: the reference engine answers these as the first prompts
assert (ENGINE, MAX_TOKENS) == (tiny_reference.ENGINE, tiny_reference.MAX_TOKENS)


def start(tmp_path, name, model, steps, *, connector, extra=None, connector_class=None):
    """The engine over `steps`, started; it waits at its gate (see `finish`)."""
    clean = [{k: v for k, v in s.items() if k != "names"} for s in steps]
    spec = {"model": model, "connector": connector, "max_tokens": MAX_TOKENS,
            "engine": ENGINE, "steps": clean,
            "extra_config": {"cpu_gb": 0.25, "retention_interval": RETENTION,
                             "intermediate_ends": "always", **(extra or {})}}
    if connector_class:
        spec.update(connector_class=connector_class, connector_module="faults")
    sched_log = tmp_path / f"{name}.scheduler.jsonl"
    return Harness(tmp_path, name, spec, env={faults.SCHEDULER_LOG: str(sched_log)},
                   gate=True), sched_log


def finish(started) -> tuple[dict, dict]:
    """Let a started engine run its steps; (its output, its lookups per request)."""
    harness, sched_log = started
    out, _ = harness.open().result()
    lookups = {}
    for line in sched_log.read_text().splitlines() if sched_log.exists() else ():
        e = json.loads(line)
        lookups.setdefault(int(e["req"].split("-")[0]), []).append(e)
    return out, lookups


def fault_script(disk: str) -> Script:
    s = Script()
    s.prompts("cold", "A", "B", "C", "D", "E")
    s.call("count", "count_stats")
    s.call("flushed", "wait_l2", disk=disk)
    # -- disk damage: a fresh CPU tier, three objects damaged on disk --------------------
    s.call("drop1", "drop_l1")
    s.call("damage", "damage", disk=disk, victims=[
        {"tokens": DOCS["A"], "chunk": 2, "kind": "full", "how": "delete"},
        {"tokens": DOCS["B"], "chunk": 1, "kind": "full", "how": "truncate"},
        {"tokens": DOCS["C"], "chunk": 3, "kind": "sliding", "how": "flip"}])
    s.prompts("damaged", "A", "B", "C", "D", "E")
    s.call("after_damage", "snapshot", disk=disk)
    # -- an L2 read that fails (fault_inject: found at lookup, the load fails) -----------
    s.call("drop2", "drop_l1")
    s.fault("l2fail", "l2_load_fails")
    s.prompts("l2fail", "D")
    s.unfault("l2fail", "l2_load_fails")
    # -- evicted between the residency check and the pin ------------------------------
    s.fault("before_pin", "evict_before_pin")
    s.prompts("before_pin", "D")
    s.unfault("before_pin", "evict_before_pin")
    # -- evicted between the pin and the load, freed memory overwritten with NaN ---------
    s.prompts("fill_l1", "E")
    s.fault("after_pin", "evict_after_pin")
    s.prompts("after_pin", "D")
    s.unfault("after_pin", "evict_after_pin")
    # -- a pin that finds nothing (every try of one lookup and its Repin) ---------------
    s.fault("pin_fails", "pin_fails")
    s.prompts("pin_fails", "D")
    s.unfault("pin_fails", "pin_fails")
    # -- LMCache's read raises after the pin took its read locks ------------------------
    s.fault("read_raises", "read_raises", min_keys=2)  # the pin's read, not a verification
    s.prompts("read_raises", "D")
    s.call("read_raises:l2", "wait_l2", disk=disk)  # LMCache's disk writes hold read locks
    s.call("read_raises:snap", "snapshot")
    s.unfault("read_raises", "read_raises")
    s.prompts("read_raises:again", "D")  # at once: the rank was not taken for down
    # -- a rank that does not answer one lookup in time (held until disarmed): D misses,
    # and its next lookup, at once, is asked and hits -----------------------------------
    s.fault("silent", "silent_rank")
    s.prompts("silent", "D")
    s.unfault("silent", "silent_rank")
    s.prompts("silent:again", "D")
    # -- an L2 tier that stops answering: each lookup waits its budget, then misses; after
    # PAUSE_AFTER give-ups in a row, lookups skip the tier ---------------------------
    s.call("drop3", "drop_l1")
    s.call("slow:before", "snapshot")
    s.fault("slow", "slow_tier", delay=TIER_DELAY)
    s.fault("slow:pause", "long_l2_pause", seconds=L2_PAUSE)
    s.prompts("slow", "E", "A", "B")
    s.prompts("slow:paused", "C")
    s.call("slow:snap", "snapshot")
    s.unfault("slow", "slow_tier")  # the tier answers again
    s.unfault("slow:pause", "long_l2_pause")  # and the pause ends
    s.prompts("slow:again", "A")
    # -- the CPU tier full during saves (and for objects coming up from disk) ----------
    s.fault("full", "store_full", leave=1)
    s.prompts("full", "F", "F", "E")
    s.call("full:snap", "snapshot")
    s.unfault("full", "store_full")
    s.prompts("full:after", "F", "F")
    s.call("final", "snapshot", disk=disk)
    # -- negative control: pins NOT honoured (force-evicted, memory overwritten) --------
    s.fault("control", "evict_after_pin", force=True)
    s.prompts("control", "G", "G")
    s.unfault("control", "evict_after_pin")
    return s


FROZEN_TEST = "test_frozen_valkey_server_misses_then_serves_again"


class Engines:
    """The reference engine, the faults engine and (for the frozen-server test) the one
    on a real Valkey/Redis server, started side by side; each waits at its gate."""

    def __init__(self, tmp_path_factory, selected):
        self.server = self.faults = self.frozen = None
        try:
            model = save_config(tiny_gemma4_config(window=100),
                                tmp_path_factory.mktemp("model"))
            # one engine starting at a time in this pool slot (tests/conftest.py)
            REFERENCE.start(tmp_path_factory)
            REFERENCE.ready()
            if selected - {FROZEN_TEST}:
                tmp = tmp_path_factory.mktemp("faults")
                disk = str(tmp / "disk")
                self.script = fault_script(disk)
                extra = {"lookup_timeout_s": LOOKUP_TIMEOUT, "l2_adapters": [
                    {"type": "fault_inject", "rate": 0.0,
                     "inner": {"type": "fs_native", "base_path": disk, "num_workers": 2}}]}
                self.faults = start(tmp, "faults", model, self.script.steps, connector=True,
                                    extra=extra, connector_class="FaultsConnector")
                self.faults[0].wait_ready()
            if FROZEN_TEST in selected:
                from tier_servers import TierServer, require_server

                tmp = tmp_path_factory.mktemp("frozen")
                self.server = TierServer(require_server(), workdir=tmp / "server").start()
                self.frozen_script = frozen_script(self.server.proc.pid, self.server.port)
                extra = {"lookup_timeout_s": LOOKUP_TIMEOUT, "l2_adapters": [
                    self.server.valkey_spec(request_timeout=VALKEY_TIMEOUT,
                                            connection_timeout=1.0)]}
                self.frozen = start(tmp, "frozen", model, self.frozen_script.steps,
                                    connector=True, extra=extra,
                                    connector_class="FaultsConnector")
                self.frozen[0].wait_ready()
        except BaseException:
            self.close()
            raise

    def close(self):
        for started in (self.faults, self.frozen):
            if started:
                started[0].kill()
        if self.server:
            self.server.kill()


def start_engines(tmp_path_factory, selected):
    return Engines(tmp_path_factory, selected)


@pytest.fixture(scope="module")
def engines(engine_pool):
    """The engines, up; no other engine runs from here on (the pool is drained)."""
    state = engine_pool.result((__name__, "start"))
    engine_pool.drain()
    return state


@pytest.fixture(scope="module")
def reference(engines):
    """Every document once, recomputed (no connector): {name: (tokens, TTFT)}."""
    ref = REFERENCE.run()
    return {name: ref[tuple(doc)] for name, doc in DOCS.items()}


@pytest.fixture(scope="module")
def runs(engines, reference):
    out, lookups = finish(engines.faults)
    return engines.script, out, reference, lookups


def step(runs, label):
    script, out, _, _ = runs
    return out["steps"][script.labels[label]]


def result(runs, label):
    (r,) = step(runs, label)["result"]  # one worker rank
    return r


def cached(runs, label):
    return step(runs, label)["cached"]


def in_scheduler(runs, label):
    """Per request of a step: how often vLLM's scheduler asked the connector for its hit
    (get_num_new_matched_tokens calls: more than one while a lookup is pending)."""
    script, _, _, lookups = runs
    return [len(lookups[r]) for r in script.requests[label]]


def test_every_request_answered_with_the_tokens_of_recomputation(runs):
    script, out, reference, _ = runs
    n, differing = 0, []
    for label, i in script.labels.items():
        names = script.steps[i].get("names")
        if not names or label == "control":
            continue
        got = out["steps"][i]["outputs"]
        assert len(got) == len(names) and all(len(t) == MAX_TOKENS for t in got), label
        n += len(names)
        differing += [(label, k, name) for k, (name, t) in enumerate(zip(names, got))
                      if t != reference[name][0]]
    assert not differing, f"tokens differ from recomputation: {differing}"
    assert n == 29


def test_negative_control_a_freed_pin_changes_tokens(runs):
    """The comparison can fail: pins force-evicted and their memory overwritten with NaN
    between the pin and the load must change the tokens of the hit."""
    _, _, reference, _ = runs
    state = result(runs, "control:disarm")
    assert state["fired"] == 1 and state["flooded_objects"] > 0
    first, second = step(runs, "control")["outputs"]
    assert cached(runs, "control") == [0, FULL]
    assert first == reference["G"][0] and second != reference["G"][0]


def test_cold_prompts_stored_on_disk(runs):
    assert cached(runs, "cold") == [0] * 5
    assert result(runs, "flushed") > 0
    assert result(runs, "drop1")["after"] == 0


def test_damaged_disk_objects_are_misses_and_intact_ones_hit(runs):
    """A: chunk 2's full-attention object deleted: the hit stops at 512. B: chunk 1's
    truncated: no hit (a hit before 512 has no sliding windows stored). C: chunk 3's
    sliding object with 64 bytes flipped: rejected by its checksum (and deleted from
    disk); LMCache's prefix fetch brought up only the windows the longest prefix needs
    (chunk 3's), so the store asks the disk for what the next shorter hit needs (the
    window before 512, retained for it) and C hits 512. D and E intact: whole hits."""
    assert len(result(runs, "damage")) == 3
    assert cached(runs, "damaged") == [512, 0, 512, FULL, FULL]
    snap = result(runs, "after_damage")
    assert snap["counters"]["rejected_objects"] >= 1  # the flipped one, at least
    assert snap["prefill_s_per_token"] > 0  # the steps' prefill was measured
    assert snap["counters"]["hit_tokens_l2"] == 512 + 512 + 2 * FULL


def test_l2_load_that_fails_is_a_miss(runs):
    """fault_inject (rate 1): D is found on disk, every load of it fails. The same step
    without the fault (D, fresh CPU tier, in "damaged") was a whole hit."""
    assert result(runs, "drop2")["after"] == 0
    assert cached(runs, "l2fail") == [0]


def test_evicted_between_check_and_pin_is_a_miss(runs):
    state = result(runs, "before_pin:disarm")
    assert state["fired"] == 1 and state["evicted"] > 0 and state["kept_locked"] == 0
    assert cached(runs, "before_pin") == [0]


def test_pinned_objects_survive_eviction_and_overwritten_free_memory(runs):
    """After the pin, everything unpinned is evicted (E and D's unpinned windows) and all
    free memory filled with NaN: the load reads only pinned objects."""
    assert cached(runs, "fill_l1") == [FULL]
    state = result(runs, "after_pin:disarm")
    assert state["fired"] == 1 and state["evicted"] > 0 and state["kept_locked"] > 0
    assert state["flooded_objects"] > 0
    assert cached(runs, "after_pin") == [FULL]


def test_pin_that_finds_nothing_is_a_miss(runs):
    state = result(runs, "pin_fails:disarm")
    assert state["fired"] >= 2  # the lookup's candidates, then the scheduler's Repin
    assert cached(runs, "pin_fails") == [0]


def test_read_that_raises_is_a_miss_and_leaks_no_lock(runs):
    state = result(runs, "read_raises:disarm")
    assert state["fired"] == 1
    assert cached(runs, "read_raises") == [0]
    snap = result(runs, "read_raises:snap")
    assert snap["read_locked"] == 0 and snap["hits"] == 0
    assert cached(runs, "read_raises:again") == [FULL]  # no pause of the lookups


def test_silent_rank_is_a_miss_and_pauses_no_lookup(runs):
    """The rank holds D's lookup until the fault is disarmed: the scheduler stops
    waiting after RANK_TIMEOUT_S and D is a miss. D asked again right after is looked up
    (one unanswered lookup pauses nothing) and hits."""
    assert result(runs, "silent:disarm")["fired"] == 1
    assert cached(runs, "silent") == [0]
    assert cached(runs, "silent:again") == [FULL]


def test_stalled_tier_misses_then_pauses_then_serves_again(runs):
    """The disk tier stops answering. E, A and B (only on disk) each wait their budget
    (vLLM asks again each step meanwhile: more than one call), give up and miss; C,
    after PAUSE_AFTER give-ups in a row, skips the tier (one call, no prefetch). Once the
    tier is back and the pause over, A hits from disk."""
    from gemma4_kv.lookup.wait import PAUSE_AFTER

    assert PAUSE_AFTER == 3
    assert result(runs, "drop3")["after"] == 0
    before, snap = result(runs, "slow:before")["counters"], result(runs, "slow:snap")["counters"]
    grew = {k: snap.get(k, 0) - before.get(k, 0)
            for k in ("l2_waits_given_up", "l2_lookups_paused")}
    assert grew == {"l2_waits_given_up": 3, "l2_lookups_paused": 1}
    state = result(runs, "slow:disarm")
    assert state["held"] >= 3 and state["prefetches"] == 3
    assert cached(runs, "slow") == [0, 0, 0]
    assert all(calls > 1 for calls in in_scheduler(runs, "slow"))
    assert cached(runs, "slow:paused") == [0]
    assert in_scheduler(runs, "slow:paused") == [1]
    assert cached(runs, "slow:again") == [FULL]


def test_full_store_saves_nothing_leaks_nothing_then_recovers(runs):
    armed = result(runs, "full:arm")
    assert armed["filled"] > 0
    assert cached(runs, "full") == [0, 0, 0]  # F not stored; E on disk, no room in L1
    snap = result(runs, "full:snap")
    assert snap["l1_used"] == armed["used"]  # a partial reservation was given back
    assert snap["write_locked"] == armed["filled"] and snap["reserved"] == 0
    state = result(runs, "full:disarm")
    assert state["used_after_release"] < state["used_before_release"]
    assert cached(runs, "full:after") == [0, FULL]


def test_no_pin_reservation_or_prefetch_outlives_the_faults(runs):
    """Nothing locked, reserved, pending or in flight is left; no object waits for a
    verification that will not come; the store's account of what L1 holds is exactly
    what LMCache holds; the known-bad set holds only objects that failed verification."""
    snap = result(runs, "final")
    assert snap["read_locked"] == 0 and snap["write_locked"] == 0 and snap["staging"] == 0
    assert snap["reserved"] == 0 and snap["hits"] == 0 and snap["pending"] == 0
    assert snap["saves_pending"] == 0 and snap["inflight"] == 0 and snap["untrusted"] == 0
    assert snap["hung"] == 0 and snap["unverified"] == 0  # no L2 prefetch was given up
    assert snap["tracked"] == snap["objects"]
    assert snap["bad"] <= snap["counters"]["rejected_objects"]


# -- a real remote tier frozen mid-run ------------------------------------------------------
VALKEY_TIMEOUT = 4.0  # the valkey client's request_timeout: longer than LOOKUP_TIMEOUT


def frozen_script(pid: int, port: int) -> Script:
    s = Script()
    s.prompts("cold", "A", "B")
    s.call("count", "count_stats")
    s.call("stored", "wait_l2", port=port)
    s.call("drop1", "drop_l1")
    s.call("frozen:before", "snapshot")
    s.call("stop", "signal", pid=pid, name="SIGSTOP")
    s.prompts("frozen", "A")
    s.prompts("frozen:next", "B")
    s.call("frozen:snap", "snapshot")  # (the saves' objects are read-locked meanwhile)
    s.call("cont", "signal", pid=pid, name="SIGCONT")
    s.call("drop2", "drop_l1")
    s.prompts("thawed", "B")
    s.call("final", "snapshot")
    return s


@pytest.fixture(scope="module")
def frozen(engines, reference):
    server = engines.server
    try:
        out, lookups = finish(engines.frozen)
        keys = len(server.keys())
    finally:
        server.kill()
    return engines.frozen_script, out, reference, lookups, keys


def test_frozen_valkey_server_misses_then_serves_again(frozen):
    """A real Valkey/Redis server (LMCache's valkey adapter) is frozen with SIGSTOP while
    A and B sit only in it. A's lookup waits its budget (at most LOOKUP_TIMEOUT, where
    the client would wait VALKEY_TIMEOUT; vLLM asks again each step meanwhile), gives up
    and misses; B right after is asked of the tier again (one give-up pauses nothing)
    and misses the same way; their saves meanwhile do not hold the engine up (LMCache
    keeps their objects read-locked while it writes them to the frozen server, until the
    client's timeout). After SIGCONT, with a fresh CPU tier, B hits from the server."""
    script, out, reference, lookups, keys = frozen
    runs = (script, out, reference, lookups)
    assert cached(runs, "cold") == [0, 0]
    assert result(runs, "stored") > 0 and result(runs, "drop1")["after"] == 0
    assert step(runs, "frozen")["outputs"] == [reference["A"][0]]
    assert step(runs, "frozen:next")["outputs"] == [reference["B"][0]]
    assert step(runs, "thawed")["outputs"] == [reference["B"][0]]
    assert cached(runs, "frozen") == [0] and cached(runs, "frozen:next") == [0]
    for label in ("frozen", "frozen:next"):
        (calls,) = in_scheduler(runs, label)
        assert calls > 1, label  # pending: asked again each step
    before = result(runs, "frozen:before")["counters"]
    grew = result(runs, "frozen:snap")["counters"].get("l2_waits_given_up", 0) - \
        before.get("l2_waits_given_up", 0)
    assert grew == 2
    assert result(runs, "drop2")["after"] == 0
    assert cached(runs, "thawed") == [FULL]
    snap = result(runs, "final")
    assert snap["counters"]["hit_tokens_l2"] == FULL  # B came from the server
    assert snap["read_locked"] == 0 and snap["hits"] == 0 and snap["pending"] == 0
    assert keys >= result(runs, "stored")
