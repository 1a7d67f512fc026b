"""Move Gemma 4-shaped KV between vLLM's paged caches and LMCache chunk objects.

One run, the same randomly placed blocks for every mover, both directions:
  ceiling        one large pinned copy_ of the same bytes (the PCIe limit)
  torch          plain torch: index the blocks, reshape to KV_2LTD on the GPU, copy_
  per_block      one copy_ per block page per layer (vLLM's old swap path; page layout)
  batched_dma    cuMemcpyBatchAsync of every page (vLLM's OffloadingConnector; page layout)
  lmcache        LMCache 0.5.6's compiled kernels, if they load with this torch
  ours_direct_P  our Triton kernel reading/writing pinned host memory, P programs
  ours_staged    our kernel to/from a device buffer + DMA of whole chunk objects
  ours_device    our kernel with chunk objects in device memory (vs device-to-device copy)
Each is checked bit-exact against the torch reference before it is timed. Interference:
an 8192^3 bf16 matmul loop's slowdown while each mover runs beside it at 8K tokens.

    python benchmarks/bench_movers.py --out results.json [--plot results.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gemma4_kv.layout.from_hf import hf_layout, load_text_config  # noqa: E402
from gemma4_kv.kernels import copy_blocks  # noqa: E402
from gemma4_kv.tools.cli import bundled_config  # noqa: E402
from paged import bits  # noqa: E402
from common.timing import cuda_median  # noqa: E402

CHUNK = 256
SHAPES = {"31b-like": "gemma4-31b-like", "e4b-like": "gemma4-e4b-like"}


# -- set-up ----------------------------------------------------------------------------
class Case:
    """Paged caches of every group (random bits, LBNHC like vLLM on GPU) and, per group,
    randomly placed blocks covering `tokens` tokens, plus pinned chunk objects."""

    def __init__(self, shape: str, tokens: int, gen: torch.Generator):
        self.layout = hf_layout(load_text_config(bundled_config(SHAPES[shape])))
        self.tokens = tokens
        self.groups = []
        total = 0
        for g in self.layout.groups:
            nblk = tokens // g.block_size
            num_blocks = nblk + 64
            caches = [torch.randint(-2**15, 2**15, (num_blocks, g.block_size, g.num_kv_heads,
                                                     2 * g.head_size), dtype=torch.int16,
                                    device="cuda").view(torch.bfloat16).permute(0, 2, 1, 3)
                      for _ in g.layers]  # LBNHC: [B, N, H, C] memory, [B, H, N, C] view
            ids = (torch.randperm(num_blocks - 1, generator=gen)[:nblk] + 1).cuda()
            per_chunk = CHUNK // g.block_size
            n_chunks = tokens // CHUNK
            slots = torch.arange(nblk, device="cuda")
            shape_ = g.chunk_shape(CHUNK)
            host = torch.empty((n_chunks, *shape_), dtype=torch.bfloat16, pin_memory=True)
            dev = torch.empty((n_chunks, *shape_), dtype=torch.bfloat16, device="cuda")
            self.groups.append(dict(g=g, caches=caches, ids=ids, chunk_index=slots // per_chunk,
                                    slots=slots % per_chunk, host=host, dev=dev))
            total += host.numel() * 2
        self.bytes = total

    def free(self):
        self.groups.clear()
        torch.cuda.empty_cache()


# -- movers: each returns a callable doing one full transfer in direction d -----------
def ours(case, d, programs, where, **launch):
    """Our kernel over every group; `where` is "host" (pinned) or "dev" objects."""
    def run():
        for x in case.groups:
            copy_blocks(x["caches"], list(x[where]), x["ids"], x["chunk_index"], x["slots"],
                        block_size=x["g"].block_size, head_size=x["g"].head_size,
                        to_chunk=d == "d2h", num_programs=programs, **launch)
    return run


def ours_staged(case, d):
    stream = torch.cuda.Stream()

    def run():
        cur = torch.cuda.current_stream()
        for x in case.groups:
            chunks = list(x["dev"])
            if d == "d2h":
                copy_blocks(x["caches"], chunks, x["ids"], x["chunk_index"], x["slots"],
                            block_size=x["g"].block_size, head_size=x["g"].head_size,
                            to_chunk=True)
                stream.wait_stream(cur)
                with torch.cuda.stream(stream):
                    for h, dv in zip(x["host"], x["dev"]):
                        h.copy_(dv, non_blocking=True)
            else:
                with torch.cuda.stream(stream):
                    for h, dv in zip(x["host"], x["dev"]):
                        dv.copy_(h, non_blocking=True)
                cur.wait_stream(stream)
                copy_blocks(x["caches"], chunks, x["ids"], x["chunk_index"], x["slots"],
                            block_size=x["g"].block_size, head_size=x["g"].head_size,
                            to_chunk=False)
        cur.wait_stream(stream)
    return run


def torch_mover(case, d):
    def run():
        for x in case.groups:
            g = x["g"]
            L, hd = len(g.layers), g.head_size
            n = x["ids"].numel()
            if d == "d2h":
                stacked = torch.stack([c[x["ids"]] for c in x["caches"]])  # [L, n, H, N, C]
                kv = stacked.unflatten(-1, (2, hd)).permute(4, 0, 1, 3, 2, 5)  # [2,L,n,N,H,hd]
                kv = kv.reshape(2, L, n // (CHUNK // g.block_size), CHUNK, -1)
                x["host"].copy_(kv.permute(2, 0, 1, 3, 4), non_blocking=True)
            else:
                dev = x["host"].to("cuda", non_blocking=True)  # [C, 2, L, T, D]
                kv = dev.permute(1, 2, 0, 3, 4).reshape(2, L, n, g.block_size,
                                                        g.num_kv_heads, hd)
                pages = kv.permute(1, 2, 4, 3, 0, 5).reshape(L, n, g.num_kv_heads,
                                                             g.block_size, 2 * hd)
                for l, c in enumerate(x["caches"]):
                    c[x["ids"]] = pages[l]
    return run


def page_views(case):
    """Per group: flat list of (device page tensor, host page tensor) in page layout."""
    out = []
    for x in case.groups:
        host = x["host"].view(-1)
        pages, off = [], 0
        for c in x["caches"]:
            page = c[0].numel()
            for b in x["ids"].tolist():
                pages.append((c[b], host[off:off + page].view_as(c[b])))
                off += page
        out.append(pages)
    return out


def per_block(case, d):
    pages = [p for grp in page_views(case) for p in grp]

    def run():
        for dev, host in pages:
            if d == "d2h":
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
    return run


def batched_dma(case, d):
    from cuda.bindings import driver

    pages = [p for grp in page_views(case) for p in grp]
    dev_ptrs = [p[0].data_ptr() for p in pages]
    host_ptrs = [p[1].data_ptr() for p in pages]
    sizes = [p[0].numel() * 2 for p in pages]
    src, dst = (dev_ptrs, host_ptrs) if d == "d2h" else (host_ptrs, dev_ptrs)
    src = [driver.CUdeviceptr(p) for p in src]
    dst = [driver.CUdeviceptr(p) for p in dst]
    attr = driver.CUmemcpyAttributes()
    attr.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    stream = torch.cuda.Stream()
    batch = 4096  # descriptors per call

    def run():
        stream.wait_stream(torch.cuda.current_stream())
        h = driver.CUstream(stream.cuda_stream)
        for i in range(0, len(src), batch):
            n = len(src[i:i + batch])
            try:
                res = driver.cuMemcpyBatchAsync(dst[i:i + batch], src[i:i + batch],
                                                sizes[i:i + batch], n, [attr], [0], 1, h)
            except TypeError:  # CUDA 12.8 signature with failIdx
                res = driver.cuMemcpyBatchAsync(dst[i:i + batch], src[i:i + batch],
                                                sizes[i:i + batch], n, [attr], [0], 1, h)
            err = res[0] if isinstance(res, tuple) else res
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemcpyBatchAsync: {err}")
        torch.cuda.current_stream().wait_stream(stream)
    return run


def lmcache_kernels(case, d):
    import lmcache.cuda_ops  # noqa: F401,F811  (the compiled CUDA kernels of the wheel)
    raise RuntimeError("lmcache.cuda_ops imported, but no driver for it is written")


def ceiling(case, d):
    host = torch.empty(case.bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")

    def run():
        (host.copy_(dev, non_blocking=True) if d == "d2h" else dev.copy_(host, non_blocking=True))
    run.keep = (host, dev)
    return run


# -- correctness -------------------------------------------------------------------------
def reference_objects(case):
    """KV_2LTD objects of every group, from the plain torch reference (on the GPU)."""
    from gemma4_kv.transfer.mover import BlockMoves, torch_gather

    refs = []
    for x in case.groups:
        n_chunks = x["host"].shape[0]
        objs = [torch.empty(x["host"].shape[1:], dtype=torch.bfloat16, device="cuda")
                for _ in range(n_chunks)]
        torch_gather(x["g"], x["caches"], objs,
                     BlockMoves(x["ids"], x["chunk_index"], x["slots"]))
        refs.append(torch.stack(objs))
    return refs


def check_d2h(case, run, refs, target="host"):
    for x in case.groups:
        x[target].view(torch.int16).fill_(0x5A5A)  # poison
    run()
    torch.cuda.synchronize()
    return all(torch.equal(bits(x[target].cuda()), bits(r)) for x, r in zip(case.groups, refs))


def check_h2d(case, run, refs):
    """Objects hold the reference; wipe the moved blocks, load, compare pages."""
    for x, r in zip(case.groups, refs):
        x["host"].copy_(r.cpu())
        x["dev"].copy_(r)
    snap = [[c[x["ids"]].clone() for c in x["caches"]] for x in case.groups]
    for x in case.groups:
        for c in x["caches"]:
            c[x["ids"]] = 0
    run()
    torch.cuda.synchronize()
    return all(torch.equal(bits(c[x["ids"]]), bits(s)) for x, sn in zip(case.groups, snap)
               for c, s in zip(x["caches"], sn))


# -- timing ------------------------------------------------------------------------------
def time_it(run, min_reps=5, max_reps=30, budget_s=2.0):
    return cuda_median(run, min_reps, max_reps, budget_s)


def matmul_slowdown(run, transfer_s):
    """Per-matmul time alone and while `run` transfers on another stream."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def loop(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            a @ b
        e1.record()
        return e0, e1

    e0, e1 = loop(20)
    e1.synchronize()
    e0, e1 = loop(50)
    e1.synchronize()
    alone = e0.elapsed_time(e1) / 50
    n = max(20, int(transfer_s * 1e3 / alone))  # cover the whole transfer
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        run()
    e0, e1 = loop(n)
    e1.synchronize()
    torch.cuda.synchronize()
    return alone, e0.elapsed_time(e1) / n


def measure(shape, tokens, gen, interference, sink):
    case = Case(shape, tokens, gen)
    refs = reference_objects(case)
    movers = {"ceiling": lambda d: ceiling(case, d),
              "torch": lambda d: torch_mover(case, d),
              "per_block": lambda d: per_block(case, d),
              "batched_dma": lambda d: batched_dma(case, d),
              "lmcache": lambda d: lmcache_kernels(case, d),
              "ours_staged": lambda d: ours_staged(case, d),
              "ours_device": lambda d: ours(case, d, 132, "dev"),
              "ours_device_528": lambda d: ours(case, d, 528, "dev")}
    for p in (8, 32, 132):
        movers[f"ours_direct_{p}"] = (lambda p: lambda d: ours(case, d, p, "host"))(p)
    for name, make in movers.items():
        if name == "per_block" and tokens > 8192:
            continue  # thousands of tiny copies: minutes at 16K+, and far off anyway
        for d in ("d2h", "h2d"):
            row = dict(shape=shape, tokens=tokens, mover=name, direction=d, bytes=case.bytes)
            try:
                run = make(d)
                if name.startswith("ours_device"):
                    row["exact"] = (check_d2h(case, run, refs, "dev") if d == "d2h" else None)
                elif name not in ("ceiling", "per_block", "batched_dma"):
                    row["exact"] = (check_d2h(case, run, refs) if d == "d2h"
                                    else check_h2d(case, run, refs))
                sec, reps = time_it(run)
                row.update(seconds=sec, reps=reps, gbps=case.bytes / sec / 1e9)
                if interference and name in ("batched_dma", "ours_staged", "ours_direct_8",
                                             "ours_direct_132", "torch", "ceiling"):
                    alone, beside = matmul_slowdown(run, sec)
                    row.update(matmul_ms_alone=alone, matmul_ms_beside=beside,
                               matmul_slowdown_pct=100 * (beside / alone - 1))
            except Exception as e:  # report, never hide: a mover that cannot run
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            sink(row)
    case.free()


def d2d_ceiling():
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    sec, _ = time_it(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / sec / 1e9  # read + write


def staged_gather_time(shape, tokens, gen):
    """Time of the kernel part alone of the staged save (SM-busy time)."""
    case = Case(shape, tokens, gen)
    sec, _ = time_it(ours(case, "d2h", 132, "dev"))
    case.free()
    return sec


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--plot")
    p.add_argument("--tokens", default="1024,4096,8192,16384,32768")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    import triton

    meta = dict(gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
                command="python benchmarks/bench_movers.py " + " ".join(sys.argv[1:]))
    meta["d2d_gbps"] = d2d_ceiling()
    result = dict(meta=meta, rows=[])

    def sink(row):  # keep what was measured even if the run is cut short
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=1))

    for shape in SHAPES:
        for t in map(int, args.tokens.split(",")):
            if shape == "31b-like" and t > 16384:
                continue  # 29.5 GB of KV at 32K: beyond what one call can move many times
            measure(shape, t, gen, interference=(t == 8192), sink=sink)
    meta["staged_gather_s_31b_8k"] = staged_gather_time("31b-like", 8192, gen)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    if args.plot:
        plot(result, args.plot)


def print_table(result):
    rows = result["rows"]
    ceil = {(r["shape"], r["tokens"], r["direction"]): r.get("gbps") for r in rows
            if r["mover"] == "ceiling"}
    print(f"\n{result['meta']['gpu']}: device-to-device {result['meta']['d2d_gbps']:.0f} GB/s")
    print(f"{'shape':9} {'tokens':>6} {'dir':4} {'mover':16} {'GB/s':>7} {'%ceil':>6} "
          f"{'exact':>5} {'matmul+%':>8}")
    for r in rows:
        c = ceil.get((r["shape"], r["tokens"], r["direction"]))
        g = r.get("gbps")
        pct = f"{100 * g / c:5.0f}%" if g and c else "     -"
        mm = f"{r['matmul_slowdown_pct']:+7.1f}%" if "matmul_slowdown_pct" in r else "       -"
        ex = {True: "yes", False: "NO", None: "-"}[r.get("exact")]
        val = f"{g:7.1f}" if g else ("  error" if "error" in r else "      -")
        print(f"{r['shape']:9} {r['tokens']:6} {r['direction']:4} {r['mover']:16} {val} {pct} "
              f"{ex:>5} {mm}")


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9), sharey=True)
    for i, shape in enumerate(SHAPES):
        for j, d in enumerate(("d2h", "h2d")):
            ax = axes[i][j]
            movers = sorted({r["mover"] for r in result["rows"]})
            for m in movers:
                pts = sorted((r["tokens"], r["gbps"]) for r in result["rows"]
                             if r["shape"] == shape and r["direction"] == d
                             and r["mover"] == m and r.get("gbps"))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=m)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape} {d}")
            ax.set_xlabel("tokens moved")
            ax.set_ylabel("GB/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"KV movers, {result['meta']['gpu']}, {result['meta']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
