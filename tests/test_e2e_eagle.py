"""End to end in real vLLM (CPU build) with an EAGLE3 draft that owns KV.

The tiny random-weight Gemma 4 target with a one-layer EAGLE3 llama draft
(`eagle_draft.py`): vLLM merges the draft's attention layer into the target's
full-attention group, so every object of that group carries draft KV. The same
prompts run with and without the connector. A probe (`kv_probe.py`) copies every
object as it is stored and every hit as it is loaded; at the end every sequence runs
once more as one fresh prefill under its own cache salt (a recomputation in the same
engine), and every capture must equal the recomputation of the same content, draft
layer included, and no stored position may be written again while its request runs.

Where vLLM 0.32's V1 model runner (the CPU build's) writes draft KV that a one-step
prefill would not have, the chunk must not be stored: the last position of a prefill
step that is not the prompt's last (the padded drafter reads the request's last token
there, not the next one), and every position of a step whose batch ends too close to
max_model_len for the drafter to run.
"""

from __future__ import annotations

import random

import pytest
import torch

from needs import require

from e2e_common import CHUNK, RETENTION, prompts, run_harness, stats_events
from eagle_draft import tiny_eagle3_config
from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
from model_keys import chunk_hashes
from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
from gemma4_kv.layout.plan import hit_ends, retained_chunks
from model_keys import max_servable_hit

require("vllm")
pytestmark = pytest.mark.vllm

SPEC_TOKENS = 2
MAX_LEN = 2048
SPLIT = 1000
"""long_prefill_token_threshold: a prefill sharing its steps with another request is
split every 1000 tokens (inside a chunk); one alone gets the whole budget."""
COMMON = {"enforce_eager": True, "max_model_len": MAX_LEN,
          "max_num_batched_tokens": MAX_LEN, "long_prefill_token_threshold": SPLIT}
PLATFORMS = {
    # The CPU build: float32, synchronous scheduling.
    "cpu": {"engine": {"dtype": "float32", "block_size": 32}, "dtype": torch.float32,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "preload": [], "rtol": 1e-3},
    # The H200 (.gpu-vllm/env.sh and benchmarks/gpu_env.sh sourced, -k cuda): bf16,
    # Triton attention, asynchronous scheduling (the scheduler's computed tokens run
    # ahead of what was accepted), batch-invariant numerics as in test_e2e_gpu.py.
    "cuda": {"engine": {"dtype": "bfloat16", "block_size": 16,
                        "gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 4 << 30},
             "dtype": torch.bfloat16, "env": {"VLLM_BATCH_INVARIANT": "1"},
             "preload": ["vllm_standins"], "rtol": 3e-2},
}
MAX_TOKENS = 6
DECODE_TOKENS = 40
"""rtol: captures of the same content computed in different steps differ by rounding
(float32: ~1e-5 of a layer's largest value, bf16 up to its ~8e-3 epsilon); KV computed
from another token or left stale differs by ~10% or more."""


def _steps():
    """The shared prompts one at a time; one that shares two chunks with the first but
    not the token after them (no hit: the draft KV of token 511 was computed from
    another token 512); one whose first chunk completes while decoding; two long
    prompts in one batch (each prefill split in steps); one so long that the drafter
    does not run in its prefill step (max_seq_len + SPEC_TOKENS > max_model_len)."""
    rng = random.Random(1)
    base = prompts()[0]
    other = [t + 1 if t < 499 else 3 for t in base[512:600]]  # differs at every token
    fresh = [rng.randrange(3, 500) for _ in range(250)]
    long_a = [rng.randrange(3, 500) for _ in range(1300)]
    long_b = [rng.randrange(3, 500) for _ in range(1300)]
    too_long = [rng.randrange(3, 500) for _ in range(MAX_LEN - 1)]
    return [{"prompts": prompts() + [base[:512] + other]},
            {"prompts": [fresh], "max_tokens": DECODE_TOKENS},
            {"prompts": [long_a, long_b], "batch": True},
            {"prompts": [too_long], "max_tokens": 1}]


def _run(tmp_path, name, model, draft, steps, *, connector, platform):
    stats = tmp_path / f"{name}.stats.jsonl"
    spec = {"model": model, "connector": connector, "max_tokens": MAX_TOKENS,
            "engine": {**COMMON, **platform["engine"]}, "preload": platform["preload"],
            "steps": [{"call": "kv_probe:sharpen_draft"}, *steps],
            "extra_config": {"cpu_gb": 0.5, "stats_file": str(stats),
                             "retention_interval": RETENTION, "intermediate_ends": "always",
                             "save_decode_tokens": True},
            "speculative_config": {"method": "eagle3", "model": draft,
                                   "num_speculative_tokens": SPEC_TOKENS}}
    out, _ = run_harness(tmp_path, name, spec, env=platform["env"])
    events = stats_events(stats)
    assert out["steps"][0]["result"][0] > 0  # draft norms sharpened
    return out, events


def _layout(event, dtype) -> KVLayout:
    """The worker's groups (its layout event) as descriptors for the planner, with the
    tiny model's geometry: 1 KV head of 32 (sliding) or 64 (full) channels."""
    return KVLayout(tuple(
        KVGroup(group_id=i, kind=AttentionKind(g["kind"]), window=g["window"],
                block_size=g["block_size"], num_kv_heads=1,
                head_size=32 if g["kind"] == "sliding" else 64,
                head_size_v=32 if g["kind"] == "sliding" else 64, dtype=dtype,
                layers=tuple(g["layers"]))
        for i, g in enumerate(event["groups"])))


def _impure(schedule, prompt_lens) -> list[set[int]]:
    """Per request, the chunks holding the last position of a prefill step that was not
    its last (from the probe's per-step log of computed tokens)."""
    starts = [[] for _ in prompt_lens]
    for step in schedule:
        for req, computed in step.items():
            i = int(req.split("-")[0])
            if not starts[i] or starts[i][-1] != computed:
                starts[i].append(computed)
    return [{(e - 1) // CHUNK for e in s[1:] if e < p} for s, p in zip(starts, prompt_lens)]


def _expected(layout, requests):
    """Hits and the prompt-chunk objects each request stores, with the draft lookahead:
    chunk c's key also names token (c + 1) * CHUNK, so a lookup uses the chunks whose
    next token is a prompt token, and a chunk ending at the prompt's end is stored
    once the first generated token is known (a step after the prefill). `requests`:
    (tokens, salt, generated tokens, chunks not to store)."""
    stored, hits, objects = set(), [], []
    m = layout.chunk_multiple
    for tokens, salt, out, impure in requests:
        seq = tokens + out
        keys = [(salt, h, seq[(c + 1) * CHUNK])
                for c, h in enumerate(chunk_hashes(seq, CHUNK)) if (c + 1) * CHUNK < len(seq)]
        p = len(tokens)
        full = (p - 1) // CHUNK
        limit = min(full * CHUNK, (p - 1) // m * m)
        hits.append(max_servable_hit(layout, CHUNK, full,
                                     lambda g, c: (keys[c], g) in stored, limit=limit))
        n = p // CHUNK
        # A chunk ending at the prompt's end is stored a step after the prefill; by
        # then vLLM has freed the sliding blocks wholly before token p - window + 1.
        late = n - 1 if n * CHUNK == p else None
        if late is not None and len(out) < 2:
            n, late = n - 1, None  # no step after the prefill: never stored
        ends = hit_ends(p // CHUNK, CHUNK, (p - 1) // m * m, RETENTION)

        def kept(g, c):
            return c != late or g.window is None or p - CHUNK + g.block_size > p - g.window + 1

        new = {(keys[c], c, g.group_id) for g in layout.groups
               for c in retained_chunks(g, CHUNK, ends)
               if c < n and c not in impure and kept(g, c)}
        new = {(c, g) for k, c, g in new if (k, g) not in stored}
        objects.append(new)
        stored |= {(keys[c], g) for c, g in new}
    return hits, objects


def _runs(tmp_path, platform):
    """Both engines, one after the other (the connector engine's recomputation prompts
    come from the first one's outputs)."""
    cfg = tiny_gemma4_config(window=100)
    model = save_config(cfg, tmp_path / "model")
    draft = save_config(tiny_eagle3_config(cfg), tmp_path / "draft")
    steps = _steps()
    base, _ = _run(tmp_path, "base", model, draft, steps, connector=False, platform=platform)
    sent = [p for s in steps for p in s["prompts"]]
    # Recomputation: every sequence once more as one prefill under its own salt (no
    # hits, the drafter runs: at most MAX_LEN - 1 - SPEC_TOKENS tokens).
    seqs = {tuple((p + o)[:MAX_LEN - 1 - SPEC_TOKENS]): None
            for p, o in zip(sent, base["outputs"])}
    refs = [{"tokens": list(seq), "salt": f"ref{i}"} for i, seq in enumerate(seqs)]
    out, events = _run(tmp_path, "conn", model, draft,
                       [{"call": "kv_probe:install"}, *steps,
                        {"prompts": refs, "max_tokens": 1},
                        {"call": "kv_probe:report", "kwargs": {"rtol": platform["rtol"]}}],
                       connector=True, platform=platform)
    return cfg, steps, sent, refs, base, out, events


CPU_TEST = "test_eagle3_draft_kv_is_stored_loaded_and_final[cpu]"
SERVER_TEST = "test_eagle3_draft_on_an_lmcache_server_prompts_ending_on_a_chunk"


def _server_run(tmp_path):
    """One engine with the EAGLE3 draft on a real `lmcache server`: each prompt alone,
    then again, then every one once more under its own cache salt (a recomputation in
    the same engine: no hit)."""
    from lmcache_servers import Server

    cfg = tiny_gemma4_config(window=512)  # a window that reaches back past a chunk
    model = save_config(cfg, tmp_path / "model")
    draft = save_config(tiny_eagle3_config(cfg), tmp_path / "draft")
    base = prompts()[0]
    sent = [base[:768], base[:768], base, base]
    server = Server(l1_gb=0.25, log_dir=str(tmp_path))
    try:
        spec = {"model": model, "connector": True, "max_tokens": MAX_TOKENS,
                "engine": {**COMMON, **PLATFORMS["cpu"]["engine"]},
                # each prompt's saves land before the next is looked up (a busy
                # machine looked up first: [0, 0, 512, 512])
                "steps": [s for p in sent for s in ({"prompts": [p]},
                                                    {"call": "faults:settle_saves"})] +
                         [{"prompts": [{"tokens": p, "salt": f"ref{i}"} for i, p in
                                       enumerate(sent)]}],
                "extra_config": {"lmcache_server": server.url,
                                 "retention_interval": RETENTION,
                                 "intermediate_ends": "always",
                                 # hits by hand, on a busy machine too (tests/patient.py)
                                 "lookup_timeout_s": 30.0,
                                 "lmcache_server_timeout_s": 10.0},
                "preload": ["patient"],
                "speculative_config": {"method": "eagle3", "model": draft,
                                       "num_speculative_tokens": SPEC_TOKENS}}
        out, _ = run_harness(tmp_path, "server", spec, env=PLATFORMS["cpu"]["env"])
    finally:
        server.stop()
    return sent, out


def engine_jobs(tmp_path_factory, selected):
    """The CPU cases' engines beside other modules' (tests/conftest.py `engine_pool`):
    nothing here depends on time."""
    jobs = []
    if CPU_TEST in selected:
        jobs.append(("cpu", 160.0,
                     lambda: _runs(tmp_path_factory.mktemp("eagle-cpu"), PLATFORMS["cpu"])))
    if SERVER_TEST in selected:
        jobs.append(("server", 70.0,
                     lambda: _server_run(tmp_path_factory.mktemp("eagle-server"))))
    return jobs


def test_eagle3_draft_on_an_lmcache_server_prompts_ending_on_a_chunk(engine_pool):
    """A prompt of 768 tokens (3 chunks) with a draft that owns KV: chunk c's key names
    token (c + 1) * 256, so at its save only chunks 0-1 have keys while its retention
    names ends at 512, 704 and 768. With a 512-token window, chunks 0-1 belong to the
    windows of 704 and 768, whose window chain is named by chunk 2's key: the server
    store raised IndexError in the save and the engine died (issue 32, item 2; on
    9aa1d62 this engine exits in its first save). Now the engine lives, keeps chunks
    0-1 for the end 512, and every answer equals its recomputation. Hits by hand
    (window 512, retention 512, hit multiple 64): base[:768] again -> 512 (the limit
    is its 2 keyable chunks; full chunks 0-1 and the window before 512, chunks 0-1);
    base (1100 tokens, 4 keyable chunks, sharing chunks 0-1) -> 512 at first, 1024
    again (its end 1024: full chunks 0-3, the window [513, 1024) in chunks 2-3); the
    salted recomputations -> 0. The hits are the negative control's lever: a
    connector that loaded nothing would pass the token check alone."""
    sent, out = engine_pool.result((__name__, "server"))
    n = len(sent)
    assert out["cached"] == [0, 512, 512, 1024] + [0] * n
    assert out["outputs"][:n] == out["outputs"][n:], "greedy tokens differ from recomputation"
    assert [s["result"] for s in out["steps"][1:2 * n:2]] == [[True]] * n  # saves landed


@pytest.mark.parametrize("name", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_eagle3_draft_kv_is_stored_loaded_and_final(engine_pool, tmp_path, name):
    platform = PLATFORMS[name]
    if name == "cpu":
        cfg, steps, sent, refs, base, out, events = engine_pool.result((__name__, "cpu"))
    else:
        cfg, steps, sent, refs, base, out, events = _runs(tmp_path, platform)
    n = len(sent)
    assert out["steps"][1]["result"] == [True]
    report = out["steps"][-1]["result"][0]
    assert out["outputs"][:n] == base["outputs"], "greedy tokens differ from recomputation"
    counter = "vllm:spec_decode_num_accepted_tokens"
    assert [s[counter] for s in out["spec_decode"][:len(base["spec_decode"])]] == \
        [s[counter] for s in base["spec_decode"]], "draft acceptance differs"

    # The draft's layer owns KV inside the target's full-attention group.
    (layout_event,) = [e for e in events if e["event"] == "layout"]
    layout = _layout(layout_event, platform["dtype"])
    target = {f"model.layers.{i}.self_attn.attn" for i in range(cfg.num_hidden_layers)}
    draft_layer = f"model.layers.{cfg.num_hidden_layers}.self_attn.attn"
    (full,) = [g for g in layout.groups if draft_layer in g.layers]
    assert full.kind is AttentionKind.FULL and len(full.layers) > 1
    assert set(full.layers) - {draft_layer} <= target
    assert {name for g in layout.groups for name in g.layers} == target | {draft_layer}

    # What was stored and loaded is final and what a recomputation computes.
    assert report["problems"] == []
    assert report["rewrites"] == [], "stored KV was written again later"
    assert report["mismatches"] == [], "stored or loaded KV differs from recomputation"
    assert report["captures"]["load"] > 0 and report["pairs"] >= report["captures"]["load"]

    # Chunks holding the last position of a prefill step that is not the prompt's last,
    # by hand: every prompt is prefilled in one step but the two batched ones, split
    # every SPLIT = 1000 tokens (steps start at 0 and 1000 of 1300): position 999, in
    # chunk 3. vLLM's schedule, as the probe logged it, agrees.
    decode, batched, too_long = len(steps[0]["prompts"]), n - 3, n - 1
    impure = [set() for _ in range(n + len(refs))]
    impure[batched] = impure[batched + 1] = {3}
    assert _impure(report["schedule"], [len(p) for p in sent] +
                   [len(r["tokens"]) for r in refs]) == impure
    # the drafter did not run in its prefill: nothing of it is stored
    impure[too_long] = set(range(len(sent[too_long]) // CHUNK))
    # Hits by hand (window 100, retention 512, hit multiple 64, 32 on the GPU: the same
    # hits; chunk c's key also names token (c + 1) * 256, so only chunks followed by a
    # prompt token are looked up): as in e2e_common.HITS but base[:768] and base[:513]
    # use chunks 0-1 only (512 either way), base[:256] + other[:44]'s chunk 0 is
    # followed by other[0] (0 either way) and base[:512] + other' shares chunk 1 but
    # not token 512 (0); the others are fresh tokens, each reference has its own salt.
    hits = [0, 1024, 512, 512, 512, 0, 0, 1024, 1792, 0, 0, 0, 0, 0] + [0] * len(refs)
    assert out["cached"] == hits
    assert base["cached"] == [0] * n
    # Stored objects: the planner's retention over these hand-derived boundaries.
    requests = [(p, None, o, impure[i]) for i, (p, o) in enumerate(zip(sent, base["outputs"]))]
    requests += [(r["tokens"], r["salt"], o, impure[n + i])
                 for i, (r, o) in enumerate(zip(refs, out["outputs"][n:]))]
    planned_hits, objects = _expected(layout, requests)
    assert planned_hits == hits
    saved = [set() for _ in requests]
    for req, chunk, gid in report["saved"]:
        saved[int(req.split("-")[0])].add((chunk, gid))
    # The decode prompt's chunk 0 is completed by generated tokens; its sliding
    # groups' blocks are out of the window (freed) by then.
    generated = {(0, g.group_id) for g in layout.groups if g.window is None}
    assert saved[decode] == objects[decode] | generated
    assert [s for i, s in enumerate(saved) if i != decode] == \
        [o for i, o in enumerate(objects) if i != decode]

    loads = [e for e in events if e["event"] == "load"]
    assert [e["end"] for e in loads] == [h for h in hits if h]
    assert report["counts"]["loaded"] == len(loads)
    for e in loads:  # the draft layer's blocks come with every hit: all of the prefix's
        blocks = e["end"] // full.block_size
        assert e["groups"][str(full.group_id)] == {
            "blocks": blocks, "bytes": blocks * full.page_bytes * len(full.layers)}

