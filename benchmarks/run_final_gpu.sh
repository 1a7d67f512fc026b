#!/usr/bin/env bash
# One device call (.gpu-vllm and .whl carried): the GPU end-to-end tests and the
# default-numerics check, the TTFT benchmark (31B-shaped: this connector and vLLM's
# OffloadingConnector; 12B- and E4B-shaped: this connector) and, with two GPUs, the
# 31B shape with tensor parallel 2. With two GPUs the tests run on GPU 1 beside the
# single-GPU benchmarks on GPU 0. Everything lands in $OUT/results.tar.gz.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
R=/tmp/results && mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; df -h /dev/shm; } > $R/gpu.txt
GPUS=$(nvidia-smi -L | wc -l)
TEST_GPU=$([ "$GPUS" -ge 2 ] && echo 1 || echo 0)

e2e() {  # the four GPU end-to-end cases and the numerics check, side by side
  for k in medium "tiny and not kv_shared" kv_shared mtp; do
    CUDA_VISIBLE_DEVICES=$TEST_GPU timeout 280 python3 -P -m pytest -q -rA -k "$k" \
      tests/test_e2e_gpu.py > "$R/e2e_${k%% *}.log" 2>&1 &
  done
  CUDA_VISIBLE_DEVICES=$TEST_GPU timeout 280 python3 benchmarks/numerics_gpu.py \
    $R/numerics.json > $R/numerics.log 2>&1 &
  wait
}
ttft() {  # config connector timeout [extra args]
  local cfg=$1 conn=$2 limit=$3; shift 3
  local name=ttft_${cfg#gemma4-}_$conn$([ "$1" = --tp ] && echo "_tp$2")
  timeout "$limit" python3 benchmarks/bench_ttft.py --config "$cfg" --connector "$conn" \
    --out "$R/$name.json" "$@" > "$R/$name.log" 2>&1
}
if [ "$GPUS" -ge 2 ]; then
  e2e & E2E=$!
  CUDA_VISIBLE_DEVICES=0 ttft gemma4-31b-like gemma4-kv 170
  CUDA_VISIBLE_DEVICES=0 ttft gemma4-31b-like offloading 180
  wait $E2E
  ttft gemma4-31b-like gemma4-kv 200 --tp 2 --cpu-gb 30
  CUDA_VISIBLE_DEVICES=0 ttft gemma4-12b-like gemma4-kv 120 &
  CUDA_VISIBLE_DEVICES=1 ttft gemma4-e4b-like gemma4-kv 120 &
  wait
else
  e2e
  ttft gemma4-31b-like gemma4-kv 160
  ttft gemma4-31b-like offloading 170
  ttft gemma4-12b-like gemma4-kv 100
fi
grep -hE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" $R/e2e_*.log
grep -E "^(recompute|vllm_prefix_cache|gemma4_kv) " $R/numerics.log
for f in $R/ttft_*.log; do grep -A4 "^gemma4-" "$f" || { echo "$f"; tail -3 "$f"; }; done
tar czf "$OUT/results.tar.gz" -C /tmp results
