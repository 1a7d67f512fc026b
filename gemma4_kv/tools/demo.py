"""The demo: a Gemma 4-shaped model in vLLM with the connector, a long prompt twice.

    gemma4-kv demo [--model CHECKPOINT_DIR] [--tokens 2048] [--shared | --serve]

Without `--model` it builds a small random-weight Gemma 4 (5 sliding : 1 full layers,
head dims 64 / 128, a window smaller than the prompt, KV-shared last layers). It uses
the GPU and the Triton kernels when one is present, vLLM's CPU build otherwise.
`--shared` runs two engines against one shared store instead (`demo_two_engines.py`);
`--serve` runs vLLM's OpenAI server with the connector and sends the prompts over HTTP
(`demo_serve.py`; without `--model`, the checkpoint gets random weights and a tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path


class Spinner:
    """A one-line progress display while something slow (vLLM's start-up) runs."""

    def __init__(self, text: str):
        self.text, self._stop = text, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0, frames, i = time.time(), "|/-\\", 0
        tty = sys.stderr.isatty()
        while not self._stop.wait(0.25 if tty else 5.0):
            line = f"{frames[i % 4]} {self.text} {time.time() - t0:5.1f} s"
            sys.stderr.write(f"\r{line}" if tty else f"{line}\n")
            sys.stderr.flush()
            i += 1
        sys.stderr.write(f"\r{self.text} done in {time.time() - t0:.1f} s\n")

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def demo_model_config(cuda: bool):
    from .harness import tiny_gemma4_config

    size = dict(hidden=512, head_dim=128, global_head_dim=256, kv_heads=2) if cuda else \
        dict(hidden=256, head_dim=64, global_head_dim=128, kv_heads=1)
    return tiny_gemma4_config(layers=18, kv_shared=6, window=256, vocab=4096, **size)


def demo_model(path: Path, cuda: bool) -> str:
    from .harness import save_config

    return save_config(demo_model_config(cuda), path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gemma4-kv demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Gemma 4 checkpoint directory (default: random weights)")
    p.add_argument("--tokens", type=int, default=2048, help="length of the long prompt")
    p.add_argument("--cpu-gb", type=float, default=1.0, help="size of the CPU store")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--shared", action="store_true",
                      help="two engines, one after the other, sharing one store")
    mode.add_argument("--serve", action="store_true",
                      help="vLLM's OpenAI server with the connector, requests over HTTP")
    args = p.parse_args(argv)
    if not args.serve:  # the server logs at INFO to a file of its own
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    import torch

    cuda = torch.cuda.is_available()
    if args.serve:
        from .demo_serve import run as serve

        print(f"gemma4-kv demo --serve: vLLM's OpenAI server, "
              f"{torch.cuda.get_device_name() if cuda else 'CPU'}")
        return serve(args.model, args.tokens, args.cpu_gb, cuda, Spinner)
    work = Path(tempfile.mkdtemp(prefix="gemma4-kv-demo-"))
    model = args.model or demo_model(work / "model", cuda)
    stats = work / "stats.jsonl"
    print(f"gemma4-kv demo: model {model}\n  device: "
          f"{torch.cuda.get_device_name() + ' (Triton kernels)' if cuda else 'CPU (torch mover)'}")

    from vllm import LLM, SamplingParams

    from .harness import connector_config, shim_kwargs

    if args.shared:
        from .demo_two_engines import run
        from ..layout.from_hf import load_text_config

        vocab = load_text_config(model).vocab_size
        rng = random.Random(0)
        long_prompt = [rng.randrange(3, vocab) for _ in range(args.tokens)]
        shared = long_prompt[: args.tokens * 5 // 8] + [rng.randrange(3, vocab)
                                                        for _ in range(300)]
        engine = {"enforce_eager": True, "max_model_len": args.tokens + 1024,
                  "dtype": "bfloat16" if cuda else "float32",
                  **({"gpu_memory_utilization": 0.4} if cuda else {"block_size": 32}),
                  **({"load_format": "auto"} if args.model else {})}
        return run(model, work, engine, long_prompt, shared, args.cpu_gb, Spinner)

    kwargs = dict(model=model, skip_tokenizer_init=True, seed=0, enforce_eager=True,
                  disable_log_stats=False,  # per-request TTFT in RequestOutput.metrics
                  max_model_len=args.tokens + 1024, enable_prefix_caching=False,
                  dtype="bfloat16" if cuda else "float32",
                  # sliding-window chunks kept every 1024 tokens: a shared start hits there
                  kv_transfer_config=connector_config({"cpu_gb": args.cpu_gb,
                                                       "retention_interval": 1024,
                                                       "stats_file": str(stats)}))
    kwargs.update(shim_kwargs())
    if not args.model:
        kwargs["load_format"] = "dummy"
    if cuda:
        kwargs["gpu_memory_utilization"] = 0.5
    else:
        kwargs["block_size"] = 32
    with Spinner("starting vLLM with the gemma4-kv connector..."):
        llm = LLM(**kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    long_prompt = [rng.randrange(3, vocab) for _ in range(args.tokens)]
    shared = long_prompt[: args.tokens * 5 // 8] + [rng.randrange(3, vocab) for _ in range(300)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)

    def send(name, tokens):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        ttft = getattr(out.metrics, "first_token_latency", None) or wall
        return name, ttft, out.num_cached_tokens, list(out.outputs[0].token_ids)

    runs = [send("cold: long prompt", long_prompt),
            send("warm: same prompt again", long_prompt),
            send("prompt sharing a prefix", shared)]
    print(f"\n{'request':28} {'TTFT s':>8} {'cached tokens':>14}")
    for name, ttft, cached, _ in runs:
        print(f"{name:28} {ttft:8.3f} {cached:14}")
    print(f"\ncold / warm TTFT: {runs[0][1] / runs[1][1]:.1f}x")
    events = [json.loads(line) for line in stats.read_text().splitlines()]
    layout = next(e for e in events if e["event"] == "layout")
    print(f"\n{'group':5} {'kind':8} {'block':>5} {'layers':>6} {'stored MB':>10} "
          f"{'loaded MB':>10}")
    for gid, g in enumerate(layout["groups"]):
        mb = {k: sum(e["groups"].get(str(gid), {}).get("bytes", 0) for e in events
                     if e["event"] == k) / 1e6 for k in ("save", "load")}
        print(f"{gid:<5} {g['kind']:8} {g['block_size']:5} {len(g['layers']):6} "
              f"{mb['save']:10.2f} {mb['load']:10.2f}")
    aliased = [a for g in layout["groups"] for a in g["aliases"]]
    print(f"KV-shared layers never stored: {len(aliased)}")
    same = runs[0][3] == runs[1][3]
    print(f"\ngreedy outputs identical cold vs warm (16 tokens): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
