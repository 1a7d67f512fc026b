"""Soak: many requests through the connector while its CPU tier evicts, against
recomputation, with memory measured along the way (real vLLM, CPU build).

    python benchmarks/soak.py --requests 3000 --out benchmarks/results/soak_cpu.json

Requests are random prefixes (of random length) of a few shared documents plus a random
tail of their own, sent in batches that are all in flight together, with chunked
prefill (`max_num_batched_tokens`) and a CPU tier a fraction of the working set, so
LMCache evicts all the time; some batches generate enough tokens to store generated
chunks. A second engine without the connector answers the same batches. Reported: the
tokens that differ (must be 0), hits, and after warm-up and at every snapshot the
worker's and the engine core's RSS, the CPU tier's use, its read-locked objects and
bytes (pins), LMCache staging, and the connector's own tables; the recomputation
engine's worker RSS at the same points, so vLLM's own growth (the same with or without
the connector) can be told from the connector's (`rss_excess`). tests/test_soak.py runs
a short version in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from e2e_common import CORES, run_group  # noqa: E402

from gemma4_kv.tools.harness import save_config, tiny_gemma4_config  # noqa: E402

ENGINE = {"enforce_eager": True, "max_model_len": 4096, "dtype": "float32", "block_size": 32,
          "max_num_batched_tokens": 512}
MiB = 1 << 20


def workload(requests: int, *, seed: int = 0, docs: int = 6, doc_len: int = 1024,
             tail: int = 200, batch: int = 16) -> list[dict]:
    """Batches of prompts: a random prefix of a random document (so requests share
    prefixes of every length) and a random tail; each batch's max_tokens is 4, or 40 in
    one batch of four (generated chunks are stored too)."""
    rng = random.Random(seed)
    texts = [[rng.randrange(3, 500) for _ in range(doc_len)] for _ in range(docs)]
    out = []
    while requests > 0:
        n = min(batch, requests)
        prompts = []
        for _ in range(n):
            doc = rng.choice(texts)
            prompt = doc[:rng.randrange(0, doc_len + 1)]
            prompt += [rng.randrange(3, 500) for _ in range(rng.randrange(1, tail + 1))]
            prompts.append(prompt)
        out.append({"prompts": prompts, "batch": True,
                    "max_tokens": 40 if rng.random() < 0.25 else 4})
        requests -= n
    return out


def with_snapshots(batches: list[dict], snapshots: int, fn: str) -> list[dict]:
    """The batches with a snapshot (`faults:<fn>`) after the first quarter (warm-up: the
    CPU tier full, every code path taken) and `snapshots` times in all."""
    marks = {max(1, len(batches) // 4)} | {
        round(len(batches) * k / snapshots) for k in range(1, snapshots + 1)}
    steps = [{"call": "faults:count_stats"}] if fn == "snapshot" else []
    for i, b in enumerate(batches, 1):
        steps.append(b)
        if i in marks:
            steps.append({"call": f"faults:{fn}", "kwargs": {}, "after": i})
    return steps


def series(steps: list[dict], out: dict, batches: list[dict]) -> list[dict]:
    """The snapshots of a run, each with the number of requests sent before it."""
    snaps = []
    for s, r in zip(steps, out["steps"]):
        if s.get("call", "").startswith("faults:") and "after" in s:
            (snap,) = r["result"]
            snaps.append({"after_requests": sum(len(b["prompts"])
                                                for b in batches[:s["after"]]), **snap})
    return snaps


def run_engine(tmp: Path, name: str, model: str, steps: list[dict], *, connector: bool,
               cpu_gb: float, timeout: int, core: int | None = None
               ) -> tuple[dict, list[dict], float]:
    """One engine over `steps`; `core`: the CPU its worker is bound to (vLLM's automatic
    binding puts every engine's worker on the same first CPU)."""
    spec = {"model": model, "connector": connector, "engine": ENGINE,
            "steps": [{k: v for k, v in s.items() if k != "after"} for s in steps],
            "extra_config": {"cpu_gb": cpu_gb, "retention_interval": 512}}
    if connector:
        spec.update(connector_class="FaultsConnector", connector_module="faults")
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    sched_log = tmp / f"{name}.scheduler.jsonl"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED="0",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # the faults: "call" steps
               VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               GEMMA4_KV_FAULTS_SCHEDULER_LOG=str(sched_log))
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    t0 = time.perf_counter()
    proc = run_group([sys.executable, "-P", "-m", "gemma4_kv.tools.harness", str(spec_path),
                      str(out_path)], env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    calls = [json.loads(line) for line in sched_log.read_text().splitlines()] \
        if sched_log.exists() else []
    return json.loads(out_path.read_text()), calls, wall


def soak(tmp: Path, requests: int, *, seed: int = 0, cpu_gb: float = 0.03,
         snapshots: int = 4, timeout: int = 3600, side_by_side: bool = False,
         **shape) -> dict:
    """Run both engines, one after the other (their wall times are reported), or, with
    `side_by_side`, at once on cores of their own (tests: nothing there is timed);
    `shape`: `workload`'s docs, doc_len, tail, batch."""
    shape = {"docs": 6, "doc_len": 1024, "tail": 200, "batch": 16} | shape
    model = save_config(tiny_gemma4_config(window=100), tmp / "model")
    batches = workload(requests, seed=seed, **shape)
    steps = with_snapshots(batches, snapshots, "snapshot")
    base_steps = with_snapshots(batches, snapshots, "rss")
    runs = [("soak", steps, True), ("base", base_steps, False)]

    def run(name, steps, connector, core=None):
        return run_engine(tmp, name, model, steps, connector=connector, cpu_gb=cpu_gb,
                          timeout=timeout, core=core)

    if side_by_side:
        with ThreadPoolExecutor(2) as ex:
            cores = [CORES.take() for _ in runs]
            try:
                futures = [ex.submit(run, *r, core=c) for r, c in zip(runs, cores)]
                (out, calls, wall), (base, _, base_wall) = [f.result() for f in futures]
            finally:
                for c in cores:
                    CORES.give(c)
    else:
        (out, calls, wall), (base, _, base_wall) = [run(*r) for r in runs]
    got, want = out["outputs"], base["outputs"]
    if len(got) != len(want):  # zip() below would drop the prompts one side lacks
        raise RuntimeError(f"{len(got)} outputs against {len(want)} recomputed")
    differing = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    tokens = sum(sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
                 for a, b in zip(got, want))
    snaps, base_snaps = series(steps, out, batches), series(base_steps, base, batches)
    warm, end = snaps[0], snaps[-1]
    prompt_tokens = sum(len(p) for b in batches for p in b["prompts"])
    return {
        "requests": len(got), "expected_requests": requests,
        "batches": len(batches), "prompt_tokens": prompt_tokens,
        "generated_tokens": sum(len(a) for a in got),
        "differing_requests": len(differing), "differing_tokens": tokens,
        "first_differing": differing[:10],
        "cached_tokens": sum(out["cached"]),
        "requests_with_hits": sum(c > 0 for c in out["cached"]),
        "reference_cached_tokens": sum(base["cached"]),
        "cpu_gb": cpu_gb, "engine": ENGINE, "workload": shape,
        "wall_s": {"connector": round(wall, 1), "reference": round(base_wall, 1),
                   "connector_startup": round(out["startup_s"], 1),
                   "reference_startup": round(base["startup_s"], 1)},
        "rss_growth_mib": round((end["rss"] - warm["rss"]) / MiB, 1),
        "engine_core_rss_growth_mib": round((end["parent_rss"] - warm["parent_rss"]) / MiB, 1),
        "reference_rss_growth_mib": round((base_snaps[-1]["rss"] - base_snaps[0]["rss"]) / MiB,
                                          1),
        "read_locked_bytes_max": max(s["read_locked_bytes"] for s in snaps),
        "l1_used_max": max(s["l1_used"] for s in snaps), "l1_total": end["l1_total"],
        "scheduler_tracked_max": max((c["tracked"] for c in calls), default=0),
        "scheduler_lookups": len(calls),
        "snapshots": snaps, "reference_snapshots": base_snaps,
    } | rss_excess({"snapshots": snaps, "reference_snapshots": base_snaps})


def rss_excess(report: dict) -> dict:
    """The connector's worker RSS above the recomputation worker's after the same requests,
    at each snapshot, and how far it moves after warm-up (the first snapshot): vLLM's own
    worker grows alike in both engines, the connector's share should not."""
    excess = [round((a["rss"] - b["rss"]) / MiB, 1)
              for a, b in zip(report["snapshots"], report["reference_snapshots"])]
    return {"rss_excess_mib": excess,
            "rss_excess_range_mib": round(max(excess) - min(excess), 1),
            "rss_excess_growth_mib": round(excess[-1] - excess[0], 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-gb", type=float, default=0.03)
    ap.add_argument("--snapshots", type=int, default=10)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="gemma4-kv-soak-"))
    tmp.mkdir(parents=True, exist_ok=True)
    report = soak(tmp, args.requests, seed=args.seed, cpu_gb=args.cpu_gb,
                  snapshots=args.snapshots, timeout=6 * 3600)
    report["command"] = " ".join(["python", "benchmarks/soak.py", *(argv or sys.argv[1:])])
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0 if report["differing_tokens"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
