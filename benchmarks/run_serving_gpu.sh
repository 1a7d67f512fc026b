#!/usr/bin/env bash
# One device call on one H200 (.gpu-vllm and .whl carried, as for run_final_gpu.sh): the
# serving benchmark on the 12B-like shape, then its exactness check. Everything lands in
# $OUT/serving_results.tar.gz: serving/ (timing: serving.json, serving.png, one JSON and
# log per system), exact/ (batch-invariant first tokens), gpu.txt and the drivers' logs.
#
#   bash benchmarks/run_serving_gpu.sh [timing|exact|all]     (default all; ~8 min)
#
# Timing, default numerics, one system after another (none, gemma4-kv, vLLM's
# OffloadingConnector with its copy op stood in by vllm_standins), each in its own engine:
# CPU tier 18 GiB for both connectors, GPU KV cache 4 GiB (kv_cache_memory_bytes; vLLM
# refused 2.5 GiB on the H200: one 8448-token request needs 2.84 GiB of this shape),
# 4096-token prefill steps, 8192-token documents with 64-token questions, 4 in flight:
#   fits: 6 documents = 0.92x the CPU tier densely (all layers, every token), 1 cold + 3
#         warm rounds, one shuffled order every round (a cycle): vLLM's GPU cache holds
#         a few of them at most, so LRU gives it next to no hits;
#   over: 20 documents = 3.06x the CPU tier densely, 1 cold + 2 warm rounds; gemma4-kv
#         retains 20.5% of the dense bytes at retention_interval 8192 (0.63x the tier;
#         at the default 4096 it keeps 31.8%, 0.97x the tier: no room for the watermark);
#   chat: 8 users x 4 turns, 512-token shared system prompt + 1536-token history, 256+
#         token messages, 32-token answers.
# Exactness: VLLM_BATCH_INVARIANT=1, none and gemma4-kv side by side on the same GPU,
# small sizes (4 documents of 2048 tokens with a 1 GiB GPU KV cache, so hits come from
# both vLLM's cache and the store; 2 users x 3 turns); first tokens must agree.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
what=${1:-all}
FINAL_OUT=$OUT OUT=/tmp/serving_results && mkdir -p $OUT  # one archive comes back
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  df -h /dev/shm; free -g; nproc; } > "$OUT/gpu.txt" 2>&1

if [ "$what" != exact ]; then
  timeout -k 20 440 python3 benchmarks/bench_serving.py --out "$OUT/serving" \
    --config gemma4-12b-like --systems none,gemma4-kv,offloading --system-timeout 200 \
    --cpu-gb 18 --kv-cache-gb 4 --max-num-batched-tokens 4096 --retention-interval 8192 \
    --doc-len 8192 --question-len 64 --questions 2 --batch 4 --max-tokens 4 \
    --fits-rounds 4 --over 3 --over-rounds 3 --chat-users 8 --chat-turns 4 \
    --settle-s 0.5 --label "H200 timing, default numerics" > "$OUT/serving.log" 2>&1
  echo "timing: exit $? after ${SECONDS}s"
fi
if [ "$what" != timing ]; then
  left=$((570 - SECONDS)); [ "$what" = exact ] && left=300
  VLLM_BATCH_INVARIANT=1 timeout -k 20 "$((left > 60 ? left : 60))" python3 \
    benchmarks/bench_serving.py --out "$OUT/exact" --parallel --gpu-memory-utilization 0.3 \
    --config gemma4-12b-like --systems none,gemma4-kv --scenarios fits,chat \
    --system-timeout 240 --cpu-gb 4 --kv-cache-gb 1 --max-num-batched-tokens 2048 \
    --retention-interval 8192 --doc-len 2048 --fits-docs 4 --fits-rounds 3 --batch 2 \
    --chat-users 2 --chat-turns 3 --chat-system 256 --chat-history 512 --settle-s 0.5 \
    --label "H200 exactness, batch-invariant" > "$OUT/exact.log" 2>&1
  echo "exactness: exit $? after ${SECONDS}s"
fi
for f in "$OUT/serving.log" "$OUT/exact.log"; do
  [ -f "$f" ] || continue
  echo "== $f"
  sed -n '/^gemma4-12b-like,/,$p' "$f" | grep -v "^wrote" || tail -20 "$f"
done
tar czf "$FINAL_OUT/serving_results.tar.gz" -C /tmp serving_results
