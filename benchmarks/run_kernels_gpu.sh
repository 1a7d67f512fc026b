#!/usr/bin/env bash
# On the H200 (through the device tool): CUDA kernel tests, then the mover benchmark.
# Writes pytest_cuda.log, movers.json, movers.png, bench.log under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import lmcache.c_ops" 2>&1 | tail -1 | tee "$OUT/lmcache_c_ops.txt"
python3 -m pytest -q -x tests/test_mover.py tests/test_plan.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -5
python3 benchmarks/bench_movers.py --out "$OUT/movers.json" --plot "$OUT/movers.png" "$@" 2>&1 | tee "$OUT/bench.log" | tail -80
