"""Keys of stored chunks: a rolling prefix hash per chunk plus a layout fingerprint.

The chunk hash covers every token up to the end of the chunk (and, in
`request_keys`, everything else of the request the KV depends on), so a key names one
exact prefix. The fingerprint covers everything a stored object's bytes depend on
besides the request: model and weights, dtype, quantization, KV cache dtype and scales,
config overrides, attention backend and page format, group geometry, chunk size, the
object format and its version, tensor-parallel rank and size. It goes into LMCache's
`ObjectKey.model_name`, so KV of another model, weights, dtype, layout or format
version is a different key: it can only miss, never be loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .. import FORMAT_VERSION
from ..layout.groups import KVLayout
from .weights import weights_signature

OBJECT_FORMAT = "KV_2LTD"


def fingerprint(layout: KVLayout, *, model: str, chunk_size: int, tp_rank: int = 0,
                tp_size: int = 1, engine: str = "", layers: str = "") -> str:
    """Name of everything a stored object depends on besides its request: `engine` is
    `EngineIdentity.digest`, `layers` the digest of `layer_identity` (both "" before)."""
    desc = repr((FORMAT_VERSION, OBJECT_FORMAT, model, chunk_size, tp_rank, tp_size,
                 layout.geometry()) + ((engine, layers) if engine or layers else ()))
    digest = hashlib.sha256(desc.encode()).hexdigest()[:24]
    return f"gemma4kv-v{FORMAT_VERSION}-tp{tp_rank}of{tp_size}-{digest}"


# -- what the engine's KV depends on besides the request ---------------------------------

@dataclass(frozen=True)
class EngineIdentity:
    """Everything of the engine's configuration the KV bytes depend on."""
    fields: dict
    digest: str
    unsafe: str | None
    """Why KV of this engine cannot be keyed safely (store and load nothing), or None."""


def _jsonable(value):
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def _without_paths(value):
    """An HF config dict without `_name_or_path` at any depth: where the checkpoint
    lies is not what it computes (`model_id` names it)."""
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k != "_name_or_path"}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    return value


def _config(obj, leave_out: tuple[str, ...] = ()):
    """A vLLM config dataclass as JSON-able fields (None stays None)."""
    if obj is None:
        return None
    return _jsonable({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
                      if f.name not in leave_out})


# Multimodal settings that change what the tower computes (hence the text KV after an
# image): processor arguments, media decoding, normalization, the encoder's attention.
_MM_FIELDS = ("mm_processor_kwargs", "media_io_kwargs", "mm_device_do_normalize",
              "mm_encoder_tp_mode", "mm_encoder_attn_backend", "mm_encoder_attn_dtype",
              "video_pruning_rate", "video_pruning_method")
# LoRA settings that change no numerics: how many adapters fit at once.
_LORA_CAPACITY = ("max_loras", "max_cpu_loras")


def engine_identity(vllm_config, *, weights_id: str | None = None,
                    model_id: str | None = None, generation: str = "") -> EngineIdentity:
    """The engine's part of the fingerprint. `weights_id` (an operator-given checkpoint
    identity) replaces the weight files' content digest, `model_id` the model's path;
    `generation` names in-place weight updates (the scheduler's
    `RequestKeyer.generation` carries it too)."""
    import vllm
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    mc, cc, lc = vllm_config.model_config, vllm_config.cache_config, vllm_config.load_config
    pc = vllm_config.parallel_config
    hf_config = json.dumps(_without_paths(mc.hf_config.to_dict()), sort_keys=True,
                           default=repr)
    overrides = mc.hf_overrides
    attn = getattr(vllm_config, "attention_config", None)
    fields = {
        "vllm": vllm.__version__,
        "model": model_id or mc.model,
        "revision": mc.revision,
        "code_revision": mc.code_revision,
        "weights": weights_id or weights_signature(mc, lc),
        "load_format": str(lc.load_format),
        "hf_config": hashlib.sha256(hf_config.encode()).hexdigest(),
        "hf_overrides": (f"callable:{getattr(overrides, '__qualname__', repr(overrides))}"
                         if callable(overrides) else _jsonable(overrides)),
        "runner": [str(getattr(mc, "runner", "")), str(getattr(mc, "convert", ""))],
        "model_impl": str(getattr(mc, "model_impl", "")),
        "model_class_overrides": _jsonable(getattr(mc, "model_class_overrides", {})),
        "dtype": str(mc.dtype),
        "quantization": mc.quantization,
        "quantization_config": _jsonable(getattr(mc, "quantization_config", None)),
        "kv_cache_dtype": cc.cache_dtype,
        "kv_cache_dtype_skip_layers": list(getattr(cc, "kv_cache_dtype_skip_layers", [])),
        "calculate_kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
        "disable_sliding_window": bool(mc.disable_sliding_window),
        "attention": _config(attn),
        "multimodal": {k: _jsonable(getattr(mc.multimodal_config, k, None))
                       for k in _MM_FIELDS} if mc.multimodal_config else None,
        "lora": _config(vllm_config.lora_config, _LORA_CAPACITY),
        "dcp": getattr(pc, "decode_context_parallel_size", 1),
        "generation": generation,
    }
    mode = get_kv_quant_mode(cc.cache_dtype)
    unsafe = None
    if mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        unsafe = (f"kv_cache_dtype {cc.cache_dtype!r} ({mode.name}) keeps quantisation "
                  "state the connector does not move or key")
    elif mode != KVQuantMode.NONE and fields["calculate_kv_scales"]:
        unsafe = ("calculate_kv_scales with an fp8 KV cache: the scales are computed from "
                  "the first batch at run time, so equal tokens give other bytes")
    elif fields["weights"].startswith("unresolved:"):
        unsafe = f"cannot identify the weights of {mc.model!r} (not local)"
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return EngineIdentity(fields, digest[:32], unsafe)


def layer_identity(vllm_config, layer_names: Iterable[str]) -> tuple[str, str | None]:
    """(digest, unsafe reason) of what each owning attention layer adds to its KV bytes:
    its backend, KV cache dtype and the k/v scales the cache is written with
    (`compilation_config.static_forward_context[name]._k_scale` / `_v_scale`, loaded with
    the weights). Call on the worker after the weights are loaded (register_kv_caches)."""
    import torch

    ctx = vllm_config.compilation_config.static_forward_context
    h = hashlib.sha256(b"gemma4-kv:layers:1\n")
    unsafe = None
    for name in sorted(layer_names):
        layer = ctx.get(name)
        if layer is None:
            unsafe = unsafe or f"layer {name!r} is not in vLLM's forward context"
            continue
        impl = getattr(layer, "impl", None)
        backend = getattr(layer, "attn_backend", None)
        desc = [name, type(impl).__name__,
                backend.get_name() if hasattr(backend, "get_name") else repr(backend),
                str(getattr(layer, "kv_cache_dtype", None))]
        h.update(json.dumps(desc).encode())
        for attr in ("_k_scale", "_v_scale"):
            scale = getattr(layer, attr, None)
            if not isinstance(scale, torch.Tensor):
                h.update(b"-")
                continue
            data = scale.detach().flatten().float().cpu().contiguous()
            h.update(struct.pack("<Q", data.numel()) + data.numpy().tobytes())
    return h.hexdigest()[:32], unsafe
