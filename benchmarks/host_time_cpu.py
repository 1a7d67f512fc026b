"""Host time of the connector's scheduler half per kind of step (issue 24: at most 1 ms
per step, both halves), on CPU, without an engine: the real scheduler half on the tiny
Gemma 4 config, with the real embedded store and lookup service behind its socket
(tests/scheduler_half.py), played in vLLM's call order. Read from the connector's own
counters (`scheduler_us_<kind>`, `scheduler_steps_<kind>`).

    python benchmarks/host_time_cpu.py [--requests 64] [--decode-steps 200] [--cprofile OUT]

Phases: `save` steps (each request's prefill, alone: cold, its chunks saved), then
`plain` steps with every request in flight decoding one token, then `load` steps (the
same prompts asked again, alone: each a hit). It asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def decode_step(half, reqs):
    """Every request in flight computes one more token: a plain step."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[r.request_id for r in reqs], resumed_req_ids=set(), new_token_ids=[],
        all_token_ids={}, new_block_ids=[None] * len(reqs),
        num_computed_tokens=[r.num_computed_tokens for r in reqs],
        num_output_tokens=[r.num_output_tokens for r in reqs])
    out.num_scheduled_tokens = {r.request_id: 1 for r in reqs}
    out.total_num_scheduled_tokens = len(reqs)
    meta = half.connector.build_connector_meta(out)
    for r in reqs:
        r.append_output_token_ids(7)
        r.num_computed_tokens += 1
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--decode-steps", type=int, default=200)
    ap.add_argument("--cprofile")
    args = ap.parse_args(argv)

    from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
    from scheduler_half import SchedulerHalf

    tmp = Path(tempfile.mkdtemp(prefix="host-time-"))
    half = SchedulerHalf(save_config(tiny_gemma4_config(window=100), tmp / "model"),
                         kv_mib=512)
    stats = half.connector._stats
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.tokens)]
               for _ in range(args.requests)]
    prof = cProfile.Profile() if args.cprofile else None
    figures = {}

    def phase(name):
        data = stats.take().data
        figures[name] = {k: v for k, v in data.items() if k.startswith("scheduler_")}

    stats.take()
    reqs = []
    for p in prompts:  # cold prefills, each alone: save steps
        req = half.request(p)
        _, meta = half.schedule(req)
        half.work(meta)
        req.num_computed_tokens = req.num_tokens
        reqs.append(req)
    phase("save")
    if prof:
        prof.enable()
    for _ in range(args.decode_steps):
        half.work(decode_step(half, reqs))
    if prof:
        prof.disable()
    phase(f"plain, {len(reqs)} in flight")
    for req in reqs:
        half.finish(req)
    for p in prompts:  # the same prompts again, each alone: load steps
        half.serve(half.request(p))
    phase("load")
    for name, d in figures.items():
        kinds = {k.rsplit("_", 1)[1] for k in d if k.startswith("scheduler_steps_")}
        for k in sorted(kinds):
            steps = d[f"scheduler_steps_{k}"]
            print(f"{name:>18}: {k:5} steps {steps:4d}  scheduler "
                  f"{d.get(f'scheduler_us_{k}', 0) / steps / 1e3:.3f} ms/step")
    if prof:
        prof.dump_stats(args.cprofile)
    print(json.dumps(figures))
    half.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
