"""Shared by the end-to-end tests (CPU build and GPU): run the same prompts through
vLLM with and without the connector, and check the connector against the planner."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter

from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
from gemma4_kv.layout.from_hf import hf_layout
from model_keys import chunk_hashes
from gemma4_kv.layout.plan import hit_ends, needed_blocks, retained_chunks
from model_keys import max_servable_hit

CHUNK = 256
RETENTION = 512
"""Sliding-window chunks are stored before prompt ends and every 512 tokens."""



def tiny_assistant_config(target, *, layers: int = 4, hidden: int = 64):
    """A Gemma 4 MTP assistant for `target` (its draft layers share target KV)."""
    import transformers

    sliding, full = target.per_layer_config[0], target.per_layer_config[-1]
    text = transformers.Gemma4TextConfig(
        vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=sliding.num_key_value_heads, head_dim=sliding.head_dim,
        global_head_dim=full.head_dim,
        sliding_window=target.sliding_window,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        hidden_activation="gelu_pytorch_tanh")
    cfg = transformers.Gemma4AssistantConfig(text_config=text,
                                             backbone_hidden_size=target.hidden_size)
    cfg.architectures = ["Gemma4AssistantForCausalLM"]
    return cfg

def prompts():
    rng = random.Random(0)
    base = [rng.randrange(3, 500) for _ in range(1100)]
    other = [rng.randrange(3, 500) for _ in range(700)]
    return [
        base,                        # cold: stores chunks 0-3
        base,                        # same prompt: hit 1024 (P - 1 = 1099)
        base[:768],                  # 3 whole stored chunks, P - 1 = 767: the hit ends
                                     # inside chunk 2, on a block boundary
        base[:600] + other[:300],    # shares 600 tokens, off a chunk boundary: hit 512
        base[:513],                  # P - 1 = 512, on a chunk boundary: hit 512
        base[:200] + other[:400],    # shares less than a chunk: no hit
        base[:256] + other[:44],     # shares exactly one chunk: hit 256
        base + other,                # longer: hit 1024, then stores chunks 4-6
        base + other,                # hit 1792
    ]


def run_engine(tmp_path, name, model, *, connector, engine, extra=None, spec_cfg=None,
               connector_class=None, role="kv_both", env=None, preload=(), steps=None,
               metrics=()):
    """`steps`: a harness script instead of `prompts()`; `metrics`: vLLM counters to
    record after each prompt (the harness's "metrics")."""
    stats = tmp_path / f"{name}.stats.jsonl"
    spec = {"model": model, "prompts": prompts(), "connector": connector, "max_tokens": 6,
            "kv_role": role,
            "engine": {"enforce_eager": True, "max_model_len": 4096, **engine},
            "extra_config": {"cpu_gb": 0.25, "stats_file": str(stats),
                             "retention_interval": RETENTION, **(extra or {})},
            "speculative_config": spec_cfg, "preload": list(preload)}
    if steps is not None:
        spec["steps"] = steps
    if metrics:
        spec["metrics"] = list(metrics)
    if connector_class:
        spec.update(connector_class=connector_class, connector_module="broken_connector")
    out, _ = run_harness(tmp_path, name, spec, env=env)
    return out, stats_events(stats)


def run_harness(tmp_path, name, spec, *, env=None, unset=()):
    """One engine: the harness (`gemma4_kv.tools.harness`) in a process group of its own over
    `spec` (see `harness_command`). Returns (its output, the finished process); its
    stdout and stderr are kept in `<name>.log`."""
    cmd, full_env, out_path = harness_command(tmp_path, name, spec, env=env, unset=unset)
    proc = run_group(cmd, env=full_env, timeout=900)
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    return json.loads(out_path.read_text()), proc


def harness_command(tmp_path, name, spec, *, env=None, unset=()):
    """(command, environment, output path) of a harness run over `spec`: vLLM's CPU KV
    space, a private vLLM cache and tests/ on the path (`env` on top, `unset` removed)."""
    spec_path, out_path = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED="0",
                    VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
                    PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    full_env.update(env or {})
    for k in unset:
        full_env.pop(k, None)
    # -P: the installed package (with its kernels), not the source tree in the cwd
    cmd = [sys.executable, "-P", "-m", "gemma4_kv.tools.harness", str(spec_path), str(out_path)]
    return cmd, full_env, out_path


def stats_events(path):
    """The events of a connector's stats file (none if it was never written)."""
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def saved_blocks(events) -> Counter:
    """Blocks saved per group id over a run's stats events."""
    saved = Counter()
    for e in events:
        if e["event"] == "save":
            for gid, v in e["groups"].items():
                saved[int(gid)] += v["blocks"]
    return saved


def run_group(cmd, *, env, timeout):
    """Run a command in its own process group; on timeout kill the whole group (vLLM's
    engine processes included), never leave them spinning behind the test run."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n"
                             + out[-3000:] + err[-6000:]) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def expected_hits(layout, retention=RETENTION):
    return expected_store(layout, retention)[0]


def expected_store(layout, retention=RETENTION):
    """Replay the prompts against a model of the store: full groups store every chunk,
    sliding groups the windows before each prompt's hit ends (`plan.hit_ends`).
    Returns the hits and the stored (chunk hash, group) objects."""
    stored, hits = set(), []
    m = layout.chunk_multiple
    for p in prompts():
        hashes = chunk_hashes(p, CHUNK)
        limit = (len(p) - 1) // m * m
        hits.append(max_servable_hit(layout, CHUNK, len(hashes),
                                     lambda g, c: (hashes[c], g) in stored, limit=limit))
        ends = hit_ends(len(hashes), CHUNK, limit, retention)
        for g in layout.groups:
            stored.update((hashes[c], g.group_id) for c in retained_chunks(g, CHUNK, ends))
    return hits, stored


def check_against_plan(cfg, events, out, base, *, dtype, block_size, assistant=None,
                       retention=RETENTION):
    layout = hf_layout(cfg, assistant_config=assistant, dtype=dtype, block_size=block_size)
    # The worker built its descriptors from vLLM's real KVCacheConfig and tensors:
    # they must be the groups we predict from the config, KV-shared aliases included.
    (real,) = [e for e in events if e["event"] == "layout"]
    assert [(g["kind"], g["window"], g["block_size"], g["layers"], g["aliases"])
            for g in real["groups"]] == [
        (g.kind.value, g.window, g.block_size, list(g.layers),
         [a for a, _ in g.aliases if not a.startswith("draft_model.") or assistant])
        for g in layout.groups]

    differing = [(i, hits_i, a, b) for i, (hits_i, a, b) in
                 enumerate(zip(out["cached"], out["outputs"], base["outputs"])) if a != b]
    assert not differing, f"greedy tokens differ from recomputation: {differing}"
    hits, stored = expected_store(layout, retention)
    assert out["cached"] == hits
    assert base["cached"] == [0] * len(hits)

    loads = [e for e in events if e["event"] == "load"]
    assert [e["end"] for e in loads] == [h for h in hits if h]
    for e in loads:
        for g in layout.groups:
            blocks = len(needed_blocks(g, 0, e["end"]))
            assert e["groups"][str(g.group_id)] == {
                "blocks": blocks, "bytes": blocks * g.page_bytes * len(g.layers)}
    # Sliding groups load only their window, never the whole prefix.
    for g in layout.groups:
        if g.window:
            most = -(-(g.window - 1) // g.block_size) + 1
            assert all(e["groups"][str(g.group_id)]["blocks"] <= most for e in loads)
    # Every object the model stores is saved exactly once, and nothing else.
    assert saved_blocks(events) == Counter({g.group_id: sum(1 for _, gid in stored if gid == g.group_id)
                             * (CHUNK // g.block_size) for g in layout.groups})


def run_mtp_case(tmp_path, *, engine, check, env=None, preload=()):
    """Target + Gemma 4 MTP assistant, with and without the connector."""
    cfg = tiny_gemma4_config(window=100)
    model = save_config(cfg, tmp_path / "model")
    assistant = save_config(tiny_assistant_config(cfg), tmp_path / "assistant")
    spec_cfg = {"method": "mtp", "model": assistant, "num_speculative_tokens": 1}
    base, _ = run_engine(tmp_path, "base", model, connector=False, engine=engine,
                         spec_cfg=spec_cfg, env=env, preload=preload)
    out, events = run_engine(tmp_path, "conn", model, connector=True, engine=engine,
                             spec_cfg=spec_cfg, env=env, preload=preload)
    check_against_plan(cfg, events, out, base, assistant=tiny_assistant_config(cfg).text_config,
                       **check)
    # Draft acceptance identical after every prompt. The number of drafts is not: on a
    # hit that leaves a one-token tail (base[:513]) vLLM's scheduler runs that token
    # like a decode step, with a placeholder draft (-1) that it counts as one more
    # (rejected) draft; tokens are identical (seen on CPU and GPU).
    counter = "vllm:spec_decode_num_accepted_tokens"
    assert [s[counter] for s in out["spec_decode"]] == [s[counter] for s in base["spec_decode"]]
    drafts = "vllm:spec_decode_num_drafts"
    assert base["spec_decode"][-1][drafts] > 0 and out["spec_decode"][-1][drafts] > 0
    return base, out
