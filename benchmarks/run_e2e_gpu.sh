#!/usr/bin/env bash
# On the H200 (through the device tool), with .gpu-vllm and .whl carried along:
# LMCache's store on this torch, CUDA kernel tests, kernel tuning sweep, GPU end-to-end
# tests in vLLM. Logs under $OUT.
cd "$(dirname "$0")/.."
source .gpu-vllm/env.sh
source benchmarks/gpu_env.sh
python3 - <<'PY' 2>&1 | tail -3 | tee "$OUT/lmcache_store.txt"
import torch
from gemma4_kv.store import ChunkStore, StoreConfig
from gemma4_kv.hf_layout import hf_layout, load_text_config
from gemma4_kv.cli import bundled_config
lay = hf_layout(load_text_config(bundled_config("gemma4-e2b-like")))
s = ChunkStore(lay, "probe", 256, StoreConfig(cpu_bytes=1 << 30))
objs = s.reserve(b"x" * 32)
print("lmcache store on GPU machine: ok; objects pinned:", {g: t.is_pinned() for g, t in objs.items()})
s.abort(b"x" * 32); s.close()
PY
python3 -P -m pytest -q -x tests/test_mover.py tests/test_plan.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -3
[ "${SWEEP:-1}" = 1 ] && python3 benchmarks/sweep_kernel.py "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log" | grep best
python3 -P -m pytest -q -x tests/test_e2e_gpu.py "$@" 2>&1 | tee "$OUT/pytest_e2e_gpu.log" | tail -30
