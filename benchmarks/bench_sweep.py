"""Tier sweep: warm hit share and round time of long-doc QA at CPU tiers from 0.4x to 3x
the working set vLLM's OffloadingConnector stores, in a looping and a Zipf-random
document order, for this connector and the OffloadingConnector at their defaults (the
tier size is the one setting), beside no connector, in one run.

    python benchmarks/bench_sweep.py --out DIR [--config gemma4-12b-like] [--layers 12]
        [--fractions 0.4,0.6,0.8,1.0,1.5,3] [more bench_serving options ...]
    python benchmarks/bench_sweep.py --plot-only OUT.png DIR/sweep.json
    python benchmarks/bench_sweep.py --merge DIR A/sweep.json B/sweep.json  # split runs

The working set is `--docs` documents as OffloadingConnector keeps them: every
full-attention token and the sliding window before the prompt's end
(`common/workload.py` `sizes`: `docs_final_hit_bytes`, checked against the bytes it reports
storing, `vllm:kv_offload_store_bytes`). Each tier size runs `bench_serving.py` with
scenarios `loop` and `zipf` (one engine per system, emptied between the two). `--layers`
keeps that many of the shape's layers (same groups, head sizes, window and 5:1 pattern:
the same bytes per token per layer, so the same tier / working-set ratios) to fit the
sweep in a GPU lease. Each point runs the systems interleaved, `--repeats` (3) times, a
fresh engine each (bench_serving's `--repeats`), and every figure is the median of the
repeats with its range (`common/stats.py`; the per-repeat values under `per_repeat`).
Before the first point one short connector-free engine runs untimed (bench_serving's
`--prime`; `--no-prime` skips it): on a fresh machine the first engine otherwise pays
for vLLM's compile cache and every model kernel's first compile, and the system listed
first looks slow at start-up and in its first rounds. Writes DIR/sweep.json (`meta.prime`:
that engine), DIR/sweep.png (medians, error bars for the range) and every point's own
bench_serving output under DIR/f<fraction>/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import plots
from common.stats import aggregate, fmt, med

HERE = Path(__file__).resolve().parent
SYSTEMS = ("gemma4-kv", "offloading")
GiB = 1 << 30


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--fractions", default="0.4,0.6,0.8,1.0,1.5,3")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--config", help="bundled model shape (bench_serving's default if unset)")
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--point-timeout", type=float, default=600.0)
    p.add_argument("--no-none", action="store_true",
                   help="no connector-free reference (a split run that already has one)")
    p.add_argument("--no-prime", action="store_true", help="no untimed first engine")
    p.add_argument("--repeats", type=int, default=3,
                   help="engines per system and point, the systems interleaved")
    args, rest = p.parse_known_args(argv)
    args.fractions = [float(f) for f in args.fractions.split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    return args, rest


def working_set(args, rest) -> dict:
    """OffloadingConnector's working set of the sweep's documents (no vLLM needed)."""
    from common import workload

    a = workload.parse_args(["--out", "/dev/null", *config_arg(args),
                                  "--docs", str(args.docs), *rest])
    sz = workload.sizes(a, workload.layout_of(a, workload.model_config(a)))
    return {"bytes": sz["docs_final_hit_bytes"], "sizes": sz, "layers": a.layers,
            "config": a.config}


def config_arg(args) -> list[str]:
    return ["--config", args.config] if args.config else []


def run_point(args, rest, out: Path, systems, cpu_gb: float, prime: bool) -> dict:
    """bench_serving at one tier size: the systems interleaved, `--repeats` times, after
    an untimed connector-free engine if `prime`."""
    cmd = [sys.executable, str(HERE / "bench_serving.py"), "--out", str(out),
           *config_arg(args), "--systems", ",".join(systems),
           "--scenarios", "loop,zipf", "--docs", str(args.docs), "--cpu-gb", f"{cpu_gb:.4f}",
           "--system-timeout", str(args.point_timeout), "--repeats", str(args.repeats),
           "--prime" if prime else "--no-prime", *rest]
    print("==", " ".join(cmd[1:]), flush=True)
    t = time.perf_counter()
    engines = len(systems) * args.repeats + prime
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=args.point_timeout * engines + 60)
    (out / "driver.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "driver.log").write_text(proc.stdout + proc.stderr)
    path = out / "serving.json"
    summary = json.loads(path.read_text()) if path.exists() else {"systems": {}}
    summary["returncode"], summary["wall_s"] = proc.returncode, time.perf_counter() - t
    return summary


def warm(rounds: list[dict]) -> dict:
    """One repeat: warm hit share (store, and vLLM's GPU cache beside it), round times and
    the connector's host time per step kind (ms, the mean over the warm rounds)."""
    rs = [r for r in rounds if r["kind"] == "warm"]
    prompt = sum(r["prompt_tokens"] for r in rs)
    if not prompt:
        return {}
    store = sum(r["store_tokens"] for r in rs) / prompt
    gpu = sum(r["gpu_tokens"] for r in rs) / prompt
    host = {}
    for r in rs:
        for k, v in (r.get("connector_ms_per_step") or {}).items():
            host.setdefault(k, []).append(v)
    return dict(store_share=store, gpu_share=gpu, hit_share=store + gpu,
                warm_wall_s=[r["wall_s"] for r in rs],
                warm_wall_mean_s=statistics.fmean(r["wall_s"] for r in rs),
                cold_wall_s=rounds[0]["wall_s"], stored_bytes_cold=rounds[0]["stored_bytes"],
                host_ms_per_step={k: statistics.fmean(v) for k, v in host.items()} or None)


ROW_STATS = ("store_share", "gpu_share", "hit_share", "warm_wall_mean_s", "cold_wall_s",
             "stored_bytes_cold", "startup_s", "host_ms_per_step")


def point_rows(f: float, summary: dict) -> list[dict]:
    """Per system and order: each figure's median and range over the repeats
    (bench_serving's per-repeat results, `runs`), the repeats' own under `per_repeat`."""
    rows = []
    for s, r in summary.get("systems", {}).items():
        runs = r.get("runs") or [r]
        for order in ("loop", "zipf"):
            per = [dict(repeat=x.get("repeat"), startup_s=x.get("startup_s"),
                        **warm(x["scenarios"][order]["rounds"]))
                   for x in runs if order in x.get("scenarios", {})]
            per = [p for p in per if "store_share" in p]
            if per:
                rows.append(dict(fraction=f, system=s, order=order, repeats=len(per),
                                 **aggregate(per, ROW_STATS), per_repeat=per))
    return rows


def hit_share(r: dict) -> float:
    """Warm prompt tokens not recomputed: from the CPU tier, or from vLLM's GPU cache in
    front of it (with a Zipf order the GPU cache serves the hottest documents itself);
    the median over the repeats (a one-run file: its sum)."""
    if "hit_share" in r:
        return med(r["hit_share"])
    return med(r["store_share"]) + med(r["gpu_share"])


def targets(rows: list[dict]) -> list[dict]:
    """Per point: gemma4-kv's warm hit share >= 0.8 x tier / working set (40-100 %) and
    >= OffloadingConnector's."""
    out = []
    by = {(r["fraction"], r["system"], r["order"]): r for r in rows}
    for (f, s, order), r in sorted(by.items()):
        if s != "gemma4-kv" or "store_share" not in r:
            continue
        off = by.get((f, "offloading", order))
        off = hit_share(off) if off and "store_share" in off else None
        goal = 0.8 * min(f, 1.0) if 0.4 <= f else None
        share = hit_share(r)
        out.append(dict(fraction=f, order=order, share=share, offloading=off, goal=goal,
                        meets_goal=None if goal is None else share >= goal,
                        beats_offloading=None if off is None else share >= off))
    return out


def print_table(sweep: dict) -> None:
    m = sweep["meta"]
    print(f"\ntier sweep: {m['config']} ({m.get('layers') or 'all'} layers), "
          f"{m.get('gpu', '?')}, working set {sweep['working_set_bytes'] / GiB:.2f} GiB "
          f"({m['docs']} documents), {m.get('repeats', 1)} repeat(s) interleaved: "
          f"median [min-max]")
    print(f"{'tier':>5} {'order':5} {'system':11} {'store %':>17} {'gpu %':>17} "
          f"{'cold s':>17} {'warm s':>17} {'stored GB':>9} {'start-up s':>17}")
    rows = sorted((r for r in sweep["rows"] if "store_share" in r),
                  key=lambda r: (r["order"], r["fraction"], r["system"]))
    for r in rows:
        print(f"{r['fraction']:5.2f} {r['order']:5} {r['system']:11} "
              f"{fmt(r['store_share'], 1, 100, 17)} {fmt(r['gpu_share'], 1, 100, 17)} "
              f"{fmt(r['cold_wall_s'], 2, width=17)} {fmt(r['warm_wall_mean_s'], 2, width=17)} "
              f"{fmt(r.get('stored_bytes_cold'), 2, 1e-9, 9)} "
              f"{fmt(r.get('startup_s'), 1, width=17)}")
    for r in rows:
        host = r.get("host_ms_per_step")
        if host:
            print(f"host ms/step, warm rounds, {r['fraction']:g} {r['order']} {r['system']}: "
                  + ", ".join(f"{k} {fmt(v, 2)}" for k, v in sorted(host.items()) if v))
    for t in sweep["targets"]:
        goal = "-" if t["goal"] is None else f"{100 * t['goal']:.1f}%"
        off = "-" if t["offloading"] is None else f"{100 * t['offloading']:.1f}%"
        met = t["meets_goal"] in (True, None) and t["beats_offloading"] in (True, None)
        print(f"target tier {t['fraction']:.2f} {t['order']}: share {100 * t['share']:.1f}% "
              f"goal {goal} offloading {off} (medians) -> {'met' if met else 'NOT met'}")


def plot(sweep: dict, path: str) -> bool:
    plt = plots.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    repeats = sweep["meta"].get("repeats", 1)
    for col, order in enumerate(("loop", "zipf")):
        for s, style in (("gemma4-kv", "o-"), ("offloading", "s--"), ("none", "x:")):
            rs = sorted((r for r in sweep["rows"] if r["system"] == s and r["order"] == order
                         and "store_share" in r), key=lambda r: r["fraction"])
            if not rs:
                continue
            x = [r["fraction"] for r in rs]
            plots.line(axes[0][col], x, [r.get("hit_share", hit_share(r)) for r in rs], style,
                       label=s)
            plots.line(axes[1][col], x, [r["warm_wall_mean_s"] for r in rs], style, label=s)
        xs = sorted({r["fraction"] for r in sweep["rows"]})
        if not xs:
            continue
        axes[0][col].plot(xs, [0.8 * min(f, 1) for f in xs], "k:", lw=0.8,
                          label="target 0.8 x tier / working set")
        axes[0][col].set_ylim(0, 1.05)
        axes[0][col].set_ylabel("warm hit share (CPU tier + vLLM's GPU cache)")
        axes[1][col].set_ylabel("warm round wall time (s)")
        for row in (0, 1):
            axes[row][col].set_xlabel("CPU tier / OffloadingConnector's working set")
            axes[row][col].set_xscale("log")
            axes[row][col].set_xticks(xs, [f"{f:g}" for f in xs])
            axes[row][col].set_title(f"{order} order ({sweep['meta']['config']}, "
                                     f"{sweep['meta'].get('gpu', '?')}; median of "
                                     f"{repeats}, bars: range)", fontsize=9)
            axes[row][col].legend(fontsize=7)
    return plots.save(fig, path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plot-only"]:
        return 0 if plot(json.loads(Path(argv[2]).read_text()), argv[1]) else 1
    if argv[:1] == ["--merge"]:
        return merge(Path(argv[1]), [json.loads(Path(a).read_text()) for a in argv[2:]])
    args, rest = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ws = working_set(args, rest)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), config=ws["config"], layers=ws["layers"],
                docs=args.docs, fractions=args.fractions, repeats=args.repeats,
                command="python benchmarks/bench_sweep.py " + " ".join(argv))
    rows = []
    for i, f in enumerate(args.fractions):
        reference = ["none"] if i == 0 and not args.no_none else []  # one reference
        systems = reference + args.systems
        first = i == 0 and not args.no_prime  # the untimed engine, before the first point
        summary = run_point(args, rest, out / f"f{f:g}", systems, f * ws["bytes"] / GiB,
                            prime=first)
        meta.setdefault("gpu", summary.get("meta", {}).get("gpu"))
        if first:
            meta["prime"] = dict(summary.get("prime") or {}, point=f)
        meta.setdefault("engines", {})[f"{f:g}"] = summary.get("engines")
        rows += point_rows(f, summary)
        if summary["returncode"]:
            print(f"== point {f}: exit {summary['returncode']} (see {out}/f{f:g}/)")
    write(out, dict(meta=meta, working_set_bytes=ws["bytes"], sizes=ws["sizes"], rows=rows))
    return 0


def write(out: Path, sweep: dict) -> None:
    sweep["targets"] = targets(sweep["rows"])
    (out / "sweep.json").write_text(json.dumps(sweep, indent=1))
    print_table(sweep)
    plot(sweep, str(out / "sweep.png"))
    print(f"wrote {out / 'sweep.json'}")


def merge(out: Path, parts: list[dict]) -> int:
    """One sweep from runs of the same shape split over device calls; each run's meta
    is kept under `runs`."""
    first = parts[0]
    if any(p["working_set_bytes"] != first["working_set_bytes"] for p in parts):
        print("these runs have different working sets: not one sweep")
        return 1
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(first["meta"], runs=[p["meta"] for p in parts],
                fractions=sorted({f for p in parts for f in p["meta"]["fractions"]}),
                prime=[p["meta"].get("prime") for p in parts])
    write(out, dict(meta=meta, working_set_bytes=first["working_set_bytes"],
                    sizes=first["sizes"], rows=[r for p in parts for r in p["rows"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
