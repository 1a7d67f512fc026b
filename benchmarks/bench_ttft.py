"""Time to first token in vLLM on a GPU: cold, warm from the connector's CPU store, and
vLLM's own GPU prefix-cache hit, for a random-weight Gemma 4-shaped model.

    python benchmarks/bench_ttft.py --out ttft.json [--config gemma4-31b-like]
        [--lengths 1024,8192,32768] [--plot ttft.png]

Per prompt length (one engine, prefix caching on): a cold prompt (the connector stores
it), `reset_prefix_cache()` then the same prompt (a hit served by the connector), then
the same prompt again (vLLM's GPU prefix-cache hit). Bytes moved per group and the
lookup / load times come from the connector's stats file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from gemma4_kv.cli import bundled_config
from gemma4_kv.harness import connector_config, shim_kwargs
from gemma4_kv.hf_layout import hf_layout, load_text_config


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    p.add_argument("--config", default="gemma4-31b-like")
    p.add_argument("--lengths", default="1024,8192,32768")
    p.add_argument("--cpu-gb", type=float, default=56)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]

    import torch
    from vllm import LLM, SamplingParams

    cfg = load_text_config(bundled_config(args.config))
    cfg.architectures = ["Gemma4ForCausalLM"]
    model = tempfile.mkdtemp(prefix="gemma4-bench-")
    cfg.save_pretrained(model)
    stats = Path(model) / "stats.jsonl"
    kwargs = dict(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  seed=0, enforce_eager=True, max_model_len=max(lengths) + 1024,
                  max_num_batched_tokens=8192, gpu_memory_utilization=0.9,
                  enable_prefix_caching=True,
                  kv_transfer_config=connector_config({"cpu_gb": args.cpu_gb,
                                                       "stats_file": str(stats)}))
    kwargs.update(shim_kwargs())
    t = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    rng = random.Random(0)

    def ttft(tokens):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens, list(out.outputs[0].token_ids)

    llm.generate([{"prompt_token_ids": [5] * 300}], sp, use_tqdm=False)  # warm-up
    rows = []
    for n in lengths:
        tokens = [rng.randrange(3, cfg.vocab_size) for _ in range(n)]
        cold, c0, o0 = ttft(tokens)
        llm.reset_prefix_cache()
        warm, c1, o1 = ttft(tokens)
        gpu, c2, o2 = ttft(tokens)
        rows.append(dict(tokens=n, cold_s=cold, warm_connector_s=warm, gpu_prefix_hit_s=gpu,
                         cached=[c0, c1, c2], same_first_token=o0 == o1 == o2))
        print(json.dumps(rows[-1]), flush=True)

    layout = hf_layout(cfg, dtype=torch.bfloat16)
    events = [json.loads(l) for l in stats.read_text().splitlines()]
    loads = [e for e in events if e["event"] == "load"]
    lookups = [e for e in events if e["event"] == "lookup" and e["end"] > 0]
    for row in rows:
        load = next((e for e in loads if e["end"] == row["cached"][1]), None)
        look = next((e for e in lookups if e["end"] == row["cached"][1]), None)
        if load:
            moved = sum(g["bytes"] for g in load["groups"].values())
            full_prefix = load["end"] * sum(g.bytes_per_token for g in layout.groups)
            row.update(loaded_bytes=moved, loaded_bytes_per_group=load["groups"],
                       full_prefix_bytes=full_prefix, loaded_fraction=moved / full_prefix,
                       load_s=load["seconds"], lookup_s=look["seconds"] if look else None,
                       load_gbps=moved / load["seconds"] / 1e9)
        row["cold_over_warm"] = row["cold_s"] / row["warm_connector_s"]
        row["warm_over_gpu_hit"] = row["warm_connector_s"] / row["gpu_prefix_hit_s"]
    props = torch.cuda.get_device_properties(0)
    import triton

    result = dict(meta=dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__,
                            date=time.strftime("%Y-%m-%d"), config=args.config,
                            engine_startup_s=startup,
                            command="python benchmarks/bench_ttft.py " + " ".join(sys.argv[1:])),
                  rows=rows)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{args.config} on {props.name}")
    print(f"{'tokens':>6} {'cold s':>7} {'warm s':>7} {'gpu-hit s':>9} {'cold/warm':>9} "
          f"{'warm/gpu':>8} {'loaded GB':>9} {'of prefix':>9} {'load s':>7} {'GB/s':>6}")
    for r in rows:
        print(f"{r['tokens']:6} {r['cold_s']:7.3f} {r['warm_connector_s']:7.3f} "
              f"{r['gpu_prefix_hit_s']:9.3f} {r['cold_over_warm']:9.1f} "
              f"{r['warm_over_gpu_hit']:8.2f} {r.get('loaded_bytes', 0) / 1e9:9.2f} "
              f"{100 * r.get('loaded_fraction', 0):8.1f}% {r.get('load_s', 0):7.3f} "
              f"{r.get('load_gbps', 0):6.1f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        x = range(len(rows))
        w = 0.27
        for k, (key, label) in enumerate([("cold_s", "cold"), ("warm_connector_s",
                                           "warm (gemma4-kv CPU store)"),
                                          ("gpu_prefix_hit_s", "vLLM GPU prefix hit")]):
            ax.bar([i + (k - 1) * w for i in x], [r[key] for r in rows], w, label=label)
        ax.set_xticks(list(x), [f"{r['tokens']} tokens" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{args.config} (random weights), {props.name}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
