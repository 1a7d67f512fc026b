"""Exact on every request vLLM serves (CPU build, real engines): LoRA adapters, mixed
prompt embeddings, a weight update with `reset_prefix_cache(reset_connector=True)`,
and vLLM's metrics and logs; requests that differ only in adapter, embeddings or
weights never share a hit over what differs, identical ones do, and every output
equals recomputation.

One connector engine and one recomputation engine (no connector) run the same
script of steps once, side by side (tests/conftest.py `engine_pool`); each test checks
one aspect of those runs.
The harness sharpens vLLM's dummy weights (norms and layer scalars set to 1), so the
tiny model's greedy tokens depend on the whole prompt and a wrong hit shows.
"""

from __future__ import annotations

import os
import random
import re
from collections import Counter

import pytest
import torch

from needs import require

from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
from gemma4_kv.layout.from_hf import hf_layout
from model_keys import chunk_hashes
from gemma4_kv.layout.plan import needed_blocks
from e2e_common import saved_blocks
from e2e_requests_common import counters, expected_store, run_steps, write_adapter
from scheduler_half import SchedulerHalf

require("vllm")
pytestmark = pytest.mark.vllm

CHUNK = 256
RETENTION = 512
BLOCK = 32  # sliding groups get 64-token blocks, full ones 32: the hit multiple is 64
N = 1100  # 4 full chunks; a repeated prompt hits min(1024, 1099 // 64 * 64) = 1024
ROWS = (950, 1020)  # embedded rows of the mixed prompts: inside chunk 3
ENGINE = {"dtype": "float32", "block_size": BLOCK, "enable_lora": True, "max_loras": 2,
          "max_lora_rank": 8, "max_cpu_loras": 2, "enable_prompt_embeds": True,
          "disable_log_stats": False, "max_num_batched_tokens": 8192}
# Log vLLM's stats (the "KV Transfer metrics" line) after every step with outputs.
ENV = {"VLLM_LOG_STATS_INTERVAL": "1e-9"}

_rng = random.Random(0)
P = [_rng.randrange(3, 500) for _ in range(N)]
Q = [_rng.randrange(3, 500) for _ in range(N)]  # a second prompt, for the batch


def _embeds(tokens, seed):
    return {"tokens": tokens, "embeds": {"seed": seed, "rows": list(ROWS)}}


# name: (harness PROMPT, model key label). Keys are modelled per label: a LoRA adapter
# or a new generation changes every chunk's key; embedded rows change their chunk's
# key on (and any prompt_embeds at all changes every key: the rows' bytes are keyed).
PROMPTS = {
    "A": ({"tokens": P, "lora": "A"}, "lora A"),
    "none": (P, ""),
    "B": ({"tokens": P, "lora": "B"}, "lora B"),
    "E1": (_embeds(P, 1), "embeds 1"),
    "E2": (_embeds(P, 2), "embeds 2"),
    "QA": ({"tokens": Q, "lora": "A"}, "lora A"),
    "Q": (Q, ""),
    "QB": ({"tokens": Q, "lora": "B"}, "lora B"),
    "QE1": (_embeds(Q, 1), "embeds 1"),
}
BEFORE = ["A", "none", "B", "A", "none", "E1", "E2", "E1", "B"]
# Batches (all sent at once; the engine core may start on the first before the others
# arrive, so a later identical request may or may not hit the earlier one), then each
# asked alone. No batch mixes requests with and without an adapter: vLLM CPU's torch
# LoRA ops (lora/ops/torch_ops/lora_ops.py, bgmv_*) index the stacked adapters with the
# no-LoRA sentinel -1, so a request without an adapter batched beside one with an
# adapter gets the last adapter slot applied (vllm-project/vllm PR #48421): vLLM then
# computes, and any cache stores, the wrong KV for it. GPU (Triton) kernels skip -1.
BATCHES = [["QA", "QB", "QA"], ["Q", "QE1", "Q"]]
AFTER_BATCH = ["Q", "QA", "QB", "QE1"]
STALE = ["none"]  # after the weight update, before the reset: served the old KV
AFTER = ["none", "none", "A"]  # after the weight update and the reset
STEPS = [{"prompts": [PROMPTS[n][0] for n in BEFORE]},
         *({"prompts": [PROMPTS[n][0] for n in b], "batch": True} for b in BATCHES),
         {"prompts": [PROMPTS[n][0] for n in AFTER_BATCH]},
         {"metrics": True},
         {"call": "engine_calls:perturb_weights"},
         {"prompts": [PROMPTS[n][0] for n in STALE]},
         {"reset": True},
         {"prompts": [PROMPTS[n][0] for n in AFTER]},
         {"metrics": True}]
BATCHED = [n for b in BATCHES for n in b]
NAMES = BEFORE + BATCHED + AFTER_BATCH + STALE + AFTER
IN_BATCH = range(len(BEFORE), len(BEFORE) + len(BATCHED))
MID, RESET, END = 4, 7, 9  # step indices
N_MID = len(BEFORE + BATCHED + AFTER_BATCH)  # requests before the weight update
N_AFTER = N_MID + len(STALE)  # the first request after the reset


def model_keys(name: str, generation: int) -> list[bytes]:
    """Stand-in chunk keys: equal exactly where the connector's keys must be equal."""
    prompt, label = PROMPTS[name]
    tokens = list(prompt if isinstance(prompt, list) else prompt["tokens"])
    if label.startswith("embeds"):
        seed = int(label.split()[1])
        tokens[ROWS[0]:ROWS[1]] = [-seed] * (ROWS[1] - ROWS[0])
        label = "embeds"
    return chunk_hashes(tokens, CHUNK, salt=f"{generation}|{label}")


def engine_jobs(tmp_path_factory, selected):
    """The two engines, beside each other and other modules' (tests/conftest.py
    `engine_pool`): nothing here depends on time."""
    tmp = tmp_path_factory.mktemp("e2e-requests")
    cfg = tiny_gemma4_config(window=100)
    model = save_config(cfg, tmp / "model")
    loras = {"A": write_adapter(tmp / "lora-A", 1, cfg), "B": write_adapter(tmp / "lora-B", 2, cfg)}
    extra = {"retention_interval": RETENTION, "intermediate_ends": "always",
             "disk_path": str(tmp / "disk")}
    return [("base", 80.0, lambda: run_steps(tmp, "base", model, STEPS, connector=False,
                                             engine=ENGINE, loras=loras, env=ENV)),
            ("conn", 80.0, lambda: run_steps(tmp, "conn", model, STEPS, connector=True,
                                             engine=ENGINE, extra=extra, loras=loras,
                                             env=ENV))]


@pytest.fixture(scope="module")
def runs(engine_pool):
    cfg = tiny_gemma4_config(window=100)
    base, _, base_log = engine_pool.result((__name__, "base"))
    out, events, log = engine_pool.result((__name__, "conn"))
    layout = hf_layout(cfg, dtype=torch.float32, block_size=BLOCK)
    # Batched requests modelled one at a time: where a batch's identical pair ran in
    # one step the later one hits nothing instead (see test_hits_...); what is stored
    # is the same either way.
    requests = ([(model_keys(n, 0), N) for n in BEFORE + BATCHED + AFTER_BATCH + STALE]
                + [(model_keys(n, 1), N) for n in AFTER])
    hits, stored = expected_store(layout, requests, CHUNK, RETENTION)
    return dict(base=base, out=out, events=events, log=log, base_log=base_log,
                layout=layout, hits=hits, stored=stored)


def test_outputs_equal_recomputation(runs):
    """Every request but the one served stale KV on purpose (next test)."""
    base, out = runs["base"], runs["out"]
    assert len(out["outputs"]) == len(NAMES)
    differing = [(i, NAMES[i], c, a, b) for i, (c, a, b) in
                 enumerate(zip(out["cached"], out["outputs"], base["outputs"]))
                 if a != b and i != N_MID]
    assert not differing, f"greedy tokens differ from recomputation: {differing}"


def test_a_weight_update_needs_the_reset(runs):
    """The control for the reset: weights changed in memory reach no key, so before
    `reset_prefix_cache(reset_connector=True)` the old KV is a hit (1024 tokens, as
    before the update) and the tokens are not those the new weights compute; after it
    the same prompt hits 0 (test_hits_only_between_identical_requests)."""
    assert runs["out"]["cached"][N_MID] == 1024
    assert runs["out"]["outputs"][N_MID] != runs["base"]["outputs"][N_MID]


def test_negative_controls_in_the_recomputation_engine(runs):
    """The comparison above can fail: in the engine without the connector, an adapter,
    other embeddings or the new weights change the greedy tokens of the same ids."""
    outs = runs["base"]["outputs"]
    first = {}
    for name, o in zip(NAMES[:N_MID], outs):
        first.setdefault(name, o)
    # Deterministic, alone and in batches
    assert all(o == first[n] for n, o in zip(NAMES[:N_MID], outs))
    assert len({tuple(first[n]) for n in PROMPTS}) == len(PROMPTS)  # all nine differ
    assert outs[N_MID] != first["none"]  # the weight update changed the model
    assert outs[N_AFTER] != first["none"] and outs[N_AFTER + 2] != first["A"]
    assert runs["base"]["cached"] == [0] * len(NAMES)


def test_hits_only_between_identical_requests(runs):
    """Exact hits: the same adapter / embeddings / generation hit the whole servable
    prefix; another adapter or none misses; other embedded rows in chunk 3 keep the
    hit of the chunks before; nothing from before the reset is served after it (the
    prompt that hit 1024 just before the reset hits 0 just after it)."""
    hits = runs["hits"]
    # E2 shares chunks 0-2 with E1 (its embedded rows start in chunk 3), but E1 kept its
    # sliding windows only before hits at 512 and 1024 (retention): E2 hits 512.
    assert hits == ([0, 0, 0, 1024, 1024, 0, 512, 1024, 1024]  # one at a time
                    + [0, 0, 1024, 0, 0, 1024]  # the batches (if run one at a time)
                    + [1024] * len(AFTER_BATCH)  # then each alone
                    + [1024]  # after the weight update: the old KV (test above)
                    + [0, 1024, 0])  # after the reset
    cached = runs["out"]["cached"]
    assert [c for i, c in enumerate(cached) if i not in IN_BATCH] == \
        [h for i, h in enumerate(hits) if i not in IN_BATCH]
    # In a batch, by hand. Q's tokens are in no request before the batches, so QB and
    # QE1 (the only requests of their batch with that adapter / those embeddings) hit
    # 0. The three requests of a batch (3 x 1100 tokens) fit in one step (8192 batched
    # tokens), whose lookups come before its saves: run together, none hits. The engine
    # core may also start one before the others, and which one is its choice (the
    # fresh-clone CI saw the in-process engine core run a batch's later Q first: [1024,
    # 0, 0] for [Q, QE1, Q]); the other of the identical pair then hits what it stored,
    # 1024 (4 full chunks: min(1024, 1099 // 64 * 64)). Never both of a pair, never
    # another value.
    assert BATCHES == [["QA", "QB", "QA"], ["Q", "QE1", "Q"]]
    qa, qb, qa_again, q, qe1, q_again = (cached[i] for i in IN_BATCH)
    assert qb == qe1 == 0, cached
    assert sorted((qa, qa_again)) in ([0, 0], [0, 1024]), cached
    assert sorted((q, q_again)) in ([0, 0], [0, 1024]), cached
    assert runs["out"]["steps"][RESET]["result"] is True  # reset_prefix_cache(...)


def test_loads_and_saves_follow_the_plan(runs):
    events, layout, stored = runs["events"], runs["layout"], runs["stored"]
    loads = [e for e in events if e["event"] == "load"]
    assert [e["end"] for e in loads] == [h for h in runs["out"]["cached"] if h]
    for e in loads:
        for g in layout.groups:
            blocks = len(needed_blocks(g, 0, e["end"]))
            assert e["groups"][str(g.group_id)] == {
                "blocks": blocks, "bytes": blocks * g.page_bytes * len(g.layers)}
    assert saved_blocks(events) == Counter({g.group_id: sum(1 for _, gid in stored if gid == g.group_id)
                             * (CHUNK // g.block_size) for g in layout.groups})


def _event_sums(events, kind):
    blocks = sum(v["blocks"] for e in events if e["event"] == kind
                 for v in e["groups"].values())
    nbytes = sum(v["bytes"] for e in events if e["event"] == kind
                 for v in e["groups"].values())
    return blocks, nbytes


def test_metrics_reach_the_front_end(runs):
    """The connector's counters arrive in `LLM.get_metrics()` (KVConnectorStats from the
    worker, through the engine core, into vllm:gemma4_kv_*), and vLLM's own external
    prefix cache counters equal the hits the requests saw."""
    out, events = runs["out"], runs["events"]
    mid, end = counters(out["steps"][MID]["result"]), counters(out["steps"][END]["result"])
    for snap, cached, n in ((mid, out["cached"][:N_MID], N_MID),
                            (end, out["cached"], len(NAMES))):
        assert snap["vllm:external_prefix_cache_hits"] == sum(cached)
        assert snap["vllm:external_prefix_cache_queries"] == n * N
        assert snap["vllm:gemma4_kv_hit_tokens"] == sum(cached)
        assert snap["vllm:gemma4_kv_lookups"] == n
        assert snap["vllm:prompt_tokens_cached"] == sum(cached)
        # The connector names its tier (get_external_cache_hit_sources). The CPU tier
        # holds everything the disk tier does, so a request asked alone finds its whole
        # hit there and never asks the disk. A batched request may be looked up while
        # the identical one before it is still being written: the disk tier is asked,
        # and whether that write reaches it first is timing, so those hits may count
        # as the disk's (up to all of the batched requests' hits), never more.
        host = snap["vllm:prompt_tokens_cached_by_source{source=host}"]
        disk = snap["vllm:prompt_tokens_cached_by_source{source=disk}"]
        assert host + disk == sum(cached)
        assert disk == snap["vllm:gemma4_kv_hit_tokens_l2"]
        assert disk <= sum(cached[i] for i in IN_BATCH if i < n)
    load_blocks, load_bytes = _event_sums(events, "load")
    save_blocks, save_bytes = _event_sums(events, "save")
    assert end["vllm:gemma4_kv_load_blocks"] == load_blocks > 0
    assert end["vllm:gemma4_kv_load_bytes"] == load_bytes
    assert end["vllm:gemma4_kv_save_blocks"] == save_blocks > 0
    assert end["vllm:gemma4_kv_save_bytes"] == save_bytes
    for half in ("scheduler", "worker"):  # host time per kind of step (issue 24.4)
        kinds = {k: end.get(f"vllm:gemma4_kv_{half}_steps_{k}", 0)
                 for k in ("plain", "load", "save")}
        assert sum(kinds.values()) == end[f"vllm:gemma4_kv_{half}_steps"], (half, kinds)
        assert kinds["load"] >= 1 and kinds["save"] >= 1 and kinds["plain"] >= 1, (half, kinds)
        assert all(end.get(f"vllm:gemma4_kv_{half}_us_{k}", 0) > 0 for k in kinds), half
    base = counters(runs["base"]["steps"][END]["result"])
    assert not [k for k in base if k.startswith("vllm:gemma4_kv_")]
    assert base.get("vllm:external_prefix_cache_hits", 0) == 0


def test_transfer_metrics_log_line(runs):
    """vLLM's "KV Transfer metrics" log line (`Gemma4KVStats.reduce`), logged after every
    step here: its hit tokens add up to the hits."""
    lines = re.findall(r"KV Transfer metrics: (.*)", runs["log"])
    assert lines
    total = sum(int(m.group(1)) for line in lines
                if (m := re.search(r"\bhit_tokens=(\d+)", line)))
    assert total == sum(runs["out"]["cached"])
    assert "KV Transfer metrics" not in runs["base_log"]


def test_lmcache_per_request_logs_are_quiet(runs):
    """At the default lmcache_log_level LMCache's per-request INFO lines stay out of the
    engine's output: "Prefetch request completed" for every group of every lookup
    with an L1 hit and for prefetches from the disk tier (dozens here at INFO)."""
    log = runs["log"]
    assert "Prefetch request completed" not in log
    info = [l for l in log.splitlines() if "LMCache INFO" in l or "LMCache DEBUG" in l]
    assert not info, info[:5]


# -- multimodal: real Requests through the real scheduler half ------------------------
# A real multimodal Gemma 4 engine needs transformers' Gemma4Processor, whose video
# processor does not import without torchvision, which the project's venv leaves out
# (setup.sh). So vLLM's scheduler-side `Request`s with real image identifiers (vLLM's
# MultiModalHasher over two PIL images of one size) go through the connector's real
# scheduler half, vLLM's KVCacheManager and block hasher, and the real worker-side
# LookupService / EmbeddedStore behind the real lookup socket.

BOI, EOI, IMAGE = 500, 501, 502
IMAGE_LEN = 66  # boi + 64 soft tokens + eoi: what vLLM's Gemma 4 processor places


def _image_id(color, model="tiny") -> str:
    """The identifier vLLM's input processor gives an image item (its MultiModalHasher
    over the PIL image; sha256: blake3, the default, is not installed)."""
    from PIL import Image
    from vllm.multimodal.hasher import MultiModalHasher

    return MultiModalHasher.hash_kwargs("sha256", model_id=model,
                                        image=Image.new("RGB", (224, 224), color))


def _with_image(offset):
    t = list(P)
    t[offset:offset + IMAGE_LEN] = [BOI] + [IMAGE] * (IMAGE_LEN - 2) + [EOI]
    return t


def test_multimodal_items_through_the_scheduler_half(tmp_path):
    """Same ids, another image of the same size: no hit over the image (0 when it is in
    chunk 0; the chunks before it when it comes later); the same image: the whole hit;
    vLLM's own block hashes differ and agree in the same places."""
    model = save_config(tiny_gemma4_config(window=100), tmp_path / "model")
    half = SchedulerHalf(model)
    try:
        a, b = _image_id((10, 200, 30)), _image_id((200, 10, 90))
        assert a != b and _image_id((10, 200, 30)) == a
        cases = [("early A", 100, a), ("early B", 100, b), ("early A", 100, a),
                 ("late A", 800, a), ("late B", 800, b), ("late A", 800, a)]
        reqs = [half.request(_with_image(off), [(ident, off, IMAGE_LEN)])
                for _, off, ident in cases]
        assert len({tuple(r.all_token_ids) for r in reqs}) == 2  # the ids never tell
        served = [half.serve(r) for r in reqs]
        hits = [h for h, _ in served]
        # The model of the store, keyed by vLLM's block hashes (chained: the last block
        # of chunk c names everything up to it, image identifiers included).
        per_chunk = CHUNK // half.hash_block
        vllm_keys = [[r.block_hashes[(c + 1) * per_chunk - 1] for c in range(N // CHUNK)]
                     for r in reqs]
        expected, _ = expected_store(half.layout, [(k, N) for k in vllm_keys], CHUNK,
                                     RETENTION)
        assert hits == expected
        assert hits[0] == hits[1] == 0 and hits[2] == 1024
        assert hits[3] == 0 and 0 < hits[4] <= 768 and hits[5] == 1024
        # vLLM's block hashes: B differs from the image's block on, A again nowhere.
        first_diff = [next((i for i, (x, y) in enumerate(zip(reqs[i0].block_hashes,
                                                             reqs[i1].block_hashes))
                            if x != y), None) for i0, i1 in ((0, 1), (0, 2), (3, 4), (3, 5))]
        assert first_diff == [100 // half.hash_block, None, 800 // half.hash_block, None]
        # The late-B hit reads late A's objects of the chunks before the image.
        (load,) = served[4][1].loads
        assert load.hashes[:hits[4] // CHUNK] == half.saved[reqs[3].request_id][:hits[4] // CHUNK]
        # An item vLLM did not hash (its counter name) is never stored nor served.
        for _ in range(2):
            r = half.request(_with_image(100), [("renderer0-mm-7-image-0", 100, IMAGE_LEN)])
            hit, meta = half.serve(r)
            assert hit == 0 and not meta.saves
    finally:
        half.close()


def test_lmcache_log_level_is_what_silences_its_per_lookup_lines():
    """Control for test_lmcache_per_request_logs_are_quiet: LMCache does log a
    "Prefetch request completed" INFO line for every L1 lookup with a hit (the
    connector's `EmbeddedStore.resident`), and `lmcache.set_log_level` is what silences it.
    (In the engine too: the script above with lmcache_log_level INFO prints dozens.)"""
    import logging

    from gemma4_kv.layout import integrity
    from gemma4_kv.stores.base import ChunkWrite
    from gemma4_kv.stores.config import StoreConfig
    from gemma4_kv.stores.embedded import EmbeddedStore
    from gemma4_kv.stores.lmcache import set_log_level

    layout = hf_layout(tiny_gemma4_config(window=100), dtype=torch.float32, block_size=BLOCK)
    store = EmbeddedStore(layout, "log-control", CHUNK, StoreConfig(cpu_bytes=64 << 20))
    lm = [l for n, l in logging.Logger.manager.loggerDict.items()
          if n.startswith("lmcache") and isinstance(l, logging.Logger)]
    saved = [(l, l.level, [(h, h.level) for h in l.handlers]) for l in lm]
    env = os.environ.get("LMCACHE_LOG_LEVEL")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    sm_logger = logging.getLogger("lmcache.v1.distributed.storage_manager")
    keep = Keep()
    sm_logger.addHandler(keep)
    try:
        h = chunk_hashes(P, CHUNK)[:1]
        res = store.reserve(ChunkWrite("log", h, 0, [tuple(g.group_id for g in layout.groups)],
                                       [CHUNK]))
        for kv, trailer, key in res.objects.values():
            kv.zero_()
            integrity.seal(kv, trailer, key)
        store.commit(res)
        seen = {}
        for level in ("INFO", "WARNING"):
            set_log_level(level)
            records.clear()
            assert store.resident(h) == {g.group_id: {0} for g in layout.groups}
            seen[level] = [r for r in records if r.startswith("Prefetch request completed")]
        # `resident` asks LMCache once for every group's row: one line
        assert len(seen["INFO"]) == 1 and seen["WARNING"] == []
    finally:
        sm_logger.removeHandler(keep)
        for l, level, handlers in saved:
            l.setLevel(level)
            for hd, hl in handlers:
                hd.setLevel(hl)
        if env is None:
            os.environ.pop("LMCACHE_LOG_LEVEL", None)
        else:
            os.environ["LMCACHE_LOG_LEVEL"] = env
        store.close()
