#!/usr/bin/env bash
# One short device call: the E4B-shaped TTFT benchmark with first tokens recorded, in
# vLLM's default numerics and in batch-invariant mode (is a cold/warm token difference
# numerics or the connector?). Results in $OUT.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
timeout 100 python3 benchmarks/bench_ttft.py --config gemma4-e4b-like --lengths 8192,32768 \
  --out "$OUT/ttft_e4b_default.json" > "$OUT/ttft_e4b_default.log" 2>&1
VLLM_BATCH_INVARIANT=1 timeout 110 python3 benchmarks/bench_ttft.py --config gemma4-e4b-like \
  --lengths 8192,32768 --out "$OUT/ttft_e4b_batch_invariant.json" > "$OUT/ttft_e4b_bi.log" 2>&1
for f in "$OUT"/ttft_e4b_*.json; do python3 -c "
import json,sys; d=json.load(open('$f'))
for r in d['rows']: print('$f'.split('/')[-1], r['tokens'], r['cached'], r['first_tokens'])"; done
tail -3 "$OUT/ttft_e4b_bi.log"
