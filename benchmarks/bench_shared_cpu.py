"""A second engine's hit from a shared `lmcache server` against the embedded store, in
real vLLM on CPU (issue 23's CPU table): lookup time, warm and cold request times, bytes
stored per prompt token, greedy tokens against recomputation.

    python benchmarks/bench_shared_cpu.py --out DIR [--tokens 4096] [--prompts 3]
        [--repeats 2] [--l1-gb 2] [--cpu-gb 1]
    python benchmarks/bench_shared_cpu.py --plot-only OUT.png DIR/shared_cpu.json

The tests' tiny Gemma 4 (`tiny_gemma4_config(window=100)`, float32, block 32), random
weights, `--prompts` random prompts of `--tokens` tokens, each engine a harness process
of its own (`gemma4_kv.tools.harness`: engine core and worker in that process, as in
the tests), `VLLM_CPU_KVCACHE_SPACE=1`, one OpenMP thread on `--core`, vLLM's prefix
cache off (every hit comes from the connector). One after the other:

- `embedded`: the embedded store (`cpu_gb`): the prompts cold, then `--repeats` warm
  passes over them;
- `server A`: the same against a real `lmcache server --l1-size-gb L1` started here;
- `server B`: a second engine process on the same server, after A exited: its first
  requests on A's prompts (hits A stored).

Per request: its TTFT (vLLM's `first_token_latency`), its lookup time from the
connector's stats file (`stats_file`: a lookup answered `pending` counts from its first
ask), hit tokens, and whether its greedy tokens equal the cold run's (a cold request
of the embedded engine is the recomputation: it has no hit). Bytes stored: the
embedded CPU tier's use (`usage()`) and the server's L1 (`memory_used_bytes` of its
HTTP status) after the cold pass, per prompt token. Writes DIR/shared_cpu.json and
DIR/shared_cpu.png (if matplotlib is installed). It is a benchmark: it asserts no
times.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = 32
WINDOW = 100
MAX_TOKENS = 6


# -- on the worker (harness "call" steps; this file is on the engine's path) ---------------
def store_usage(worker) -> list:
    """(type of the connector's store, bytes it uses)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    store = get_kv_transfer_group()._worker.store
    return [type(store).__name__, store.usage()[0]]


# -- the driver ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LMCacheServer:
    """A real `lmcache server` with its own L1 segment (the command line of
    `server_wire.server_argv`, as the README and the tests start it)."""

    def __init__(self, l1_gb: float, log: Path):
        from gemma4_kv.stores.server import server_argv

        exe = Path(sys.executable).with_name("lmcache")
        self.port, self.http = free_port(), free_port()
        self.shm = f"g4kvbench{uuid.uuid4().hex[:10]}"
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.log = open(log, "ab")
        env = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false")
        self.proc = subprocess.Popen(
            server_argv(str(exe), port=self.port, shm_name=self.shm, l1_gb=l1_gb,
                        http_port=self.http, host="127.0.0.1"),
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            try:
                self.status()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"lmcache server did not come up (log: {log})") from None
                time.sleep(0.3)

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/status", timeout=5) as r:
            return json.load(r)

    def l1(self) -> dict:
        return self.status()["storage_manager"]["l1_manager"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        Path(f"/dev/shm/lmcache_l1_pool_{self.shm}").unlink(missing_ok=True)
        self.log.close()


def run_engine(tmp: Path, name: str, model: str, extra: dict, steps: list, args) -> dict:
    """One harness process over `steps`: its output and its stats events."""
    stats = tmp / f"{name}.stats.jsonl"
    spec = {"model": model, "connector": True, "max_tokens": MAX_TOKENS,
            "engine": {"enforce_eager": True, "max_model_len": args.tokens + 512,
                       "dtype": "float32", "block_size": BLOCK, "disable_log_stats": False,
                       "distributed_executor_backend": "uni"},
            "extra_config": {"stats_file": str(stats), **extra}, "steps": steps}
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_OMP_THREADS_BIND=str(args.core), PYTHONHASHSEED="0",
               VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-P", "-m", "gemma4_kv.tools.harness", str(spec_path),
           str(out_path)]
    t0 = time.perf_counter()
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.engine_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    if rc != 0:
        tail = (tmp / f"{name}.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"engine {name} failed ({rc}):\n{tail}")
    out = json.loads(out_path.read_text())
    out["wall_s"] = time.perf_counter() - t0
    out["events"] = [json.loads(l) for l in stats.read_text().splitlines()] \
        if stats.exists() else []
    return out


def script(passes: list, probe: bool) -> tuple[list, list]:
    """Harness steps of (pass name, prompts) pairs and their names per step (None: not a
    pass of prompts): "usage" reads the store's use, `probe` reads the counters after
    each pass."""
    steps, names = [], []
    if probe:
        steps.append({"call": "shared_probe:install"})
        names.append("probe-install")
    for name, prompts in passes:
        if prompts is None:
            steps.append({"call": f"bench_shared_cpu:store_{name}"})
            names.append(name)
            continue
        steps.append({"prompts": prompts})
        names.append(name)
        if probe:
            steps.append({"call": "shared_probe:report"})
            names.append(f"probe-{name}")
    return steps, names


def step_result(out: dict, names: list, name: str):
    """The (first worker's) result of the call step `name`."""
    return out["steps"][names.index(name)]["result"][0]


def probes(out: dict, names: list) -> list[dict]:
    """The counters after each pass (`--probe`), in pass order."""
    return [dict(after=n.removeprefix("probe-"), **s["result"][0])
            for n, s in zip(names, out["steps"]) if n.startswith("probe-") and
            n != "probe-install"]


def per_request(out: dict, step_names: list[str | None]) -> list[dict]:
    """One row per request of the named prompt steps, with its lookup from the stats
    file. Requests run one at a time, so the n-th request to be looked up is the n-th
    request sent."""
    lookups: dict[str, list[dict]] = {}
    for e in out["events"]:
        if e["event"] == "lookup":
            lookups.setdefault(e["req_id"], []).append(e)
    ordered = list(lookups.values())
    rows, k = [], 0
    for name, step in zip(step_names, out["steps"]):
        if "outputs" not in step:
            continue
        for i, (ttft, cached, tokens) in enumerate(zip(step["ttft"], step["cached"],
                                                       step["outputs"])):
            evs = ordered[k] if k < len(ordered) else []
            k += 1
            rows.append(dict(pass_=name, prompt=i, ttft_s=ttft, cached=cached,
                             outputs=tokens, lookups=len(evs),
                             lookup_s=sum(e["seconds"] for e in evs) if evs else None,
                             hit=evs[-1]["end"] if evs else None))
    if k != len(ordered):
        raise RuntimeError(f"{len(ordered)} requests were looked up, {k} were sent")
    return rows


def saved_bytes(out: dict) -> int:
    """Bytes of KV the connector copied out of vLLM's cache (its save events)."""
    return sum(g["bytes"] for e in out["events"] if e["event"] == "save"
               for g in e["groups"].values())


def summary(rows: list[dict], kind: str) -> dict:
    """Min, median and max of a pass's TTFT and lookup times."""
    rs = [r for r in rows if r["pass_"] == kind]
    out = {"requests": len(rs), "hit_tokens": [r["cached"] for r in rs]}
    for key in ("ttft_s", "lookup_s"):
        vals = [r[key] for r in rs if r[key] is not None]
        if vals:
            out[key] = dict(min=min(vals), median=statistics.median(vals), max=max(vals))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plot-only"]:
        return 0 if plot(json.loads(Path(argv[2]).read_text()), argv[1]) else 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for shared_cpu.json/.png")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="warm passes")
    p.add_argument("--l1-gb", type=float, default=2.0, help="the server's L1")
    p.add_argument("--cpu-gb", type=float, default=1.0, help="the embedded store's CPU tier")
    p.add_argument("--core", type=int, default=0, help="CPU of each engine's OpenMP thread")
    p.add_argument("--engine-timeout", type=float, default=900)
    p.add_argument("--systems", default="embedded,server",
                   help="embedded and/or server (A then B)")
    p.add_argument("--workdir", help="engine logs, specs and stats files (default: a "
                   "temporary directory)")
    p.add_argument("--probe", action="store_true",
                   help="timing counters inside each engine (shared_probe.py), per pass")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="gemma4-kv-shared-cpu-"))
    tmp.mkdir(parents=True, exist_ok=True)
    systems = args.systems.split(",")

    from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

    model = save_config(tiny_gemma4_config(window=WINDOW), tmp / "model")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.tokens)]
               for _ in range(args.prompts)]
    passes = [("cold", prompts), ("usage", None)] + [("warm", prompts)] * args.repeats
    a_steps, a_names = script(passes, args.probe)
    b_steps, b_names = script([("first", prompts)], args.probe)
    runs, load = {}, {}

    def loadavg(name):
        load[name] = os.getloadavg()
        print(f"== {name}: load average {load[name]}", flush=True)

    if "embedded" in systems:
        loadavg("embedded")
        out = run_engine(tmp, "embedded", model, {"cpu_gb": args.cpu_gb}, a_steps, args)
        runs["embedded"] = dict(rows=per_request(out, a_names), startup_s=out["startup_s"],
                                stored_bytes=step_result(out, a_names, "usage")[1],
                                saved_bytes=saved_bytes(out), probe=probes(out, a_names))
    server_meta = None
    if "server" in systems:
        server = LMCacheServer(args.l1_gb, tmp / "lmcache-server.log")
        try:
            extra = {"lmcache_server": server.url}
            loadavg("server A")
            out = run_engine(tmp, "server-a", model, extra, a_steps, args)
            l1 = server.l1()
            runs["server A"] = dict(rows=per_request(out, a_names), startup_s=out["startup_s"],
                                    stored_bytes=l1["memory_used_bytes"],
                                    stored_objects=l1["total_object_count"],
                                    saved_bytes=saved_bytes(out), probe=probes(out, a_names))
            loadavg("server B")
            out = run_engine(tmp, "server-b", model, extra, b_steps, args)
            runs["server B"] = dict(rows=per_request(out, b_names),
                                    startup_s=out["startup_s"],
                                    saved_bytes=saved_bytes(out), probe=probes(out, b_names))
            server_meta = dict(l1_gb=args.l1_gb, l1_after=server.l1())
        finally:
            server.stop()

    reference = {r["prompt"]: r["outputs"] for r in
                 next(iter(runs.values()))["rows"] if r["pass_"] == "cold"}
    for name, run in runs.items():
        for r in run["rows"]:
            r["same_tokens"] = r["outputs"] == reference[r["prompt"]]
        run["summary"] = {k: summary(run["rows"], k) for k in ("cold", "warm", "first")
                          if any(r["pass_"] == k for r in run["rows"])}
        run["all_tokens_equal"] = all(r["same_tokens"] for r in run["rows"])
        if "stored_bytes" in run:
            run["stored_bytes_per_prompt_token"] = run["stored_bytes"] / (
                args.prompts * args.tokens)
    import torch

    result = dict(meta=dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__,
                            cpus=len(os.sched_getaffinity(0)), load_before=load,
                            tokens=args.tokens, prompts=args.prompts, repeats=args.repeats,
                            cpu_gb=args.cpu_gb, server=server_meta, block=BLOCK,
                            window=WINDOW, max_tokens=MAX_TOKENS, workdir=str(tmp),
                            reference=f"{next(iter(runs))} cold pass (no hits)",
                            command="python benchmarks/bench_shared_cpu.py "
                                    + " ".join(argv)),
                  runs=runs)
    (out_dir / "shared_cpu.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    if plot(result, str(out_dir / "shared_cpu.png")):
        print(f"wrote {out_dir / 'shared_cpu.png'}")
    print(f"wrote {out_dir / 'shared_cpu.json'}")
    return 0 if all(r["all_tokens_equal"] for r in runs.values()) else 1


def _range(s: dict | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    if not s:
        return "-"
    return f"{fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)} " \
           f"(med {fmt.format(s['median'] * scale)})"


def print_table(result: dict) -> None:
    m = result["meta"]
    print(f"\n{m['prompts']} prompts x {m['tokens']} tokens, tiny Gemma 4 (window {m['window']}, "
          f"float32, block {m['block']}), {m['cpus']} CPUs, load before {m['load_before']}")
    head = ("", *result["runs"])
    lines = [head]
    runs = list(result["runs"].values())

    def row(label, fn):
        lines.append((label, *[fn(r) for r in runs]))

    def pass_of(r):
        return r["summary"].get("warm") or r["summary"].get("first")

    row("lookup per hit, ms", lambda r: _range((pass_of(r) or {}).get("lookup_s"), 1e3,
                                                "{:.1f}"))
    row("lookup per cold request, ms",
        lambda r: _range(r["summary"].get("cold", {}).get("lookup_s"), 1e3, "{:.1f}"))
    row("warm / B request TTFT, s", lambda r: _range((pass_of(r) or {}).get("ttft_s")))
    row("cold request TTFT, s", lambda r: _range(r["summary"].get("cold", {}).get("ttft_s")))
    row("hit tokens", lambda r: ",".join(map(str, sorted(set(
        (pass_of(r) or {}).get("hit_tokens", []))))))
    row("stored bytes / prompt token", lambda r: f"{r['stored_bytes_per_prompt_token']:.0f}"
        if "stored_bytes_per_prompt_token" in r else "-")
    tokens = m["prompts"] * m["tokens"]
    row("saved bytes / prompt token", lambda r: f"{r['saved_bytes'] / tokens:.0f}"
        if r.get("saved_bytes") else "-")
    row("tokens equal recomputation", lambda r: "yes" if r["all_tokens_equal"] else "NO")
    row("engine start, s", lambda r: f"{r['startup_s']:.1f}")
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))


def plot(result: dict, path: str) -> bool:
    """Per run: TTFT of cold and warm (or B's first) requests, lookup time beside them."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG (later: --plot-only OUT.png JSON)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(result["runs"])
    for ax, key, label in ((axes[0], "ttft_s", "TTFT (s)"),
                           (axes[1], "lookup_s", "lookup (s)")):
        for k, kind in enumerate(("cold", "warm", "first")):
            xs, ys = [], []
            for i, name in enumerate(names):
                for r in result["runs"][name]["rows"]:
                    if r["pass_"] == kind and r[key] is not None:
                        xs.append(i + (k - 1) * 0.25)
                        ys.append(r[key])
            if xs:
                ax.plot(xs, ys, "o", label=kind)
        ax.set_xticks(range(len(names)), names)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    m = result["meta"]
    fig.suptitle(f"{m['prompts']} x {m['tokens']} tokens, tiny Gemma 4 on CPU "
                 f"({m['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


if __name__ == "__main__":
    sys.exit(main())
