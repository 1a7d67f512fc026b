"""Where a lookup on a running `lmcache server` spends its time, without vLLM: the
worker's `LookupService` over a real `ServerStore` and a real server, asked the way the
scheduler asks (again every `--step-ms` while the answer is `pending`), for prompts of
the tiny Gemma 4 engine of `bench_shared_cpu.py`.

    python benchmarks/profile_server_lookup.py [--lookups 60] [--tokens 4096]
        [--step-ms 1] [--gap-ms 0] [--cprofile OUT.prof] [--out OUT.json]

Per lookup: the scheduler's rounds (`Lookup` messages until one is answered with a
hit), the wall time from the first ask to the pin, the load's `release`; the RPCs sent
to the server per operation (counted on the client), the time of one RPC round trip
(`ping`), and host time per phase (the store's calls, `integrity.verify`, the key
encoding `_tokens`, the L1 views). The prompts are stored first through the store's
own `reserve`/`commit` with sealed objects, every chunk for every group, as the engine
stores them with a server. It asserts nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common.timing import Timers  # noqa: E402  (phase timers, shared)

CHUNK = 256


class Counting:
    """The server client with every RPC counted per operation (calls still go out)."""

    def __init__(self, client):
        self._client, self.calls = client, Counter()

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr) or name == "close":
            return attr

        def call(*a, **kw):
            self.calls[name] += 1
            return attr(*a, **kw)

        return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lookups", type=int, default=60)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=1.0,
                   help="time between the scheduler's asks while pending")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="pause after each release (the forward an engine runs between a "
                        "load's release and the next request's lookup)")
    p.add_argument("--l1-gb", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (the engine's worker runs one OpenMP thread)")
    p.add_argument("--cprofile", help="write a cProfile of the lookups here")
    p.add_argument("--spy-server", help="record the server process with py-spy (raw "
                   "stacks) into this file while the lookups run")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from bench_shared_cpu import WINDOW, BLOCK, LMCacheServer
    from gemma4_kv.keys.engine import fingerprint
    from gemma4_kv.layout.from_hf import hf_layout
    from gemma4_kv.layout.plan import hit_chunks
    from gemma4_kv.lookup import messages
    from gemma4_kv.lookup.service import LookupService
    from gemma4_kv.lookup.channel import LookupServer
    from gemma4_kv.layout import integrity
    from gemma4_kv.stores.base import ChunkWrite
    from gemma4_kv.stores.server import ServerStore
    from gemma4_kv.tools.harness import tiny_gemma4_config
    import hashlib
    import struct

    layout = hf_layout(tiny_gemma4_config(window=WINDOW), dtype=torch.float32,
                       block_size=BLOCK)
    fp = fingerprint(layout, model="profile", chunk_size=CHUNK)
    tmp = Path(tempfile.mkdtemp(prefix="gemma4-kv-profile-"))
    srv = LMCacheServer(args.l1_gb, tmp / "lmcache-server.log")
    timers = Timers()
    try:
        store = ServerStore(layout, fp, CHUNK, url=srv.url, timeout_s=1.0)
        client = Counting(store.conn.wire.client)
        store.conn.wire.client = client
        m = layout.chunk_multiple
        limit = (args.tokens - 1) // m * m  # the hit a request of --tokens asks for
        rng = random.Random(0)
        chains = []
        for _ in range(args.prompts):
            prev, chain = hashlib.sha256(b"profile").digest(), []
            for _c in range(args.tokens // CHUNK):
                prev = hashlib.sha256(prev + struct.pack("<q", rng.getrandbits(62))).digest()
                chain.append(prev)
            chains.append(chain)
            res = store.reserve(ChunkWrite("w", chain, 0,
                                           [tuple(g.group_id for g in layout.groups)]
                                           * len(chain), [limit]))
            for (_h, _g), (kv, trailer, key) in res.objects.items():
                kv.copy_(torch.randn(kv.shape, dtype=kv.dtype))
                integrity.seal(kv, trailer, key)
            store.commit(res)
        l1 = srv.l1()
        service = LookupService(store, layout, CHUNK, timeout_s=2.0)

        timers.wrap(integrity, "verify", "integrity.verify")
        timers.wrap(integrity, "key64", "integrity.key64")
        timers.wrap(store.conn, "tokens", "conn.tokens (hashes -> token ids)")
        timers.wrap(store.conn, "key", "conn.key (IPCCacheServerKey)")
        timers.wrap(store.conn, "views", "conn.views")
        for name in ("start_lookup", "poll_lookup", "keep", "read", "release"):
            timers.wrap(store.reads, name, f"reads.{name}")
        for name in ("poll", "resident", "pin", "start_prefetch", "finish_prefetch"):
            timers.wrap(store, name, f"store.{name}")

        # one RPC's round trip on an idle connection
        rtts = []
        for _ in range(50):
            t = time.perf_counter()
            store.conn.wire.ping(None).result(5)
            rtts.append(time.perf_counter() - t)

        def one(i: int) -> dict:
            chain = chains[i % len(chains)]
            req = f"r{i}"
            before = Counter(client.calls)
            t0 = time.perf_counter()
            rounds, reply, acked = 0, None, None
            while True:
                rounds += 1
                reply = service.handle(messages.Lookup(req, chain, 0, limit, [], 1))
                if not reply.pending:
                    break
                p = store._inflight[0] if store._inflight else None
                lk = p.full if p is not None else None
                if acked is None and lk is not None and not lk.acks:
                    acked = time.perf_counter() - t0
                # The lookup thread between the scheduler's asks (LookupServer's advance).
                step_end = time.perf_counter() + args.step_ms / 1e3
                while service.advance() and time.perf_counter() < step_end:
                    time.sleep(LookupServer.BUSY_POLL_MS / 1e3)
                time.sleep(max(0.0, step_end - time.perf_counter()))
            t_pin = time.perf_counter() - t0
            hit = service.take(req, 1)
            if hit is None:
                raise SystemExit(f"lookup {i} missed: {reply}")
            t = time.perf_counter()
            service.done(hit)
            t_release = time.perf_counter() - t
            time.sleep(args.gap_ms / 1e3)
            calls = client.calls - before
            return dict(rounds=rounds, hit=reply.pinned, lookup_s=t_pin, release_s=t_release,
                        acked_s=acked,
                        rpcs=dict(calls), rpc_total=sum(calls.values()))

        for i in range(5):  # warm-up
            one(i)
        timers.reset()
        spy = None
        if args.spy_server:
            import subprocess

            spy = subprocess.Popen(["py-spy", "record", "--idle", "--threads", "--rate", "500",
                                    "--format", "raw", "-o", args.spy_server,
                                    "-p", str(srv.proc.pid)])
            time.sleep(2.0)  # py-spy attaches
        prof = cProfile.Profile() if args.cprofile else None
        if prof:
            prof.enable()
        rows = [one(i) for i in range(args.lookups)]
        if prof:
            prof.disable()
            prof.dump_stats(args.cprofile)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        hit_bytes = sum(layout.groups[g].bytes_per_token * CHUNK
                        for g, c in hit_chunks(layout, 0, rows[0]["hit"], CHUNK))
        store.close()
    finally:
        srv.stop()

    n = len(rows)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    rpcs = Counter()
    for r in rows:
        rpcs.update(r["rpcs"])
    report = dict(
        tokens=args.tokens, hit=rows[0]["hit"], hit_bytes=hit_bytes, lookups=n,
        step_ms=args.step_ms, gap_ms=args.gap_ms, load=os.getloadavg(),
        server_objects=l1["total_object_count"], server_bytes=l1["memory_used_bytes"],
        rounds_median=med("rounds"), lookup_ms_median=1e3 * med("lookup_s"),
        lookup_ms_min=1e3 * min(r["lookup_s"] for r in rows),
        release_ms_median=1e3 * med("release_s"),
        acked_ms_median=1e3 * statistics.median(r["acked_s"] for r in rows
                                                if r["acked_s"] is not None),
        rpc_per_lookup={k: v / n for k, v in sorted(rpcs.items())},
        rpc_total_per_lookup=sum(rpcs.values()) / n,
        ping_rtt_ms_median=1e3 * statistics.median(rtts),
        host_ms_per_lookup={k: 1e3 * v / n for k, v in sorted(timers.seconds.items())},
        host_calls_per_lookup={k: v / n for k, v in sorted(timers.calls.items())})
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
