"""What moves KV objects between an engine and a Valkey/Redis server fastest (issue 23,
item 6): a unix socket, fewer and larger values, more connections, compression.

Five parts, each against real server processes started here on loopback
(`tests/tier_servers.py`; every binary given by `--servers`, each io-threads setting of
`--io-threads`), and with the client LMCache 0.5.6's `valkey` adapter uses, valkey-glide's
sync client, one client per thread as its worker pool has them:

  wire      the bare client: TCP loopback against a unix socket, 1-160 MiB values (a
            value of K objects is a K times larger value on the wire), 1-16 clients,
            MGET of several values in one call; SET and GET into a caller's buffer
  servers   a few of those points against every server and io-threads setting
  adapter   LMCache's own adapters through `gemma4_kv.stores.lmcache.StorageLayer` (the
            embedded store's storage layer): one layer writes 31B-shaped objects (one
            per chunk and group: 5 x 40 MiB sliding, 1 x 20 MiB full, each with its
            trailer), a second one with an empty CPU tier prefetches them all (lookup
            and load, what a second engine's lookup does); `num_workers` swept; the
            `resp` adapter (C++ client) on equal-sized objects for reference
  compress  lz4 and zstd on bf16 KV bytes (random normal, and real KV objects from a
            tiny vLLM run when `--kv-dir` names them): ratio and CPU seconds per GB
            each way, then the wire with compression in the loop (compress before
            SET; GET, then decompress into the caller's buffer), and with glide's
            own compression (`CompressionConfiguration`, in its Rust core)
  pairs     the main comparisons run back to back, A then B, several times: the
            ratio of the two rates per pair, less at the mercy of a loaded machine

Every point records wall time and the CPU the clients (this process), the server and
everything else on the machine used meanwhile (/proc), so a loaded machine shows. The
parts run in `--rounds` interleaved rounds; the tables give each point's median.

    python benchmarks/bench_valkey.py --out valkey.json            # full (minutes)
    python benchmarks/bench_valkey.py --quick --out valkey.json    # aimed at 60 s on the H200

lz4 and zstandard are optional (the compress part is skipped without them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tier_servers import TierServer  # noqa: E402

MiB = 1 << 20
GB = 1e9
TICK = os.sysconf("SC_CLK_TCK")
def objects_31b(chunk: int = 256, full: bool = True) -> dict[int, tuple]:
    """{group id: KV_2LTD shape} of the 31B shape's objects of one `chunk`-token chunk:
    5 sliding groups ([2, 10, chunk, 4096] bf16: 40 MiB at 256 tokens) and, with `full`,
    the full-attention group ([2, 10, chunk, 2048])."""
    shapes = [(2, 10, chunk, 4096)] * 5 + ([(2, 10, chunk, 2048)] if full else [])
    return dict(enumerate(shapes))


# -- CPU accounting -------------------------------------------------------------------

def _proc_ticks(pid: int | str) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def _machine_busy() -> int:
    """Busy jiffies of every core since boot (all but idle and iowait)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(v[:8]) - v[3] - v[4]


class Meter:
    """Wall time and CPU cores used by this process, the server and the rest."""

    def __init__(self, server_pid: int | None):
        self.pid = server_pid

    def __enter__(self):
        self.t = time.perf_counter()
        self.me, self.srv = _proc_ticks("self"), self._srv()
        self.busy = _machine_busy()
        return self

    def _srv(self) -> int:
        return _proc_ticks(self.pid) if self.pid else 0

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t
        busy = _machine_busy()
        me, srv = _proc_ticks("self") - self.me, self._srv() - self.srv
        w = self.wall * TICK
        self.cpu = {"client_cores": round(me / w, 2), "server_cores": round(srv / w, 2),
                    "others_cores": round(max(0, busy - self.busy - me - srv) / w, 2)}
        return False


# -- servers ----------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    tier: TierServer
    sock: str

    @property
    def pid(self) -> int:
        return self.tier.proc.pid


def start_server(binary: str, io_threads: int, root: Path) -> Server:
    """`binary` on a loopback port and a unix socket, no persistence, no memory limit."""
    base = Path(binary).name
    work = Path(tempfile.mkdtemp(prefix=f"{base}-io{io_threads}-", dir=root))
    sock = str(work / "s.sock")
    args = ["--unixsocket", sock, "--unixsocketperm", "700", "--io-threads", str(io_threads)]
    if base.startswith("redis") and io_threads > 1:
        args += ["--io-threads-do-reads", "yes"]  # Redis reads on the main thread otherwise
    tier = TierServer(binary, workdir=work, args=tuple(args)).start()
    c = client(tier, None)
    info = c.custom_command(["INFO", "server"]).decode()
    c.close()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    kind = "valkey" if "valkey_version" in fields else "redis"  # valkey also says redis 7.2.4
    version = fields.get(f"{kind}_version", "?").strip()
    return Server(f"{kind} {version} io-threads {io_threads}", tier, sock)


def client(tier: TierServer, sock: str | None, compression: str | None = None):
    """A glide sync client over TCP, or over the unix socket `sock`; `compression`
    "zstd-N" or "lz4-N" turns on glide's own value compression (its Rust core
    compresses on SET and decompresses on GET, off the GIL)."""
    import glide_sync as g

    addr = g.NodeAddress(unix_socket_path=sock) if sock else g.NodeAddress(tier.host, tier.port)
    extra = {}
    if compression:
        backend, level = compression.split("-")
        extra["compression"] = g.CompressionConfiguration(
            enabled=True, backend=getattr(g.CompressionBackend, backend.upper()),
            compression_level=int(level))
    return g.GlideClient.create(g.GlideClientConfiguration(
        addresses=[addr], request_timeout=60_000,
        advanced_config=g.AdvancedGlideClientConfiguration(connection_timeout=10_000), **extra))


def flush(server: Server) -> None:
    c = client(server.tier, None)
    c.custom_command(["FLUSHALL", "SYNC"])
    c.close()


def dbsize(c) -> int:
    return int(c.custom_command(["DBSIZE"]))


# -- data -----------------------------------------------------------------------------

def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def bf16_normal(n_bytes: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_bytes // 2, generator=g, dtype=torch.float32).to(
        torch.bfloat16).view(torch.uint8).numpy()


def real_kv(kv_dir: str | None, n_bytes: int) -> tuple[np.ndarray | None, str]:
    """Bytes of the KV objects under `kv_dir` (every file, trailers included), up to
    `n_bytes`; (None, why) when there are none."""
    if not kv_dir:
        return None, "no --kv-dir"
    files = sorted(p for p in Path(kv_dir).rglob("*") if p.is_file())
    if not files:
        return None, f"no files under {kv_dir}"
    parts, got = [], 0
    for p in files:
        b = np.fromfile(p, dtype=np.uint8)
        parts.append(b)
        got += b.size
        if got >= n_bytes:
            break
    return np.concatenate(parts)[:n_bytes], f"{len(parts)} objects from {kv_dir}"


# -- codecs ---------------------------------------------------------------------------

def codecs() -> dict:
    """name -> (compress(bytes-like) -> bytes, decompress(bytes-like, n) -> bytes)."""
    out = {}
    try:
        import lz4.frame as lz4f

        out["lz4"] = (lambda b: lz4f.compress(b, store_size=False),
                      lambda b, n: lz4f.decompress(b))
    except ImportError:
        pass
    try:
        import zstandard as zstd

        local = threading.local()  # zstd contexts are not thread-safe: one per thread

        def ctx(level):
            if not hasattr(local, "c"):
                local.c, local.d = {}, zstd.ZstdDecompressor()
            if level not in local.c:
                local.c[level] = zstd.ZstdCompressor(level=level)
            return local.c[level], local.d

        for level in (1, 3):
            out[f"zstd-{level}"] = (
                lambda b, lv=level: ctx(lv)[0].compress(b),
                lambda b, n: ctx(1)[1].decompress(b, max_output_size=n))

        def shuf(b):  # bf16: the sign/exponent bytes together, then the mantissa bytes
            return ctx(1)[0].compress(np.ascontiguousarray(
                np.frombuffer(b, np.uint8).reshape(-1, 2).T).tobytes())

        def unshuf(b, n):
            x = np.frombuffer(ctx(1)[1].decompress(b, max_output_size=n), np.uint8)
            return np.ascontiguousarray(x.reshape(2, -1).T).tobytes()

        out["shuffle+zstd-1"] = (shuf, unshuf)
    except ImportError:
        pass
    return out


GLIDE_CODECS = ("glide zstd-1", "glide zstd-3", "glide lz4-0")
"""glide's own value compression (`CompressionConfiguration`), which LMCache 0.5.6's
worker pool never turns on."""


def codec_costs(name: str, fns, data: np.ndarray, value: int) -> dict:
    """Ratio and single-thread CPU seconds per GB of `value`-byte values of `data`."""
    comp, decomp = fns
    vals = [data[i:i + value] for i in range(0, data.size - value + 1, value)]
    t0 = time.thread_time()
    packed = [comp(v) for v in vals]
    t1 = time.thread_time()
    for p, v in zip(packed, vals):
        out = decomp(p, value)
        assert len(out) == value and out[:64] == v[:64].tobytes() and out[-64:] == v[-64:].tobytes()
    t2 = time.thread_time()
    n = value * len(vals)
    return {"codec": name, "ratio": round(n / sum(len(p) for p in packed), 4),
            "compress_cpu_s_per_GB": round((t1 - t0) / (n / GB), 3),
            "decompress_cpu_s_per_GB": round((t2 - t1) / (n / GB), 3), "bytes": n}


# -- the wire ---------------------------------------------------------------------------

def _threads(n: int, work) -> None:
    errors = []

    def run(t):
        try:
            work(t)
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    ts = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def wire_point(server: Server, *, transport: str, value: int, clients: int, total: int,
               mget: int = 1, codec: str | None = None, data: np.ndarray | None = None,
               label: str = "") -> dict:
    """SET then GET `total` bytes of `value`-byte values from `clients` threads, each with
    its own client; GETs into a reused buffer per thread (as LMCache's pool does), `mget`
    values per call; with `codec`, compressed before SET and decompressed after GET."""
    n = max(clients * mget, total // value // (clients * mget) * (clients * mget))
    src = data if data is not None else random_bytes(value, 0)
    vals = [src[(i * value) % (src.size - value + 1):][:value] for i in range(n)] \
        if src.size > value else [src] * n
    in_glide = codec.removeprefix("glide ") if codec and codec.startswith("glide ") else None
    comp, decomp = codecs()[codec] if codec and not in_glide else (None, None)
    cs = [client(server.tier, server.sock if transport == "unix" else None, in_glide)
          for _ in range(clients)]
    keys = [f"w{value}:{i}".encode() for i in range(n)]
    wire_bytes = [0] * clients
    try:
        def put(t):
            for i in range(t, n, clients):
                v = comp(vals[i]) if comp else memoryview(vals[i])
                wire_bytes[t] += len(v)
                cs[t].set(keys[i], v)

        with Meter(server.pid) as ms:
            _threads(clients, put)
        room = value + value // 64 + (1 << 16) if comp else value  # a codec may expand
        bufs = [[memoryview(bytearray(room)) for _ in range(mget)] for _ in range(clients)]
        dst = [bytearray(value) for _ in range(clients)] if comp else None
        bad = []

        def get(t):
            mine = list(range(t, n, clients))
            for j in range(0, len(mine), mget):
                idx = mine[j:j + mget]
                got = cs[t].mget([keys[i] for i in idx], buffers=bufs[t][:len(idx)]) \
                    if mget > 1 else [cs[t].get(keys[idx[0]], buffer=bufs[t][0])]
                for i, b, r in zip(idx, bufs[t], got):
                    m = int(r)
                    if comp:
                        out = decomp(b[:m], value)
                        dst[t][:] = out
                        m = len(out)
                    if m != value:
                        bad.append((i, m))
                    elif j == 0 and (dst[t] if comp else b)[:64] != vals[i][:64].tobytes():
                        bad.append((i, "bytes"))

        with Meter(server.pid) as mg:
            _threads(clients, get)
        if bad:
            raise RuntimeError(f"{server.name}: wrong values read back: {bad[:3]}")
    finally:
        for c in cs:
            c.close()
        flush(server)
    b = n * value
    return {"part": label or "wire", "server": server.name, "transport": transport,
            "value_MiB": value / MiB, "clients": clients, "mget": mget, "codec": codec,
            "values": n, "bytes": b, "wire_bytes": sum(wire_bytes),
            "set_GBps": round(b / ms.wall / GB, 3), "get_GBps": round(b / mg.wall / GB, 3),
            "set_cpu": ms.cpu, "get_cpu": mg.cpu}


# -- LMCache's adapters -----------------------------------------------------------------

def adapter_point(server: Server, *, spec: dict, objects: dict, chunks: int,
                  label: str) -> dict:
    """A storage layer writes `chunks` chunks of `objects` ({group id: KV shape}) to the
    tier; a second one, with an empty CPU tier, prefetches them all back."""
    from gemma4_kv.layout import integrity
    from gemma4_kv.stores.lmcache import StorageLayer

    layouts = {g: ([torch.Size(s), torch.Size(integrity.SEAL_SHAPE)],
                   [torch.bfloat16, integrity.SEAL_DTYPE]) for g, s in objects.items()}
    n_obj = chunks * len(objects)
    obj_bytes = {g: torch.Size(s).numel() * 2 + 32 for g, s in objects.items()}
    total = chunks * sum(obj_bytes.values())
    src = {g: torch.from_numpy(bf16_normal(obj_bytes[g] - 32, g)).view(torch.bfloat16)
           .view(objects[g]) for g in objects}

    def new_layer():  # room for every object, each rounded up to L1's 4 KiB alignment
        return StorageLayer(total + n_obj * 4096 + (64 << 20), [spec])

    def key(layer, c, g):
        return layer.key(c.to_bytes(32, "little"), "bench", 0, g)

    watch = client(server.tier, None)
    try:
        w = new_layer()
        keys = {}
        for g in objects:
            ks = [key(w, c, g) for c in range(chunks)]
            got = w.reserve(ks, w.layout(*layouts[g]))
            for c, k in enumerate(ks):
                kv, trailer = got[k]
                kv.copy_(src[g])
                kv.view(-1)[:4] = torch.tensor([c, g, 7, 7], dtype=torch.bfloat16)
                trailer.fill_(c)
            keys[g] = ks
        with Meter(server.pid) as ms:
            for g in objects:
                w.publish(keys[g])
            deadline = time.monotonic() + 600
            while dbsize(watch) < n_obj:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: only {dbsize(watch)} of {n_obj} stored")
                time.sleep(0.002)
        w.close()

        r = new_layer()
        rows = [(g, [key(r, c, g) for c in range(chunks)], r.layout(*layouts[g]), -1)
                for g in objects]
        with Meter(server.pid) as mg:
            handle = r.prefetch(rows, "full")
            deadline = time.monotonic() + 600
            while (out := r.prefetch_outcome(handle)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: prefetch did not finish")
                time.sleep(0.001)
        hits = sum(len(h) for h in out.hit)
        all_keys = [k for _, ks, _, _ in rows for k in ks]
        read = r.read(all_keys)
        bad = 0
        for (g, ks, _, _) in rows:
            for c, k in enumerate(ks):
                s = read.get(k)
                ok = s is not None and int(s.trailer[0]) == c and \
                    s.kv.view(-1)[:2].tolist() == [c, g] and torch.equal(s.kv.view(-1)[4:], src[g].view(-1)[4:])
                bad += not ok
        r.unlock(all_keys)
        r.close()
        if hits != n_obj or bad:
            raise RuntimeError(f"{label}: {hits} of {n_obj} objects came back, {bad} wrong")
    finally:
        watch.close()
        flush(server)
    shown = {k: v for k, v in spec.items() if k not in ("startup_nodes", "host", "port")}
    return {"part": "adapter", "label": label, "server": server.name, "spec": shown,
            "objects": n_obj, "object_MiB": sorted({round(b / MiB, 2) for b in obj_bytes.values()}),
            "bytes": total, "store_GBps": round(total / ms.wall / GB, 3),
            "prefetch_GBps": round(total / mg.wall / GB, 3), "prefetch_s": round(mg.wall, 3),
            "store_cpu": ms.cpu, "prefetch_cpu": mg.cpu}


# -- plan -----------------------------------------------------------------------------

def memcpy_cost(n: int = 256 * MiB) -> dict:
    """One thread's memcpy, the yardstick of the codec costs on this machine."""
    a, b = random_bytes(n, 3), np.empty(n, np.uint8)
    np.copyto(b, a)
    t = time.thread_time()
    for _ in range(4):
        np.copyto(b, a)
    return {"data": "-", "codec": "memcpy", "ratio": 1.0, "bytes": 4 * n,
            "compress_cpu_s_per_GB": round((time.thread_time() - t) / (4 * n / GB), 3),
            "decompress_cpu_s_per_GB": 0.0}


def plan(args, servers: list[Server]):
    """(label, thunk) of every point of one round."""
    main = servers[0]
    total = args.total_mib * MiB
    pts = []

    def wire(srv=main, label="wire", **kw):
        pts.append((label, lambda: wire_point(srv, total=total, label=label, **kw)))

    if "wire" in args.parts:
        for transport in ("tcp", "unix"):
            for clients in args.clients:
                wire(transport=transport, value=40 * MiB, clients=clients)
            for size in args.sizes:
                if size != 40:
                    wire(transport=transport, value=size * MiB, clients=args.base_clients)
            wire(transport=transport, value=40 * MiB, clients=args.base_clients, mget=4)
    if "servers" in args.parts:
        for srv in servers[1:]:
            for transport in ("tcp", "unix"):
                for clients in sorted({1, args.base_clients}):
                    wire(srv, "servers", transport=transport, value=40 * MiB, clients=clients)
    if "compress" in args.parts:
        data = bf16_normal(8 * 40 * MiB, 1)  # the codec table has the real KV's ratios
        for codec in [None, *codecs(), *GLIDE_CODECS]:
            wire(label="compress", transport="tcp", value=40 * MiB,
                 clients=args.base_clients, codec=codec, data=data)
    if "adapter" in args.parts:
        mixed, uniform = objects_31b(), objects_31b(full=False)

        def chunks_of(objects):
            return max(1, round(args.adapter_mib * MiB / sum(np.prod(s) * 2
                                                             for s in objects.values())))
        chunks = chunks_of(mixed)
        node = f"{main.tier.host}:{main.tier.port}"
        base = {"type": "valkey", "startup_nodes": node, "request_timeout": 60.0}
        for workers in args.workers:
            pts.append((f"valkey num_workers {workers}", lambda w=workers: adapter_point(
                main, spec={**base, "num_workers": w}, objects=mixed, chunks=chunks,
                label=f"valkey, num_workers {w}, 31B objects (40 + 20 MiB)")))
        for n in args.chunk_tokens:
            small = objects_31b(n)
            mib = "/".join(f"{np.prod(x) * 2 / MiB:g}" for x in sorted(set(small.values()),
                                                                        reverse=True))
            pts.append((f"valkey chunk {n}", lambda small=small, n=n, mib=mib: adapter_point(
                main, spec={**base, "num_workers": args.base_clients}, objects=small,
                chunks=chunks_of(small), label=f"valkey, num_workers {args.base_clients}, 31B "
                f"objects of {n}-token chunks ({mib} MiB)")))
        u_chunks = chunks_of(uniform)
        pts.append(("valkey uniform", lambda: adapter_point(
            main, spec={**base, "num_workers": args.base_clients}, objects=uniform,
            chunks=u_chunks, label=f"valkey, num_workers {args.base_clients}, 40 MiB objects only")))
        if args.resp:
            pts.append(("resp uniform", lambda: adapter_point(
                main, spec={"type": "resp", "host": main.tier.host, "port": main.tier.port,
                            "num_workers": args.base_clients}, objects=uniform, chunks=u_chunks,
                label=f"resp (C++ client), num_workers {args.base_clients}, 40 MiB objects only")))
            pts.append(("resp mixed", lambda: adapter_point(
                main, spec={"type": "resp", "host": main.tier.host, "port": main.tier.port,
                            "num_workers": args.base_clients}, objects=mixed, chunks=chunks,
                label=f"resp (C++ client), num_workers {args.base_clients}, 31B objects "
                "(40 + 20 MiB)")))
    return pts


def pair_plan(args, servers: list[Server]):
    """(name, option A, option B): each compared with its baseline B, back to back."""
    main, c, t = servers[0], args.base_clients, args.pair_mib * MiB

    def w(srv=main, **kw):
        kw = {"transport": "tcp", "value": 40 * MiB, "clients": c, **kw}
        return lambda: wire_point(srv, total=t, label="pair", **kw)

    out = [("unix socket / TCP", w(transport="unix"), w()),
           (f"{c} clients / 1", w(), w(clients=1)),
           (f"{2 * c} clients / {c}", w(clients=2 * c), w()),
           ("160 MiB values / 40 MiB", w(value=160 * MiB), w()),
           ("4 MiB values / 40 MiB", w(value=4 * MiB), w()),
           ("MGET of 4 / GET", w(mget=4), w()),
           ("unix socket, 160 MiB values / TCP, 40 MiB", w(transport="unix", value=160 * MiB), w())]
    out += [(f"{s.name} / {main.name}", w(s), w()) for s in servers[1:]]
    data = bf16_normal(8 * 40 * MiB, 4)
    out += [(f"{k} / none (bf16 random normal)", w(codec=k, data=data), w(data=data))
            for k in ("lz4", "zstd-1", "glide zstd-1", "glide lz4-0")
            if k in codecs() or k in GLIDE_CODECS]
    if "adapter" in args.parts:
        uniform = objects_31b(full=False)
        valkey = {"type": "valkey", "startup_nodes": f"{main.tier.host}:{main.tier.port}",
                  "request_timeout": 60.0}

        def a(spec, objects=uniform):
            chunks = max(1, round(args.pair_adapter_mib * MiB /
                                  sum(np.prod(s) * 2 for s in objects.values())))
            return lambda: adapter_point(main, spec=spec, objects=objects, chunks=chunks,
                                         label="pair")
        out += [("adapter: resp / valkey (40 MiB objects)",
                 a({"type": "resp", "host": main.tier.host, "port": main.tier.port,
                    "num_workers": c}), a({**valkey, "num_workers": c})),
                (f"adapter: valkey num_workers {2 * c} / {c}",
                 a({**valkey, "num_workers": 2 * c}), a({**valkey, "num_workers": c}))]
        out += [(f"adapter: valkey, {n}-token chunks / 256 (31B objects)",
                 a({**valkey, "num_workers": c}, objects_31b(n)),
                 a({**valkey, "num_workers": c}, objects_31b())) for n in args.chunk_tokens]
    return out


QUICK_PAIRS = ("unix socket / TCP", "4 MiB values", "glide lz4", "adapter: resp",
               "adapter: valkey, 64")


def attempt(thunk, what: str, errors: list) -> dict | None:
    """The point's result, or None with the failure kept in `errors` (a loaded machine
    once stalled a loopback connection past the kernel's TCP timeout): one failed point
    does not lose the run."""
    try:
        return thunk()
    except Exception as e:  # noqa: BLE001 - recorded and reported
        errors.append({"point": what, "error": f"{type(e).__name__}: {e}"[:300],
                       "time": time.strftime("%H:%M:%S")})
        print(f"FAILED {what}: {errors[-1]['error']}", flush=True)
        return None


def run_pairs(comparisons, pairs: int, errors: list, checkpoint, out: list) -> None:
    """Each comparison `pairs` times, A and B back to back (ABBA order, so a load that
    rises or falls during a pair favours neither): per pair the ratios A / B, appended
    to `out`."""
    for i in range(pairs):
        for name, a, b in comparisons:
            first, second = (a, b) if i % 2 == 0 else (b, a)
            ra = attempt(first, f"pair {i} {name}", errors)
            rb = attempt(second, f"pair {i} {name}", errors) if ra else None
            if ra is None or rb is None:
                continue
            if i % 2:
                ra, rb = rb, ra
            read = "get_GBps" if "get_GBps" in ra else "prefetch_GBps"
            write = "set_GBps" if "set_GBps" in ra else "store_GBps"
            rcpu = read.replace("GBps", "cpu")

            def cost(r):  # client + server CPU seconds per GB read
                return (r[rcpu]["client_cores"] + r[rcpu]["server_cores"]) / r[read]

            out.append({"comparison": name, "pair": i,
                        "read_ratio": round(ra[read] / rb[read], 3),
                        "write_ratio": round(ra[write] / rb[write], 3),
                        "read_cpu_ratio": round(cost(ra) / cost(rb), 3),
                        "a": {read: ra[read], write: ra[write], "read_cpu_s_per_GB": round(cost(ra), 3)},
                        "b": {read: rb[read], write: rb[write], "read_cpu_s_per_GB": round(cost(rb), 3)},
                        "others_cores": round((ra[rcpu]["others_cores"] +
                                               rb[rcpu]["others_cores"]) / 2, 2)})
            print(f"pair {i} {name:48} read x{out[-1]['read_ratio']:.2f} "
                  f"write x{out[-1]['write_ratio']:.2f} read cpu/GB "
                  f"x{out[-1]['read_cpu_ratio']:.2f}", flush=True)
        checkpoint()


def pair_summary(rows: list[dict]) -> list[dict]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["comparison"], []).append(r)
    out = []
    for name, rs in groups.items():
        m = {"comparison": name, "pairs": len(rs)}
        for f in ("read_ratio", "write_ratio", "read_cpu_ratio"):
            if f not in rs[0]:  # runs before the CPU ratio was recorded
                continue
            v = [r[f] for r in rs]
            m[f], m[f + "_range"] = round(statistics.median(v), 3), [min(v), max(v)]
        m["others_cores"] = round(statistics.median(r["others_cores"] for r in rs), 2)
        out.append(m)
    return out


# -- report ---------------------------------------------------------------------------

def _key(r: dict) -> tuple:
    return (r["part"], r.get("label"), r["server"], r.get("transport"), r.get("value_MiB"),
            r.get("clients"), r.get("mget"), r.get("codec"))


RATES = (("set_GBps", "set_cpu"), ("get_GBps", "get_cpu"), ("store_GBps", "store_cpu"),
         ("prefetch_GBps", "prefetch_cpu"))


def medians(rows: list[dict]) -> list[dict]:
    """One row per point: the median over the rounds of each rate, of the cores each
    side used and of the CPU seconds per GB moved (cores / rate, per round), with the
    rates' range. CPU seconds per GB move less with the machine's load than rates do."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for rs in groups.values():
        m = dict(rs[0])
        m.pop("round", None)
        for rate, cpu in RATES:
            if rate not in m:
                continue
            v = [r[rate] for r in rs]
            m[rate], m[rate + "_range"] = round(statistics.median(v), 3), [min(v), max(v)]
            c = {k: round(statistics.median(r[cpu][k] for r in rs), 2) for k in rs[0][cpu]}
            for side in ("client", "server"):
                c[f"{side}_s_per_GB"] = round(statistics.median(
                    r[cpu][f"{side}_cores"] / r[rate] for r in rs), 2)
            m[cpu] = c
        m["rounds"] = len(rs)
        out.append(m)
    return out


def _cpu(c: dict) -> str:
    """client / server CPU seconds per GB, and the cores everything else used meanwhile."""
    return f"{c['client_s_per_GB']:.2f}/{c['server_s_per_GB']:.2f} ({c['others_cores']:.1f})"


def table(rows: list[dict], costs: list[dict], pairs: list[dict] = ()) -> str:
    lines = []
    wire = [r for r in rows if "get_GBps" in r]
    if wire:
        lines.append("wire (glide sync clients; GB/s median of rounds [min-max]; GET cpu: "
                     "client/server CPU s per GB (cores used by the rest of the machine))")
        lines.append(f"{'part':8} {'server':28} {'via':4} {'MiB':>5} {'cl':>3} {'mget':>4} "
                     f"{'codec':14} {'GET GB/s':>18} {'SET GB/s':>18} {'GET cpu':>17}")
        for r in wire:
            g, s = r["get_GBps_range"], r["set_GBps_range"]
            lines.append(
                f"{r['part']:8} {r['server']:28} {r['transport']:4} {r['value_MiB']:5g} "
                f"{r['clients']:3d} {r['mget']:4d} {r['codec'] or '-':14} "
                f"{r['get_GBps']:6.3f} [{g[0]:.2f}-{g[1]:.2f}] {r['set_GBps']:6.3f} "
                f"[{s[0]:.2f}-{s[1]:.2f}] {_cpu(r['get_cpu']):>17}")
    ad = [r for r in rows if r["part"] == "adapter"]
    if ad:
        lines.append("\nLMCache adapters through StorageLayer (write, then a second layer "
                     "prefetches all; GB/s median [min-max]; prefetch cpu as above)")
        for r in ad:
            p, s = r["prefetch_GBps_range"], r["store_GBps_range"]
            lines.append(f"  {r['label']:58} {r['bytes'] / GB:5.2f} GB  prefetch "
                         f"{r['prefetch_GBps']:.3f} [{p[0]:.2f}-{p[1]:.2f}]  store "
                         f"{r['store_GBps']:.3f} [{s[0]:.2f}-{s[1]:.2f}]  cpu "
                         f"{_cpu(r['prefetch_cpu'])}")
    if pairs:
        lines.append("\nback-to-back pairs: rate of A / rate of B, median [min-max] over the "
                     "pairs (cores used by the rest of the machine)")
        for r in pairs:
            a, b = r["read_ratio_range"], r["write_ratio_range"]
            cpu = f"  read CPU/GB x{r['read_cpu_ratio']:.2f}" if "read_cpu_ratio" in r else ""
            lines.append(f"  {r['comparison']:52} read x{r['read_ratio']:.2f} "
                         f"[{a[0]:.2f}-{a[1]:.2f}]  write x{r['write_ratio']:.2f} "
                         f"[{b[0]:.2f}-{b[1]:.2f}]{cpu}  n={r['pairs']} ({r['others_cores']:.1f})")
    if costs:
        lines.append("\ncodecs (one thread; CPU seconds per GB of KV)")
        for c in costs:
            lines.append(f"  {c['data']:28} {c['codec']:15} ratio {c['ratio']:.3f}  compress "
                         f"{c['compress_cpu_s_per_GB']:.2f} s/GB  decompress "
                         f"{c['decompress_cpu_s_per_GB']:.2f} s/GB")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="few points, one round (< 60 s on the H200)")
    ap.add_argument("--servers", default="",
                    help="comma-separated server binaries (default: valkey-server, else "
                         "redis-server, on PATH); the first is the main one")
    ap.add_argument("--io-threads", default="1,4",
                    help="io-threads settings of the first valkey binary (others: 1)")
    ap.add_argument("--parts", default="pairs,wire,servers,compress,adapter")
    ap.add_argument("--pairs", type=int, default=6, help="back-to-back pairs per comparison")
    ap.add_argument("--pair-mib", type=int, default=160, help="bytes per wire run of a pair")
    ap.add_argument("--pair-adapter-mib", type=int, default=400,
                    help="bytes per adapter run of a pair (whole chunks of 200 MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--total-mib", type=int, default=512, help="bytes per wire point")
    ap.add_argument("--adapter-mib", type=int, default=1540,
                    help="bytes per adapter point (whole 31B chunks of 220 MiB)")
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--sizes", default="1,4,16,40,160", help="value sizes, MiB")
    ap.add_argument("--workers", default="1,4,8,16", help="adapter num_workers settings")
    ap.add_argument("--base-clients", type=int, default=8,
                    help="clients of the size, MGET, server and codec points (LMCache's "
                         "default num_workers)")
    ap.add_argument("--chunk-tokens", default="64",
                    help="chunk sizes whose 31B objects the adapter also moves (against 256)")
    ap.add_argument("--no-resp", dest="resp", action="store_false")
    ap.add_argument("--kv-dir", help="files of real KV objects for the compress part")
    ap.add_argument("--only", default="", help="only the comparisons and points whose "
                    "name contains this")
    ap.add_argument("--from-json", help="measure nothing: the tables of that run's rounds")
    args = ap.parse_args(argv)
    args.pairs_only = ("",)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    if args.quick:  # the comparisons that moved in the CPU runs, one sweep round
        args.rounds, args.total_mib, args.adapter_mib, args.pairs = 1, 160, 440, 2
        args.pair_mib, args.pair_adapter_mib = 80, 200
        args.clients, args.sizes, args.workers = "1,8", "4", "8"
        args.parts = "pairs,wire,servers,adapter"
        args.pairs_only = QUICK_PAIRS
    args.parts = args.parts.split(",")
    args.clients = [int(x) for x in args.clients.split(",")]
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.workers = [int(x) for x in args.workers.split(",")]
    args.chunk_tokens = [int(x) for x in args.chunk_tokens.split(",") if x]
    if args.from_json:
        old = json.loads(Path(args.from_json).read_text())
        meta, rows, costs = old["meta"], old["rounds"], old["codecs"]
        pair_rows = old.get("pair_rounds", [])
        meta["rendered_by"] = "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])])
    else:
        meta, rows, costs, pair_rows = measure(args, argv)
    text = write_json(args.out, meta, rows, costs, pair_rows)
    Path(args.out + ".partial").unlink(missing_ok=True)
    print("\n" + text)
    print(f"wrote {args.out}")
    return 0


def write_json(path: str, meta, rows, costs, pair_rows) -> str:
    summary, pairs = medians(rows), pair_summary(pair_rows)
    text = table(summary, costs, pairs)
    Path(path).write_text(json.dumps({"meta": meta, "table": text.splitlines(),
                                      "points": summary, "pairs": pairs, "codecs": costs,
                                      "rounds": rows, "pair_rounds": pair_rows}, indent=1))
    return text


def measure(args, argv) -> tuple[dict, list[dict], list[dict], list[dict]]:
    """(meta, one row per point and round, codec costs, one row per pair)."""
    binaries = [b for b in args.servers.split(",") if b] or \
        [next(b for b in ("valkey-server", "redis-server") if shutil.which(b))]
    binaries = [shutil.which(b) or b for b in binaries]

    from gemma4_kv.stores import lmcache as lmc

    lmc.set_log_level("WARNING")
    root = Path(tempfile.mkdtemp(prefix="bench-valkey-"))
    servers: list[Server] = []
    rows, costs, pair_rows = [], [], []
    meta = {"command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "loadavg_start": os.getloadavg(), "errors": []}
    try:
        import importlib.metadata as md

        meta["packages"] = {p: md.version(p) for p in
                            ("lmcache", "valkey-glide-sync", "lz4", "zstandard")
                            if _installed(p)}
        for i, b in enumerate(binaries):
            ios = [int(x) for x in args.io_threads.split(",")] if i == 0 else [1]
            for io in ios:
                servers.append(start_server(b, io, root))
        meta["servers"] = [s.name for s in servers]
        print("servers:", ", ".join(meta["servers"]), flush=True)
        kv, kv_note = real_kv(args.kv_dir, 8 * 40 * MiB)
        meta["real_kv"] = kv_note
        if "compress" in args.parts:
            sample = 2 * 40 * MiB
            sources = [("bf16 random normal", bf16_normal(sample, 2))]
            if kv is not None:
                sources.append((f"real KV ({kv_note})", kv[:sample]))
            costs.append(memcpy_cost())
            for name, data in sources:
                value = min(40 * MiB, data.size)
                for cname, fns in codecs().items():
                    costs.append({"data": name, **codec_costs(cname, fns, data, value)})
        def checkpoint():  # what is measured so far, in case the run dies
            write_json(args.out + ".partial", meta, rows, costs, pair_rows)

        if "pairs" in args.parts:
            run_pairs([c for c in pair_plan(args, servers) if args.only in c[0] and
                       c[0].startswith(args.pairs_only)],
                      args.pairs, meta["errors"], checkpoint, pair_rows)
        points = [pt for pt in plan(args, servers) if args.only in pt[0]]
        for rnd in range(args.rounds):
            checkpoint()
            for label, thunk in points:
                r = attempt(thunk, f"round {rnd} {label}", meta["errors"])
                if r is None:
                    continue
                r["round"] = rnd
                rows.append(r)
                rate = r.get("get_GBps", r.get("prefetch_GBps"))
                print(f"round {rnd} {label:24} {r['server']:26} {r.get('transport', ''):4} "
                      f"{r.get('value_MiB', '')!s:>5} x{r.get('clients', '')!s:<3} "
                      f"{r.get('codec') or ''} read {rate:.3f} GB/s", flush=True)
    finally:
        for s in servers:
            s.tier.kill()
        shutil.rmtree(root, ignore_errors=True)
    meta["loadavg_end"] = os.getloadavg()
    return meta, rows, costs, pair_rows


def _installed(name: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
