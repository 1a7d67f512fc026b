#!/usr/bin/env bash
# One device call (.gpu-vllm and .whl carried) after a change to the save/load path: the
# CUDA kernel, mover and integrity tests; the GPU end-to-end cases side by side (each
# engine has a fixed 4 GiB KV cache) beside the checksum-cost benchmark; then the
# 31B-shaped TTFT benchmark of this connector. Logs and JSON under $OUT/results.tar.gz.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
R=/tmp/results && mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; } > $R/gpu.txt
timeout 150 python3 -P -m pytest -q -x tests/test_mover.py tests/test_integrity.py \
  tests/test_staging.py > $R/pytest_cuda.log 2>&1
tail -1 $R/pytest_cuda.log
for k in medium "tiny and not kv_shared" kv_shared mtp; do
  timeout 300 python3 -P -m pytest -q -rA -x -k "$k" tests/test_e2e_gpu.py \
    > "$R/e2e_${k%% *}.log" 2>&1 &
done
timeout 120 python3 benchmarks/bench_checksum.py --out $R/checksum.json > $R/checksum.log 2>&1
wait
grep -hE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" $R/e2e_*.log
cat $R/checksum.log
timeout 170 python3 benchmarks/bench_ttft.py --config gemma4-31b-like --connector gemma4-kv \
  --lengths 8192,32768 --out $R/ttft_31b_gemma4kv.json > $R/ttft_31b_gemma4kv.log 2>&1
grep -A4 "^gemma4-" $R/ttft_31b_gemma4kv.log || tail -5 $R/ttft_31b_gemma4kv.log
tar czf "$OUT/results.tar.gz" -C /tmp results
