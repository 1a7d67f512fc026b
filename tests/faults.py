"""Faults injected into a running engine, for tests/test_e2e_faults.py and the soak.

Every public function is a `collective_rpc` target: the harness's
`{"call": "faults:<name>", "kwargs": {...}}` step runs `name(worker, **kwargs)` on each
worker (tests/ is on the engine's PYTHONPATH). A fault wraps a method of the live
connector's objects (`LookupService`, `EmbeddedStore`, LMCache's adapters) on the instance,
or changes what they hold (L1 contents, disk files); `arm` installs it, `disarm` takes it
off and returns what it did, so a test can show the fault really happened.

The scheduler half runs in vLLM's engine-core process, which the CPU build spawns (no
fork): engines that must pause lookups for less than `scheduler.RANK_BACKOFF_S` load
their connector from here (`FaultsConnector`, harness `connector_module: "faults"`).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

from gemma4_kv.connector import scheduler
from gemma4_kv.connector import Gemma4KVConnector

RANK_BACKOFF_S = 3.0
"""The scheduler's pause after a rank failed a lookup, under `FaultsConnector` (10 s by
default, too long to wait for in CI)."""


SCHEDULER_LOG = "GEMMA4_KV_FAULTS_SCHEDULER_LOG"
"""Environment variable: a file where `FaultsConnector` appends one JSON line per
`get_num_new_matched_tokens` call (request, wall time, seconds it took, answer, and how
many requests the scheduler half keeps state for)."""


class FaultsConnector(Gemma4KVConnector):
    """The connector, with the scheduler's lookup pause after a failed rank shortened
    (`scheduler.RANK_BACKOFF_S` is a module attribute the scheduler half reads when it is
    built), and each lookup's time in the scheduler recorded: how long a fault held
    vLLM's scheduler up, measured where it happens rather than through TTFT."""

    def __init__(self, *args, **kwargs):
        scheduler.RANK_BACKOFF_S = RANK_BACKOFF_S
        super().__init__(*args, **kwargs)
        self._faults_log = os.environ.get(SCHEDULER_LOG)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        t0, wall = time.perf_counter(), time.time()
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self._faults_log:
            with open(self._faults_log, "a") as f:
                f.write(json.dumps({"req": request.request_id, "t": wall,
                                    "seconds": time.perf_counter() - t0,
                                    "tokens": answer[0],
                                    "tracked": len(self._scheduler._requests)}) + "\n")
        return answer


_armed: dict[str, dict] = {}  # fault name -> its state and counters (per process)
_totals: Counter = Counter()  # cumulative connector counters (vLLM takes the live ones)


def _worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def _lmcache(store):
    """LMCache's StorageManager inside the store's adapter: faults reach into LMCache
    itself (its L1's locks, its L2 adapters), which the store never uses."""
    return store.tier.storage_manager


def _hashes(tokens: list[int], chunk_size: int) -> list[bytes]:
    """The scheduler's chunk keys of a plain token prompt (generation "", no salt)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from keyer import chunk_keys

    req = Request("faults", tokens, SamplingParams(max_tokens=1), None)
    return chunk_keys(req, chunk_size).hashes


# -- what the store holds -----------------------------------------------------------------
def count_stats(worker) -> bool:
    """Keep a running total of the connector's counters (vLLM takes them every step)."""
    stats = _worker().stats
    if getattr(stats, "_faults_counted", False):
        return True
    add = stats.add

    def counted(name, value, group=None):
        _totals[name] += value
        add(name, value, group)

    stats.add = counted
    stats._faults_counted = True
    return True


def snapshot(worker, disk: str | None = None) -> dict:
    """Memory and bookkeeping of this rank: process RSS, the CPU tier (used bytes, objects,
    read-locked objects and their bytes, LMCache staging), the connector's own tables,
    and the running counters."""
    import psutil

    w = _worker()
    store, lookups = w.store, w.lookups
    status = store.tier.status()
    l1 = _lmcache(store)._l1_manager
    with l1._lock:
        locked_bytes = sum(e.memory_obj.get_size() for e in l1._objects.values()
                           if e.read_lock.is_locked())
    used, total = store.usage()
    me = psutil.Process()
    out = {
        "pid": os.getpid(), **_lineage(me),
        "rss": me.memory_info().rss,
        "parent_rss": me.parent().memory_info().rss,  # vLLM's engine core (the scheduler)
        "l1_used": used, "l1_total": total,
        "objects": status["total_object_count"] - status["staging_object_count"],
        "read_locked": status["read_locked_count"], "read_locked_bytes": locked_bytes,
        "write_locked": status["write_locked_count"],
        "staging": status["staging_object_count"], "staging_bytes": status["staging_bytes"],
        "tracked": len(store.capacity.tracked()), "ends": len(store.capacity.live_ends()),
        "reserved": len(set(store.capacity.tracked()) - store.capacity._stored),
        **store.l2.counts(),  # inflight, untrusted, bad, hung, unverified
        "hits": len(lookups._hits), "pending": len(lookups._pending),
        "saves_pending": len(w.saves),
        "counters": dict(_totals),
        "prefill_s_per_token": lookups.wait.rates.prefill_s(1),
        "fillers": len(_armed.get("store_full", {}).get("keys", ())),
    }
    if disk:
        out["disk_files"] = len([p for p in Path(disk).rglob("*") if p.is_file()])
    return out


def rss(worker) -> dict:
    """RSS of this worker and of its parent (vLLM's engine core); needs no connector, so
    a recomputation engine can be measured alike."""
    import psutil

    me = psutil.Process()
    return {"pid": os.getpid(), **_lineage(me), "rss": me.memory_info().rss,
            "parent_rss": me.parent().memory_info().rss}


def _lineage(me) -> dict:
    """Where this worker runs: the PIDs above it (its parent first, three at most) and its
    parent's name. With vLLM's multiprocessing on (the CPU build: mp executor), the
    parent is the engine core, whose parent is the front-end (the harness); with
    VLLM_ENABLE_V1_MULTIPROCESSING=0 all three are one process, the harness."""
    ancestors, p = [], me
    while len(ancestors) < 3 and (p := p.parent()) is not None:
        ancestors.append(p.pid)
    return {"ancestors": ancestors, "parent": me.parent().name()}


def drop_l1(worker, timeout: float = 30.0) -> dict:
    """Empty the CPU tier (what a fresh engine has). Waits first until nothing is
    read-locked: no request is in flight between steps, but LMCache holds objects it is
    still writing to an L2 tier (a server that was frozen) until those writes end.
    Raises TimeoutError, dropping nothing, if objects are still read-locked after
    `timeout` seconds: they would stay in L1 and the step after would not start from
    an empty CPU tier."""
    store = _worker().store
    t0 = time.monotonic()
    while True:  # the lookup thread settles prefetches (`ChunkStore.poll` is its alone)
        before = store.tier.status()
        if not before["read_locked_count"]:
            break
        if time.monotonic() > t0 + timeout:
            raise TimeoutError(
                f"faults.drop_l1: {before['read_locked_count']} CPU-tier object(s) still "
                f"read-locked after {timeout} s (an L2 write or a load that never ended); "
                "nothing dropped")
        time.sleep(0.05)
    store.drop_l1()
    after = store.tier.status()
    return {"before": before["total_object_count"], "after": after["total_object_count"],
            "read_locked": after["read_locked_count"],
            "waited": round(time.monotonic() - t0, 2)}


def wait_l2(worker, disk: str | None = None, port: int | None = None,
            timeout: float = 60.0) -> int:
    """Wait until LMCache has written every CPU-tier object to the L2 tier (its stores are
    asynchronous): no copy in flight (`EmbeddedStore.l2_writes_in_flight`: a task ends
    once its files are written), none holding a read lock (one just taken off LMCache's
    queue), and the disk tier's files, or a Redis-protocol server's keys on `port`, as
    many as the CPU tier's objects; how many there are. Call it with no request in
    flight (then only L2 writes hold read locks). Raises TimeoutError if that is not
    so after `timeout` seconds."""
    store = _worker().store
    deadline = time.monotonic() + timeout
    while True:
        status = store.tier.status()
        have = _server_keys(port) if port else len(
            [p for p in Path(disk).rglob("*") if p.is_file() and p.stat().st_size > 0])
        in_flight = store.l2_writes_in_flight()
        if have >= status["total_object_count"] and status["read_locked_count"] == 0 \
                and in_flight == 0:
            return have
        if time.monotonic() > deadline:
            where = f"the server on port {port}" if port else f"the disk tier in {disk}"
            raise TimeoutError(
                f"faults.wait_l2: after {timeout} s {where} holds {have} object(s) of the "
                f"CPU tier's {status['total_object_count']}, and "
                f"{status['read_locked_count']} are still read-locked by writes, "
                f"{in_flight} write(s) in flight")
        time.sleep(0.05)


def _server_keys(port: int) -> int:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"DBSIZE\r\n")
        return int(s.recv(64).strip().lstrip(b":"))


def signal(worker, pid: int, name: str) -> str:
    """Send a signal to another process (SIGSTOP / SIGCONT a tier's server mid-run)."""
    import signal as signals

    os.kill(pid, getattr(signals, name))
    return name


def damage(worker, disk: str, victims: list[dict]) -> list[str]:
    """Damage disk-tier objects: each victim {"tokens", "chunk", "kind", "how"} names the
    object of chunk `chunk` of that prompt in the first group of `kind` (full / sliding);
    `how` is delete, truncate (100 bytes cut off the end) or flip (64 bytes inverted in
    the middle)."""
    w = _worker()
    store = w.store
    done = []
    for v in victims:
        h = _hashes(v["tokens"], w.chunk_size)[v["chunk"]]
        gid = next(g.group_id for g in w.layout.groups if g.kind.value == v["kind"])
        (path,) = [p for p in Path(disk).rglob("*") if p.is_file()
                   and p.name.startswith(store.namespace + "@") and h.hex() in p.name
                   and int(p.name.split("@")[2], 16) == gid]
        raw = path.read_bytes()
        if v["how"] == "delete":
            path.unlink()
        elif v["how"] == "truncate":
            path.write_bytes(raw[:-100])
        elif v["how"] == "flip":
            mid = len(raw) // 2
            path.write_bytes(raw[:mid] + bytes(b ^ 0xFF for b in raw[mid:mid + 64])
                             + raw[mid + 64:])
        else:
            raise ValueError(v["how"])
        done.append(f"{v['how']} {path.name} ({len(raw)} bytes)")
    return done


# -- faults ---------------------------------------------------------------------------------
def arm(worker, fault: str, **params) -> dict:
    """Install `fault` (one of FAULTS) with its parameters; what it found at install."""
    if fault in _armed:
        raise RuntimeError(f"{fault} is armed already")
    state = {"fired": 0, **params}
    _armed[fault] = state
    return FAULTS[fault][0](_worker(), state) or {}


def disarm(worker, fault: str) -> dict:
    """Take `fault` off; its state (how often it fired, what it changed)."""
    state = _armed.pop(fault)
    FAULTS[fault][1](_worker(), state)
    return {k: v for k, v in state.items() if k not in ("keys", "undo")}


def _patch(state: dict, obj, name: str, make):
    """Replace obj.name by make(original) on the instance; remember how to undo it."""
    original = getattr(obj, name)
    setattr(obj, name, functools.wraps(original)(make(original)))
    state.setdefault("undo", []).append(lambda: delattr(obj, name))


def _undo(w, state: dict) -> None:
    for undo in reversed(state.get("undo", [])):
        undo()


def _one_shot(state: dict) -> bool:
    if state["fired"] < state.get("shots", 1):
        state["fired"] += 1
        return True
    return False


def _evict_unlocked(store, state: dict, force: bool = False) -> None:
    """Everything in L1 that is not locked goes (with `force`, locked objects too: the
    negative control); counts what went and what stayed."""
    before = store.tier.status()["total_object_count"]
    if force:
        _lmcache(store).clear(force=True)
    else:
        store.drop_l1()
    after = store.tier.status()
    state["evicted"] = state.get("evicted", 0) + before - after["total_object_count"]
    state["kept_locked"] = after["read_locked_count"]


def _flood(store, state: dict) -> None:
    """Write NaN into every free byte of L1 and give it back: whatever a load reads from
    memory that is not pinned is garbage from here on."""
    objs = _fill(store, "faults-flood")
    for obj in objs.values():
        for i in range(2):
            t = obj.get_tensor(i)
            t.fill_(float("nan") if t.is_floating_point() else -1)
    state["flooded_objects"] = state.get("flooded_objects", 0) + len(objs)
    store.tier.discard(list(objs))


def _fill(store, namespace: str, leave: int = 0) -> dict:
    """Reserve objects of the smallest group's size under a foreign namespace until L1
    has no room (write-locked: neither visible nor evictable), then give `leave` of them
    back; {key: LMCache memory object}."""
    from lmcache.v1.distributed.api import ObjectKey

    gid = min(store._groups, key=lambda g: store._bytes[g])
    layout = store._layouts[gid]
    objs, n, size = {}, 0, 64
    while size:  # LMCache allocates a batch whole or not at all: halve it until 1 fails
        batch = [ObjectKey(chunk_hash=f"{namespace}-{n + i}".encode().ljust(32, b"\0"),
                           model_name=namespace, kv_rank=store.kv_rank, object_group_id=gid)
                 for i in range(size)]
        n += size
        got = _lmcache(store).reserve_write(batch, layout)
        objs.update(got)
        if len(got) < len(batch):
            size //= 2
    for k in list(objs)[len(objs) - leave:] if leave else ():
        store.tier.discard([k])
        del objs[k]
    return objs


# evicted between the residency check and the pin
def _arm_evict_before_pin(w, state):
    lookups = w.lookups

    def make(original):
        def candidates(*a, **kw):
            out = original(*a, **kw)
            if out and _one_shot(state):
                _evict_unlocked(lookups.store, state)
            return out
        return candidates
    _patch(state, lookups, "_candidates", make)


# evicted (and the memory reused) between the pin and the load
def _arm_evict_after_pin(w, state):
    lookups = w.lookups

    def make(original):
        def pin(*a, **kw):
            hit = original(*a, **kw)
            if hit is not None and _one_shot(state):
                _evict_unlocked(lookups.store, state, force=state.get("force", False))
                if state.get("flood", True):
                    _flood(lookups.store, state)
            return hit
        return pin
    _patch(state, lookups, "_pin", make)


# a pin (the CPU-tier read behind a hit) that finds nothing
def _arm_pin_fails(w, state):
    def make(original):
        def pin(*a, **kw):
            state["fired"] += 1
            return None
        return pin
    _patch(state, w.store, "pin", make)


# LMCache's read of read-locked objects raises (after the pin took its locks)
def _arm_read_raises(w, state):
    """LMCache's read raises once: the first read of at least `min_keys` objects (a pin
    reads a hit's objects in one call; verifying what came up from L2 reads one)."""
    sm = _lmcache(w.store)

    def make(original):
        def unsafe_read(keys, *a, **kw):
            if len(keys) >= state.get("min_keys", 1) and _one_shot(state):
                raise RuntimeError("faults: injected CPU-tier read failure")
            return original(keys, *a, **kw)
        return unsafe_read
    _patch(state, sm, "unsafe_read", make)


# every L2 load fails (LMCache's fault_inject adapter: present at lookup, load fails)
def _fault_adapter(w):
    from lmcache.v1.distributed.l2_adapters.fault_inject_l2_adapter import FaultInjectL2Adapter

    (adapter,) = [a for _, a in _lmcache(w.store).l2_adapters()
                  if isinstance(a, FaultInjectL2Adapter)]
    return adapter


def _arm_l2_load_fails(w, state):
    adapter = _fault_adapter(w)
    state["was"] = adapter._rate
    adapter._rate = state.get("rate", 1.0)


def _disarm_l2_load_fails(w, state):
    _fault_adapter(w)._rate = state["was"]


# the L2 tier answers lookups `delay` seconds late
def _inner_adapter(w):
    adapter = _lmcache(w.store).l2_adapters()[0][1]
    return getattr(adapter, "_inner", adapter)


def _arm_slow_tier(w, state):
    """Each lookup answer of the (inner) L2 adapter is held back until `delay` seconds
    after LMCache first asked for it, or until the fault is disarmed (the tier is back);
    a timer then wakes LMCache's prefetch loop to ask again."""
    adapter = _inner_adapter(w)
    delay = state["delay"]
    first_asked: dict = {}
    state["timers"], state["held"] = [], 0

    def make(original):
        def query(task_id):
            if task_id not in first_asked:
                first_asked[task_id] = time.monotonic()
                state["held"] += 1
                t = threading.Timer(delay, adapter._lookup_efd.notify)
                t.daemon = True
                t.start()
                state["timers"].append(t)
            if not state.get("released") and time.monotonic() < first_asked[task_id] + delay:
                return None
            return original(task_id)
        return query
    _patch(state, adapter, "query_lookup_and_lock_result", make)

    def count(original):
        def start(*a, **kw):
            state["prefetches"] = state.get("prefetches", 0) + 1
            return original(*a, **kw)
        return start
    state["prefetches"] = 0
    _patch(state, w.store, "start_prefetch", count)


def _disarm_slow_tier(w, state, timeout: float = 60.0):
    """The tier answers again: every held answer is given now, and this returns once
    the prefetches they held have settled (none in flight or given up), so the next
    lookup finds no key withheld for them. Raises TimeoutError if they have not after
    `timeout` seconds."""
    state["released"] = True
    for t in state.pop("timers"):
        t.cancel()
    _inner_adapter(w)._lookup_efd.notify()
    store, deadline = w.store, time.monotonic() + timeout
    while (left := store.l2.counts())["inflight"] or left["hung"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"faults: L2 prefetches still unsettled {timeout} s after "
                               f"the slow tier answered again: {left}")
        time.sleep(0.05)  # the lookup thread polls (`ChunkStore.poll` is its alone)
    _undo(w, state)


# not a fault: the lookups' skip of L2 after repeated give-ups made to last `seconds`
def _arm_long_l2_pause(w, state):
    """The first pause lasts 5 s by default: a loaded CI machine can outlast it between
    two prompts. Disarm ends it, as its time running out would."""
    wait = w.lookups.wait
    state["was"] = wait._pause
    wait._pause = state["seconds"]


def _disarm_long_l2_pause(w, state):
    wait = w.lookups.wait
    wait._paused_until, wait._pause = time.monotonic(), state["was"]


# a worker rank that does not answer one lookup within the scheduler's RANK_TIMEOUT_S:
# the lookup thread is held until the fault is disarmed (at most `stall` seconds)
def _arm_silent_rank(w, state):
    from gemma4_kv.lookup import messages

    lookups = w.lookups
    stall = state.get("stall", 60.0)
    state["go"] = go = threading.Event()

    def make(original):
        def handle(msg):
            if isinstance(msg, messages.Lookup) and _one_shot(state):
                go.wait(stall)
            return original(msg)
        return handle
    _patch(state, lookups, "handle", make)
    # the server thread calls the handler it was given: route it through the instance
    server = w.server
    state["server_handle"] = server._handle
    server._handle = lambda msg: lookups.handle(msg)


def _disarm_silent_rank(w, state):
    state.pop("go").set()
    w.server._handle = state.pop("server_handle")
    _undo(w, state)


# the CPU tier has no room for saves (everything in it is a write reservation)
def _arm_store_full(w, state):
    store = w.store
    _evict_unlocked(store, state)
    state["keys"] = list(_fill(store, "faults-filler", leave=state.get("leave", 0)))
    state["filled"] = len(state["keys"])
    state["used_full"] = store.usage()[0]
    return {"filled": state["filled"], "used": state["used_full"]}


def _disarm_store_full(w, state):
    store = w.store
    state["used_before_release"] = store.usage()[0]
    store.tier.discard(state["keys"])
    state["used_after_release"] = store.usage()[0]


FAULTS = {
    "evict_before_pin": (_arm_evict_before_pin, _undo),
    "evict_after_pin": (_arm_evict_after_pin, _undo),
    "pin_fails": (_arm_pin_fails, _undo),
    "read_raises": (_arm_read_raises, _undo),
    "l2_load_fails": (_arm_l2_load_fails, _disarm_l2_load_fails),
    "slow_tier": (_arm_slow_tier, _disarm_slow_tier),
    "long_l2_pause": (_arm_long_l2_pause, _disarm_long_l2_pause),
    "silent_rank": (_arm_silent_rank, _disarm_silent_rank),
    "store_full": (_arm_store_full, _disarm_store_full),
}


def settle_saves(worker, timeout: float = 30.0) -> bool:
    """Commit every save this worker has made (waiting for their copies) and wait until
    the store's server has answered what was handed back, so that a lookup of the next
    prompt sees them. Without it a loaded machine can look up before the last save
    landed (eventual visibility: a miss, then a hit one prompt later)."""
    w = _worker()
    w.saves.wait()
    flush = getattr(w.store, "flush", None)
    return bool(flush(timeout)) if flush is not None else True
