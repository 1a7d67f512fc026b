"""A real multimodal Gemma 4 through the connector on a CUDA GPU (tests/e2e_mm.py says
what and why): `Gemma4ForConditionalGeneration` with random weights and its vision tower,
image prompts through `LLM.generate`, Gemma 4's bidirectional attention within images,
torchvision's image processor; bf16 in vLLM's batch-invariant mode as in
tests/test_e2e_gpu.py, the three engines side by side on the one GPU (fixed KV caches).
Run by `benchmarks/gpu.sh mm`; skipped without a GPU. One test per check; every check
and what it saw go to the JSON file G4KV_MM_RESULT names."""

from __future__ import annotations

import pytest

from needs import require
from e2e_common import stats_events
from e2e_mm import CHECKS, ENGINES, assert_check, conclude, harness, write_model

pytestmark = [pytest.mark.cuda, pytest.mark.vllm]

ENGINE = {"dtype": "bfloat16", "block_size": 16, "gpu_memory_utilization": 0.1,
          "kv_cache_memory_bytes": 2 << 30}
"""Sliding groups get 32-token blocks, full ones 16: the hit multiple is 32."""
ENV = {"VLLM_BATCH_INVARIANT": "1"}
PRELOAD = ["vllm_standins"]  # benchmarks/: an op batch-invariant mode asks for


@pytest.fixture(scope="module")
def mm_gpu(tmp_path_factory):
    require("vllm")
    import torch
    import transformers
    import vllm

    tmp = tmp_path_factory.mktemp("mm-gpu")
    model = write_model(tmp / "model", gpu=True)
    started = {name: harness(tmp, name, model, cls, engine=ENGINE, env=ENV, preload=PRELOAD)
               for name, cls in ENGINES}
    runs = {name: h.result()[0] for name, (h, _) in started.items()}
    return conclude(runs, stats_events(started["conn"][1]),
                    versions={"vllm": vllm.__version__, "torch": torch.__version__,
                              "transformers": transformers.__version__},
                    device=torch.cuda.get_device_name(0))


@pytest.mark.parametrize("check", CHECKS)
def test_gpu_multimodal(mm_gpu, check):
    assert_check(mm_gpu, check)
