"""Run prompts through a real vLLM engine, with or without the connector.

Used by the end-to-end tests, the demo and the GPU benchmarks. Run as a script so
vLLM's engine processes start from a clean `__main__`:

    python -m gemma4_kv.tools.harness SPEC.json OUT.json

SPEC: {"model": dir, "connector": bool,
       "connector_class"/"connector_module": another connector (tests),
       "extra_config": {...}, "engine": {extra vllm.LLM kwargs}, "max_tokens": 8,
       "speculative_config": {...} | null, "loras": {name: adapter dir},
       "preload": [modules whose install() runs before the engine starts, e.g. stand-ins
                   for compiled vLLM ops missing on the GPU machine],
       "metrics": [vLLM counter names]     recorded after each prompt (log stats on)
       "prompt_ids": bool                  record each prompt's token ids as vLLM ran
                                           them (images expanded): OUT "prompt_ids"
       "prompts": [PROMPT, ...]            sent one at a time: later ones hit earlier ones
       "steps": [STEP, ...]}               or a script of steps (instead of "prompts"):
STEP:  {"prompts": [PROMPT, ...], "batch": bool (all in flight at once),
        "max_tokens": n} | {"call": "module:function", "kwargs": {...}} (run on every
        worker through collective_rpc: a caller's probes, counters or faults; with
        vLLM's engine in processes of its own the caller sets
        VLLM_ALLOW_INSECURE_SERIALIZATION=1, as vLLM sends the function pickled) |
        {"reset": true}
        (llm.reset_prefix_cache(reset_connector=True)) | {"metrics": true} (vLLM's
        Prometheus counters so far, [[name, labels, value]]: needs "disable_log_stats":
        false in "engine")
PROMPT: [token ids] | {"tokens": [...], "lora": name, "salt": str,
        "embeds": {"seed": s, "rows": [lo, hi]}, (rows lo..hi-1 given as random
        embeddings of that seed instead of token ids)
        "images": [{"seed": s, "size": [w, h]}]} (`noise_image`s as the prompt's
        multi_modal_data, one per image placeholder token in "tokens": a multimodal
        model, with its processor and tokenizer, and "skip_tokenizer_init": false)
OUT:  {"outputs": [[token ids]], "cached": [num_cached_tokens], "ttft": [s],
       "metrics": [{"name{label=value,...}": cumulative value}] (with "metrics"),
       "steps": [{"outputs", "cached", "ttft", "metrics"} | {"result"}], ...} (outputs,
       cached, ttft and metrics of every prompt of every step, in order)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def tiny_gemma4_config(*, layers: int = 12, kv_shared: int = 0, window: int = 100,
                       head_dim: int = 32, global_head_dim: int = 64, hidden: int = 128,
                       kv_heads: int = 1, vocab: int = 512, **overrides):
    """A small random-weight Gemma 4 text config: 5 sliding : 1 full layers."""
    import transformers

    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                   for i in range(layers)]
    layer_types[-1] = "full_attention"
    cfg = transformers.Gemma4TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
        head_dim=head_dim, global_head_dim=global_head_dim, max_position_embeddings=8192,
        sliding_window=window, layer_types=layer_types, num_kv_shared_layers=kv_shared,
        vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=16,
        hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0,
        **overrides)
    cfg.architectures = ["Gemma4ForCausalLM"]
    return cfg


def save_config(cfg, path: str | Path) -> str:
    Path(path).mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    return str(path)


def connector_config(extra: dict, *, role: str = "kv_both",
                     connector: str = "Gemma4KVConnector", module: str | None = None) -> dict:
    """vLLM's `kv_transfer_config` that loads this connector: by the name its vLLM plugin
    registers, or from `module` (`kv_connector_module_path`)."""
    config = {"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra}
    if module is not None:
        config["kv_connector_module_path"] = module
    return config


def shim_kwargs() -> dict:
    """Engine arguments of the vLLM-without-compiled-ops recipe (shared/gpu-vllm) when it
    is in use on a GPU machine; nothing elsewhere."""
    try:
        import vllm_c_shim
    except ImportError:
        return {}
    return vllm_c_shim.engine_kwargs()


def run(spec: dict) -> dict:
    import importlib

    from vllm import LLM

    for name in spec.get("preload", []):
        importlib.import_module(name).install()  # the forked engine core inherits it

    kwargs = dict(model=spec["model"], load_format="dummy", skip_tokenizer_init=True,
                  seed=0, enable_prefix_caching=False, worker_extension_cls=WORKER_EXTENSION)
    kwargs.update(shim_kwargs())
    kwargs.update(spec.get("engine", {}))
    if spec.get("speculative_config"):
        kwargs["speculative_config"] = spec["speculative_config"]
        kwargs["disable_log_stats"] = False  # for the draft acceptance counters
    if spec.get("metrics"):
        kwargs["disable_log_stats"] = False
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = connector_config(
            spec.get("extra_config", {}), role=spec.get("kv_role", "kv_both"),
            connector=spec.get("connector_class", "Gemma4KVConnector"),
            module=spec.get("connector_module"))
    if spec.get("loras"):
        kwargs.setdefault("enable_lora", True)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    if kwargs["load_format"] == "dummy":
        llm.collective_rpc("sharpen_dummy_weights")
    out: dict[str, Any] = {"outputs": [], "cached": [], "ttft": [], "startup_s": startup,
                           "steps": []}
    steps = spec.get("steps") or [{"prompts": spec["prompts"]}]
    for step in steps:
        if "call" in step:
            module, name = step["call"].split(":")
            fn = getattr(importlib.import_module(module), name)
            result = llm.collective_rpc(fn, kwargs=step.get("kwargs", {}))
            out["steps"].append({"result": result})
        elif step.get("reset"):
            out["steps"].append({"result": llm.reset_prefix_cache(reset_connector=True)})
        elif step.get("metrics"):
            out["steps"].append({"result": _all_counters(llm)})
        else:
            out["steps"].append(_generate(llm, spec, step, out))
    return out


def _generate(llm, spec: dict, step: dict, out: dict) -> dict:
    """One step's prompts, one at a time (later ones may hit earlier ones) or in one
    batch (all in flight together)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=step.get("max_tokens", spec.get("max_tokens", 8)),
                        temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [_prompt(p, spec, llm) for p in step["prompts"]]
    res: dict[str, list] = {"outputs": [], "cached": [], "ttft": []}
    groups = [prompts] if step.get("batch") else [[p] for p in prompts]
    for group in groups:
        t = time.perf_counter()
        loras = [lora for _, lora in group]
        results = llm.generate([p for p, _ in group], sp, use_tqdm=False,
                               lora_request=loras if any(loras) else None)
        wall = time.perf_counter() - t
        for r in results:
            res["outputs"].append(list(r.outputs[0].token_ids))
            res["cached"].append(r.num_cached_tokens)
            if spec.get("prompt_ids"):
                res.setdefault("prompt_ids", []).append(list(r.prompt_token_ids))
            first = getattr(r.metrics, "first_token_latency", None) if r.metrics else None
            res["ttft"].append(first or wall)  # = TTFT when max_tokens is 1
        if spec.get("speculative_config"):
            out.setdefault("spec_decode", []).append(_spec_counters(llm))
        if spec.get("metrics"):
            res.setdefault("metrics", []).append(_counters(llm, spec["metrics"]))
    for k in res:
        out.setdefault(k, []).extend(res[k])
    return res


def _prompt(p, spec: dict, llm):
    """(vLLM prompt, LoRA request) of a PROMPT."""
    if isinstance(p, list):
        return {"prompt_token_ids": p}, None
    prompt = {"prompt_token_ids": p["tokens"]}
    if p.get("salt"):
        prompt["cache_salt"] = p["salt"]
    if p.get("images"):
        prompt["multi_modal_data"] = {"image": [noise_image(**i) for i in p["images"]]}
    if p.get("embeds"):
        import torch

        lo, hi = p["embeds"]["rows"]
        hidden = llm.llm_engine.model_config.get_hidden_size()
        embeds = torch.zeros(len(p["tokens"]), hidden)
        gen = torch.Generator().manual_seed(p["embeds"]["seed"])
        embeds[lo:hi] = torch.randn(hi - lo, hidden, generator=gen)
        prompt["prompt_embeds"] = embeds
        prompt["prompt_is_token_ids"] = [not lo <= i < hi for i in range(len(p["tokens"]))]
    lora = None
    if p.get("lora"):
        from vllm.lora.request import LoRARequest

        names = sorted(spec["loras"])
        lora = LoRARequest(p["lora"], names.index(p["lora"]) + 1, spec["loras"][p["lora"]])
    return prompt, lora


def noise_image(seed: int, size: list[int]):
    """A deterministic RGB image of uniform noise, `size` = [width, height]: two seeds
    give two images of one size (equal placeholder token ids, different content)."""
    import numpy as np
    from PIL import Image

    w, h = size
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


WORKER_EXTENSION = "gemma4_kv.tools.harness.HarnessWorker"  # by name: "__main__" under -m


class HarnessWorker:
    """vLLM worker extension of harness engines: what the harness runs on every worker,
    called by name, so no function has to be pickled across vLLM's processes."""

    def sharpen_dummy_weights(self) -> int:
        return sharpen_dummy_weights(self)


def sharpen_dummy_weights(worker) -> int:
    """collective_rpc target. vLLM's dummy weights are U(-1e-3, 1e-3) for everything,
    Gemma 4's per-layer `layer_scalar` and its RMSNorm weights included, so each layer
    scales the residual by ~1e-3 and greedy tokens depend on little but the last few
    prompt tokens: a wrong hit would go unseen. Norms and scalars set to 1 make every
    position count."""
    n = 0
    model = worker.model_runner.model
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("layer_scalar") or name.endswith("norm.weight"):
            t.data.fill_(1.0)
            n += 1
    return n


def _all_counters(llm) -> list:
    """Every counter of the engine as the front-end sees it (`LLM.get_metrics`)."""
    from vllm.v1.metrics.reader import Counter

    return [[m.name, m.labels, m.value] for m in llm.get_metrics() if isinstance(m, Counter)]


def _counters(llm, names) -> dict:
    """Cumulative values of vLLM's counters `names`, one entry per set of labels (the
    engine's and model's own left out): e.g. vllm:prompt_tokens_cached_by_source{source=disk}."""
    out = {}
    for m in llm.get_metrics():
        if m.name in names and hasattr(m, "value"):
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items())
                              if k not in ("engine", "model_name"))
            out[f"{m.name}{{{labels}}}" if labels else m.name] = m.value
    return out


def _spec_counters(llm) -> dict:
    """Cumulative draft / accepted token counters of the engine."""
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}


def main(argv=None) -> None:
    """Run the spec at argv[0], write its result to argv[1], exit (see `_exit_now`)."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("PYTHONHASHSEED", "0")
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result))
    _exit_now(0)


def _exit_now(rc: int) -> None:
    """Shut the engine down as a normal exit does (vLLM's exit handlers stop the engine
    and with it the connector, whose writes reach their tiers; threads that end by
    themselves are joined), then leave without tearing the interpreter down: that
    teardown (torch's and vLLM's modules) took seconds per engine and changes nothing."""
    import atexit
    import threading

    atexit._run_exitfuncs()
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main()
