"""Time to first token in vLLM on a GPU: cold, warm from a CPU KV store, and vLLM's own
GPU prefix-cache hit, for a random-weight Gemma 4-shaped model.

    python benchmarks/bench_ttft.py --out ttft.json [--config gemma4-31b-like]
        [--connector gemma4-kv|offloading] [--lengths 1024,8192,32768] [--plot ttft.png]

Per prompt length (one engine, prefix caching on): a cold prompt (the connector stores
it), a one-token request and a pause so stores land, then `--repeats` times:
`reset_prefix_cache()`, the same prompt (a hit served from the CPU store), the same
prompt again (vLLM's GPU prefix-cache hit); medians are reported. `gemma4-kv` is this
connector (bytes per group, lookup and load times come from its stats file);
`offloading` is vLLM's native OffloadingConnector with its compiled copy op replaced by
benchmarks/vllm_standins.py (cuMemcpyBatchAsync).

A shared tier: `--l2 '[{"type": "valkey", ...}]'` adds LMCache L2 tiers behind the CPU
store; `--server tcp://HOST:PORT` makes a running `lmcache server` the store instead
(`lmcache_server`). A second engine started with `--from-tier` (same tier, same
prompts) measures hits served from it: no cold runs, and before each warm run its CPU
tier (if it has one) is emptied, so the hit comes from the shared tier.

Peers on the same rows: `--connector lmcache-mp --server URL` is LMCache 0.5.6's own
MP connector (`lmcache/integration/vllm/lmcache_mp_connector.py`) against a running
`lmcache server` in its CUDA mode; `--connector offloading-fs --fs-dir DIR` is vLLM's
OffloadingConnector with `TieringOffloadingSpec` and an `fs` secondary tier in DIR.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gemma4_kv.tools.cli import bundled_config
from common.peers import transfer_config
from gemma4_kv.layout.from_hf import hf_layout, load_text_config
from gemma4_kv.tools.harness import shim_kwargs


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    p.add_argument("--config", default="gemma4-31b-like")
    p.add_argument("--connector", default="gemma4-kv",
                   choices=["gemma4-kv", "offloading", "offloading-fs", "lmcache-mp"])
    p.add_argument("--server", help="tcp://HOST:PORT of a running lmcache server")
    p.add_argument("--fs-dir", help="the fs secondary tier's directory (offloading-fs)")
    p.add_argument("--label", help="name of this run in its JSON (default: connector)")
    p.add_argument("--lengths", default="1024,8192,32768")
    p.add_argument("--cpu-gb", type=float, default=50)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--repeats", type=int, default=3, help="warm and GPU-hit runs (median)")
    p.add_argument("--l2", help="JSON list of LMCache L2 tiers behind the CPU store")
    p.add_argument("--codec", default="none", choices=("none", "lossless", "cachegen"),
                   help="l2_codec of the --l2 tiers (gemma4-kv; bits at their default)")
    p.add_argument("--from-tier", action="store_true",
                   help="no cold runs; every warm hit comes up from the --l2 tiers")
    p.add_argument("--model-dir", help="where the random-weight model's config is written "
                   "(default: a new temporary directory; with --l2 a fixed one per config, "
                   "since the model path is part of every key and a second engine must "
                   "name the same model to share the tier)")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.from_tier:  # collective_rpc with a function (empty_cpu_tier)
        import os

        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    import torch
    from vllm import LLM, SamplingParams

    if shim_kwargs():  # vLLM without its compiled ops (GPU machine): stand-ins for two
        import vllm_standins  # of them; the forked engine core inherits them

        vllm_standins.install()

    cfg = load_text_config(bundled_config(args.config))
    cfg.architectures = ["Gemma4ForCausalLM"]
    layout = hf_layout(cfg, dtype=torch.bfloat16)
    shared = args.l2 or args.server or args.fs_dir
    model = args.model_dir or (f"{tempfile.gettempdir()}/gemma4-bench-{args.config}"
                               if shared else tempfile.mkdtemp(prefix="gemma4-bench-"))
    cfg.save_pretrained(model)
    stats = Path(tempfile.mkdtemp(prefix="gemma4-bench-stats-")) / "stats.jsonl"
    kwargs = dict(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  seed=0, enforce_eager=True, max_model_len=max(lengths) + 1024,
                  max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                  enable_prefix_caching=True, tensor_parallel_size=args.tp,
                  disable_custom_all_reduce=True,  # not on this machine's vLLM (no compiled ops)
                  kv_transfer_config=transfer_config(args, layout, stats))
    kwargs.update(shim_kwargs())
    t = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    # All prompts first, from their own generator: engine B (`--from-tier`) never settles,
    # and its prompts must be engine A's.
    draw = random.Random(0)
    prompts = {n: [draw.randrange(3, cfg.vocab_size) for _ in range(n)] for n in lengths}
    fillers = random.Random(1)

    def ttft(tokens):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens, list(out.outputs[0].token_ids)

    def settle():
        """Let stores land (vLLM's connector submits them in the next step)."""
        llm.generate([{"prompt_token_ids": [fillers.randrange(3, 1000)] * 8}], sp, use_tqdm=False)
        time.sleep(1.0)

    ttft([5] * 300)  # warm-up
    rows = []
    for n in lengths:
        tokens = prompts[n]
        if args.from_tier:
            cold, c0, o0 = float("nan"), None, None
        else:
            cold, c0, o0 = ttft(tokens)
            settle()
        warm, gpu = [], []
        for _ in range(args.repeats):
            llm.reset_prefix_cache()
            if args.from_tier and args.l2:
                llm.collective_rpc(empty_cpu_tier)
            warm.append(ttft(tokens))
            gpu.append(ttft(tokens))
        o0 = o0 if o0 is not None else warm[0][2]
        rows.append(dict(tokens=n, cold_s=cold, warm_connector_s=statistics.median(
                             t for t, _, _ in warm),
                         gpu_prefix_hit_s=statistics.median(t for t, _, _ in gpu),
                         warm_runs_s=[t for t, _, _ in warm], gpu_hit_runs_s=[t for t, _, _ in gpu],
                         cached=[c0, warm[0][1], gpu[0][1]],
                         first_tokens=dict(cold=o0, warm=[o for _, _, o in warm],
                                           gpu_hit=[o for _, _, o in gpu]),
                         same_first_token=all(o == o0 for _, _, o in warm + gpu)))
        print(json.dumps(rows[-1]), flush=True)

    events = ([json.loads(l) for l in stats.read_text().splitlines()]
              if stats.exists() else [])
    for row in rows:
        add_phases(row, events, layout)
        row["cold_over_warm"] = row["cold_s"] / row["warm_connector_s"]
        row["warm_over_gpu_hit"] = row["warm_connector_s"] / row["gpu_prefix_hit_s"]
    props = torch.cuda.get_device_properties(0)
    import triton

    result = dict(meta=dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__,
                            date=time.strftime("%Y-%m-%d"), config=args.config,
                            connector=args.connector, tensor_parallel=args.tp,
                            label=args.label or args.connector, server=args.server,
                            l2=args.l2, codec=args.codec, from_tier=args.from_tier,
                            engine_startup_s=startup,
                            groups=[(g.kind.value, g.block_size, len(g.layers))
                                    for g in layout.groups],
                            command="python benchmarks/bench_ttft.py " + " ".join(sys.argv[1:])),
                  rows=rows)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    if args.plot:
        plot([result], args.plot)


def empty_cpu_tier(worker) -> int:
    """collective_rpc target: drop every unpinned object from the connector's CPU tier
    (the L2 tiers keep theirs)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    store = get_kv_transfer_group()._worker.store
    store.drop_l1()
    return store.usage()[0]


def add_phases(row: dict, events: list, layout) -> None:
    """Bytes per group, lookup and load times of the warm hits (gemma4-kv's stats file):
    bytes of one hit summed over tensor-parallel ranks, times the slowest rank's, the
    median over the repeats."""
    hit = row["cached"][1]
    by_req = {}
    for e in events:
        if e["event"] in ("load", "lookup") and e["end"] == hit:
            by_req.setdefault(e["req_id"], []).append(e)
    hits = [evs for evs in by_req.values() if any(e["event"] == "load" for e in evs)]
    if not hits:
        return
    loads = [e for e in hits[0] if e["event"] == "load"]
    per_group = {}
    for e in loads:
        for gid, g in e["groups"].items():
            per_group[gid] = {k: per_group.get(gid, {}).get(k, 0) + v for k, v in g.items()}

    def slowest(evs, kind):
        return max((e["seconds"] for e in evs if e["event"] == kind), default=0.0)

    load_s = statistics.median(slowest(evs, "load") for evs in hits)
    moved = sum(g["bytes"] for g in per_group.values())
    full_prefix = hit * sum(g.bytes_per_token for g in layout.groups)  # all heads
    row.update(ranks_loaded=sorted({e.get("rank", 0) for e in loads}),
               loaded_bytes=moved, loaded_bytes_per_group=per_group,
               full_prefix_bytes=full_prefix, loaded_fraction=moved / full_prefix,
               load_s=load_s, lookup_s=statistics.median(slowest(evs, "lookup") for evs in hits),
               load_gbps=moved / load_s / 1e9)


def print_table(result: dict) -> None:
    m = result["meta"]
    print(f"\n{m['config']}, {m['connector']}, on {m['gpu']}")
    print(f"{'tokens':>6} {'cold s':>7} {'warm s':>7} {'gpu-hit s':>9} {'cold/warm':>9} "
          f"{'warm/gpu':>8} {'loaded GB':>9} {'of prefix':>9} {'lookup s':>8} {'load s':>7} "
          f"{'GB/s':>6}")
    for r in result["rows"]:
        print(f"{r['tokens']:6} {r['cold_s']:7.3f} {r['warm_connector_s']:7.3f} "
              f"{r['gpu_prefix_hit_s']:9.3f} {r['cold_over_warm']:9.1f} "
              f"{r['warm_over_gpu_hit']:8.2f} {r.get('loaded_bytes', 0) / 1e9:9.2f} "
              f"{100 * r.get('loaded_fraction', 0):8.1f}% {r.get('lookup_s') or 0:8.3f} "
              f"{r.get('load_s', 0):7.3f} {r.get('load_gbps', 0):6.1f}")


def plot(results: list, path: str) -> None:
    """One panel per model shape: cold, warm per connector, GPU prefix hit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def panel(r):
        return r["meta"]["config"], r["meta"].get("tensor_parallel", 1)

    panels = sorted({panel(r) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (config, tp) in zip(axes[0], panels):
        mine = [r for r in results if panel(r) == (config, tp)]
        bars = [("cold", "cold_s", mine[0])]
        bars += [(f"warm ({r['meta']['connector']})", "warm_connector_s", r) for r in mine]
        bars += [("vLLM GPU prefix hit", "gpu_prefix_hit_s", mine[0])]
        rows = mine[0]["rows"]
        w = 0.8 / len(bars)
        for k, (label, key, r) in enumerate(bars):
            ax.bar([i + (k - (len(bars) - 1) / 2) * w for i in range(len(rows))],
                   [row[key] for row in r["rows"]], w, label=label)
        ax.set_xticks(range(len(rows)), [f"{r['tokens']} tokens" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{config}{f', TP {tp}' if tp > 1 else ''} (random weights), "
                     f"{mine[0]['meta']['gpu']}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot-only"]:  # --plot-only OUT.png RESULT.json ...
        plot([json.loads(Path(f).read_text()) for f in sys.argv[3:]], sys.argv[2])
    else:
        main()
