#!/usr/bin/env bash
# On the H200 (through the device tool), with .gpu-vllm and .whl carried along: the
# CUDA kernel tests, then the GPU end-to-end cases and the default-numerics check side
# by side (each engine has a fixed 4 GiB KV cache), then the 31B-shaped TTFT benchmark
# for this connector and vLLM's OffloadingConnector. Logs and JSON under $OUT.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; df -h /dev/shm; } > "$OUT/gpu.txt"
timeout 60 python3 -P -m pytest -q tests/test_mover.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -1
for k in medium "tiny and not kv_shared" kv_shared mtp; do
  name=${k%% *}
  timeout 260 python3 -P -m pytest -q -rA -k "$k" --junitxml="$OUT/e2e_$name.xml" \
    tests/test_e2e_gpu.py > "$OUT/e2e_$name.log" 2>&1 &
done
timeout 260 python3 benchmarks/numerics_gpu.py "$OUT/numerics.json" > "$OUT/numerics.log" 2>&1 &
wait
grep -hE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT"/e2e_*.log
grep -E "^(recompute|vllm_prefix|gemma4_kv) " "$OUT/numerics.log"
for c in gemma4-kv offloading; do
  timeout "$([ $c = gemma4-kv ] && echo 150 || echo 180)" python3 benchmarks/bench_ttft.py \
    --config gemma4-31b-like --connector $c --out "$OUT/ttft_31b_$c.json" > "$OUT/ttft_31b_$c.log" 2>&1
  grep -A5 "^gemma4-31b-like" "$OUT/ttft_31b_$c.log" || tail -5 "$OUT/ttft_31b_$c.log"
done
