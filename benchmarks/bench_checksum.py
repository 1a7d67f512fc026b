"""Cost of the integrity trailers (gemma4_kv/integrity.py) on the machine it runs on.

Saves seal objects on the GPU, in the staging buffer, before the copy to the host;
objects that come up from a disk or remote tier are verified on the host before they
are offered. This measures both for 31B-shaped objects (a sliding group's 256-token
chunk object: [2, 10, 256, 4096] bf16 = 42 MB; a full group's: [2, 10, 256, 2048]),
against a plain device copy and a host memcpy of the same bytes, medians after
warm-up (CUDA events on the GPU, perf_counter on the host):

    python benchmarks/bench_checksum.py --out checksum.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gemma4_kv.layout import integrity
from common.timing import cuda_median

SHAPES = {"sliding": (2, 10, 256, 4096), "full": (2, 10, 256, 2048)}


def gpu_seal(objects: int, shape, reps: int) -> dict:
    kv = torch.randint(-2**15, 2**15, (objects, *shape), dtype=torch.int16,
                       device="cuda").view(torch.bfloat16)
    keys = list(range(objects))
    nbytes = kv.numel() * kv.element_size()

    def timed(fn) -> float:
        return cuda_median(fn, reps)[0]

    dst = torch.empty_like(kv)
    seal = timed(lambda: integrity.seal_many(kv, keys))
    copy = timed(lambda: dst.copy_(kv))
    return {"objects": objects, "bytes": nbytes, "seal_s": seal, "seal_GBps": nbytes / seal / 1e9,
            "d2d_copy_s": copy, "d2d_copy_GBps": 2 * nbytes / copy / 1e9}


def host_verify(shape, reps: int) -> dict:
    kv = torch.randint(-2**15, 2**15, shape, dtype=torch.int16).view(torch.bfloat16)
    if torch.cuda.is_available():
        kv = kv.pin_memory()
    trailer = torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE)
    integrity.seal(kv, trailer, 7)
    nbytes = kv.numel() * kv.element_size()
    dst = torch.empty_like(kv)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    verify = timed(lambda: integrity.verify(kv, trailer, 7))
    copy = timed(lambda: dst.copy_(kv))
    assert integrity.verify(kv, trailer, 7)
    return {"bytes": nbytes, "threads": torch.get_num_threads(), "verify_s": verify,
            "verify_GBps": nbytes / verify / 1e9, "memcpy_s": copy,
            "memcpy_GBps": nbytes / copy / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=48, help="objects sealed per GPU call")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="checksum.json")
    args = p.parse_args(argv)
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "host": {}, "gpu": {}}
    print(f"{'object':8} {'where':5} {'MB':>6} {'checksum GB/s':>14} {'copy GB/s':>10}")
    for name, shape in SHAPES.items():
        h = result["host"][name] = host_verify(shape, args.reps)
        print(f"{name:8} {'host':5} {h['bytes'] / 1e6:6.1f} {h['verify_GBps']:14.1f} "
              f"{h['memcpy_GBps']:10.1f}")
        if torch.cuda.is_available():
            g = result["gpu"][name] = gpu_seal(args.objects, shape, args.reps)
            print(f"{name:8} {'gpu':5} {g['bytes'] / 1e6:6.0f} {g['seal_GBps']:14.1f} "
                  f"{g['d2d_copy_GBps']:10.1f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
