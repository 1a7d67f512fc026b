"""Serving benchmark: rounds of many requests through vLLM with a GPU KV cache smaller
than the working set, with no connector, this connector, and vLLM's OffloadingConnector
at the same CPU memory. Modelled on LMCache's long-doc-QA and multi-round-QA benchmarks.

    python benchmarks/bench_serving.py --out DIR [--config gemma4-12b-like | --tiny]
        [--systems none,gemma4-kv,offloading] [--scenarios fits,over,chat] [--cpu-gb 18]
        [--repeats 3] [--no-prime]
    python benchmarks/bench_serving.py --plot-only OUT.png DIR/serving.json

Scenarios (each starts from empty caches: `reset_prefix_cache(reset_connector=True)`):
- `fits`: long-doc QA whose dense working set (all layers, every token) fits in the CPU
  tier; `over`: the same with a dense working set `--over` (3) times the CPU tier;
  `loop`: `--docs` documents, `--loop-rounds` rounds in one order (a cycle: LRU's worst
  case); `zipf`: `--zipf-requests` requests over `--docs` documents drawn from a Zipf
  law (exponent `--zipf-s`), in rounds of `--docs` requests (the tier sweep,
  `bench_sweep.py`, runs these two at tier sizes around the working set).
  N documents of L tokens, each asked one of Q question suffixes per round, in one
  shuffled order (`--order reshuffle`: a new one each round), `--batch` requests in
  flight (one `llm.generate` of a list).
  Round 0 is cold (nothing stored yet), the rest are warm.
- `chat`: U users x T turns; a turn's prompt is the whole conversation so far, the
  previous answers included, plus a new user message (`--chat-answer` generated tokens
  per turn). With `--chat-align` (default) message lengths put each prompt's end half an
  answer before a chunk boundary, so every answer completes a chunk that a connector
  storing generated tokens can serve on the next turn.
A warm-up (other documents: cold, then served again after a GPU-cache reset, with
decoding) runs first, outside the measurements: Triton compiles cost seconds.

Per round: wall time, TTFT per request (vLLM's `RequestOutput.metrics.first_token_latency`,
from the request's arrival), the share of prompt tokens served from the store (vLLM's own
counter `vllm:external_prefix_cache_hits` over the round's prompt tokens; what vLLM's GPU
prefix cache served is `vllm:prefix_cache_hits`, counted apart), bytes stored per prompt
token (this connector's `stats_file` save events; `vllm:kv_offload_store_bytes` for the
OffloadingConnector) and every request's first token (exactness: compared with the same
prompt under no connector and with the cold round; equal in batch-invariant mode).

Every engine runs in its own process (`--worker`), one after the other (`--parallel`:
side by side, for exactness checks only). Timings on the GPU machine swing by +-30 %
between runs, so each system runs `--repeats` (3) times, a fresh engine each time, the
systems interleaved (none, gemma4-kv, offloading, none, gemma4-kv, ...), and every
figure (round wall time, TTFT, hit shares, bytes, start-up, the connector's host time
per step kind) is reported as the median with its [min, max] (`common/stats.py`; the
per-repeat values kept beside). Before them one untimed engine (`--prime`, no
connector, only the warm-up round over one document) takes the machine's first-engine
costs: vLLM's compile cache, the first kernel compiles. Writes DIR/serving.json (the
engines in the order they ran, the aggregated systems with each repeat's own result
under `runs`, targets), DIR/serving.png (medians, error bars for the range; matplotlib,
if installed), and per engine DIR/<system>.r<i>.json, .log and -work/ (the model config;
gemma4-kv's stats file), DIR/prime.*.

    python benchmarks/bench_serving.py --merge DIR A/serving.json B/serving.json
joins runs split over device calls: each call's engines become repeats, and a call
may run other scenarios than the next (each round's median is over the repeats that
ran it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import plots
from common.stats import aggregate, fmt, med, stat
from common.workload import (CHUNK, SCENARIOS, Chat, StatsTail, counters, cuda_present,
                             engine_kwargs, layout_of, longdoc_rounds, model_config,
                             prompt_key, settle_stores, sizes, zipf_rounds)
from common.workload import parse_args as workload_args


def parse_args(argv=None) -> argparse.Namespace:
    """The workload's options (`common/workload.py`), described as this benchmark."""
    return workload_args(argv, description=__doc__.split("\n\n")[0])

def p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)] if s else 0.0


def run_worker(args, system: str, result_path: Path) -> None:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    import torch

    from gemma4_kv.tools.harness import sharpen_dummy_weights, shim_kwargs

    from vllm.platforms import current_platform  # no CUDA initialised: the engine forks

    if system.startswith("offloading") and not current_platform.is_cuda_alike():
        raise SystemExit(f"{system}: vLLM's OffloadingConnector needs CUDA "
                         "(its CPU offloading worker has no CPU-only path); skipped")
    if shim_kwargs():  # vLLM without its compiled ops (GPU machine): stand-ins for the copy
        import vllm_standins  # op and batch-invariant mode's query; the engine core forks

        vllm_standins.install()
    from vllm import LLM, SamplingParams

    cfg = model_config(args)
    layout = layout_of(args, cfg)
    work = result_path.parent / f"{result_path.stem}-work"  # model config, stats file
    work.mkdir(parents=True, exist_ok=True)
    model = str(work / "model")
    cfg.save_pretrained(model)
    stats = work / "stats.jsonl"
    kwargs = engine_kwargs(args, system, model, stats, layout)
    result = dict(system=system, engine={k: v for k, v in kwargs.items() if k != "model"},
                  sizes=sizes(args, layout), scenarios={})

    def save():
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(result_path)

    t = time.perf_counter()
    llm = LLM(**kwargs)
    result["startup_s"] = time.perf_counter() - t
    llm.collective_rpc(sharpen_dummy_weights)
    result["num_gpu_blocks"] = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    import vllm

    result["versions"] = dict(vllm=vllm.__version__, torch=torch.__version__)
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(0)
    vocab = cfg.vocab_size
    tail = StatsTail(stats)
    rng = random.Random(12345)
    answer_sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                               detokenize=False)

    def settle():
        settle_stores(llm, vocab, rng, args.settle_s if system.startswith("offloading")
                      else 0.0)

    def run_round(items, sp, batch: int) -> dict:
        """items: [(label, tokens)], `batch` at a time in one llm.generate each."""
        before, reqs = counters(llm), []
        t0 = time.perf_counter()
        for i in range(0, len(items), batch):
            group = items[i:i + batch]
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": toks} for _, toks in group], sp,
                                use_tqdm=False)
            wall = time.perf_counter() - t
            for (label, toks), o in zip(group, outs):
                first = getattr(o.metrics, "first_token_latency", None) if o.metrics else None
                reqs.append(dict(label=label, key=prompt_key(toks), prompt=len(toks),
                                 cached=o.num_cached_tokens or 0, ttft=first or wall,
                                 ttft_from_metrics=bool(first),
                                 output=list(o.outputs[0].token_ids)))
        wall = time.perf_counter() - t0
        settle()
        after = counters(llm)
        delta = {k: v - before.get(k, 0) for k, v in after.items()}
        events = tail.take()
        prompt = sum(r["prompt"] for r in reqs)
        ttfts = [r["ttft"] for r in reqs]
        saved = sum(g["bytes"] for e in events if e["event"] == "save"
                    for g in e["groups"].values())
        loads = [e for e in events if e["event"] == "load"]
        if system == "gemma4-kv":
            stored = saved
            loaded = sum(g["bytes"] for e in loads for g in e["groups"].values())
        elif system == "none":
            stored = loaded = 0
        else:  # the OffloadingConnector's own counters (None if this vLLM has none)
            stored = delta.get("vllm:kv_offload_store_bytes",
                               0 if "vllm:kv_offload_store_bytes" in after else None)
            loaded = delta.get("vllm:kv_offload_load_bytes",
                               0 if "vllm:kv_offload_load_bytes" in after else None)
        external = delta.get("vllm:external_prefix_cache_hits", 0)
        local = delta.get("vllm:prefix_cache_hits", 0)
        host = {half + kind: delta.get(f"vllm:gemma4_kv_{half}_us{kind}", 0) / 1e3
                / delta[f"vllm:gemma4_kv_{half}_steps{kind}"]
                for half in ("scheduler", "worker")
                for kind in ("", "_plain", "_load", "_save")
                if delta.get(f"vllm:gemma4_kv_{half}_steps{kind}")}
        return dict(wall_s=wall, requests=len(reqs), prompt_tokens=prompt,
                    ttft_mean_s=statistics.fmean(ttfts), ttft_p90_s=p90(ttfts),
                    store_share=external / prompt, gpu_share=local / prompt,
                    cached_share=sum(r["cached"] for r in reqs) / prompt,
                    store_tokens=external, gpu_tokens=local,
                    store_tokens_from_loads=sum(e["end"] - e["start"] for e in loads),
                    stored_bytes=stored,
                    stored_bytes_per_token=None if stored is None else stored / prompt,
                    loaded_bytes=loaded, preemptions=delta.get("vllm:num_preemptions", 0),
                    connector_ms_per_step=host or None,
                    counters={k: v for k, v in delta.items() if v and (
                        "cache" in k or "kv_offload" in k or "gemma4_kv" in k
                        or "preempt" in k or k == "vllm:prompt_tokens")},
                    req=reqs)

    def reset():
        ok = llm.reset_prefix_cache(reset_connector=system != "none")
        tail.take()
        return ok

    # Warm-up: prefill, a store and its hit, decoding, then empty caches.
    t = time.perf_counter()
    warm = longdoc_rounds(args, vocab, "warmup", max(1, args.warmup_docs), 1)[0]
    run_round(warm, answer_sp, args.batch)
    llm.reset_prefix_cache()  # vLLM's GPU cache only: the next round hits the store
    run_round(warm, answer_sp, args.batch)
    result["warmup_s"] = time.perf_counter() - t
    result["warmup_reset_ok"] = reset()
    save()

    sz = result["sizes"]
    for name in args.scenarios:
        t = time.perf_counter()
        if name == "chat":
            rounds = run_chat(args, vocab, run_round)
        else:
            if name == "zipf":
                plan = zipf_rounds(args, vocab, name)
            else:
                docs, n = {"fits": (sz["fits_docs"], args.fits_rounds),
                           "over": (sz["over_docs"], args.over_rounds),
                           "loop": (args.docs, args.loop_rounds)}[name]
                plan = longdoc_rounds(args, vocab, name, docs, n)
            rounds = []
            for r, items in enumerate(plan):
                rounds.append(dict(round=r, kind="cold" if r == 0 else "warm",
                                   **run_round(items, answer_sp, args.batch)))
                print(f"[{system}] {name} round {r}: {rounds[-1]['wall_s']:.2f} s, "
                      f"store {100 * rounds[-1]['store_share']:.1f}%", flush=True)
        result["scenarios"][name] = dict(rounds=rounds, wall_s=time.perf_counter() - t,
                                         reset_ok=reset())
        save()
    result["done"] = True
    save()


def run_chat(args, vocab: int, run_round) -> list[dict]:
    from vllm import SamplingParams

    chat = Chat(args, vocab)
    sp = SamplingParams(max_tokens=args.chat_answer, temperature=0.0, ignore_eos=True,
                        detokenize=False)
    rounds = []
    for t in range(args.chat_turns):
        items = chat.turn(t)
        prev = {u: (chat.prev_prompt[u], len(chat.conv[u])) for u, _ in items}
        rec = run_round([(f"u{u}t{t}", p) for u, p in items], sp,
                        args.chat_batch or args.chat_users)
        for (u, prompt), r in zip(items, rec["req"]):
            chat.answered(u, prompt, r["output"])
            if t:
                prev_prompt, history = prev[u]
                # the KV of the last answer token was never computed: history - 1 tokens
                r["history"] = history
                r["covers_history"] = r["cached"] >= (history - 1) // CHUNK * CHUNK
                r["includes_answer"] = r["cached"] > prev_prompt
        later = [r for r in rec["req"] if "history" in r]
        rec.update(round=t, kind="cold" if t == 0 else "warm",
                   includes_answer=(sum(r["includes_answer"] for r in later) / len(later)
                                    if later else None),
                   covers_history=(sum(r["covers_history"] for r in later) / len(later)
                                   if later else None))
        rounds.append(rec)
        print(f"turn {t}: {rec['wall_s']:.2f} s, store {100 * rec['store_share']:.1f}%, "
              f"answer in hit {rec['includes_answer']}", flush=True)
    return rounds


# -- driver ----------------------------------------------------------------------------------

PRIME_ARGS = ["--scenarios", "", "--warmup-docs", "1"]
"""The untimed first engine: no connector, no scenario, only the worker's warm-up round
over one document (start-up, first kernel compiles, vLLM's compile cache)."""


def engine_order(args) -> list[tuple[str, int | None]]:
    """(system, repeat) in the order the engines run: the untimed prime (repeat None)
    first, then the systems interleaved, `--repeats` times."""
    order = [("none", None)] if args.prime else []
    return order + [(s, i) for i in range(args.repeats) for s in args.systems]


def run_systems(args, argv: list[str]) -> tuple[dict, list[dict]]:
    """Every engine of the run (`engine_order`), each in its own process: ({system: [one
    worker result per repeat]}, [the engines as they ran, the prime first])."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if args.inproc:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    procs = {}
    stopped = []
    engines: list[dict] = []

    def stop(signum, frame):
        """SIGTERM / SIGINT (e.g. `timeout`): end the workers' process groups (vLLM's
        engine cores too), then summarize what finished."""
        stopped.append(signum)
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def tag(system, repeat):
        return "prime" if repeat is None else f"{system}.r{repeat}"

    def start(system, repeat):
        name = tag(system, repeat)
        log = open(out / f"{name}.log", "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", system,
               str(out / f"{name}.json"), *argv, *(PRIME_ARGS if repeat is None else [])]
        what = ("untimed warm-up" if repeat is None
                else f"repeat {repeat + 1}/{args.repeats}")
        engines.append(dict(engine=len(engines), system=system, repeat=repeat,
                            timed=repeat is not None, file=f"{name}.json"))
        print(f"== engine {engines[-1]['engine']} ({what}): {system}: {' '.join(cmd[1:])}",
              flush=True)
        # own session: on timeout the whole group (vLLM's engine core too) is killed
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True), log, time.perf_counter())

    def finish(name):
        proc, log, t0 = procs[name]
        try:
            proc.wait(timeout=max(1.0, args.system_timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            print(f"== {name}: timed out after {args.system_timeout:.0f} s", flush=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # leftovers of its group
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)
        proc.wait()
        log.close()
        path = out / f"{name}.json"
        r = json.loads(path.read_text()) if path.exists() else {}
        r.update(returncode=proc.returncode, process_s=time.perf_counter() - t0)
        if proc.returncode != 0 or not r.get("done"):
            lines = (out / f"{name}.log").read_text(errors="replace").splitlines()
            r["error"] = "\n".join(lines[-25:])
            print(f"== {name}: exit {proc.returncode}; log tail:\n" + "\n".join(lines[-8:]),
                  flush=True)
        return r

    runs: dict[str, list[dict]] = {s: [] for s in args.systems}
    skipped = {}
    if any(s.startswith("offloading") for s in args.systems) and not cuda_present():
        for s in args.systems:
            if s.startswith("offloading"):
                skipped[s] = (f"{s}: skipped: vLLM's OffloadingConnector needs CUDA (its "
                              "CPU offloading worker has no CPU-only path)")
                print(f"== {skipped[s]}", flush=True)
                runs[s] = [dict(system=s, skipped=skipped[s])]
    pending = [(s, i) for s, i in engine_order(args) if s not in skipped]
    while pending and not stopped:
        # --parallel: one repeat's systems side by side (the prime alone, first)
        n = 1 if not args.parallel or pending[0][1] is None else \
            sum(1 for _, i in pending if i == pending[0][1])
        batch, pending = pending[:n], pending[n:]
        for s, i in batch:
            start(s, i)
        for (s, i), e in zip(batch, engines[-len(batch):]):
            r = finish(tag(s, i))
            e.update(returncode=r["returncode"], process_s=r["process_s"],
                     startup_s=r.get("startup_s"), done=bool(r.get("done")))
            if i is not None:
                r.setdefault("system", s)
                runs[s].append(dict(r, repeat=i, engine=e["engine"]))
    for s, i in pending:
        if i is not None:
            runs[s].append(dict(system=s, repeat=i,
                                error=f"not run: stopped by signal {stopped[0]}"))
    return runs, engines


def exactness(runs: dict[str, list[dict]]) -> dict:
    """First tokens: each system against `none` on the same prompt (repeat i against
    none's repeat i, or its first), and each system's warm rounds against its own cold
    round; counts summed over the repeats."""
    def firsts(r):
        out = {}
        for name, sc in r.get("scenarios", {}).items():
            for rd in sc["rounds"]:
                for q in rd["req"]:
                    if q["output"]:
                        out.setdefault((name, q["key"]), []).append((rd["round"],
                                                                     q["output"][0]))
        return out

    nones = [r for r in runs.get("none", []) if r.get("scenarios")]
    report = {}
    for s, rs in runs.items():
        rs = [r for r in rs if r.get("scenarios")]
        if not rs:
            continue
        counts = dict(compared_with_none=0, differ_from_none=0, repeated_prompts=0,
                      differ_from_first_time=0)
        for i, r in enumerate(rs):
            ref = firsts(nones[min(i, len(nones) - 1)]) if nones else {}
            mine = firsts(r)
            vs_none = [(v[0][1], ref[k][0][1]) for k, v in mine.items() if k in ref]
            cold_warm = [(a, b) for v in mine.values() for (_, a) in v[:1] for (_, b) in v[1:]]
            counts["compared_with_none"] += len(vs_none)
            counts["differ_from_none"] += sum(a != b for a, b in vs_none)
            counts["repeated_prompts"] += len(cold_warm)
            counts["differ_from_first_time"] += sum(a != b for a, b in cold_warm)
        if s == "none":
            counts.update(compared_with_none=None, differ_from_none=None)
        report[s] = dict(counts, repeats=len(rs))
    return report


def targets_of(results: dict) -> dict:
    """The issue's targets on one repeat ({system: worker result}), where it has the
    systems and scenarios they need."""
    def rounds(s, name):
        return results.get(s, {}).get("scenarios", {}).get(name, {}).get("rounds", [])

    def warm(s, name, key="wall_s"):
        xs = [r[key] for r in rounds(s, name) if r["kind"] == "warm"]
        return statistics.fmean(xs) if xs else None

    def share(s, name, key="store_tokens"):
        rs = [r for r in rounds(s, name) if r["kind"] == "warm"]
        p = sum(r["prompt_tokens"] for r in rs)
        return sum(r[key] for r in rs) / p if p else None

    t = {}
    for name in ("fits", "over"):
        cold = {s: rounds(s, name)[0]["wall_s"] for s in results if rounds(s, name)}
        if "none" in cold and "gemma4-kv" in cold:
            t[f"{name}_cold_vs_none"] = dict(value=cold["gemma4-kv"] / cold["none"] - 1,
                                             goal="<= +3%", ok=lambda x: x <= 0.03)
    g, o = warm("gemma4-kv", "fits"), warm("offloading", "fits")
    if g and o:
        t["fits_warm_vs_offloading"] = dict(value=g / o, goal="<= 0.8x", ok=lambda x: x <= 0.8)
    sh = share("gemma4-kv", "over")
    if sh is not None:
        t["over_warm_store_share"] = dict(value=sh, goal=">= 90%", ok=lambda x: x >= 0.9,
                                          gpu_share=share("gemma4-kv", "over", "gpu_tokens"))
    for off in ("offloading", "offloading-defaults"):
        g, o = warm("gemma4-kv", "over"), warm(off, "over")
        if g and o:
            t[f"over_warm_vs_{off}"] = dict(value=g / o, goal="< 1x", ok=lambda x: x < 1)
    later = [r for r in rounds("gemma4-kv", "chat") if r["kind"] == "warm"]
    if later:
        t["chat_turns_hit_answers"] = dict(value=min(r["includes_answer"] for r in later),
                                           goal="100% of turns after the first",
                                           ok=lambda x: x == 1.0)
    return t


def targets(runs: dict[str, list[dict]]) -> dict:
    """Each target on every repeat (repeat i of each system together), reported as the
    median and range of its values; met or not on the median."""
    n = max((len(rs) for rs in runs.values()), default=0)
    per = [targets_of({s: rs[i] for s, rs in runs.items() if i < len(rs)}) for i in range(n)]
    out = {}
    for key in dict.fromkeys(k for p in per for k in p):
        ts = [p.get(key) for p in per]
        first = next(t for t in ts if t)
        v = stat(t and t["value"] for t in ts)
        out[key] = dict(value=v, goal=first["goal"], met=bool(v) and first["ok"](v["median"]))
        if "gpu_share" in first:
            out[key]["gpu_share"] = stat(t and t["gpu_share"] for t in ts)
    return out


ROUND_STATS = ("wall_s", "ttft_mean_s", "ttft_p90_s", "store_share", "gpu_share",
               "cached_share", "store_tokens", "gpu_tokens", "store_tokens_from_loads",
               "stored_bytes", "stored_bytes_per_token", "loaded_bytes", "preemptions",
               "includes_answer", "covers_history", "connector_ms_per_step")
"""A round's figures that become a median and range over the repeats."""
ENGINE_STATS = ("startup_s", "warmup_s", "process_s", "num_gpu_blocks")


def aggregate_system(rs: list[dict]) -> dict:
    """One system's repeats as one result: every figure of ROUND_STATS and ENGINE_STATS
    a `stat` (median, min, max, the per-repeat values); the repeats' own results under
    `runs`. A round is aggregated over the repeats that finished its scenario."""
    if rs and rs[0].get("skipped"):
        return dict(rs[0])
    first = next((r for r in rs if "sizes" in r), {})
    out = dict(system=first.get("system") or (rs[0].get("system") if rs else None),
               repeats=len(rs), done=bool(rs) and all(r.get("done") for r in rs),
               sizes=first.get("sizes"), versions=first.get("versions"), gpu=first.get("gpu"),
               **aggregate(rs, ENGINE_STATS), scenarios={}, runs=rs)
    bad = [r for r in rs if r.get("error")]
    if bad:
        out.update(error=bad[0]["error"], returncode=bad[0].get("returncode"),
                   failed_repeats=[r.get("repeat") for r in bad])
    names = dict.fromkeys(n for r in rs for n in r.get("scenarios", {}))
    for name in names:
        scs = [r["scenarios"][name] for r in rs if name in r.get("scenarios", {})]
        rounds = []
        for k, rd in enumerate(scs[0]["rounds"]):
            same = [sc["rounds"][k] for sc in scs if len(sc["rounds"]) > k]
            rounds.append(dict(round=rd["round"], kind=rd["kind"], requests=rd["requests"],
                               prompt_tokens=rd["prompt_tokens"], repeats=len(same),
                               **aggregate(same, ROUND_STATS)))
        out["scenarios"][name] = dict(rounds=rounds, wall_s=stat(sc["wall_s"] for sc in scs),
                                      repeats=len(scs))
    return out


def summarize(meta: dict, runs: dict[str, list[dict]], engines: list[dict]) -> dict:
    meta = dict(meta)
    first = next((r for rs in runs.values() for r in rs if "versions" in r), {})
    meta.update(first.get("versions", {}))
    if first.get("gpu"):
        meta["gpu"] = first["gpu"]
    meta["sizes"] = next((r["sizes"] for rs in runs.values() for r in rs if "sizes" in r),
                         None)
    prime = [e for e in engines if not e["timed"]]
    return dict(meta=meta, prime=prime[0] if len(prime) == 1 else (prime or None),
                engines=engines, systems={s: aggregate_system(rs) for s, rs in runs.items()},
                exactness=exactness(runs), targets=targets(runs))


def run_meta(args, command: str) -> dict:
    import platform

    return dict(date=time.strftime("%Y-%m-%d %H:%M"), command=command, label=args.label,
                config=args.config, host=platform.node(), repeats=args.repeats,
                batch_invariant=os.environ.get("VLLM_BATCH_INVARIANT") == "1",
                args={k: v for k, v in vars(args).items() if k != "out"})


def host_line(host: dict | None) -> str:
    """The connector's host time per step kind (ms), `median [min-max]` each."""
    return ", ".join(f"{k} {fmt(v, 2)}" for k, v in sorted((host or {}).items()) if v)


def print_table(summary: dict) -> None:
    m = summary["meta"]
    sz = m.get("sizes") or {}
    print(f"\n{m['config']}, {m.get('gpu', 'CPU')}, batch-invariant {m['batch_invariant']}, "
          f"CPU tier {m['args']['cpu_gb']} GiB, GPU KV {m['args']['kv_cache_gb']} GiB, "
          f"{m.get('repeats', 1)} repeat(s) interleaved: median [min-max]")
    if sz:
        print(f"docs: fits {sz['fits_docs']} ({sz['fits_dense_over_cpu']:.2f}x the CPU tier "
              f"dense), over {sz['over_docs']} ({sz['over_dense_over_cpu']:.2f}x dense, "
              f"{sz['over_retained_over_cpu']:.2f}x as gemma4-kv retains it: "
              f"{100 * sz['retained_over_dense']:.1f}% of dense)")
    prime = summary.get("prime")
    for p in prime if isinstance(prime, list) else [prime]:
        if p:
            print(f"untimed first engine: {p['system']}, {p.get('process_s', 0):.1f} s "
                  f"(start-up {fmt(p.get('startup_s'), 1)} s)")
    head = (f"{'scenario':8} {'system':19} {'rnd':>3} {'kind':4} {'wall s':>17} "
            f"{'ttft':>20} {'p90':>20} {'store %':>17} {'gpu %':>17} {'B/tok':>8} "
            f"{'load GB':>7} {'note':}")
    print(head)
    for name in SCENARIOS:
        for s, r in summary["systems"].items():
            for rd in r.get("scenarios", {}).get(name, {}).get("rounds", []):
                note = ""
                if med(rd.get("includes_answer")) is not None:
                    note = f"answer in hit {fmt(rd['includes_answer'], 0, 100)}%"
                if med(rd.get("preemptions")):
                    note += f" preempted {fmt(rd['preemptions'], 0)}"
                print(f"{name:8} {s:19} {rd['round']:3} {rd['kind']:4} "
                      f"{fmt(rd['wall_s'], 2, width=17)} {fmt(rd['ttft_mean_s'], 3, width=20)} "
                      f"{fmt(rd['ttft_p90_s'], 3, width=20)} "
                      f"{fmt(rd['store_share'], 1, 100, 17)} {fmt(rd['gpu_share'], 1, 100, 17)} "
                      f"{fmt(rd.get('stored_bytes_per_token'), 0, width=8)} "
                      f"{fmt(rd.get('loaded_bytes'), 2, 1e-9, 7)} {note}")
    for s, r in summary["systems"].items():
        if r.get("skipped"):
            print(r["skipped"])
            continue
        print(f"{s}: start-up {fmt(r.get('startup_s'), 1)} s, warm-up "
              f"{fmt(r.get('warmup_s'), 1)} s, process {fmt(r.get('process_s'), 1)} s "
              f"({r.get('repeats', 1)} engines)")
        for name, sc in r.get("scenarios", {}).items():
            for rd in sc["rounds"]:
                if rd.get("connector_ms_per_step"):
                    print(f"  host ms/step {name} round {rd['round']}: "
                          f"{host_line(rd['connector_ms_per_step'])}")
        if r.get("error"):
            print(f"{s}: did not finish (exit {r.get('returncode')}, repeats "
                  f"{r.get('failed_repeats')}): "
                  f"{r['error'].splitlines()[-1] if r['error'] else ''}")
    print("exactness (first tokens):", json.dumps(summary["exactness"]))
    for k, v in summary["targets"].items():
        print(f"target {k}: {fmt(v['value'], 3)} (goal {v['goal']}) "
              f"{'met' if v['met'] else 'NOT met'} on the median")


def plot(summary: dict, path: str) -> bool:
    plt = plots.pyplot()
    if plt is None:
        return False
    names = [n for n in SCENARIOS if any(n in r.get("scenarios", {})
                                         for r in summary["systems"].values())]
    systems = [s for s, r in summary["systems"].items() if r.get("scenarios")]
    if not names or not systems:
        print("no system finished a scenario: no PNG")
        return False
    rows = (("wall_s", "round wall time (s)"), ("ttft_mean_s", "mean TTFT (s), p90 dot"),
            ("store_share", "prompt tokens: store (solid),\nvLLM GPU cache (light)"))
    fig, axes = plt.subplots(len(rows), len(names), figsize=(5.2 * len(names), 9.5),
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    w = 0.8 / max(1, len(systems))
    repeats = summary["meta"].get("repeats", 1)
    for col, name in enumerate(names):
        for row, (key, label) in enumerate(rows):
            ax = axes[row][col]
            n = 0
            for k, s in enumerate(systems):
                rs = summary["systems"][s]["scenarios"].get(name, {}).get("rounds", [])
                x = [r["round"] + (k - (len(systems) - 1) / 2) * w for r in rs]
                c = colors[k % len(colors)]
                plots.bars(ax, x, [r[key] for r in rs], w, label=s, color=c)
                if key == "ttft_mean_s":
                    ax.plot(x, [med(r["ttft_p90_s"]) for r in rs], ".", color="black", ms=4)
                if key == "store_share":
                    plots.bars(ax, x, [r["gpu_share"] for r in rs], w,
                               bottom=[r["store_share"] for r in rs], color=c, alpha=0.35)
                n = max(n, len(rs))
            ax.set_xticks(range(n))
            ax.set_xlabel("turn (0 = first)" if name == "chat" else "round (0 = cold)")
            ax.set_ylabel(label, fontsize=8)
            if key == "store_share":
                ax.set_ylim(0, 1.05)
            ax.set_title(f"{name} ({summary['meta']['config']}, "
                         f"{summary['meta'].get('gpu', 'CPU')}; median of {repeats}, "
                         f"bars: range)", fontsize=9)
            ax.legend(fontsize=7)
    return plots.save(fig, path)


def merge(out: Path, parts: list[dict]) -> int:
    """One result from runs of the same shape and systems split over device calls (each
    call with its own untimed first engine): every part's engines become repeats, in
    the parts' order (repeat i of each system stays beside repeat i of the others: the
    same call). A scenario's rounds are aggregated over the repeats that ran it, so parts
    may run other scenarios (fits in one call, chat in the next). Each part's meta is
    kept under `meta.runs`, its untimed engine under `prime`."""
    if any("runs" not in r for p in parts for r in p["systems"].values()
           if not r.get("skipped")):
        print("a part has no per-repeat results (written before --repeats): not merged")
        return 1
    runs: dict[str, list[dict]] = {}
    for k, p in enumerate(parts):
        for s, r in p["systems"].items():
            have = runs.setdefault(s, [])
            if r.get("skipped"):
                have[:] = have or [dict(r)]
                continue
            if have and have[0].get("skipped"):
                have.clear()
            have += [dict(x, repeat=len(have) + j, part=k) for j, x in enumerate(r["runs"])]
    meta = dict(parts[0]["meta"], runs=[p["meta"] for p in parts],
                repeats=max(len(rs) for rs in runs.values()))
    engines = [dict(e, part=k) for k, p in enumerate(parts) for e in p.get("engines", [])]
    summary = summarize(meta, runs, engines)
    summary["prime"] = [p.get("prime") for p in parts]
    write(out, summary)
    return 0


def write(out: Path, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(summary, indent=1))
    print_table(summary)
    plot(summary, str(out / "serving.png"))
    print(f"wrote {out / 'serving.json'}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plot-only"]:  # --plot-only OUT.png RESULT.json
        summary = json.loads(Path(argv[2]).read_text())
        return 0 if plot(summary, argv[1]) else 1
    if argv[:1] == ["--merge"]:  # --merge DIR A/serving.json B/serving.json ...
        return merge(Path(argv[1]), [json.loads(Path(a).read_text()) for a in argv[2:]])
    if argv[:1] == ["--worker"]:  # --worker SYSTEM RESULT.json ARGS...
        run_worker(parse_args(argv[3:]), argv[1], Path(argv[2]))
        return 0
    args = parse_args(argv)
    command = "python benchmarks/bench_serving.py " + " ".join(argv)
    runs, engines = run_systems(args, argv)
    summary = summarize(run_meta(args, command), runs, engines)
    write(Path(args.out), summary)
    return 0 if all(r.get("done") or r.get("skipped")
                    for r in summary["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
