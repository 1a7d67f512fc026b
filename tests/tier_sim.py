"""The tier sweep's long-document orders (benchmarks/bench_sweep.py: bench_serving's `zipf`
and `loop` scenarios) played through vLLM's real scheduler, counting where each prompt's
tokens come from, at the sweep's real sizes and without a model.

What runs is real: vLLM's v1 `Scheduler` and its GPU prefix cache (`KVCacheManager` over
the sweep's 1 GiB of KV, chunked prefill at 4096 tokens a step, the requests of a batch in
flight together), and behind it either
- this connector's scheduler half, its lookup service and its embedded store (LMCache's
  L1 at the tier's size, with `stores/capacity.py` deciding what stays), or
- vLLM's OffloadingConnector: its scheduler half and CPU manager with the LRU policy.
Only the worker's copies are left out: our worker's part of a step (take the pinned hits,
reserve and commit the saves, end finished requests) is played by hand with the objects
never filled, and the OffloadingConnector's transfers are reported done in the step that
issued them. So the counts (tokens from vLLM's GPU cache, tokens from the CPU tier) are
the systems' own; only timing (a load or store still in flight at a later lookup) may
differ from a GPU run.

    python tests/tier_sim.py [--fractions 0.4,0.6,0.8,1.0] [--seeds 0,1,2] [--orders zipf,loop]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import workload  # noqa: E402  (the sweep's workload and sizes)

SWEEP = ["--config", "gemma4-12b-like", "--layers", "12", "--docs", "16", "--doc-len", "8192",
         "--question-len", "48", "--kv-cache-gb", "1", "--batch", "4", "--max-tokens", "4",
         "--loop-rounds", "3", "--zipf-requests", "48", "--warmup-docs", "1"]
"""bench_sweep's options in `benchmarks/gpu.sh sweep` (its timing options left out)."""
SYSTEMS = ("gemma4-kv", "offloading")
GiB = 1 << 30


def sweep_args(seed: int = 0, extra: list[str] = ()) -> argparse.Namespace:
    return workload.parse_args(["--out", os.devnull, *SWEEP, "--seed", str(seed),
                                     *extra])


@dataclass
class Served:
    """One request: its label (document and question) and where its prompt came from."""

    label: str
    prompt: int
    gpu: int = 0
    store: int = 0


@dataclass
class Rounds:
    rounds: list[list[Served]] = field(default_factory=list)

    def warm_share(self) -> float:
        """bench_sweep's hit share: warm rounds' tokens from the store and vLLM's GPU
        cache over their prompt tokens."""
        warm = [r for rd in self.rounds[1:] for r in rd]
        return sum(r.gpu + r.store for r in warm) / sum(r.prompt for r in warm)

    def warm_tokens(self) -> tuple[int, int]:
        warm = [r for rd in self.rounds[1:] for r in rd]
        return sum(r.store for r in warm), sum(r.gpu for r in warm)


class Engine:
    """vLLM's scheduler with one system's connector at a CPU tier of `cpu_bytes`; `run`
    plays rounds of (label, tokens) `batch` at a time, as bench_serving's `run_round`."""

    def __init__(self, system: str, cpu_bytes: int, args: argparse.Namespace, workdir: Path,
                 async_scheduling: bool = False):
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (get_kv_cache_configs, get_request_block_hasher,
                                                 init_none_hash, resolve_kv_cache_block_sizes)
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from gemma4_kv.layout.from_hf import layer_specs

        if system not in SYSTEMS:
            raise ValueError(f"system {system!r}: choose from {', '.join(SYSTEMS)}")
        self.args = args
        cfg = workload.model_config(args)
        model = workdir / "model"
        if not (model / "config.json").exists():
            cfg.save_pretrained(model)
        if system == "gemma4-kv":
            kt = KVTransferConfig(kv_connector="Gemma4KVConnector",
                                  kv_connector_module_path="gemma4_kv.connector",
                                  kv_role="kv_both",
                                  kv_connector_extra_config={"cpu_gb": cpu_bytes / GiB})
        else:  # common/peers.py transfer_config's settings, as the sweep runs it
            layout = workload.layout_of(args, cfg)
            kt = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                  kv_connector_extra_config={
                                      "cpu_bytes_to_use": cpu_bytes,
                                      "blocks_per_chunk": 256 // max(
                                          g.block_size for g in layout.groups)})
        vc = EngineArgs(model=str(model), load_format="dummy", skip_tokenizer_init=True,
                        dtype=args.dtype, seed=0, max_model_len=workload.max_model_len(args),
                        block_size=16,  # vLLM's default on CUDA
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=max(args.batch, args.chat_batch or args.chat_users, 2),
                        enable_prefix_caching=True, kv_transfer_config=kt,
                        ).create_engine_config()
        vc.cache_config.kv_cache_layout = "LBNHC"  # the engine core's pick on CUDA
        specs = {}
        dtype = getattr(torch, args.dtype)
        for name, s in layer_specs(vc.model_config.hf_text_config, dtype=dtype,
                                   block_size=16)[0].items():
            kw = dict(block_size=16, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                      dtype=dtype)
            specs[name] = (SlidingWindowSpec(sliding_window=s.window, **kw) if s.window
                           else FullAttentionSpec(**kw))
        kcc = get_kv_cache_configs(vc, [specs], [int(args.kv_cache_gb * GiB)])[0]
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        block, hash_block = resolve_kv_cache_block_sizes(kcc, vc)
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(hash_block, hash_fn)
        self.vocab = cfg.vocab_size
        self.worker = _OurWorker(vc, kcc) if system == "gemma4-kv" else _OffloadingWorker()
        self.async_scheduling = async_scheduling
        self._in_flight = None  # async scheduling: the step the workers run now
        # Counts, not timing: a lookup slowed by a loaded machine must not count as a rank
        # down (whose back-off would turn the next lookups into misses). The scheduler
        # half reads the timeout once, when vLLM's scheduler builds it.
        from gemma4_kv.connector import scheduler as half

        timeout, half.RANK_TIMEOUT_S = half.RANK_TIMEOUT_S, 3600.0
        try:
            self.scheduler = (AsyncScheduler if async_scheduling else Scheduler)(
                vc, kcc, StructuredOutputManager(vc), block_size=block,
                hash_block_size=hash_block, log_stats=True)
        finally:
            half.RANK_TIMEOUT_S = timeout
        self._seen: dict[str, list[int]] = {}  # request id -> [local hit, external hit]
        self._watch(self.scheduler.connector)
        self._ids = iter(range(10**9))

    def _watch(self, connector) -> None:
        """Record each request's local (GPU) hit as vLLM hands it to the connector and
        the external hit vLLM allocated blocks for."""
        lookup, alloc = connector.get_num_new_matched_tokens, connector.update_state_after_alloc

        def get_num_new_matched_tokens(request, num_computed_tokens, *a, **kw):
            self._seen.setdefault(request.request_id, [0, 0])[0] = num_computed_tokens
            return lookup(request, num_computed_tokens, *a, **kw)

        def update_state_after_alloc(request, blocks, num_external_tokens):
            seen = self._seen.setdefault(request.request_id, [0, 0])
            seen[1] = max(seen[1], num_external_tokens)  # an async load: again with 0
            return alloc(request, blocks, num_external_tokens)

        connector.get_num_new_matched_tokens = get_num_new_matched_tokens
        connector.update_state_after_alloc = update_state_after_alloc

    def batch(self, items, max_tokens: int) -> list[Served]:
        """One `llm.generate` of these (label, tokens): every request added, then steps
        until all have finished."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        s = self.scheduler
        reqs = []
        for label, tokens in items:
            r = Request(f"sim-{next(self._ids)}", list(tokens),
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                        block_hasher=self.block_hasher)
            s.add_request(r)
            reqs.append((label, r))
        while s.has_requests() or self._in_flight is not None:
            self.step()
        out = []
        for label, r in reqs:
            gpu, ext = self._seen.pop(r.request_id, (0, 0))
            out.append(Served(label, r.num_prompt_tokens, gpu, ext))
        return out

    def step(self) -> None:
        """One engine-core step. Synchronous scheduling: schedule, the workers run it, its
        output. Asynchronous (vLLM's batch queue of 2): the next step is scheduled (its
        lookups made) before the workers run the previous one and its output comes back."""
        s = self.scheduler
        so = None
        if s.has_requests():
            so = s.schedule()
            # a request samples a token in a step that computes its last known token
            so.sim_sampled = [r for r in so.num_scheduled_tokens
                              if not s.requests[r].is_prefill_chunk]
        if self.async_scheduling:
            so, self._in_flight = self._in_flight, so
        if so is not None:
            self._finish(so)

    def _finish(self, so) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        connector_output = self.worker.step(so.kv_connector_metadata)
        ids = list(so.num_scheduled_tokens)
        sampled = [[7] if r in so.sim_sampled else [] for r in ids]  # 7: any token
        self.scheduler.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled, kv_connector_output=connector_output))

    def run(self, plan: list[list[tuple[str, list[int]]]]) -> Rounds:
        """bench_serving's rounds, `batch` requests at a time, each round followed by its
        `settle` request (8 unrelated tokens, one generated)."""
        import random

        rng = random.Random(12345)
        out = Rounds()
        for items in plan:
            served = []
            for i in range(0, len(items), self.args.batch):
                served += self.batch(items[i:i + self.args.batch], self.args.max_tokens)
            self.batch([("settle", [rng.randrange(3, self.vocab) for _ in range(8)])], 1)
            out.rounds.append(served)
        return out

    def reset(self) -> None:
        """bench_serving's reset between scenarios: vLLM's GPU cache and the connector's."""
        if not self.scheduler.reset_prefix_cache(reset_connector=True):
            raise RuntimeError("vLLM's scheduler did not reset its caches")

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.close()


class _OurWorker:
    """This connector's worker rank without its copies: the real embedded store and
    lookup service behind the real lookup socket; each step takes the hits the
    scheduler half made the rank pin and releases them, reserves and commits what the
    step saves (objects left unfilled), then ends the requests that finished."""

    def __init__(self, vc, kcc):
        from gemma4_kv.config.settings import ConnectorSettings
        from gemma4_kv.connector.metrics import Gemma4KVStats
        from gemma4_kv.keys.engine import fingerprint
        from gemma4_kv.layout.groups import from_vllm
        from gemma4_kv.lookup.channel import LookupServer
        from gemma4_kv.lookup.service import LookupService
        from gemma4_kv.lookup.sockets import socket_address
        from gemma4_kv.stores.factory import open_store

        settings = ConnectorSettings.from_extra_config(
            vc.kv_transfer_config.kv_connector_extra_config)
        layout = from_vllm(kcc)
        self.store = open_store(settings.store_config(), layout,
                                fingerprint(layout, model="sim", chunk_size=settings.chunk_size),
                                settings.chunk_size)
        self.service = LookupService(self.store, layout, settings.chunk_size, 2.0,
                                     Gemma4KVStats())
        self.server = LookupServer(socket_address(vc.kv_transfer_config.engine_id,
                                                  os.getpid(), 0), self.service.handle)

    def step(self, meta):
        for load in meta.loads:
            pinned = self.service.take(load.req_id, load.pin)
            if pinned is None or (pinned.start, pinned.hit) != (load.start, load.hit):
                raise RuntimeError(f"the rank did not pin the hit of {load.req_id}")
            self.service.done(pinned)
        for save in meta.saves:
            self.store.commit(self.store.reserve(save.write))
        for job in meta.finished:
            self.store.on_request_finished(job.req_id)
        return None

    def close(self):
        self.server.close()
        self.service.close()
        self.store.close()


class _OffloadingWorker:
    """The OffloadingConnector's workers, reduced to what its scheduler half hears: every
    load and store job of a step done in that step (`completed_jobs`), a request's load
    reported received."""

    def step(self, meta):
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata)
        from vllm.v1.outputs import KVConnectorOutput

        done = OffloadingWorkerMetadata()
        received = set()
        for job_id, job in meta.load_jobs.items():
            done.completed_jobs[job_id] = 1
            received.add(job.req_id)
        for job_id in meta.store_jobs:
            done.completed_jobs[job_id] = 1
        return KVConnectorOutput(finished_recving=received or None,
                                 kv_connector_worker_meta=done)

    def close(self):
        pass


def working_set(args) -> int:
    """bench_sweep's working set: OffloadingConnector's bytes of `--docs` documents."""
    layout = workload.layout_of(args, workload.model_config(args))
    return workload.sizes(args, layout)["docs_final_hit_bytes"]


def simulate(system: str, fraction: float, orders=("loop", "zipf"), seed: int = 0,
             workdir: Path | None = None, async_scheduling: bool = False) -> dict[str, Rounds]:
    """One sweep point of one system: its engine plays each order (loop, then zipf, the
    caches reset in between, as bench_sweep's point does)."""
    args = sweep_args(seed)
    cpu = int(fraction * working_set(args))
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(system, cpu, args, Path(workdir or tmp), async_scheduling)
        try:
            out = {}
            for name in orders:
                plan = (workload.zipf_rounds(args, engine.vocab, name) if name == "zipf"
                        else workload.longdoc_rounds(args, engine.vocab, name, args.docs,
                                                          args.loop_rounds))
                out[name] = engine.run(plan)
                engine.reset()
            return out
        finally:
            engine.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fractions", default="0.4,0.6,0.8,1.0")
    p.add_argument("--seeds", default="0")
    p.add_argument("--orders", default="loop,zipf")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--detail", action="store_true", help="every request's hits")
    p.add_argument("--async-scheduling", action="store_true")
    a = p.parse_args(argv)
    orders = a.orders.split(",")
    print(f"{'seed':>4} {'tier':>5} {'order':5} {'system':11} {'share':>6} {'store':>6} "
          f"{'gpu':>6}")
    for seed in [int(x) for x in a.seeds.split(",")]:
        for f in [float(x) for x in a.fractions.split(",")]:
            for system in a.systems.split(","):
                points = simulate(system, f, orders, seed,
                                  async_scheduling=a.async_scheduling)
                for order, rounds in points.items():
                    store, gpu = rounds.warm_tokens()
                    prompt = sum(r.prompt for rd in rounds.rounds[1:] for r in rd)
                    print(f"{seed:4} {f:5.2f} {order:5} {system:11} "
                          f"{100 * rounds.warm_share():5.1f}% {100 * store / prompt:5.1f}% "
                          f"{100 * gpu / prompt:5.1f}%", flush=True)
                    if a.detail:
                        for i, rd in enumerate(rounds.rounds):
                            print("   ", i, " ".join(
                                f"{r.label}:{'S' if r.store else 'G' if r.gpu else '-'}"
                                for r in rd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
