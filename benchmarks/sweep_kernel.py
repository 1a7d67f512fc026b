"""Tune the Triton kernel's launch constants on the GPU: tile bytes per iteration,
warps and programs, for device-buffer gathers (the staged save) and UVA loads, on the
31B-like shape at 8K tokens. Prints a table, writes JSON.

    python benchmarks/sweep_kernel.py OUT.json
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_movers import Case, ours, time_it  # noqa: E402


def main():
    case = Case("31b-like", 8192, torch.Generator().manual_seed(0))
    rows = []
    for where, d in (("dev", "d2h"), ("dev", "h2d"), ("host", "h2d"), ("host", "d2h")):
        for programs in (132, 264, 528):
            for tile in (8192, 16384, 32768):
                for warps in (4, 8):
                    if where == "host" and programs != 132:
                        continue
                    sec, _ = time_it(ours(case, d, programs, where, tile_bytes=tile,
                                             num_warps=warps), budget_s=0.5)
                    r = dict(where=where, dir=d, programs=programs, tile=tile, warps=warps,
                             ms=sec * 1e3, gbps=case.bytes / sec / 1e9)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))
    for where, d in {(r["where"], r["dir"]) for r in rows}:
        best = max((r for r in rows if (r["where"], r["dir"]) == (where, d)), key=lambda r: r["gbps"])
        print("best", where, d, best)


if __name__ == "__main__":
    main()
