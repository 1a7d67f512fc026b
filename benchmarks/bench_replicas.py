"""Replicas: N live vLLM replicas serving at once behind a router that knows nothing of
caches, each with its own KV tier or sharing one (issue 33, item 1).

    python benchmarks/bench_replicas.py --out DIR [--shapes gemma4-12b-like,gemma4-31b-like]
        [--systems alone,server,valkey,resp,servers+valkey,offloading-fs] [--replicas 2]
        [--repeats K] [--docs 16] [--batch 4]
    python benchmarks/bench_replicas.py --smoke --out DIR [--systems alone,server]
    python benchmarks/bench_replicas.py --plot-only OUT.png DIR/replicas.json
    python benchmarks/bench_replicas.py --merge DIR A/replicas.json B/replicas.json  # split runs

Workload (the hand measurement of 2026-12-04 on the H200): `--docs` documents (16) split
evenly over the replicas, `--batch` (4) requests in flight per replica (one
`llm.generate` of a list at a time), all replicas serving at once, three rounds:
1. each replica asks about its own share of the documents (question 0; cold);
2. each asks about the next replica's share: the very requests that replica sent in
   round 1, in the same order and batches (a cache-blind router sends them elsewhere);
   their greedy tokens are compared with that replica's round-1 tokens (a cold run of the
   same prompts on the same random weights) and reported, never asserted;
3. each asks about its own share again (question 1, a new question).
A round's wall time is the slowest replica's (each times its own `llm.generate` calls);
its hit share is prompt tokens served by the connector (vLLM's
`vllm:external_prefix_cache_hits`) over prompt tokens, summed over replicas; what vLLM's
GPU prefix cache served is counted apart. Between rounds (untimed) every replica lets its
stores land (`common/workload.py` `settle_stores`, after a `--settle-s` pause for every system),
then the driver waits until the shared tiers stop growing (`--quiet-s`: write-behind to
an L2 or an fs tier), so round 2 can see what round 1 stored.

Systems (a fresh set of servers, tiers and replicas for each run):
- `alone`: each replica its own embedded CPU tier (`cpu_gb`), nothing shared (the
  negative control: round 2 has no hits);
- `server`: one `lmcache server` (L1 `--server-l1-gb`) that every replica uses;
- `valkey`: each replica the embedded store at its default CPU tier (`cpu_gb` 4, scaled:
  see below) with one shared Valkey server as its L2 tier (`l2_adapters`), through
  LMCache's `valkey` adapter (the glide client);
- `resp`: the same through a `resp` adapter (LMCache's C++ client under gemma4-kv's
  `RespClient`: it receives straight into L1);
- `servers+valkey`: one `lmcache server` per "host" (two servers on one machine stand for
  two hosts; L1 `--server-l1-gb` / N each), each replica on its own, the servers sharing
  one Valkey as their L2 (`server_argv(..., l2_adapters=[...])`);
- `offloading-fs`: vLLM's OffloadingConnector, its CPU tier (`cpu_gb`) plus a
  `TieringOffloadingSpec` fs tier in one directory every replica shares
  (`common/peers.py`); needs vLLM >= 0.33 and CUDA (the H200 bundle), skipped
  with a line elsewhere;
- `none`: no connector (optional).
Every other connector setting is at its default.

Shapes: the bundled `gemma4-12b-like` (8K-token documents) and `gemma4-31b-like` (32K),
random weights, built with `--layers` of their layers (12; the same groups, head sizes and
window). Tier sizes are given for the whole model (the hand measurement's, for 12B: CPU
tier 24 GiB per replica, server L1 48 GB, Valkey 48 GB, the default CPU tier 4 GiB) and
scaled by layers / the shape's layers, so tiers hold the same share of the documents as
at full depth; vLLM's GPU KV cache per replica holds `--batch` requests of the longest
prompt (densely), far less than a replica's share. JSON and table show the sizes used.

Engines: each replica is a process of its own (`--replica`, the serving workload's engine
arguments), started together with `--gpu-memory-utilization` 0.8 / N, that warms up
(Triton compiles; other documents, a store and its hit) before it says it is ready. The
machine's first engine is untimed: a connector-free one runs its warm-up first
(`--no-prime` skips it). `--repeats K` runs the systems interleaved (A B C A B C ...) and
reports the median and range of every cell.

Writes DIR/replicas.json (device, date, command, git commit, every run with its
per-replica numbers, the cells, the token checks), prints a table, writes
DIR/replicas.png (matplotlib, if installed; later: --plot-only) and every replica's and
server's log under DIR/logs/.

`--smoke`: vLLM's CPU build, the tests' tiny Gemma 4 (bench_serving `--tiny`), 4
documents of 2048 tokens, 2 in flight, in-process engines, no prime (tests/
test_bench_replicas.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # common, vllm_standins
sys.path.insert(0, str(ROOT / "tests"))  # lmcache_servers, tier_servers (as bench_valkey)

from common import workload  # noqa: E402
from common.peers import transfer_config  # noqa: E402

SYSTEMS = ("alone", "server", "valkey", "resp", "servers+valkey", "offloading-fs", "none")
DEFAULT_SYSTEMS = "alone,server,valkey,resp,servers+valkey,offloading-fs"
GiB = 1 << 30
ROUNDS = ("own (cold)", "other's", "own again")

SHAPES = {
    # doc_len; tier sizes for the whole model (GiB): each replica's CPU tier (`alone`,
    # `offloading-fs`), the one server's L1, Valkey's maxmemory
    "gemma4-12b-like": dict(doc_len=8192, cpu_gb=24.0, server_l1_gb=48.0, valkey_gb=48.0),
    # 16 documents of 32K tokens as gemma4-kv keeps them take 150 GB at all 60 layers
    # (12B: 15 GB): tiers of the same ratios to them
    "gemma4-31b-like": dict(doc_len=32768, cpu_gb=80.0, server_l1_gb=160.0, valkey_gb=160.0),
}
DEFAULT_CPU_GB = 4.0  # the connector's cpu_gb default (the `valkey` row keeps it)

SMOKE = dict(shapes="tiny", docs=4, batch=2, max_tokens=2, doc_len=2048, question_len=16,
             repeats=1, prime=False, inproc=True, settle_s=0.1, start_timeout=240.0,
             round_timeout=120.0, max_num_batched_tokens=1024,
             kv_cache_gb=0.008)  # GPU KV: one request, nothing left for a later round
"""Documents of 2048 tokens, not 512: a lookup waits for the server (or an L2) at most
the measured prefill time of what it would add (`lookup/wait.py`), and on 2 busy cores a
512-token prefill of the tiny model was shorter than the server's answer (round 1 gave up
waiting, the pause after three give-ups spanned round 2: no hits)."""
SMOKE_TIERS = dict(cpu_gb=0.05, server_l1_gb=0.25, valkey_gb=0.25, valkey_cpu_gb=0.02)
"""Every tier holds what it is asked to keep (the smoke test checks bookkeeping, not
capacity)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory for JSON, PNG and logs")
    p.add_argument("--smoke", action="store_true",
                   help="vLLM's CPU build, tiny model and sizes (the CPU test)")
    p.add_argument("--shapes", default="gemma4-12b-like",
                   help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, default=12, help="layers kept of each shape")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS,
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--docs", type=int, default=16, help="documents, split over replicas")
    p.add_argument("--doc-len", type=int, help="tokens (default: the shape's, 8K / 32K)")
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="requests in flight per replica")
    p.add_argument("--max-tokens", type=int, default=4, help="greedy answer tokens")
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs of each system")
    p.add_argument("--prime", action=argparse.BooleanOptionalAction, default=True,
                   help="an untimed connector-free engine first (compiles, caches)")
    p.add_argument("--cpu-gb", type=float, help="each replica's CPU tier, actual GiB "
                   "(default: the shape's, scaled)")
    p.add_argument("--valkey-cpu-gb", type=float,
                   help=f"`valkey` row's CPU tier (default: {DEFAULT_CPU_GB} scaled)")
    p.add_argument("--server-l1-gb", type=float, help="the one server's L1, actual GB "
                   "(default: the shape's, scaled); servers+valkey: / N per server")
    p.add_argument("--valkey-gb", type=float, help="Valkey maxmemory (default: scaled)")
    p.add_argument("--kv-cache-gb", type=float,
                   help="vLLM's GPU KV cache per replica (default: --batch prompts, dense)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="per replica (default 0.8 / replicas)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="untimed pause after each round before its stores are awaited")
    p.add_argument("--quiet-s", type=float, default=0.5,
                   help="after a round, untimed: wait until the shared tiers (server L1, "
                        "Valkey keys, fs bytes) stay unchanged this long (at most 60 s)")
    p.add_argument("--start-timeout", type=float, default=420.0,
                   help="seconds for the replicas to start and warm up")
    p.add_argument("--round-timeout", type=float, default=300.0)
    p.add_argument("--inproc", action="store_true",
                   help="engine and worker in the replica's process (vLLM's CPU build)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    given = sys.argv[1:] if argv is None else argv
    if "--smoke" in given:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.systems = [s for s in args.systems.split(",") if s]
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    for s in args.shapes:
        if s not in SHAPES and not (args.smoke and s == "tiny"):
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    if args.docs % args.replicas:
        p.error("--docs must split evenly over --replicas")
    return args


# -- shapes and sizes (driver and replicas; no vLLM) ---------------------------------------

def serving_argv(args, shape: str) -> list[str]:
    """The serving workload's options for this shape (its model, layout and engine arguments),
    as a command line: the driver and every replica parse the same."""
    argv = ["--out", "/dev/null", "--batch", str(args.batch), "--max-tokens",
            str(args.max_tokens), "--question-len", str(args.question_len),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--chat-users", "1", "--chat-turns", "1", "--chat-history", "64"]
    if shape == "tiny":
        argv += ["--tiny", "--doc-len", str(args.doc_len or 512)]
    else:
        argv += ["--config", shape, "--layers", str(args.layers),
                 "--doc-len", str(args.doc_len or SHAPES[shape]["doc_len"])]
    return argv + (["--inproc"] if args.inproc else [])


def serving_args(args, shape: str) -> argparse.Namespace:
    return workload.parse_args(serving_argv(args, shape))


def shape_sizes(args, shape: str) -> dict:
    """Tier sizes (actual GiB) and what the documents take, for one shape."""
    sa = serving_args(args, shape)
    cfg = workload.model_config(sa)
    layout = workload.layout_of(sa, cfg)
    sz = workload.sizes(sa, layout)
    dense = sz["dense_bytes_per_token"]
    if shape == "tiny":
        scale, tiers = 1.0, dict(SMOKE_TIERS)
    else:
        full = json.loads(_bundled(shape).read_text())["num_hidden_layers"]
        scale = min(args.layers, full) / full
        t = SHAPES[shape]
        tiers = dict(cpu_gb=t["cpu_gb"] * scale, server_l1_gb=t["server_l1_gb"] * scale,
                     valkey_gb=t["valkey_gb"] * scale, valkey_cpu_gb=DEFAULT_CPU_GB * scale)
    for k in tiers:
        if getattr(args, k, None) is not None:
            tiers[k] = getattr(args, k)
    mml = workload.max_model_len(sa)
    MiB = 1 << 20  # --batch prompts of max_model_len, densely (vLLM's own minimum is one)
    kv = args.kv_cache_gb or -(-args.batch * mml * dense // MiB) / 1024
    return dict(shape=shape, layers=cfg.num_hidden_layers, doc_len=sa.doc_len, question_len=sa.question_len,
                tier_scale=scale, **tiers, kv_cache_gb=kv, max_model_len=mml,
                dense_bytes_per_token=dense, doc_retained_bytes=sz["doc_retained_bytes"],
                docs_retained_bytes=args.docs * sz["doc_retained_bytes"],
                docs_final_hit_bytes=args.docs * sz["doc_final_hit_bytes"], vocab=cfg.vocab_size)


def _bundled(shape: str) -> Path:
    from gemma4_kv.tools.cli import bundled_config

    return Path(bundled_config(shape))


def plan(docs: int, replicas: int) -> list[list[list[tuple[int, int]]]]:
    """rounds[r][replica] = [(document, question)]: own share, the next one's (its round-1
    requests), own share with a new question."""
    share = [list(range(i * docs // replicas, (i + 1) * docs // replicas))
             for i in range(replicas)]
    return [[[(d, 0) for d in share[i]] for i in range(replicas)],
            [[(d, 0) for d in share[(i + 1) % replicas]] for i in range(replicas)],
            [[(d, 1) for d in share[i]] for i in range(replicas)]]


def prompt(seed: int, doc_len: int, question_len: int, vocab: int, d: int, q: int):
    tok = workload.tokens_of
    return (tok(f"{seed}:replicas:doc:{d}", doc_len, vocab)
            + tok(f"{seed}:replicas:q:{d}:{q}", question_len, vocab))


# -- a replica: one engine, rounds on command ---------------------------------------------

def run_replica(spec: dict) -> None:
    """Start the engine, warm up, write `ready`; then one JSON command a line on stdin
    (`round`: run it, write its reply file; `quit`)."""
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    import torch

    from gemma4_kv.tools.harness import connector_config, sharpen_dummy_weights, shim_kwargs

    if shim_kwargs():  # vLLM without its compiled ops (GPU machine): stand-ins
        import vllm_standins

        vllm_standins.install()
    from vllm import LLM, SamplingParams

    sa = workload.parse_args(spec["serving_argv"])
    cfg = workload.model_config(sa)
    layout = workload.layout_of(sa, cfg)
    stats = Path(spec["work"]) / f"stats-{spec['replica']}.jsonl"
    kw = workload.engine_kwargs(sa, "none", spec["model"], stats, layout)
    kw["kv_cache_memory_bytes"] = int(spec["kv_cache_gb"] * GiB)
    if spec["gpu_memory_utilization"] is not None and sa.config != "tiny":
        kw["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    conn = spec["connector"]
    if conn is not None and conn.get("offloading_fs"):
        from types import SimpleNamespace

        kw["kv_transfer_config"] = transfer_config(SimpleNamespace(
            connector="offloading-fs", cpu_gb=conn["cpu_gb"], fs_dir=conn["offloading_fs"]),
            layout, stats)
    elif conn is not None:
        kw["kv_transfer_config"] = connector_config({**conn, "stats_file": str(stats)})
    t = time.perf_counter()
    llm = LLM(**kw)
    startup = time.perf_counter() - t
    llm.collective_rpc(sharpen_dummy_weights)
    vocab = cfg.vocab_size
    rng = random.Random(f"settle:{spec['replica']}")
    sp = SamplingParams(max_tokens=sa.max_tokens, temperature=0.0, ignore_eos=True,
                        detokenize=False)
    pause = spec["settle_s"]
    docs: dict = {}

    def tokens(d, q):
        if (d, q) not in docs:
            docs[(d, q)] = prompt(spec["seed"], sa.doc_len, sa.question_len, vocab, d, q)
        return docs[(d, q)]

    def run_round(items) -> dict:
        before, reqs = workload.counters(llm), []
        t0 = time.perf_counter()
        for i in range(0, len(items), sa.batch):
            group = items[i:i + sa.batch]
            outs = llm.generate([{"prompt_token_ids": tokens(d, q)} for d, q in group], sp,
                                use_tqdm=False)
            for (d, q), o in zip(group, outs):
                first = getattr(o.metrics, "first_token_latency", None) if o.metrics else None
                reqs.append(dict(label=f"d{d}q{q}", prompt=len(o.prompt_token_ids),
                                 cached=o.num_cached_tokens or 0, ttft=first,
                                 output=list(o.outputs[0].token_ids)))
        wall = time.perf_counter() - t0
        workload.settle_stores(llm, vocab, rng, pause)
        delta = {k: v - before.get(k, 0) for k, v in workload.counters(llm).items()}
        prompt_tokens = sum(r["prompt"] for r in reqs)
        ttfts = [r["ttft"] for r in reqs if r["ttft"] is not None]
        return dict(wall_s=wall, settled_s=time.perf_counter() - t0, requests=len(reqs),
                    prompt_tokens=prompt_tokens,
                    store_tokens=delta.get("vllm:external_prefix_cache_hits", 0),
                    gpu_tokens=delta.get("vllm:prefix_cache_hits", 0),
                    preemptions=delta.get("vllm:num_preemptions", 0),
                    ttft_mean_s=statistics.fmean(ttfts) if ttfts else None,
                    counters={k: v for k, v in delta.items() if v and (
                        "gemma4_kv" in k or "kv_offload" in k or "cache" in k)},
                    req=reqs)

    # Warm-up (untimed): a cold document, its store, its hit after a GPU-cache reset.
    t = time.perf_counter()
    warm = [(-1 - spec["replica"], 0)]
    run_round(warm)
    llm.reset_prefix_cache()
    run_round(warm)
    llm.reset_prefix_cache()  # vLLM's GPU cache only: the rounds start from it empty
    import vllm

    ready = dict(startup_s=startup, warmup_s=time.perf_counter() - t,
                 num_gpu_blocks=llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
                 versions=dict(vllm=vllm.__version__, torch=torch.__version__),
                 device=(torch.cuda.get_device_name(0) if torch.cuda.is_available()
                         else "CPU"),
                 engine={k: v for k, v in kw.items() if k != "model"})
    _write(Path(spec["ready"]), ready)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        _write(Path(cmd["reply"]), run_round([tuple(x) for x in cmd["items"]]))
    os._exit(0)  # no engine shutdown to wait for: the driver ends the process group


def _write(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, default=str))
    tmp.replace(path)


# -- the driver: servers, replicas, rounds ---------------------------------------------------

class Stopped(BaseException):
    """SIGTERM / SIGINT (e.g. `timeout`): stop everything, summarize what finished."""


class Replica:
    def __init__(self, args, run_dir: Path, logs: Path, name: str, spec: dict, env: dict):
        self.name, self.run_dir = name, run_dir
        spec = dict(spec, ready=str(run_dir / f"{name}.ready.json"))
        self.ready_path = Path(spec["ready"])
        self.log = open(logs / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--replica", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT, text=True,
            env=env, start_new_session=True)  # own group: vLLM's engine core goes with it

    def wait_file(self, path: Path, deadline: float) -> dict:
        while not path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: "
                                   + self.tail())
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no answer in time: " + self.tail())
            time.sleep(0.05)
        return json.loads(path.read_text())

    def send(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def tail(self) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-15:])

    def terminate(self) -> None:
        """SIGTERM to its process group, not waiting (`stop` waits)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def stop(self, fast: bool = False) -> None:
        """SIGTERM to its process group, a few seconds, then SIGKILL to what is left
        (`fast`: SIGKILL at once)."""
        try:
            if not fast:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        deadline = time.monotonic() + 10  # the engine core too: its GPU memory is freed
        while time.monotonic() < deadline:  # before the next system's engines start
            try:
                os.killpg(self.proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.1)
        self.log.close()


class Deferred:
    """SIGTERM and SIGINT wait while a process is started and recorded: a `Stopped`
    raised between its start and its entry in the list to stop would orphan it. (Not
    `pthread_sigmask`: the signal may reach another thread of this process.)"""

    depth = 0
    pending: int | None = None

    def __enter__(self):
        Deferred.depth += 1

    def __exit__(self, *exc):
        Deferred.depth -= 1
        if not Deferred.depth and Deferred.pending is not None and exc[0] is None:
            raise Stopped(Deferred.pending)


def on_signal(signum, frame):
    if Deferred.depth:
        Deferred.pending = signum
    else:
        raise Stopped(signum)


def skip_reason(system: str) -> str | None:
    if system != "offloading-fs":
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("vllm")
    except PackageNotFoundError:
        import vllm

        v = vllm.__version__
    major_minor = tuple(int(x) for x in v.split(".")[:2] if x.isdigit())
    if major_minor < (0, 33) or not workload.cuda_present():
        return (f"offloading-fs: skipped: vLLM's OffloadingConnector with an fs tier is run "
                f"on vLLM >= 0.33 with CUDA only (the H200 bundle); here vLLM {v}, "
                f"CUDA {workload.cuda_present()}")
    return None


def shared_sizes(servers, work: Path) -> list:
    """What the shared tiers hold now: each lmcache server's L1 bytes, each Valkey's key
    count, the fs tier's bytes."""
    import socket

    out = []
    for s in servers:
        try:
            if hasattr(s, "status"):  # lmcache server
                out.append(s.status()["storage_manager"]["l1_manager"]["memory_used_bytes"])
            else:  # Valkey: DBSIZE, inline
                with socket.create_connection(("127.0.0.1", s.port), timeout=2) as c:
                    c.sendall(b"DBSIZE\r\n")
                    out.append(c.recv(64).strip().decode())
        except (OSError, KeyError, TypeError) as e:
            out.append(repr(e))
    fs = work / "fs"
    if fs.exists():
        out.append(sum(f.stat().st_size for f in fs.rglob("*") if f.is_file()))
    return out


def quiesce(servers, work: Path, quiet_s: float, limit_s: float = 60.0) -> tuple:
    """Untimed, after a round: wait until the shared tiers stop growing (`quiet_s`
    unchanged; write-behind to an L2 or an fs tier lands after the replicas' own
    commit), at most `limit_s`. Returns (seconds waited, last sizes)."""
    t = time.monotonic()
    last = shared_sizes(servers, work)
    if not last or quiet_s <= 0:
        return 0.0, last
    while time.monotonic() - t < limit_s:
        time.sleep(quiet_s)
        now = shared_sizes(servers, work)
        if now == last:
            break
        last = now
    return time.monotonic() - t, last


def valkey_spec(server) -> str:
    return json.dumps({"type": "valkey", "startup_nodes": f"127.0.0.1:{server.port}",
                       "request_timeout": 10.0, "connection_timeout": 2.0})


def resp_spec(server) -> dict:
    return {"type": "resp", "host": "127.0.0.1", "port": server.port}


def run_system(args, shape: str, sizes: dict, system: str, repeat: int, logs: Path,
               env: dict) -> dict:
    """One run: fresh servers and tiers, N replicas started together, three rounds."""
    from lmcache_servers import Server
    from tier_servers import TierServer

    res = dict(shape=shape, system=system, repeat=repeat)
    stopped = False
    work = Path(tempfile.mkdtemp(prefix=f"replicas-{system.replace('+', '-')}-"))
    servers, replicas = [], []
    n = args.replicas
    try:
        if system in ("valkey", "resp", "servers+valkey"):
            vk = TierServer(workdir=work / "valkey", args=(
                "--maxmemory", f"{max(1, round(sizes['valkey_gb'] * 1024))}mb",
                "--maxmemory-policy", "allkeys-lru"))
            with Deferred():
                servers.append(vk)
                vk.start()
        if system == "server":
            with Deferred():
                servers.append(Server(l1_gb=sizes["server_l1_gb"], log_dir=str(logs)))
            conns = [{"lmcache_server": servers[-1].url}] * n
        elif system == "servers+valkey":
            for _ in range(n):
                with Deferred():
                    servers.append(Server(l1_gb=sizes["server_l1_gb"] / n,
                                          log_dir=str(logs),
                                          l2_adapters=[json.loads(valkey_spec(vk))]))
            conns = [{"lmcache_server": h.url} for h in servers[1:]]
        elif system in ("valkey", "resp"):
            spec = json.loads(valkey_spec(vk)) if system == "valkey" else resp_spec(vk)
            conns = [{"cpu_gb": sizes["valkey_cpu_gb"], "l2_adapters": [spec]}] * n
        elif system == "alone":
            conns = [{"cpu_gb": sizes["cpu_gb"]}] * n
        elif system == "offloading-fs":
            (work / "fs").mkdir()
            conns = [{"offloading_fs": str(work / "fs"), "cpu_gb": sizes["cpu_gb"]}] * n
        else:
            conns = [None] * n
        res["servers"] = [getattr(s, "url", f"valkey 127.0.0.1:{s.port}") for s in servers]
        model = work / "model"  # one path: it is part of every key, replicas must share it
        sa = serving_args(args, shape)
        workload.model_config(sa).save_pretrained(str(model))
        base = dict(serving_argv=serving_argv(args, shape), model=str(model), work=str(work),
                    kv_cache_gb=sizes["kv_cache_gb"], seed=args.seed,
                    gpu_memory_utilization=(args.gpu_memory_utilization
                                            or round(0.8 / n, 3)),
                    settle_s=args.settle_s)
        tag = f"{shape}-{system.replace('+', '-')}-r{repeat}"
        t0 = time.monotonic()
        for i in range(n):
            with Deferred():
                replicas.append(Replica(args, work, logs, f"{tag}-replica{i}",
                                        dict(base, replica=i, connector=conns[i]), env))
        deadline = time.monotonic() + args.start_timeout
        res["ready"] = [r.wait_file(r.ready_path, deadline) for r in replicas]
        res["start_s"] = time.monotonic() - t0
        rounds = []
        for k, per_replica in enumerate(plan(args.docs, n)):
            for i, r in enumerate(replicas):
                r.send(dict(op="round", items=per_replica[i],
                            reply=str(work / f"replica{i}.round{k}.json")))
            t = time.monotonic()
            deadline = t + args.round_timeout
            reps = [r.wait_file(work / f"replica{i}.round{k}.json", deadline)
                    for i, r in enumerate(replicas)]
            rounds.append(round_record(k, reps, time.monotonic() - t))
            rounds[-1]["quiesce_s"], rounds[-1]["shared_sizes"] = quiesce(
                servers, work, args.quiet_s)
            print(f"[{tag}] round {k + 1}: {rounds[-1]['wall_s']:.2f} s, hits "
                  f"{100 * rounds[-1]['hit_share']:.1f}%", flush=True)
        res["rounds"] = rounds
        res["tokens"] = token_check(rounds, n)
        res["done"] = True
    except Stopped:
        stopped = True  # `timeout -k` leaves seconds: kill, do not wait
        raise
    except Exception as e:  # noqa: BLE001 - record it, go on with the next run
        res["error"] = f"{type(e).__name__}: {e}"[-3000:]
        print(f"[{shape} {system} r{repeat}] error: {res['error'][-800:]}", flush=True)
    finally:
        for r in replicas if not stopped else []:
            r.terminate()  # all at once: each may take seconds to exit
        for r in replicas:
            r.stop(fast=stopped)
        for s in servers:
            if stopped:
                s.kill()
            s.stop()  # after a kill: only the lmcache server's shared memory and log
        shutil.rmtree(work, ignore_errors=True)
    return res


def round_record(k: int, reps: list[dict], driver_s: float) -> dict:
    prompt_tokens = sum(r["prompt_tokens"] for r in reps)
    store = sum(r["store_tokens"] for r in reps)
    gpu = sum(r["gpu_tokens"] for r in reps)
    return dict(round=k + 1, kind=ROUNDS[k], wall_s=max(r["wall_s"] for r in reps),
                driver_s=driver_s, prompt_tokens=prompt_tokens, store_tokens=store,
                gpu_tokens=gpu, hit_share=store / prompt_tokens,
                gpu_share=gpu / prompt_tokens,
                replicas=[{k2: v for k2, v in r.items() if k2 != "req"} | dict(
                    hit_share=r["store_tokens"] / r["prompt_tokens"],
                    requests_detail=[{x: q[x] for x in ("label", "prompt", "cached", "ttft",
                                                        "output")} for q in r["req"]])
                          for r in reps])


def token_check(rounds: list[dict], n: int) -> dict:
    """Round 2 of replica i against round 1 of replica i + 1 (the same prompts, cold)."""
    compared = differ = 0
    for i in range(n):
        cold = {q["label"]: q["output"]
                for q in rounds[0]["replicas"][(i + 1) % n]["requests_detail"]}
        for q in rounds[1]["replicas"][i]["requests_detail"]:
            compared += 1
            differ += q["output"] != cold[q["label"]]
    return dict(compared=compared, differ=differ, identical=compared > 0 and differ == 0)


def prime(args, shape: str, sizes: dict, logs: Path, env: dict) -> dict:
    """The machine's first engine, untimed: one connector-free replica's warm-up."""
    work = Path(tempfile.mkdtemp(prefix="replicas-prime-"))
    t = time.monotonic()
    model = work / "model"
    workload.model_config(serving_args(args, shape)).save_pretrained(str(model))
    with Deferred():
        r = Replica(args, work, logs, "prime", dict(
            serving_argv=serving_argv(args, shape), model=str(model), work=str(work),
            kv_cache_gb=sizes["kv_cache_gb"], seed=args.seed, replica=0, connector=None,
            gpu_memory_utilization=(args.gpu_memory_utilization
                                    or round(0.8 / args.replicas, 3)), settle_s=0.0), env)
    try:
        ready = r.wait_file(r.ready_path, time.monotonic() + args.start_timeout)
        return dict(seconds=time.monotonic() - t, startup_s=ready["startup_s"])
    except Exception as e:  # noqa: BLE001
        return dict(error=f"{type(e).__name__}: {e}"[-2000:])
    finally:
        r.stop(fast=True)
        shutil.rmtree(work, ignore_errors=True)


def cells(runs: list[dict]) -> dict:
    """{shape: {system: {rounds: [{wall_s, hit_share, gpu_share: {median, min, max}}],
    tokens_identical, runs}}} over the finished repeats."""
    out: dict = {}
    for r in runs:
        c = out.setdefault(r["shape"], {}).setdefault(r["system"], dict(runs=0, failed=0))
        if r.get("skipped"):
            c["skipped"] = r["skipped"]
            continue
        if not r.get("done"):
            c["failed"] += 1
            c.setdefault("errors", []).append(r.get("error"))
            continue
        c["runs"] += 1
        c.setdefault("_rounds", []).append(r["rounds"])
        c.setdefault("_tokens", []).append(r["tokens"])
    for shape in out.values():
        for c in shape.values():
            rs = c.pop("_rounds", [])
            toks = c.pop("_tokens", [])
            if not rs:
                continue
            c["rounds"] = [{key: stat([run[k][key] for run in rs])
                            for key in ("wall_s", "hit_share", "gpu_share")}
                           | dict(round=k + 1, kind=ROUNDS[k]) for k in range(len(rs[0]))]
            c["tokens_identical"] = all(t["identical"] for t in toks)
            c["tokens_differ"] = sum(t["differ"] for t in toks)
            c["tokens_compared"] = sum(t["compared"] for t in toks)
    return out


def stat(xs: list[float]) -> dict:
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs), n=len(xs))


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def print_table(summary: dict) -> None:
    m = summary["meta"]
    print(f"\nreplicas: {m['replicas']} on {m['device']}, {m['docs']} documents, "
          f"{m['batch']} in flight per replica, {m['repeats']} repeat(s) interleaved "
          f"(median, range), {m['date']}")
    for shape, sz in m["sizes"].items():
        print(f"{shape}: {sz['layers']} layers, documents {sz['doc_len']} + "
              f"{sz['question_len']} tokens, all as gemma4-kv keeps them "
              f"{sz['docs_retained_bytes'] / 1e9:.3g} GB; tiers (x{sz['tier_scale']:.2f} "
              f"of full depth): CPU {sz['cpu_gb']:.3g} GiB per replica, server L1 "
              f"{sz['server_l1_gb']:.3g} GB, valkey row CPU {sz['valkey_cpu_gb']:.3g} GiB, "
              f"Valkey {sz['valkey_gb']:.3g} GB; GPU KV {sz['kv_cache_gb']:.3g} GiB per "
              f"replica")
    print(f"{'shape':16} {'system':15} {'round 1 s':>17} {'round 2 s':>17} "
          f"{'round 3 s':>17} {'r2 hits':>7} {'r3 hits':>7} {'r2 gpu':>6} "
          f"{'r2 tokens = cold':>16}")

    def cell(s):
        if s["n"] == 1:
            return f"{s['median']:17.2f}"
        return f"{s['median']:6.2f} ({s['min']:.2f}-{s['max']:.2f})".rjust(17)

    for shape, systems in summary["cells"].items():
        for system, c in systems.items():
            if c.get("skipped"):
                print(f"{shape:16} {system:15} {c['skipped']}")
                continue
            if not c.get("rounds"):
                print(f"{shape:16} {system:15} did not finish: "
                      f"{(c.get('errors') or ['?'])[-1]}"[:400])
                continue
            r = c["rounds"]
            same = (f"yes ({c['tokens_compared']})" if c["tokens_identical"] else
                    f"no ({c['tokens_differ']}/{c['tokens_compared']} differ)")
            print(f"{shape:16} {system:15} {cell(r[0]['wall_s'])} {cell(r[1]['wall_s'])} "
                  f"{cell(r[2]['wall_s'])} {100 * r[1]['hit_share']['median']:6.1f}% "
                  f"{100 * r[2]['hit_share']['median']:6.1f}% "
                  f"{100 * r[1]['gpu_share']['median']:5.1f}% {same:>16}"
                  + (f"  ({c['failed']} run(s) failed)" if c["failed"] else ""))


def plot(summary: dict, path: str) -> bool:
    """Per shape: round wall time (median, range as error bars) and hit share per
    system and round."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG (later: --plot-only OUT.png JSON)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s, c in summary["cells"].items()
              if any(x.get("rounds") for x in c.values())]
    if not shapes:
        print("no system finished: no PNG")
        return False
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 7.5), squeeze=False)
    for col, shape in enumerate(shapes):
        systems = [s for s, c in summary["cells"][shape].items() if c.get("rounds")]
        w = 0.8 / len(systems)
        for row, key in enumerate(("wall_s", "hit_share")):
            ax = axes[row][col]
            for k, s in enumerate(systems):
                rs = summary["cells"][shape][s]["rounds"]
                x = [i + (k - (len(systems) - 1) / 2) * w for i in range(len(rs))]
                med = [r[key]["median"] for r in rs]
                err = [[m - r[key]["min"] for m, r in zip(med, rs)],
                       [r[key]["max"] - m for m, r in zip(med, rs)]]
                ax.bar(x, med, w, yerr=err, capsize=2, label=s)
            ax.set_xticks(range(len(ROUNDS)), [f"{i + 1}: {n}" for i, n in enumerate(ROUNDS)])
            ax.set_ylabel("round wall time (s), slowest replica" if key == "wall_s"
                          else "prompt tokens served by the connector")
            if key == "hit_share":
                ax.set_ylim(0, 1.05)
            ax.set_title(f"{shape}, {summary['meta']['replicas']} replicas, "
                         f"{summary['meta']['device']}", fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def merge(out: Path, paths: list[str]) -> dict:
    """One summary of runs split over device calls: every run, cells over all of them,
    the first file's meta with each part's date, command and commit."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    meta = dict(parts[0]["meta"])
    meta.update(parts=[{k: m["meta"].get(k) for k in ("date", "command", "git_commit",
                                                       "device", "stopped")}
                       for m in parts],
                command=" ; ".join(m["meta"]["command"] for m in parts),
                repeats=max(m["meta"]["repeats"] for m in parts))
    for m in parts[1:]:
        meta["sizes"].update(m["meta"]["sizes"])
        if meta.get("device") in (None, "?"):
            meta["device"] = m["meta"].get("device")
    runs = [r for m in parts for r in m["runs"]]
    summary = dict(meta=meta, runs=runs, cells=cells(runs))
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "replicas.json", summary)
    return summary


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--merge"]:  # --merge DIR A/replicas.json B/replicas.json ...
        summary = merge(Path(argv[1]), argv[2:])
        print_table(summary)
        plot(summary, str(Path(argv[1]) / "replicas.png"))
        return 0
    if argv[:1] == ["--plot-only"]:  # --plot-only OUT.png RESULT.json
        return 0 if plot(json.loads(Path(argv[2]).read_text()), argv[1]) else 1
    if argv[:1] == ["--replica"]:  # --replica SPEC_JSON
        run_replica(json.loads(argv[1]))
        return 0
    args = parse_args(argv)
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if args.inproc:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.smoke:
        env.setdefault("OMP_NUM_THREADS", "1")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    command = "python benchmarks/bench_replicas.py " + " ".join(argv)
    sizes = {s: shape_sizes(args, s) for s in args.shapes}
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M %Z"), command=command,
                git_commit=git_commit(), label=args.label, replicas=args.replicas,
                docs=args.docs, batch=args.batch, repeats=args.repeats, device="?",
                sizes=sizes, args={k: v for k, v in vars(args).items() if k != "out"})
    runs: list[dict] = []
    summary = dict(meta=meta, runs=runs, cells={})

    def save():
        summary["cells"] = cells(runs)
        _write(out / "replicas.json", summary)

    try:
        for shape in args.shapes:
            if args.prime and "prime" not in meta:
                meta["prime"] = prime(args, shape, sizes[shape], logs, env)
                print(f"== prime (untimed): {meta['prime']}", flush=True)
            for rep in range(args.repeats):  # interleaved: A B C A B C ...
                for system in args.systems:
                    why = skip_reason(system)
                    if why:
                        if rep == 0:
                            print(f"== {why}", flush=True)
                            runs.append(dict(shape=shape, system=system, repeat=rep,
                                             skipped=why))
                        continue
                    print(f"== {shape} {system} repeat {rep + 1}/{args.repeats}", flush=True)
                    runs.append(run_system(args, shape, sizes[shape], system, rep, logs, env))
                    for ready in runs[-1].get("ready", [])[:1]:
                        meta["device"] = ready["device"]
                        meta.update(ready["versions"])
                    save()
    except Stopped as e:
        meta["stopped"] = f"signal {e.args[0]}"
        print(f"== stopped by signal {e.args[0]}; summarizing what finished", flush=True)
    save()
    print_table(summary)
    plot(summary, str(out / "replicas.png"))
    print(f"wrote {out / 'replicas.json'}")
    ok = all(r.get("done") or r.get("skipped") for r in runs) and "stopped" not in meta
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
