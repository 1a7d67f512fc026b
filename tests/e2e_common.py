"""Shared by the end-to-end tests (CPU build and GPU): run the same prompts through
vLLM with and without the connector, and check the connector against the planner."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import gates
from engine_zygote import ZYGOTE

from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
from gemma4_kv.layout.from_hf import hf_layout
from model_keys import chunk_hashes
from gemma4_kv.layout.plan import hit_ends, retained_chunks
from model_keys import max_servable_hit

CHUNK = 256
RETENTION = 512
"""Sliding-window chunks are stored before prompt ends and every 512 tokens."""



def tiny_assistant_config(target, *, layers: int = 4, hidden: int = 64):
    """A Gemma 4 MTP assistant for `target` (its draft layers share target KV)."""
    import transformers

    sliding, full = target.per_layer_config[0], target.per_layer_config[-1]
    text = transformers.Gemma4TextConfig(
        vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=sliding.num_key_value_heads, head_dim=sliding.head_dim,
        global_head_dim=full.head_dim,
        sliding_window=target.sliding_window,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        hidden_activation="gelu_pytorch_tanh")
    cfg = transformers.Gemma4AssistantConfig(text_config=text,
                                             backbone_hidden_size=target.hidden_size)
    cfg.architectures = ["Gemma4AssistantForCausalLM"]
    return cfg

def prompts():
    """The prompts every end-to-end engine runs; `HITS` says what each must hit."""
    rng = random.Random(0)
    base = [rng.randrange(3, 500) for _ in range(1100)]
    other = [rng.randrange(3, 500) for _ in range(700)]
    return [
        base,                        # cold
        base,                        # the same prompt again
        base[:768],                  # 3 stored chunks; P - 1 = 767 ends inside chunk 2
        base[:600] + other[:300],    # shares 600 tokens, off a chunk boundary
        base[:513],                  # P - 1 = 512, on a chunk boundary
        base[:200] + other[:400],    # shares less than a chunk
        base[:256] + other[:44],     # shares exactly one chunk
        base + other,                # longer: its chunks 4-6 are new
        base + other,                # the same again
    ]


# What `prompts()` must hit, derived by hand (not by the planner) for chunk 256,
# retention 512 and a hit multiple m (the largest block size: 64 on the CPU build,
# 32 on the GPU) that never moves a limit below the stored chunks used here. A hit
# is at most L = (P - 1) // m * m and at most the prompt's whole chunks; full groups
# need every chunk before it, a sliding group of window W the chunks holding tokens
# [hit - W + 1, hit). Full groups store every chunk; sliding groups only the windows
# before the request's hit ends: multiples of 512, its last whole chunk, and L.
#
# W = 100 (one chunk before any end):
#   base       0     stores full 0-3, sliding 1 (end 512) and 3 (end 1024)
#   base       1024
#   base[:768] 512   L = 704 (736 on GPU) needs sliding chunk 2: not stored.
#                    Stores sliding 2 (ends 704, 768)
#   +other     512   chunk 2 differs; stores full and sliding 2' (end 768)
#   base[:513] 512   L = 512
#   +other     0     chunk 0 differs; stores full 0'', 1'', sliding 1'' (end 512)
#   base[:256] 0     256 needs sliding chunk 0 of base: no end at 256 so far.
#                    Stores sliding 0 (its last whole chunk)
#   base+other 1024  chunk 4 is new; stores full 4-6, sliding 5, 6 (ends 1536, 1792)
#   base+other 1792  L = 1792
#   stored: 4 + 1 + 2 + 3 = 10 chunks per full group, 2+1+1+1+1+2 = 8 per sliding one.
# W = 512 (two chunks before an end >= 512, the first one before 256):
#   base 0 (stores full and sliding 0-3), base 1024, base[:768] 736 (L = 736 on GPU,
#   sliding 0-2 stored), +other 512 (stores full and sliding 2'), base[:513] 512,
#   +other 0 (stores full and sliding 0'', 1''), base[:256] 256 (sliding chunk 0 was
#   stored for the end 512), base+other 1024 (stores full and sliding 4-6), 1792.
#   stored: 4 + 1 + 2 + 3 = 10 chunks per group of either kind.
HITS = {100: [0, 1024, 512, 512, 512, 0, 0, 1024, 1792],
        512: [0, 1024, 736, 512, 512, 0, 256, 1024, 1792]}
STORED_CHUNKS = {100: {"full": 10, "sliding": 8}, 512: {"full": 10, "sliding": 10}}
"""Objects stored per group of each kind, by sliding window (see `HITS`)."""


def run_engine(tmp_path, name, model, **kw):
    """One engine over `prompts()` (see `start_engine`): (its output, its stats events)."""
    return finish_engine(start_engine(tmp_path, name, model, **kw))


def finish_engine(started):
    """(output, stats events) of an engine `start_engine` started (its gate opened)."""
    harness, stats = started
    if harness.gate:
        harness.open()
    out, _ = harness.result()
    return out, stats_events(stats)


def start_engine(tmp_path, name, model, *, connector, engine, extra=None, spec_cfg=None,
                 connector_class=None, role="kv_both", env=None, preload=(), steps=None,
                 metrics=(), gate=False):
    """An engine over `prompts()`, started (the harness, its stats file). `steps`: a
    harness script instead; `metrics`: vLLM counters to record after each prompt (the
    harness's "metrics"); `gate`: it waits at its gate until `finish_engine`."""
    stats = Path(tmp_path) / f"{name}.stats.jsonl"
    spec = {"model": model, "prompts": prompts(), "connector": connector, "max_tokens": 6,
            "kv_role": role,
            "engine": {"enforce_eager": True, "max_model_len": 4096, **engine},
            "extra_config": {"cpu_gb": 0.25, "stats_file": str(stats),
                             "retention_interval": RETENTION,
                             "intermediate_ends": "always", **(extra or {})},
            "speculative_config": spec_cfg, "preload": list(preload)}
    if steps is not None:
        spec["steps"] = steps
    if metrics:
        spec["metrics"] = list(metrics)
    if connector_class:
        spec.update(connector_class=connector_class, connector_module="broken_connector")
    return Harness(tmp_path, name, spec, env=env, gate=gate), stats


def run_harness(tmp_path, name, spec, *, env=None, unset=()):
    """One engine: the harness (`gemma4_kv.tools.harness`) in a process group of its own over
    `spec` (see `harness_command`). Returns (its output, the finished process); its
    stdout and stderr are kept in `<name>.log`."""
    return Harness(tmp_path, name, spec, env=env, unset=unset).result()


ONE_PROCESS = {"engine": {"distributed_executor_backend": "uni"},
               "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
"""Each test engine runs its engine core and its worker inside the harness process: on
the 2-core CI machine every process of an engine costs its own imports of torch and
vLLM (about 40 s of the 2 minutes an engine took to start beside others). The
connector's halves still talk through their lookup sockets. Engines whose processes a
test measures (tests/test_soak.py, through benchmarks/soak.py) keep vLLM's own
multiprocess layout; a spec or `env` may override both."""


def harness_command(tmp_path, name, spec, *, env=None, unset=()):
    """(command, environment, output path) of a harness run over `spec`: vLLM's CPU KV
    space, the test run's vLLM cache (`VLLM_CACHE_ROOT`, set for the whole run by
    tests/conftest.py; a private one elsewhere), tests/ on the path and pickled
    collective_rpc functions allowed (the "call" steps of engines in processes of their
    own) (`env` on top, `unset` removed)."""
    tmp_path = Path(tmp_path)
    spec_path, out_path = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    if "engine" in spec:  # one process (see ONE_PROCESS)
        spec = {**spec, "engine": {**ONE_PROCESS["engine"], **spec["engine"]}}
    spec_path.write_text(json.dumps(spec))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    full_env = dict(os.environ, **ONE_PROCESS["env"], VLLM_CPU_KVCACHE_SPACE="1",
                    PYTHONHASHSEED="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                    VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT",
                                                   str(tmp_path / "vllm-cache")),
                    PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    full_env.update(env or {})
    for k in unset:
        full_env.pop(k, None)
    # -P: the installed package (with its kernels), not the source tree in the cwd
    cmd = [sys.executable, "-P", "-m", "gemma4_kv.tools.harness", str(spec_path), str(out_path)]
    return cmd, full_env, out_path


def stats_events(path):
    """The events of a connector's stats file (none if it was never written)."""
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def saved_blocks(events) -> Counter:
    """Blocks saved per group id over a run's stats events."""
    saved = Counter()
    for e in events:
        if e["event"] == "save":
            for gid, v in e["groups"].items():
                saved[int(gid)] += v["blocks"]
    return saved


# -- engines in the background, side by side --------------------------------------------------
GATE_TIMEOUT = 1800.0
"""Seconds an engine waits at its gate before it gives up (and exits with an error)."""


class Cores:
    """The CPU each engine's worker is bound to (`VLLM_CPU_OMP_THREADS_BIND`): the least
    used of this process's CPUs, one OpenMP thread. vLLM's automatic binding puts the
    worker of every engine on the same first CPU (one thread on 2 cores), so engines
    started side by side would all run there; one thread each keeps every engine's
    numerics the same wherever it runs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._use = Counter({c: 0 for c in sorted(os.sched_getaffinity(0))})

    def __len__(self) -> int:
        return len(self._use)

    def take(self) -> int:
        with self._lock:
            core = min(self._use, key=lambda c: (self._use[c], c))
            self._use[core] += 1
            return core

    def give(self, core: int) -> None:
        with self._lock:
            self._use[core] -= 1


CORES = Cores()


class Memory:
    """Engines this machine's memory holds at once (`UNIT_GIB` each: a tiny engine's
    1 GiB CPU KV space, which vLLM zero-fills, and its three processes), handed out in
    the order asked (FIFO): an engine pool job holds its units while it runs, an engine
    parked at its gate holds one until it exits. Pool jobs are asked for before any
    parking module's start, and modules park in their test order, so whoever waits, waits
    for engines that finish without it (no deadlock while one module's parked engines
    fit)."""

    UNIT_GIB = 1.75
    KEEP_GIB = 3.0  # pytest, servers, page cache

    def __init__(self):
        try:
            with open("/proc/meminfo") as f:
                avail = next(int(l.split()[1]) << 10 for l in f
                             if l.startswith("MemAvailable"))
        except (OSError, StopIteration):
            avail = 8 << 30
        self.total = max(2, int((avail / (1 << 30) - self.KEEP_GIB) / self.UNIT_GIB))
        self.free = self.total
        self._cv = threading.Condition()
        self._queue: list[object] = []

    def take(self, n: int = 1, timeout: float = 1800.0) -> None:
        n = min(n, self.total)
        me = object()
        deadline = time.monotonic() + timeout
        with self._cv:
            self._queue.append(me)
            try:
                while self._queue[0] is not me or self.free < n:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise AssertionError(
                            f"no memory for {n} more engine(s) within {timeout:.0f} s "
                            f"({self.total} fit; {self.free} free)")
                    self._cv.wait(min(left, 1.0))
                self.free -= n
            finally:
                self._queue.remove(me)
                self._cv.notify_all()

    def give(self, n: int = 1) -> None:
        with self._cv:
            self.free += min(n, self.total)
            self._cv.notify_all()


MEMORY = Memory()


class Harness:
    """One engine: the harness (`gemma4_kv.tools.harness`) over `spec` in a process group of
    its own, started now (see `harness_command`; forked from the test run's zygote where
    it can be, tests/engine_zygote.py); `result()` waits for it and returns
    (its output, the finished process), its stdout and stderr kept in `<name>.log`.

    With `gate`, the engine starts up and then waits at a first step (tests/gates.py)
    until `open()`: engines start side by side (their start-up is most of their time)
    and take turns where a test times them. The gate's step is left out of the output."""

    _live: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, tmp_path, name, spec, *, env=None, unset=(), gate=False,
                 timeout=900.0):
        tmp_path = Path(tmp_path)
        self.name, self.timeout = name, timeout
        self.gate = tmp_path / f"{name}.gate" if gate else None
        if gate:
            for stale in (self.gate, Path(f"{self.gate}.ready")):
                stale.unlink(missing_ok=True)
            steps = spec.get("steps") or [{"prompts": spec["prompts"]}]
            spec = {**spec, "steps": [gates.step(self.gate, GATE_TIMEOUT), *steps]}
        self._unit = bool(gate)  # parked: it holds memory beyond any pool job's
        if self._unit:
            MEMORY.take()
        self.core = CORES.take()
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(self.core), **(env or {})}
        self.cmd, full_env, self.out_path = harness_command(tmp_path, name, spec, env=env,
                                                            unset=unset)
        self.log_path = tmp_path / f"{name}.log"
        self._out = open(tmp_path / f"{name}.stdout", "ab")  # O_APPEND: several processes
        self._err = open(tmp_path / f"{name}.stderr", "ab")
        self.proc = ZYGOTE.spawn(self.cmd, full_env, self._out, self._err)
        self._deadline = time.monotonic() + timeout
        self._done = None
        Harness._live.add(self)

    def texts(self) -> tuple[str, str]:
        """Its stdout and stderr so far."""
        return tuple(Path(f.name).read_text(errors="replace") for f in (self._out, self._err))

    def tail(self) -> str:
        out, err = self.texts()
        return out[-3000:] + err[-8000:]

    def wait_ready(self, timeout: float = 900.0) -> "Harness":
        """Wait until the engine is up and waiting at its gate."""
        ready = Path(f"{self.gate}.ready")
        deadline = time.monotonic() + timeout
        while not ready.exists():
            assert self.proc.poll() is None, f"{self.name} exited before its gate:\n{self.tail()}"
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{self.name} not up after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.1)
        return self

    def open(self) -> "Harness":
        """Let the engine go on past its gate (it has `timeout` seconds from now)."""
        self._deadline = time.monotonic() + self.timeout
        self.gate.touch()
        return self

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL its whole process group (vLLM's engine processes included)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._release()

    def result(self):
        if self._done is None:
            try:
                try:
                    rc = self.proc.wait(timeout=max(1.0, self._deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.kill()
                    raise AssertionError(f"timed out after {self.timeout:.0f} s: "
                                         f"{' '.join(self.cmd)}\n{self.tail()}") from None
            finally:
                self._release()
            out, err = self.texts()
            self.log_path.write_text(out + err)
            assert rc == 0, out[-3000:] + err[-8000:]
            result = json.loads(self.out_path.read_text())
            if self.gate:
                assert result["steps"].pop(0)["result"] == [True]
            self._done = result, subprocess.CompletedProcess(self.cmd, rc, out, err)
        return self._done

    def _release(self) -> None:
        if self._unit:
            self._unit = False
            MEMORY.give()
        if self.core is not None:
            CORES.give(self.core)
            self.core = None
            self._out.close()
            self._err.close()

    @classmethod
    def kill_all(cls) -> None:
        """Every engine still running (at the end of the test run: none should be)."""
        for h in list(cls._live):
            h.kill()
            h._release()


class EnginePool:
    """Engine runs side by side, `slots` at a time, for the test modules that time nothing
    (tests/conftest.py `engine_pool` submits their `engine_jobs`): on 2 cores four
    engines start in about the time of two one after the other. A job is a function
    that runs engines (one after the other where one needs another's result)."""

    def __init__(self, slots: int):
        self.slots = slots
        self._ex = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="engines")
        self._jobs: dict = {}
        self._later: dict = {}
        self._started: dict = {}  # key -> ("ok", state) or ("error", exception)
        self._current = None  # the timed module's state whose engines are up
        self._lock = threading.Lock()
        self.timeline: list[tuple[object, float, float]] = []  # (key, start, end), monotonic
        self.created = time.monotonic()

    def submit(self, key, fn, units: int = 1) -> Future:
        """Run `fn` (holding `units` of `MEMORY` while it runs; 0: it takes its own)."""
        def job():
            if units:
                MEMORY.take(units)
            t0 = time.monotonic()
            try:
                return fn()
            finally:
                self.timeline.append((key, t0, time.monotonic()))
                if units:
                    MEMORY.give(units)

        self._jobs[key] = self._ex.submit(job)
        return self._jobs[key]

    def later(self, key, fn) -> None:
        """A timed module's start-up (its state has `close()`): run by the first
        `result(key)`, after every pool job, with the previous module's engines closed."""
        self._later[key] = fn

    def __contains__(self, key) -> bool:
        return key in self._jobs or key in self._later

    def result(self, key):
        if key in self._jobs:
            return self._jobs[key].result()
        with self._lock:
            if key not in self._started:
                self.drain()
                if self._current is not None:
                    self._current.close()
                    self._current = None
                t0 = time.monotonic()
                try:
                    state = self._later[key]()
                    self.timeline.append((key, t0, time.monotonic()))
                    self._started[key] = ("ok", state)
                    self._current = state
                except BaseException as e:  # noqa: BLE001 - each of its tests reports it
                    self._started[key] = ("error", e)
        how, value = self._started[key]
        if how == "error":
            raise value
        return value

    def drain(self) -> None:
        """Wait until no pool job is queued or running (a test that times an engine runs
        it alone)."""
        wait(list(self._jobs.values()))

    def close(self) -> None:
        for f in self._jobs.values():
            f.cancel()
        if self._current is not None:
            try:
                self._current.close()
            except Exception:  # noqa: BLE001 - the engines are killed below anyway
                pass
        Harness.kill_all()
        self._ex.shutdown(wait=True)
        ZYGOTE.close()


def pool_slots() -> int:
    """Pool jobs side by side: two per CPU (what memory holds is `MEMORY`'s to say)."""
    return 2 * len(CORES)


def counted(out: dict, names) -> list[dict]:
    """Per prompt, how much each of the counters `names` grew (those that did)."""
    rows, last = [], {}
    for snapshot in out["metrics"]:
        now = {n: v for n, v in snapshot.items() if n in names}
        rows.append({n: v - last.get(n, 0) for n, v in now.items() if v != last.get(n, 0)})
        last = now
    return rows


def run_group(cmd, *, env, timeout):
    """Run a command in its own process group; on timeout kill the whole group (vLLM's
    engine processes included), never leave them spinning behind the test run."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n"
                             + out[-3000:] + err[-6000:]) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def expected_hits(layout, retention=RETENTION):
    return expected_store(layout, retention)[0]


def expected_store(layout, retention=RETENTION):
    """Replay the prompts against a model of the store: full groups store every chunk,
    sliding groups the windows before each prompt's hit ends (`plan.hit_ends`).
    Returns the hits and the stored (chunk hash, group) objects."""
    stored, hits = set(), []
    m = layout.chunk_multiple
    for p in prompts():
        hashes = chunk_hashes(p, CHUNK)
        limit = (len(p) - 1) // m * m
        hits.append(max_servable_hit(layout, CHUNK, len(hashes),
                                     lambda g, c: (hashes[c], g) in stored, limit=limit))
        ends = hit_ends(len(hashes), CHUNK, limit, retention)
        for g in layout.groups:
            stored.update((hashes[c], g.group_id) for c in retained_chunks(g, CHUNK, ends))
    return hits, stored


def check_against_plan(cfg, events, out, base, *, dtype, block_size, page_bytes,
                       assistant=None):
    """The connector's run of `prompts()` against recomputation and what `HITS` derives
    by hand: hits, blocks and bytes loaded per group, objects saved. `page_bytes`: every
    group's page (vLLM makes them equal), worked out by hand from the config."""
    layout = hf_layout(cfg, assistant_config=assistant, dtype=dtype, block_size=block_size)
    # The worker built its descriptors from vLLM's real KVCacheConfig and tensors:
    # they must be the groups we predict from the config, KV-shared aliases included.
    (real,) = [e for e in events if e["event"] == "layout"]
    groups = real["groups"]
    assert [(g["kind"], g["window"], g["block_size"], g["layers"], g["aliases"])
            for g in groups] == [
        (g.kind.value, g.window, g.block_size, list(g.layers),
         [a for a, _ in g.aliases if not a.startswith("draft_model.") or assistant])
        for g in layout.groups]

    differing = [(i, hits_i, a, b) for i, (hits_i, a, b) in
                 enumerate(zip(out["cached"], out["outputs"], base["outputs"])) if a != b]
    assert not differing, f"greedy tokens differ from recomputation: {differing}"
    hits = HITS[cfg.sliding_window]
    assert out["cached"] == hits
    assert base["cached"] == [0] * len(hits)
    # The planner agrees with the hand derivation (a clearer message if it drifts).
    assert expected_hits(layout) == hits

    loads = [e for e in events if e["event"] == "load"]
    assert [e["end"] for e in loads] == [h for h in hits if h]
    for e in loads:
        for gid, g in enumerate(groups):
            blocks = _blocks_for_hit(g["block_size"], g["window"], e["end"])
            assert e["groups"][str(gid)] == {
                "blocks": blocks, "bytes": blocks * page_bytes * len(g["layers"])}
    # Every object the hand derivation stores is saved exactly once, and nothing else.
    chunks = STORED_CHUNKS[cfg.sliding_window]
    assert saved_blocks(events) == Counter({
        gid: chunks["full" if g["window"] is None else "sliding"] * CHUNK // g["block_size"]
        for gid, g in enumerate(groups)})


def _blocks_for_hit(block_size: int, window: int | None, hit: int) -> int:
    """Blocks a group loads for a hit of `hit` tokens: all of them for full attention;
    for a window W those from the one holding token hit - W + 1 on (vLLM's
    SlidingWindowManager frees the blocks wholly before it)."""
    first = 0 if window is None else max(0, hit - window + 1) // block_size
    return hit // block_size - first


def mtp_case_runs(tmp_path, *, engine, env=None, preload=()) -> dict:
    """The two engine runs of the MTP case (target + Gemma 4 MTP assistant, with and
    without the connector), as jobs: {"base": job, "conn": job}, each job returning
    (cfg, output, stats events)."""
    cfg = tiny_gemma4_config(window=100)
    model = save_config(cfg, Path(tmp_path) / "model")
    assistant = save_config(tiny_assistant_config(cfg), Path(tmp_path) / "assistant")
    spec_cfg = {"method": "mtp", "model": assistant, "num_speculative_tokens": 1}

    def job(name, connector):
        return lambda: (cfg, *run_engine(tmp_path, name, model, connector=connector,
                                         engine=engine, spec_cfg=spec_cfg, env=env,
                                         preload=preload))

    return {"base": job("base", False), "conn": job("conn", True)}


def check_mtp_case(runs, *, check):
    """`mtp_case_runs`' results {"base": ..., "conn": ...} against each other and the plan."""
    cfg, base, _ = runs["base"]
    _, out, events = runs["conn"]
    check_against_plan(cfg, events, out, base, assistant=tiny_assistant_config(cfg).text_config,
                       **check)
    # Draft acceptance identical after every prompt. The number of drafts is not: on a
    # hit that leaves a one-token tail (base[:513]) vLLM's scheduler runs that token
    # like a decode step, with a placeholder draft (-1) that it counts as one more
    # (rejected) draft; tokens are identical (seen on CPU and GPU).
    counter = "vllm:spec_decode_num_accepted_tokens"
    assert [s[counter] for s in out["spec_decode"]] == [s[counter] for s in base["spec_decode"]]
    drafts = "vllm:spec_decode_num_drafts"
    assert base["spec_decode"][-1][drafts] > 0 and out["spec_decode"][-1][drafts] > 0
    return base, out


def run_mtp_case(tmp_path, *, engine, check, env=None, preload=()):
    """Target + Gemma 4 MTP assistant, with and without the connector, one after the other."""
    jobs = mtp_case_runs(tmp_path, engine=engine, env=env, preload=preload)
    return check_mtp_case({name: job() for name, job in jobs.items()}, check=check)
