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
(`bench_serving.sizes`: `docs_final_hit_bytes`, checked against the bytes it reports
storing, `vllm:kv_offload_store_bytes`). Each tier size runs `bench_serving.py` with
scenarios `loop` and `zipf` (one engine per system, emptied between the two). `--layers`
keeps that many of the shape's layers (same groups, head sizes, window and 5:1 pattern:
the same bytes per token per layer, so the same tier / working-set ratios) to fit the
sweep in a GPU lease. Before the first point one short connector-free engine runs
untimed (`--no-prime` skips it): on a fresh machine the first engine otherwise pays for
vLLM's compile cache and every model kernel's first compile, and the system listed
first looks slow at start-up and in its first rounds. Writes DIR/sweep.json, DIR/sweep.png and every point's own
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
    args, rest = p.parse_known_args(argv)
    args.fractions = [float(f) for f in args.fractions.split(",")]
    args.systems = [s for s in args.systems.split(",") if s]
    return args, rest


def working_set(args, rest) -> dict:
    """OffloadingConnector's working set of the sweep's documents (no vLLM needed)."""
    sys.path.insert(0, str(HERE))
    import bench_serving

    a = bench_serving.parse_args(["--out", "/dev/null", *config_arg(args),
                                  "--docs", str(args.docs), *rest])
    sz = bench_serving.sizes(a, bench_serving.layout_of(a, bench_serving.model_config(a)))
    return {"bytes": sz["docs_final_hit_bytes"], "sizes": sz, "layers": a.layers,
            "config": a.config}


def config_arg(args) -> list[str]:
    return ["--config", args.config] if args.config else []


def run_point(args, rest, out: Path, systems, cpu_gb: float) -> dict:
    cmd = [sys.executable, str(HERE / "bench_serving.py"), "--out", str(out),
           *config_arg(args), "--systems", ",".join(systems),
           "--scenarios", "loop,zipf", "--docs", str(args.docs), "--cpu-gb", f"{cpu_gb:.4f}",
           "--system-timeout", str(args.point_timeout), *rest]
    print("==", " ".join(cmd[1:]), flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=args.point_timeout * len(systems) + 60)
    (out / "driver.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "driver.log").write_text(proc.stdout + proc.stderr)
    path = out / "serving.json"
    summary = json.loads(path.read_text()) if path.exists() else {"systems": {}}
    summary["returncode"], summary["wall_s"] = proc.returncode, time.perf_counter() - t
    return summary


def prime(args, rest, out: Path) -> None:
    """One untimed connector-free engine over one document, so that compile caches and
    first kernel compiles are not charged to whichever system runs first."""
    cmd = [sys.executable, str(HERE / "bench_serving.py"), "--out", str(out),
           *config_arg(args), "--systems", "none", "--scenarios", "fits", "--fits-docs", "1",
           "--fits-rounds", "1", "--system-timeout", str(args.point_timeout), *rest]
    print("== prime:", " ".join(cmd[1:]), flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout + 60)
    out.mkdir(parents=True, exist_ok=True)
    (out / "driver.log").write_text(proc.stdout + proc.stderr)
    print(f"== prime: exit {proc.returncode} after {time.perf_counter() - t:.1f} s", flush=True)


def warm(rounds: list[dict]) -> dict:
    """Warm hit share (store, and vLLM's GPU cache beside it) and round times."""
    rs = [r for r in rounds if r["kind"] == "warm"]
    prompt = sum(r["prompt_tokens"] for r in rs)
    if not prompt:
        return {}
    return dict(store_share=sum(r["store_tokens"] for r in rs) / prompt,
                gpu_share=sum(r["gpu_tokens"] for r in rs) / prompt,
                warm_wall_s=[r["wall_s"] for r in rs],
                warm_wall_mean_s=statistics.fmean(r["wall_s"] for r in rs),
                cold_wall_s=rounds[0]["wall_s"], stored_bytes_cold=rounds[0]["stored_bytes"])


def point_rows(f: float, summary: dict) -> list[dict]:
    rows = []
    for s, r in summary.get("systems", {}).items():
        for order in ("loop", "zipf"):
            sc = r.get("scenarios", {}).get(order)
            if sc:
                rows.append(dict(fraction=f, system=s, order=order, **warm(sc["rounds"]),
                                 startup_s=r.get("startup_s")))
    return rows


def hit_share(r: dict) -> float:
    """Warm prompt tokens not recomputed: from the CPU tier, or from vLLM's GPU cache in
    front of it (with a Zipf order the GPU cache serves the hottest documents itself)."""
    return r["store_share"] + r["gpu_share"]


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
    print(f"\ntier sweep: {sweep['meta']['config']} ({sweep['meta'].get('layers') or 'all'} "
          f"layers), {sweep['meta'].get('gpu', '?')}, working set "
          f"{sweep['working_set_bytes'] / GiB:.2f} GiB ({sweep['meta']['docs']} documents)")
    print(f"{'tier':>5} {'order':5} {'system':11} {'store':>6} {'gpu':>5} {'cold s':>7} "
          f"{'warm s':>7} {'stored GB':>9}")
    for r in sorted(sweep["rows"], key=lambda r: (r["order"], r["fraction"], r["system"])):
        if "store_share" not in r:
            continue
        stored = r.get("stored_bytes_cold")
        print(f"{r['fraction']:5.2f} {r['order']:5} {r['system']:11} "
              f"{100 * r['store_share']:5.1f}% {100 * r['gpu_share']:4.1f}% "
              f"{r['cold_wall_s']:7.2f} {r['warm_wall_mean_s']:7.2f} "
              f"{'-' if stored is None else f'{stored / 1e9:9.2f}'}")
    for t in sweep["targets"]:
        goal = "-" if t["goal"] is None else f"{100 * t['goal']:.1f}%"
        off = "-" if t["offloading"] is None else f"{100 * t['offloading']:.1f}%"
        met = t["meets_goal"] in (True, None) and t["beats_offloading"] in (True, None)
        print(f"target tier {t['fraction']:.2f} {t['order']}: share {100 * t['share']:.1f}% "
              f"goal {goal} offloading {off} -> {'met' if met else 'NOT met'}")


def plot(sweep: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG (later: --plot-only OUT.png JSON)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, order in enumerate(("loop", "zipf")):
        for s, style in (("gemma4-kv", "o-"), ("offloading", "s--"), ("none", "x:")):
            rs = sorted((r for r in sweep["rows"] if r["system"] == s and r["order"] == order
                         and "store_share" in r), key=lambda r: r["fraction"])
            if not rs:
                continue
            x = [r["fraction"] for r in rs]
            axes[0][col].plot(x, [hit_share(r) for r in rs], style, label=s)
            axes[1][col].plot(x, [r["warm_wall_mean_s"] for r in rs], style, label=s)
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
                                     f"{sweep['meta'].get('gpu', '?')})", fontsize=9)
            axes[row][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


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
                docs=args.docs, fractions=args.fractions,
                command="python benchmarks/bench_sweep.py " + " ".join(argv))
    rows = []
    if not args.no_prime:
        prime(args, rest, out / "prime")
    for i, f in enumerate(args.fractions):
        reference = ["none"] if i == 0 and not args.no_none else []  # one reference
        systems = args.systems + reference
        summary = run_point(args, rest, out / f"f{f:g}", systems, f * ws["bytes"] / GiB)
        meta.setdefault("gpu", summary.get("meta", {}).get("gpu"))
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
                fractions=sorted({f for p in parts for f in p["meta"]["fractions"]}))
    write(out, dict(meta=meta, working_set_bytes=first["working_set_bytes"],
                    sizes=first["sizes"], rows=[r for p in parts for r in p["rows"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
