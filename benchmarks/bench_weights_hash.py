"""First-start cost of the weights' identity (gemma4_kv/keys/weights.py) on this machine.

Writes a synthetic checkpoint of `--gib` GiB of shards (1 GiB each) in a
temporary directory, then times `file_digests` over the shards (what `weights_signature`
spends its time in; needs no vLLM) with an empty digest cache (the first start: every
file is read and hashed) and again with the cache it wrote (every later start: a stat
per file). The files are in the page cache, as they are right after vLLM has read
them. Wall and CPU seconds of this process:

    python benchmarks/bench_weights_hash.py --gib 4 --threads 1 2 4 --out hash.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn) -> dict:
    w, c = time.perf_counter(), _cpu()
    out = fn()
    return {"wall_s": round(time.perf_counter() - w, 2), "cpu_s": round(_cpu() - c, 2),
            "result": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=int, default=4)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out")
    args = p.parse_args()

    from gemma4_kv.keys import weights

    root = tempfile.mkdtemp(prefix="bench-weights-")
    ckpt = os.path.join(root, "ckpt")
    os.makedirs(ckpt)
    shard = bytes(1 << 30)  # sha256 costs the same for any bytes
    for i in range(args.gib):
        with open(os.path.join(ckpt, f"model-{i + 1:05d}-of-{args.gib:05d}.safetensors"),
                  "wb") as f:
            f.write(shard)
    del shard
    files = sorted(os.path.join(ckpt, n) for n in os.listdir(ckpt))
    runs = []
    for threads in args.threads:
        os.environ["GEMMA4_KV_CACHE_DIR"] = os.path.join(root, f"cache-{threads}")
        weights.HASH_THREADS = threads
        cold = timed(lambda: weights.file_digests(files))
        cached = timed(lambda: weights.file_digests(files))
        assert cold.pop("result") == cached.pop("result")
        runs.append({"threads": threads, "cold": cold, "cached": cached})
        print(json.dumps(runs[-1]))
    out = {"gib": args.gib, "cpus": len(os.sched_getaffinity(0)),
           "loadavg": os.getloadavg(), "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    for f in files:
        os.unlink(f)


if __name__ == "__main__":
    main()
