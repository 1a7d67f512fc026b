"""Run prompts through a real vLLM engine, with or without the connector.

Used by the end-to-end tests, the demo and the GPU benchmarks. Run as a script so
vLLM's engine processes start from a clean `__main__`:

    python -m gemma4_kv.harness SPEC.json OUT.json

SPEC: {"model": dir, "prompts": [[token ids], ...], "connector": bool,
       "connector_class"/"connector_module": another connector (tests),
       "extra_config": {...}, "engine": {extra vllm.LLM kwargs}, "max_tokens": 8,
       "speculative_config": {...} | null,
       "preload": [modules whose install() runs before the engine starts, e.g. stand-ins
                   for compiled vLLM ops missing on the GPU machine]}
OUT:  {"outputs": [[token ids]], "cached": [num_cached_tokens], "ttft": [s], ...}
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


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


def save_config(cfg, path: str | Path) -> str:
    Path(path).mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    return str(path)


def connector_config(extra: dict, *, role: str = "kv_both",
                     connector: str = "Gemma4KVConnector",
                     module: str = "gemma4_kv.connector") -> dict:
    """vLLM's `kv_transfer_config` that loads this connector."""
    return {"kv_connector": connector, "kv_connector_module_path": module, "kv_role": role,
            "kv_connector_extra_config": extra}


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

    from vllm import LLM, SamplingParams

    for name in spec.get("preload", []):
        importlib.import_module(name).install()  # the forked engine core inherits it

    kwargs = dict(model=spec["model"], load_format="dummy", skip_tokenizer_init=True,
                  seed=0, enable_prefix_caching=False)
    kwargs.update(shim_kwargs())
    kwargs.update(spec.get("engine", {}))
    if spec.get("speculative_config"):
        kwargs["speculative_config"] = spec["speculative_config"]
        kwargs["disable_log_stats"] = False  # for the draft acceptance counters
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = connector_config(
            spec.get("extra_config", {}), role=spec.get("kv_role", "kv_both"),
            connector=spec.get("connector_class", "Gemma4KVConnector"),
            module=spec.get("connector_module", "gemma4_kv.connector"))
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0,
                        ignore_eos=True, detokenize=False)
    out = {"outputs": [], "cached": [], "ttft": [], "startup_s": startup}
    for tokens in spec["prompts"]:  # one at a time: later prompts hit earlier ones
        t = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
        out["ttft"].append(time.perf_counter() - t)  # = TTFT when max_tokens is 1
        out["outputs"].append(list(res.outputs[0].token_ids))
        out["cached"].append(res.num_cached_tokens)
        if spec.get("speculative_config"):
            out.setdefault("spec_decode", []).append(_spec_counters(llm))
    return out


def _spec_counters(llm) -> dict:
    """Cumulative draft / accepted token counters of the engine."""
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("PYTHONHASHSEED", "0")
    result = run(spec)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
