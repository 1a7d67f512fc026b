"""Real weights through real vLLM (CPU build): two engines of one host start side by
side on one checkpoint (a tiny random Gemma 4 saved by transformers, loaded from its
safetensors). The weights are hashed once for both, in the background, the engines
agree on the fingerprint, and the KV is cached (a repeated prompt hits).
"""

from __future__ import annotations

import random

import pytest

from needs import require

from e2e_requests_common import run_steps
from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

require("vllm")
pytestmark = pytest.mark.vllm

N = 1100  # 4 full chunks: a repeated prompt hits min(1024, 1099 // 64 * 64) = 1024
_rng = random.Random(5)
P = [_rng.randrange(3, 500) for _ in range(N)]
ENGINES = ("a", "b")


def engine_jobs(tmp_path_factory, selected):
    import transformers

    tmp = tmp_path_factory.mktemp("e2e-weights")
    cfg = tiny_gemma4_config(window=100)
    model = save_config(cfg, tmp / "model")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model)
    env = {"GEMMA4_KV_CACHE_DIR": str(tmp / "digests")}  # shared by both: one host
    engine = {"dtype": "float32", "block_size": 32, "load_format": "safetensors"}
    return [(name, 60.0, lambda name=name: run_steps(
        tmp, name, model, [{"prompts": [P, P]}], connector=True, engine=engine, env=env))
        for name in ENGINES]


@pytest.fixture(scope="module")
def runs(engine_pool):
    return {name: engine_pool.result((__name__, name)) for name in ENGINES}


def test_weights_are_hashed_once_per_host_and_cached(runs):
    logs = [log for _, _, log in runs.values()]
    assert sum(log.count("gemma4-kv: hashing 1 weight file(s)") for log in logs) == 1
    assert not any("cannot be keyed safely" in log for log in logs)
    fingerprints = {e["fingerprint"] for _, events, _ in runs.values() for e in events
                    if e["event"] == "layout"}
    assert len(fingerprints) == 1
    for out, _, _ in runs.values():
        assert out["cached"] == [0, 1024]
