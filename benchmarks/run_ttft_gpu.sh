#!/usr/bin/env bash
# On the H200 (through the device tool), with .gpu-vllm and .whl carried along:
# GPU end-to-end tests in vLLM, then the 31B-shaped TTFT benchmark. Logs under $OUT.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
timeout 280 python3 -P -m pytest -q tests/test_e2e_gpu.py 2>&1 | tee "$OUT/pytest_e2e_gpu.log" | tail -15
timeout 290 python3 benchmarks/bench_ttft.py --out "$OUT/ttft.json" --plot "$OUT/ttft.png" "$@" 2>&1 | tee "$OUT/ttft.log" | grep -v "^(EngineCore\|^INFO\|^WARNING" | tail -25
