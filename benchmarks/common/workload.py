"""The serving workload, shared by the benchmarks that run it (`bench_serving.py`, the
replicas benchmark `bench_replicas.py`, the tier sweep `bench_sweep.py`, and the tests'
`tier_sim.py`): its options, the model shape and layout, what the documents take, the
token streams (identical in every system's process), each system's engine arguments,
and vLLM's counters. Nothing here times anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

from common.peers import transfer_config

SYSTEMS = ("none", "gemma4-kv", "offloading", "offloading-defaults")
SCENARIOS = ("fits", "over", "loop", "zipf", "chat")
CHUNK = 256  # the connector's chunk_size (its default)
GiB = 1 << 30
SETTLE_LIMIT_S = 600.0
"""Hang guard of `settle`: saves still uncommitted after this long fail the run."""

# --tiny: vLLM's CPU build, the tests' tiny Gemma 4 (CI smoke test)
TINY = dict(config="tiny", dtype="float32", block_size=32, cpu_gb=0.01, kv_cache_gb=0.004,
            max_num_batched_tokens=512, doc_len=512, question_len=16, batch=2, max_tokens=2,
            fits_rounds=3, over_rounds=2, chat_users=2, chat_turns=3, docs=4,
            zipf_requests=12,
            chat_system=64, chat_history=128, chat_message=16, chat_answer=16,
            warmup_docs=1, settle_s=0.2, repeats=1, prime=False)


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """The serving workload's options (`bench_serving.py`'s command line; the replicas
    benchmark and the tier sweep build their shapes from it too)."""
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory for JSON, PNG and logs")
    p.add_argument("--tiny", action="store_true",
                   help="tiny model and sizes for vLLM's CPU build (smoke test)")
    p.add_argument("--config", default="gemma4-12b-like", help="bundled model shape")
    p.add_argument("--layers", type=int,
                   help="keep the shape's first LAYERS layers (same groups, head sizes and "
                        "window: the same bytes per token per layer)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, help="vLLM block_size (default: vLLM's)")
    p.add_argument("--systems", default="none,gemma4-kv,offloading",
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--cpu-gb", type=float, default=4.0,
                   help="CPU tier of every connector: gemma4-kv cpu_gb (its default), "
                        "OffloadingConnector cpu_bytes_to_use")
    p.add_argument("--kv-cache-gb", type=float, default=4.0,
                   help="vLLM's GPU KV cache (kv_cache_memory_bytes), smaller than the "
                        "working set but enough for one request of max_model_len (vLLM "
                        "refuses less: 2.84 GiB for 8448 tokens of the 12B-like shape)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--doc-len", type=int, default=8192)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--questions", type=int, default=2, help="question suffixes per document")
    p.add_argument("--fits-docs", type=int,
                   help="default: as many as fill 92%% of the CPU tier densely")
    p.add_argument("--over", type=float, default=3.0,
                   help="`over`: dense working set / CPU tier")
    p.add_argument("--over-docs", type=int, help="default: from --over")
    p.add_argument("--docs", type=int, default=16, help="`loop` and `zipf`: documents")
    p.add_argument("--loop-rounds", type=int, default=3, help="rounds incl. the cold one")
    p.add_argument("--zipf-requests", type=int, default=64)
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent")
    p.add_argument("--order", choices=("same", "reshuffle"), default="same",
                   help="documents (and chat users) in one seeded shuffled order every "
                        "round (LMCache long-doc-QA's `tile`: a cycle, LRU's worst case), "
                        "or a new shuffle each round")
    p.add_argument("--fits-rounds", type=int, default=4, help="rounds incl. the cold one")
    p.add_argument("--over-rounds", type=int, default=3, help="rounds incl. the cold one")
    p.add_argument("--batch", type=int, default=4, help="long-doc requests in flight")
    p.add_argument("--max-tokens", type=int, default=4, help="long-doc answer tokens")
    p.add_argument("--chat-users", type=int, default=8)
    p.add_argument("--chat-turns", type=int, default=4)
    p.add_argument("--chat-batch", type=int, help="chat requests in flight (default: users)")
    p.add_argument("--chat-system", type=int, default=512, help="shared system prompt tokens")
    p.add_argument("--chat-history", type=int, default=1536, help="per-user first context")
    p.add_argument("--chat-message", type=int, default=256, help="user message tokens (min)")
    p.add_argument("--chat-answer", type=int, default=32, help="generated tokens per turn")
    p.add_argument("--chat-align", action=argparse.BooleanOptionalAction, default=True,
                   help="end prompts half an answer before a chunk boundary")
    p.add_argument("--warmup-docs", type=int, default=2)
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="OffloadingConnector: pause after each round so its stores land "
                        "(not timed; gemma4-kv waits for its own count of committed saves)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inproc", action="store_true",
                   help="vLLM's CPU build: engine and worker in the benchmark's process "
                        "(VLLM_ENABLE_V1_MULTIPROCESSING=0, uni executor; starts faster)")
    p.add_argument("--parallel", action="store_true",
                   help="run the systems side by side (exactness checks; not for timing)")
    p.add_argument("--system-timeout", type=float, default=900.0,
                   help="seconds one system's process may take")
    p.add_argument("--label", default="", help="free text stored in the JSON (run, mode)")
    p.add_argument("--repeats", type=int, default=3,
                   help="engines per system, interleaved (none, gemma4-kv, offloading, "
                        "none, ...): every figure is their median with its range")
    p.add_argument("--prime", action=argparse.BooleanOptionalAction, default=None,
                   help="one untimed connector-free engine on a tiny prompt set before "
                        "the timed ones (default: on, off with --parallel or --tiny)")
    if "--tiny" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**TINY)  # explicit options still win
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    for s in args.scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.prime is None:
        args.prime = not args.parallel
    if args.question_len >= CHUNK:
        p.error(f"--question-len must be < {CHUNK}: a document's end is then a stored "
                "chunk boundary that every question of it can hit")
    return args


# -- model and sizes (both driver and workers; no CUDA, no vLLM) ---------------------------

def model_config(args):
    """The HF text config of the benchmarked shape."""
    if args.config == "tiny":
        from gemma4_kv.tools.harness import tiny_gemma4_config

        # window >= chunk_size: under chunked prefill a smaller window loses a chunk's first
        # sliding blocks before the chunk completes (the connector warns), as no Gemma 4 does
        return tiny_gemma4_config(window=256)
    from gemma4_kv.tools.cli import bundled_config
    from gemma4_kv.layout.from_hf import load_text_config

    cfg = load_text_config(bundled_config(args.config))
    if getattr(args, "layers", None):  # the same shape built with fewer layers
        import transformers

        data = {k: v for k, v in json.loads(bundled_config(args.config).read_text()).items()
                if k not in ("model_type", "architectures")}
        cfg = transformers.Gemma4TextConfig(**{**data, "num_hidden_layers": args.layers})
        if "full_attention" not in cfg.layer_types:
            raise SystemExit("--layers must keep a full-attention layer")
    cfg.architectures = ["Gemma4ForCausalLM"]
    return cfg


def layout_of(args, cfg):
    import torch

    from gemma4_kv.layout.from_hf import hf_layout

    kw = {"block_size": args.block_size} if args.block_size else {}
    return hf_layout(cfg, dtype=getattr(torch, args.dtype), **kw)


def sizes(args, layout) -> dict:
    """Documents per long-doc scenario and what they take, densely and as retained by
    this connector (plan.retained_chunks: sliding groups only before hit ends)."""
    from gemma4_kv.config.settings import ConnectorSettings
    from gemma4_kv.layout.plan import hit_ends, retained_chunks

    dense = sum(g.bytes_per_token for g in layout.groups)
    prompt = args.doc_len + args.question_len
    n = prompt // CHUNK
    limit = min(n * CHUNK, (prompt - 1) // layout.chunk_multiple * layout.chunk_multiple)

    def retained(interval):
        ends = hit_ends(n, CHUNK, limit, interval)
        return sum((n if g.window is None else len(retained_chunks(g, CHUNK, ends)))
                   * CHUNK * g.bytes_per_token for g in layout.groups)

    kept = retained(ConnectorSettings().retention_interval)
    final = retained(n * CHUNK)  # only the final hit's window: what OffloadingConnector keeps
    doc_dense = n * CHUNK * dense
    cpu = args.cpu_gb * GiB
    fits = args.fits_docs or max(1, math.floor(0.92 * cpu / doc_dense))
    over = args.over_docs or max(1, math.ceil(args.over * cpu / doc_dense))
    return dict(dense_bytes_per_token=dense, doc_dense_bytes=doc_dense,
                doc_retained_bytes=kept, retained_over_dense=kept / doc_dense,
                doc_final_hit_bytes=final, final_hit_over_dense=final / doc_dense,
                docs_final_hit_bytes=args.docs * final,
                fits_docs=fits, over_docs=over,
                fits_dense_over_cpu=fits * doc_dense / cpu,
                over_dense_over_cpu=over * doc_dense / cpu,
                over_retained_over_cpu=over * kept / cpu)


def max_model_len(args) -> int:
    longdoc = args.doc_len + args.question_len + args.max_tokens
    chat = (args.chat_system + args.chat_history
            + args.chat_turns * (args.chat_message + CHUNK + args.chat_answer))
    return -(-(max(longdoc, chat) + 64) // 128) * 128


# -- workloads (identical token streams in every system's process) -------------------------

def tokens_of(seed: str, n: int, vocab: int) -> list[int]:
    """`n` token ids drawn from `seed`: the same in every process and Python run."""
    rng = random.Random(seed)  # str seeds: the same in every process and Python run
    return [rng.randrange(3, vocab) for _ in range(n)]


def prompt_key(tokens) -> str:
    return hashlib.sha1(array("i", tokens).tobytes()).hexdigest()[:16]


def longdoc_rounds(args, vocab: int, name: str, docs: int, rounds: int):
    """[[(label, tokens)] per round]: every document once per round, shuffled, with
    question (doc + round) % Q."""
    base = f"{args.seed}:{name}"
    doc = [tokens_of(f"{base}:doc:{d}", args.doc_len, vocab) for d in range(docs)]
    qs = [tokens_of(f"{base}:q:{q}", args.question_len, vocab) for q in range(args.questions)]
    out = []
    for r in range(rounds):
        order = list(range(docs))
        random.Random(f"{base}:order" + (f":{r}" if args.order == "reshuffle" else "")
                      ).shuffle(order)
        out.append([(f"d{d}q{(d + r) % args.questions}", doc[d] + qs[(d + r) % args.questions])
                    for d in order])
    return out


def zipf_rounds(args, vocab: int, name: str):
    """`--zipf-requests` requests over `--docs` documents, document d drawn with weight
    1 / (d + 1) ** s, in rounds of `--docs` (the first one cold-ish)."""
    base = f"{args.seed}:{name}"
    doc = [tokens_of(f"{base}:doc:{d}", args.doc_len, vocab) for d in range(args.docs)]
    qs = [tokens_of(f"{base}:q:{q}", args.question_len, vocab) for q in range(args.questions)]
    rng = random.Random(f"{base}:draws")
    draws = rng.choices(range(args.docs), [1 / (d + 1) ** args.zipf_s
                                           for d in range(args.docs)], k=args.zipf_requests)
    items = [(f"d{d}q{i % args.questions}", doc[d] + qs[i % args.questions])
             for i, d in enumerate(draws)]
    return [items[i:i + args.docs] for i in range(0, len(items), args.docs)]


class Chat:
    """U conversations; `turn(t)` gives this turn's prompts, `answered` extends them."""

    def __init__(self, args, vocab: int):
        self.args, self.vocab = args, vocab
        system = tokens_of(f"{args.seed}:system", args.chat_system, vocab)
        self.conv = [system + tokens_of(f"{args.seed}:history:{u}", args.chat_history, vocab)
                     for u in range(args.chat_users)]
        self.prev_prompt = [0] * args.chat_users

    def message_len(self, u: int) -> int:
        a, m = self.args, self.args.chat_message
        if not a.chat_align:
            return m
        target = CHUNK - max(1, a.chat_answer // 2)  # prompt end, mod CHUNK
        return m + (target - len(self.conv[u]) - m) % CHUNK

    def turn(self, t: int):
        users = list(range(self.args.chat_users))
        random.Random(f"{self.args.seed}:chat-order"
                      + (f":{t}" if self.args.order == "reshuffle" else "")).shuffle(users)
        out = []
        for u in users:
            msg = tokens_of(f"{self.args.seed}:msg:{u}:{t}", CHUNK + self.args.chat_message,
                          self.vocab)[:self.message_len(u)]
            out.append((u, self.conv[u] + msg))
        return out

    def answered(self, u: int, prompt: list[int], answer: list[int]) -> None:
        self.prev_prompt[u] = len(prompt)
        self.conv[u] = prompt + answer


# -- worker: one system, one engine ---------------------------------------------------------

def engine_kwargs(args, system: str, model: str, stats: Path, layout) -> dict:
    from gemma4_kv.tools.harness import connector_config, shim_kwargs

    kw = dict(model=model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
              seed=0, enforce_eager=True, max_model_len=max_model_len(args),
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=max(args.batch, args.chat_batch or args.chat_users, 2),
              enable_prefix_caching=True, disable_log_stats=False,
              kv_cache_memory_bytes=int(args.kv_cache_gb * GiB))
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.inproc:
        kw["distributed_executor_backend"] = "uni"
    if args.config != "tiny":
        kw.update(gpu_memory_utilization=args.gpu_memory_utilization,
                  disable_custom_all_reduce=True)
    if system == "gemma4-kv":
        kw["kv_transfer_config"] = connector_config({"cpu_gb": args.cpu_gb,
                                                     "stats_file": str(stats)})
    elif system.startswith("offloading"):
        cfg = transfer_config(
            SimpleNamespace(connector="offloading", cpu_gb=args.cpu_gb), layout, stats)
        if system == "offloading-defaults":
            extra = cfg["kv_connector_extra_config"]
            cfg["kv_connector_extra_config"] = {"cpu_bytes_to_use": extra["cpu_bytes_to_use"]}
        kw["kv_transfer_config"] = cfg
    kw.update(shim_kwargs())
    return kw


def counters(llm) -> dict[str, float]:
    """vLLM's counters, summed over labels."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[m.name] = out.get(m.name, 0) + v
    return out


class StatsTail:
    """New lines of the connector's stats_file since the last call."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def take(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.pos)
            text = f.read()
        done = text.rfind("\n") + 1
        self.pos += done
        return [json.loads(line) for line in text[:done].splitlines() if line]


def settle_stores(llm, vocab: int, rng: random.Random, pause_s: float = 0.0) -> None:
    """Tiny unrelated requests (no whole chunk: nothing to store) until the stores of the
    last requests are done: connectors commit (and report) the stores that landed on a
    later engine step. gemma4-kv counts its save jobs and those committed (its counters
    come with every step); the OffloadingConnector counts nothing still in flight, so it
    gets a pause (`pause_s`, --settle-s) before its one tiny request."""
    from vllm import SamplingParams

    if pause_s:
        time.sleep(pause_s)
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while True:
        llm.generate([{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(8)]}],
                     SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
        c = counters(llm)
        if c.get("vllm:gemma4_kv_saves_committed", 0) >= c.get("vllm:gemma4_kv_saves", 0):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"gemma4-kv saves still uncommitted after "
                               f"{SETTLE_LIMIT_S} s of engine steps: {c}")


def cuda_present() -> bool:
    import torch  # the driver never starts vLLM, so CUDA may be initialised here

    return torch.cuda.is_available()
