#!/usr/bin/env bash
# One H200 call (device tool; .gpu-vllm and .whl carried): CUDA kernel tests, GPU
# end-to-end tests in vLLM, the 31B-shaped TTFT benchmark, the mover benchmark at 8K.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
timeout 60 python3 -P -m pytest -q -x tests/test_mover.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -2
timeout 190 python3 -P -m pytest -q -x --tb=short tests/test_e2e_gpu.py 2>&1 | tee "$OUT/pytest_e2e_gpu.log" | tail -4
timeout 230 python3 benchmarks/bench_ttft.py --out "$OUT/ttft.json" --plot "$OUT/ttft.png" --cpu-gb 50 2>&1 \
  | tee "$OUT/ttft.log" | grep -v "^(EngineCore\|INFO\|WARNING" | tail -8
timeout 100 python3 benchmarks/bench_movers.py --tokens 8192 --out "$OUT/movers_8k.json" --plot "$OUT/movers_8k.png" 2>&1 \
  | tee "$OUT/bench_8k.log" | grep -A40 "device-to-device"
