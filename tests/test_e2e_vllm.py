"""End to end in real vLLM (CPU build): tiny random-weight Gemma 4 models, the same
prompts with and without the connector. Greedy outputs must be identical, cached
tokens and bytes loaded per group must be what the planner predicts."""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.layout.from_hf import hf_layout
from e2e_common import (CHUNK, check_against_plan, prompts, run_engine, run_mtp_case,
                        save_config, tiny_gemma4_config)

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

BLOCK = 32  # vLLM --block-size: sliding groups get 64-token blocks, full ones 32
WINDOW = 100  # smaller than every prompt and than a chunk
ENGINE = {"dtype": "float32", "block_size": BLOCK}
CHECK = {"dtype": torch.float32, "block_size": BLOCK}


@pytest.mark.parametrize("variant", ["plain", "kv_shared_chunked_prefill"])
def test_connector_matches_recomputation(tmp_path, variant):
    shared = variant != "plain"
    cfg = tiny_gemma4_config(kv_shared=4 if shared else 0, window=WINDOW)
    model = save_config(cfg, tmp_path / "model")
    engine = {**ENGINE, **({"max_num_batched_tokens": 512} if shared else {})}
    base, _ = run_engine(tmp_path, "base", model, connector=False, engine=engine)
    out, events = run_engine(tmp_path, "conn", model, connector=True, engine=engine)
    check_against_plan(cfg, events, out, base, **CHECK)
    if not shared:
        return
    # Negative control: the same hits with the blocks left unfilled must change tokens,
    # so the comparison above can fail.
    broken, _ = run_engine(tmp_path, "broken", model, connector=True, engine=engine,
                           connector_class="SkipLoadConnector")
    assert broken["cached"] == out["cached"]
    hits = [i for i, c in enumerate(out["cached"]) if c]
    assert any(broken["outputs"][i] != base["outputs"][i] for i in hits)


def test_second_engine_reuses_kv_from_the_disk_tier(tmp_path):
    """A kv_producer engine stores through LMCache's disk tier; a fresh kv_consumer
    engine (another process, empty CPU tier) serves its hits from there."""
    cfg = tiny_gemma4_config(window=WINDOW)
    model = save_config(cfg, tmp_path / "model")
    disk = {"disk_path": str(tmp_path / "disk")}
    producer, _ = run_engine(tmp_path, "producer", model, connector=True, engine=ENGINE,
                             extra=disk, role="kv_producer")
    consumer, events = run_engine(tmp_path, "consumer", model, connector=True, engine=ENGINE,
                                  extra=disk, role="kv_consumer")
    assert producer["cached"] == [0] * len(prompts())
    m = hf_layout(cfg, dtype=torch.float32, block_size=BLOCK).chunk_multiple
    assert consumer["cached"] == [min(len(p) // CHUNK * CHUNK, (len(p) - 1) // m * m)
                                  for p in prompts()]
    assert consumer["outputs"] == producer["outputs"]
    assert not [e for e in events if e["event"] == "save"]


def test_connector_with_mtp_assistant(tmp_path):
    run_mtp_case(tmp_path, engine=ENGINE, check=CHECK)
