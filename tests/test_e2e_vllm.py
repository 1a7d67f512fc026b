"""End to end in real vLLM (CPU build): tiny random-weight Gemma 4 models, the same
prompts with and without the connector. Greedy outputs must be identical, cached
tokens and bytes loaded per group must be what the planner predicts.

The engines of every case run side by side with other modules' (tests/conftest.py
`engine_pool`, `engine_jobs` below); nothing here depends on time."""

from __future__ import annotations

import pytest
import torch

from e2e_common import (check_against_plan, counted, check_mtp_case, mtp_case_runs, prompts,
                        run_engine, save_config, tiny_gemma4_config)
from needs import require

require("vllm")
pytestmark = pytest.mark.vllm

BLOCK = 32  # vLLM --block-size: sliding groups get 64-token blocks, full ones 32
WINDOW = 100  # smaller than every prompt and than a chunk
ENGINE = {"dtype": "float32", "block_size": BLOCK}
# Every group's page (vLLM makes them equal): a full layer's 32-token block of 1 KV
# head of 64 float32 channels, K and V: 32 * 1 * 2 * 64 * 4 = 16384 bytes; a sliding
# layer's (head 32) is 8192 at 32 tokens, so vLLM gives sliding groups 64-token blocks.
CHECK = {"dtype": torch.float32, "block_size": BLOCK, "page_bytes": 16384}
VARIANTS = ["plain", "kv_shared_chunked_prefill"]
L2_WAITS = ("vllm:gemma4_kv_l2_waits_given_up", "vllm:gemma4_kv_l2_fetches_not_worth_it",
            "vllm:gemma4_kv_l2_lookups_paused")
"""The connector's counters of lookups that did not wait for an L2 tier (`lookup/wait.py`:
a fetch slower than recomputing what it adds, on this machine at this moment)."""


def _variant(variant):
    shared = variant != "plain"
    cfg = tiny_gemma4_config(kv_shared=4 if shared else 0, window=WINDOW)
    engine = {**ENGINE, **({"max_num_batched_tokens": 512} if shared else {})}
    return cfg, engine


def engine_jobs(tmp_path_factory, selected):
    """[(key, seconds, job)]: each engine of each selected case on its own; the
    consumer of the disk case after its producer."""
    jobs = []
    if "test_connector_matches_recomputation" in selected:
        for variant in VARIANTS:
            cfg, engine = _variant(variant)
            tmp = tmp_path_factory.mktemp(variant)
            model = save_config(cfg, tmp / "model")
            runs = [("base", {"connector": False}), ("conn", {"connector": True})]
            if variant != "plain":
                runs.append(("broken", {"connector": True,
                                        "connector_class": "SkipLoadConnector"}))
            for name, kw in runs:
                jobs.append(((variant, name), 40.0,
                             lambda tmp=tmp, name=name, model=model, engine=engine, kw=kw:
                             run_engine(tmp, name, model, engine=engine, **kw)))
    if "test_second_engine_reuses_kv_from_the_disk_tier" in selected:
        jobs.append(("disk", 80.0, lambda: _disk_runs(tmp_path_factory.mktemp("disk"))))
    if "test_lossless_disk_tier_serves_identical_outputs" in selected:
        jobs.append(("disk_lossless", 80.0,
                     lambda: _disk_runs(tmp_path_factory.mktemp("disk_lossless"), LOSSLESS)))
    if "test_cachegen_disk_tier_serves_hits_and_reports_agreement" in selected:
        jobs.append(("disk_cachegen", 80.0,
                     lambda: _disk_runs(tmp_path_factory.mktemp("disk_cachegen"),
                                        {"l2_codec": "cachegen"})))
    if "test_connector_with_mtp_assistant" in selected:
        tmp = tmp_path_factory.mktemp("mtp")
        for name, job in mtp_case_runs(tmp, engine=ENGINE).items():
            jobs.append((("mtp", name), 50.0, job))
    return jobs


def _disk_runs(tmp, codec: dict | None = None):
    cfg = tiny_gemma4_config(window=WINDOW)
    model = save_config(cfg, tmp / "model")
    disk = {"disk_path": str(tmp / "disk"), **(codec or {})}
    producer, _ = run_engine(tmp, "producer", model, connector=True, engine=ENGINE,
                             extra=disk, role="kv_producer")
    consumer, events = run_engine(tmp, "consumer", model, connector=True, engine=ENGINE,
                                  extra=disk, role="kv_consumer", metrics=L2_WAITS)
    return cfg, producer, consumer, events, sorted((tmp / "disk").rglob("*.data"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_connector_matches_recomputation(engine_pool, variant):
    shared = variant != "plain"
    cfg, _ = _variant(variant)
    base, _ = engine_pool.result((__name__, (variant, "base")))
    out, events = engine_pool.result((__name__, (variant, "conn")))
    check_against_plan(cfg, events, out, base, **CHECK)
    if not shared:
        return
    # Negative control: the same hits with the blocks left unfilled must change tokens,
    # so the comparison above can fail.
    broken, _ = engine_pool.result((__name__, (variant, "broken")))
    assert broken["cached"] == out["cached"]
    hits = [i for i, c in enumerate(out["cached"]) if c]
    assert any(broken["outputs"][i] != base["outputs"][i] for i in hits)


def test_second_engine_reuses_kv_from_the_disk_tier(engine_pool):
    """A kv_producer engine stores through LMCache's disk tier; a fresh kv_consumer
    engine (another process, empty CPU tier, started after the producer exited) serves
    its hits from there."""
    cfg, producer, consumer, events, _ = engine_pool.result((__name__, "disk"))
    check_disk_hits(producer, consumer, events)


def check_disk_hits(producer, consumer, events, exact: bool = True):
    assert producer["cached"] == [0] * len(prompts())
    # The producer stored each prompt's whole chunks and the windows before its own
    # limit, so each hits min(its whole chunks, (P - 1) // 64 * 64):
    # 1100 -> 1024, 768 -> 704, 900 -> 768, 513 -> 512, 600 -> 512, 300 -> 256, 1800 -> 1792.
    hits = [1024, 1024, 704, 768, 512, 512, 256, 1792, 1792]
    # A lookup that measured the disk fetch as slower than recomputing what it adds (the
    # prefill rate and the tier's throughput, on this machine, now: a neighbouring
    # engine can change either) does not wait for it, and the connector counts that;
    # such a prompt hits at most its hand-derived value. Every other prompt hits exactly
    # that value. The first lookup has no measurement yet and waits up to
    # `lookup_timeout_s`: its hit proves the consumer reads the disk tier.
    waits = counted(consumer, L2_WAITS)
    why = f"cached {consumer['cached']}, L2 waits skipped per prompt {waits}"
    assert waits[0] == {} and consumer["cached"][0] == hits[0], why
    for got, want, skipped in zip(consumer["cached"], hits, waits):
        assert got == want if not skipped else got <= want, why
    if exact:
        assert consumer["outputs"] == producer["outputs"]
    assert not [e for e in events if e["event"] == "save"]


LOSSLESS = {"l2_codec": "lossless", "l2_codec_frame": 1.0}
"""A frame of the object's size holds any object, so every object reaches the disk
(float32 KV of random weights compresses little: the ratio is printed)."""


def test_lossless_disk_tier_serves_identical_outputs(engine_pool):
    """The disk case with `l2_codec: lossless`: every file on the disk is a frame
    (magic G4KC: the codec was on the path; without it the files are the objects'
    bytes), and the consumer's hits and greedy outputs are the producer's, as
    without the codec."""
    cfg, producer, consumer, events, files = engine_pool.result((__name__, "disk_lossless"))
    assert files
    heads = [f.read_bytes()[:48] for f in files]
    assert all(h[:4] == b"G4KC" for h in heads)
    raw = sum(int.from_bytes(h[8:16], "little") for h in heads)
    payload = sum(int.from_bytes(h[16:24], "little") for h in heads)
    print(f"\nlossless on this model's float32 KV: {len(files)} objects, {raw} bytes -> "
          f"{payload} ({raw / payload:.3f}x), {sum(h[7] == 1 for h in heads)} stored as is")
    check_disk_hits(producer, consumer, events)


def test_cachegen_disk_tier_serves_hits_and_reports_agreement(engine_pool):
    """The disk case with `l2_codec: cachegen` (4 bits): every file is a cachegen frame
    (codec id 2), every one smaller than its object, and the consumer hits exactly what
    the hand-derived plan says from those lossy objects: each decoded object passed the
    integrity check (its trailer sealed again by the decoder), or the hit would be
    shorter. Its greedy outputs are compared with the producer's and the agreement is
    printed, never asserted (the codec is lossy; random weights give KV with little of
    the structure it relies on)."""
    cfg, producer, consumer, events, files = engine_pool.result((__name__, "disk_cachegen"))
    assert files
    heads = [f.read_bytes()[:48] for f in files]
    assert all(h[:4] == b"G4KC" and h[5] == 2 for h in heads)
    raw = sum(int.from_bytes(h[8:16], "little") for h in heads)
    stored = sum(f.stat().st_size for f in files)
    assert stored < raw
    check_disk_hits(producer, consumer, events, exact=False)
    pairs = list(zip(consumer["outputs"], producer["outputs"], strict=True))
    same = sum(a == b for a, b in pairs)
    first = sum(a[:1] == b[:1] for a, b in pairs)
    tokens = sum(len(a) for a, _ in pairs)
    agree = sum(x == y for a, b in pairs for x, y in zip(a, b))
    print(f"\ncachegen 4 bits on this model's float32 KV: {raw} bytes -> {stored} on disk "
          f"({raw / stored:.2f}x); outputs equal {same}/{len(pairs)}, first tokens "
          f"{first}/{len(pairs)}, tokens {agree}/{tokens}")


def test_connector_with_mtp_assistant(engine_pool):
    runs = {name: engine_pool.result((__name__, ("mtp", name))) for name in ("base", "conn")}
    check_mtp_case(runs, check=CHECK)
