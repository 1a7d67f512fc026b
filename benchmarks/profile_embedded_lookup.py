"""Where a lookup on the embedded store spends its time, without vLLM: the worker's
`LookupService` over a real `EmbeddedStore` (real LMCache L1), behind its real
`LookupServer` socket, asked by a real `LookupClient` through `lookup_all_ranks`, as the
scheduler half asks, for a prompt of the sweep's shape (12B-like, `--layers` layers,
8K-token documents) whose chunks are stored as the connector stores them.

    python benchmarks/profile_embedded_lookup.py [--lookups 60] [--layers 12]
        [--tokens 8256] [--busy-thread] [--switch-ms 5] [--cprofile OUT.prof]
        [--out OUT.json]

Per phase, host milliseconds per lookup (nested phases are included in their parents;
measured with every phase's function wrapped, which adds time of its own): the whole
service `handle` on the lookup thread, and inside it the store's calls: LMCache L1
queries (contains / read-lock), `unsafe_read` (the KV views), ObjectKey construction,
the ranking/capacity bookkeeping (`Capacity.served`), `servable_hits`, the server's
decode and reply encoding (`_answer` less `handle`). Then, without wrappers: the whole
scheduler call (`lookup_all_ranks`, over the socket), the channel's round trip for a
no-op message (a `Release` of nothing), the service called on this thread (wall and
thread CPU time), the load's `done` (the model thread's release), and the
scheduler's own key derivation (one sha256 per chunk of the prompt, `RequestKeyer`).

`--busy-thread` runs a pure-Python thread beside the lookup thread, as the model
runner shares the worker process with it: lookups then wait for the GIL. It asserts
nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common.timing import Timers  # noqa: E402  (phase timers, shared)

CHUNK = 256


def layout_of(layers: int):
    import torch
    import transformers

    from gemma4_kv.layout.from_hf import hf_layout
    from gemma4_kv.tools.cli import bundled_config

    data = {k: v for k, v in json.loads(bundled_config("gemma4-12b-like").read_text()).items()
            if k not in ("model_type", "architectures")}
    cfg = transformers.Gemma4TextConfig(**{**data, "num_hidden_layers": layers})
    return hf_layout(cfg, dtype=torch.bfloat16)


def store_prompt(store, layout, chain, prompt_len: int, interval: int) -> int:
    """Store the prompt's chunks as the scheduler half has them stored (the retention
    policy, `plan.retention`); the hit a lookup asks for (the prompt asked again)."""
    from gemma4_kv.layout import integrity
    from gemma4_kv.layout.plan import retention
    from gemma4_kv.stores.base import ChunkWrite

    kept = retention(layout, CHUNK, prompt_len, interval)
    groups = [kept.groups(c) for c in range(prompt_len // CHUNK)]
    res = store.reserve(ChunkWrite("writer", chain, 0, groups, list(kept.ends),
                                   frozenset(kept.ends) - kept.main))
    for kv, trailer, key in res.objects.values():
        kv.fill_(1)
        integrity.seal(kv, trailer, key)
    store.commit(res)
    store.on_request_finished("writer")
    return min(kept.main)


def busy(stop: threading.Event) -> None:
    """Pure Python holding the GIL whenever it may, as a model runner's host code."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lookups", type=int, default=60)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--tokens", type=int, default=8256, help="prompt length (8K document "
                   "and a 64-token question, as bench_serving's long documents)")
    p.add_argument("--retention", type=int, default=4096)
    p.add_argument("--l1-gb", type=float, default=1.0)
    p.add_argument("--busy-thread", action="store_true")
    p.add_argument("--switch-ms", type=float, help="sys.setswitchinterval (default 5 ms)")
    p.add_argument("--cprofile", help="write the lookup thread's cProfile here")
    p.add_argument("--top", type=int, default=25, help="cProfile rows printed")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    from gemma4_kv.keys.engine import fingerprint
    from gemma4_kv.keys.request import RequestKeyer
    from gemma4_kv.layout import plan
    from gemma4_kv.lookup import messages, service as service_mod
    from gemma4_kv.lookup.channel import LookupClient, LookupServer
    from gemma4_kv.lookup.ranks import lookup_all_ranks
    from gemma4_kv.lookup.service import LookupService
    from gemma4_kv.stores import capacity, embedded, lmcache
    from gemma4_kv.stores.embedded import EmbeddedStore, StoreConfig

    lmcache.set_log_level("WARNING")  # the connector's default: no line per L1 query

    layout = layout_of(args.layers)
    fp = fingerprint(layout, model="profile", chunk_size=CHUNK)
    store = EmbeddedStore(layout, fp, CHUNK, StoreConfig(cpu_bytes=int(args.l1_gb * 2**30)))
    n = args.tokens // CHUNK
    prev, chain = hashlib.sha256(b"profile").digest(), []
    for c in range(n):
        prev = hashlib.sha256(prev + struct.pack("<q", c)).digest()
        chain.append(prev)
    limit = store_prompt(store, layout, chain, args.tokens, args.retention)
    objects = len(plan.hit_chunks(layout, 0, limit, CHUNK))

    svc = LookupService(store, layout, CHUNK, timeout_s=2.0)
    tmp = tempfile.mkdtemp(prefix="g4kv-prof-")
    os.chmod(tmp, 0o700)
    address = f"ipc://{tmp}/r0.sock"
    profile = prof = cProfile.Profile() if args.cprofile else None

    def handle(msg):
        if prof is not None and isinstance(msg, messages.Lookup):
            prof.enable()
            try:
                return svc.handle(msg)
            finally:
                prof.disable()
        return svc.handle(msg)

    server = LookupServer(address, handle, advance=svc.advance)
    client = LookupClient([address])
    stop = threading.Event()
    spinner = threading.Thread(target=busy, args=(stop,), daemon=True)
    if args.busy_thread:
        spinner.start()

    timers = Timers()
    timers.wrap(LookupService, "handle", "service.handle")
    timers.wrap(LookupService, "_candidates", "  service._candidates")
    timers.wrap(service_mod, "servable_hits", "    plan.servable_hits")
    timers.wrap(EmbeddedStore, "resident", "    store.resident")
    timers.wrap(EmbeddedStore, "pin", "  store.pin")
    timers.wrap(EmbeddedStore, "_lock_and_view", "    store._lock_and_view")
    timers.wrap(embedded, "hit_chunks", "    plan.hit_chunks (pin)")
    timers.wrap(capacity.Capacity, "served", "    capacity.served")
    # one LMCache L1 query (a prefetch task served from L1 on this thread)
    query = "_query" if hasattr(lmcache.StorageLayer, "_query") else "resident"
    timers.wrap(lmcache.StorageLayer, query, "      lmcache: L1 query (contains/lock)")
    timers.wrap(lmcache.StorageLayer, "read", "      lmcache: unsafe_read")
    timers.wrap(lmcache.StorageLayer, "key", "      lmcache: ObjectKey")
    timers.wrap(lmcache.StorageLayer, "unlock", "lmcache: unlock")
    timers.wrap(EmbeddedStore, "poll", "  store.poll")
    timers.wrap(EmbeddedStore, "release", "store.release")
    timers.wrap(LookupServer, "_answer", "server._answer (decode, handle, encode)")

    def lookup(i: int) -> dict:
        req = f"r{i}"
        t0 = time.perf_counter()
        hit, _ = lookup_all_ranks(client, messages.Lookup(req, chain, 0, limit, [], 1))
        t_lookup = time.perf_counter() - t0
        h = svc.take(req, 1)  # the model thread's load takes the pin, frees it once loaded
        if h is None or hit != limit:
            raise SystemExit(f"lookup {i} missed: hit {hit} of {limit}")
        t = time.perf_counter()
        svc.done(h)
        return dict(lookup_s=t_lookup, done_s=time.perf_counter() - t)

    def noop() -> float:
        t = time.perf_counter()
        if client.ask_all(messages.Release("nobody", 0)) is None:
            raise SystemExit("no-op round trip failed")
        return time.perf_counter() - t

    try:
        for i in range(5):  # warm-up
            lookup(i)
            noop()
        timers.reset()
        profiling = prof is not None
        # Phases: with every timed function wrapped (the wrappers add their own time).
        timed = [lookup(i) for i in range(args.lookups)]
        per_lookup = {k: 1e3 * v / len(timed) for k, v in sorted(timers.seconds.items())}
        calls = {k: v / len(timed) for k, v in sorted(timers.calls.items())}
        timers.unwrap()
        prof = None  # the figures below: no profiler, no wrappers
        rows = [lookup(i) for i in range(args.lookups)]
        rtts = [noop() for _ in range(args.lookups)]
        # The service alone, on this thread (no channel, no lookup thread).
        direct, direct_cpu = [], []
        for i in range(args.lookups):
            t, c = time.perf_counter(), time.thread_time()
            svc.handle(messages.Lookup(f"d{i}", chain, 0, limit, [], 1))
            direct_cpu.append(time.thread_time() - c)
            direct.append(time.perf_counter() - t)
            svc.release(f"d{i}", 1)
    finally:
        stop.set()
        if spinner.is_alive():
            spinner.join()
        timers.unwrap()
        client.close()
        server.close()
        store.close()
        os.rmdir(tmp)

    # The scheduler's key derivation of the same prompt (a fresh request each time).
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    keyer = RequestKeyer(CHUNK)
    tokens = list(range(args.tokens))
    keying = []
    for i in range(20):
        r = Request(f"k{i}", tokens, SamplingParams(max_tokens=1), None)
        t = time.perf_counter()
        keys = keyer.keys(r, r.num_prompt_tokens)
        keys.extend(r, n * CHUNK)
        keying.append(time.perf_counter() - t)

    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    report = dict(
        date=time.strftime("%Y-%m-%d %H:%M"), command=" ".join(["python", *sys.argv]),
        layers=args.layers, groups=len(layout.groups), tokens=args.tokens, chunks=n,
        hit=limit, objects_pinned=objects, lookups=len(rows), busy_thread=args.busy_thread,
        switch_ms=1e3 * sys.getswitchinterval(), cpus=os.cpu_count(), load=os.getloadavg(),
        lookup_ms_median=med([r["lookup_s"] for r in rows]),
        lookup_ms_min=1e3 * min(r["lookup_s"] for r in rows),
        noop_round_trip_ms_median=med(rtts),
        service_direct_ms_median=med(direct),
        service_direct_cpu_ms_median=med(direct_cpu),
        done_ms_median=med([r["done_s"] for r in rows]),
        scheduler_keys_ms_median=med(keying),
        host_ms_per_lookup=per_lookup, calls_per_lookup=calls)
    print(f"{report['layers']} layers, {report['groups']} groups, {n} chunks, hit {limit} "
          f"tokens, {objects} objects pinned; busy thread: {args.busy_thread}, switch "
          f"interval {report['switch_ms']:.1f} ms")
    for k in ("lookup_ms_median", "lookup_ms_min", "noop_round_trip_ms_median",
              "service_direct_ms_median", "service_direct_cpu_ms_median", "done_ms_median", "scheduler_keys_ms_median"):
        print(f"  {k:<40} {report[k]:8.3f}")
    print("  per lookup (ms, calls):")
    for k, v in per_lookup.items():
        print(f"    {k:<44} {v:8.3f}  {calls[k]:6.1f}")
    if profiling:
        profile.dump_stats(args.cprofile)
        st = pstats.Stats(args.cprofile)
        st.sort_stats("tottime").print_stats(args.top)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
