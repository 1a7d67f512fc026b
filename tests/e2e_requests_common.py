"""Shared by tests/test_e2e_requests.py: a harness run of steps (with the engine's log
output), LoRA adapters on disk, and a model of what the connector stores and serves
when chunk keys are given per request."""

from __future__ import annotations

import json
import os

from gemma4_kv.layout.plan import hit_ends, retained_chunks
from model_keys import max_servable_hit
from e2e_common import run_harness, stats_events


def run_steps(tmp_path, name, model, steps, *, connector, engine, extra=None, loras=None,
              env=None, max_tokens=6):
    """One engine (harness subprocess) over a script of steps. Returns (harness output,
    stats-file events, the process's stdout + stderr)."""
    stats = tmp_path / f"{name}.stats.jsonl"
    spec = {"model": model, "steps": steps, "connector": connector, "max_tokens": max_tokens,
            "engine": {"enforce_eager": True, "max_model_len": 4096, **engine},
            "extra_config": {"cpu_gb": 0.25, "stats_file": str(stats), **(extra or {})},
            "loras": loras or {}}
    # the connector's default LMCache log level is under test
    out, proc = run_harness(tmp_path, name, spec, env=env, unset=("LMCACHE_LOG_LEVEL",))
    return out, stats_events(stats), proc.stdout + proc.stderr


def write_adapter(path, seed: int, cfg, rank: int = 8) -> str:
    """A random peft LoRA adapter on the MLP of every layer, large enough (x0.5) that
    it changes greedy tokens of the tiny model."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    dims = {"gate_proj": (cfg.hidden_size, cfg.intermediate_size),
            "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for m, (d_in, d_out) in dims.items():
            pre = f"base_model.model.model.layers.{i}.mlp.{m}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.5
            tensors[f"{pre}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.5
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
                   "bias": "none", "target_modules": list(dims), "task_type": "CAUSAL_LM"}, f)
    return str(path)


def expected_store(layout, requests, chunk_size, retention):
    """Replay requests against a model of the store. `requests`: in order, each
    (chunk keys, prompt length), or a list of them scheduled in one step (all looked up
    before any stores); two requests' chunks are the same object exactly where their
    keys are equal. Full groups store every chunk, sliding groups the windows before
    each prompt's hit ends. Returns the hit of every request and the stored (key,
    group)s."""
    stored, hits = set(), []
    m = layout.chunk_multiple
    for step in requests:
        step = step if isinstance(step, list) else [step]
        new = set()
        for keys, n_tokens in step:
            limit = (n_tokens - 1) // m * m
            hits.append(max_servable_hit(layout, chunk_size, len(keys),
                                         lambda g, c: (keys[c], g) in stored, limit=limit))
            ends = hit_ends(len(keys), chunk_size, limit, retention)
            for g in layout.groups:
                new.update((keys[c], g.group_id) for c in retained_chunks(g, chunk_size, ends))
        stored |= new
    return hits, stored


def counters(snapshot, prefix="vllm:"):
    """{name: value} (labels other than model/engine joined into the name) of a
    harness {"metrics": true} step."""
    out = {}
    for name, labels, value in snapshot:
        extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items())
                         if k not in ("model_name", "engine"))
        if name.startswith(prefix):
            out[f"{name}{{{extra}}}" if extra else name] = value
    return out
