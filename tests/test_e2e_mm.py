"""A real multimodal Gemma 4 through the connector on vLLM's CPU build (tests/e2e_mm.py
says what and why): `Gemma4ForConditionalGeneration` with random weights and its vision
tower, image prompts through `LLM.generate`, transformers' PIL image processor; float32.
torchvision is absent here: its processes run with a stand-in whose functions all raise
(tests/torchvision_standin), and image attention is causal (vLLM's CPU attention has no
bidirectional mode; tests/test_e2e_gpu_mm.py runs Gemma 4's on the GPU). The three
engines run side by side in the test run's engine pool (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

from needs import require
from e2e_common import stats_events
from e2e_mm import CHECKS, ENGINES, STANDIN, assert_check, conclude, harness, write_model
from engine_zygote import SPAWN_AFRESH

require("vllm")
pytestmark = pytest.mark.vllm
OPT_IN = "G4KV_MM_CPU"
if not os.environ.get(OPT_IN):
    pytest.skip(f"set {OPT_IN}=1 to run the multimodal CPU case (three engines): kept out "
                "of CI's 15 minutes; the GPU runs it (benchmarks/gpu.sh mm)",
                allow_module_level=True)

ENGINE = {"dtype": "float32", "block_size": 32}
"""Sliding groups get 64-token blocks, full ones 32: the hit multiple is 64."""
PRELOAD = ["pil_backend"]  # tests/torchvision_standin: transformers' PIL image processor


def _env() -> dict:
    """The stand-in first on the engine's path (the harness's own entries after it), in a
    process of its own (not forked from the test run's zygote, nor starting it)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    return {"PYTHONPATH": os.pathsep.join([STANDIN, tests, os.environ.get("PYTHONPATH", "")]),
            SPAWN_AFRESH: "1"}


def engine_jobs(tmp_path_factory, selected):
    """The three engines, beside each other and other modules' (tests/conftest.py
    `engine_pool`): nothing here depends on time. The model is written first, once."""
    tmp = tmp_path_factory.mktemp("e2e-mm")
    model = write_model(tmp / "model", gpu=False)

    def job(name, cls):
        def run():
            h, stats = harness(tmp, name, model, cls, engine=ENGINE, env=_env(),
                               preload=PRELOAD)
            return h.result()[0], stats_events(stats)
        return run

    return [(name, 60.0, job(name, cls)) for name, cls in ENGINES]


@pytest.fixture(scope="module")
def mm_cpu(engine_pool):
    runs = {name: engine_pool.result((__name__, name)) for name, _ in ENGINES}
    import transformers
    import vllm

    return conclude({n: out for n, (out, _) in runs.items()}, runs["conn"][1],
                    versions={"vllm": vllm.__version__,
                              "transformers": transformers.__version__},
                    device="cpu")


@pytest.mark.parametrize("check", CHECKS)
def test_multimodal(mm_cpu, check):
    assert_check(mm_cpu, check)
