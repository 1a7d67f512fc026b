"""Keys of stored chunks: a rolling prefix hash per chunk plus a layout fingerprint.

The chunk hash covers every token up to the end of the chunk (and, in
`keys/request.py`, everything else of the request the KV depends on), so a key names one
exact prefix. The fingerprint (`store_fingerprint`) covers everything a stored object's
bytes depend on besides the request: the engine's configuration (`engine_identity`:
model, dtype, quantization, KV cache dtype, config overrides, compilation and kernel
choices, the vLLM environment variables that change kernels), the weights' content
(`weights.py`), what the process runs on (`runtime_identity`: device and compute
capability or CPU ISA, torch, CUDA and kernel library versions, torch's matmul
precision), what each attention layer was given (`layer_identity`: the backend vLLM
selected, KV scales), the page format, group geometry, chunk size, the object format
and its version, the L2 tiers' codec (`l2_codec`), tensor-parallel rank and size. It
goes into LMCache's `ObjectKey.model_name`, so KV of another model, weights, numerics,
layout, format version or stored form is a different key: it can only miss, never be loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .. import FORMAT_VERSION
from ..layout.groups import KVLayout
from . import weight_files, weights

OBJECT_FORMAT = "KV_2LTD"


def fingerprint(layout: KVLayout, *, model: str, chunk_size: int, tp_rank: int = 0,
                tp_size: int = 1, engine: str = "", layers: str = "",
                codec: str = "") -> str:
    """Name of everything a stored object depends on besides its request: `engine` is
    the digest of the engine, weights and runtime, `layers` the digest of
    `layer_identity` (both "" before), `codec` the L2 tiers' stored form
    (`StoreConfig.codec_identity`; "" for none, which leaves the name as it was)."""
    desc = repr((FORMAT_VERSION, OBJECT_FORMAT, model, chunk_size, tp_rank, tp_size,
                 layout.geometry()) + ((engine, layers) if engine or layers else ())
                + ((("codec", codec),) if codec else ()))
    digest = hashlib.sha256(desc.encode()).hexdigest()[:24]
    return f"gemma4kv-v{FORMAT_VERSION}-tp{tp_rank}of{tp_size}-{digest}"


@dataclass(frozen=True)
class StoreFingerprint:
    name: str
    """The stores' namespace (LMCache's `model_name`)."""
    unsafe: str | None
    """Why this rank's KV cannot be keyed safely (store and load nothing), or None."""


def store_fingerprint(vllm_config, layout: KVLayout, *, kv_cache_layout: str, device,
                      chunk_size: int, tp_rank: int, tp_size: int,
                      model_id: str | None = None, weights_id: str | None = None,
                      runtime: dict | None = None, codec: str = "") -> StoreFingerprint:
    """The worker's fingerprint, once its KV caches exist (register_kv_caches): waits for
    the weights' digest (`weights.take`) unless `weights_id` names them. `runtime`
    defaults to `runtime_identity(device)`."""
    engine = engine_identity(vllm_config, weights_id=weights_id, model_id=model_id)
    signature, weights_unsafe = (weights_id, None) if weights_id else weights.take(
        vllm_config.model_config, vllm_config.load_config).result()
    runtime = runtime_identity(device) if runtime is None else runtime
    layers, layers_unsafe = layer_identity(vllm_config,
                                           [n for g in layout.groups for n in g.layers])
    combined = json.dumps({"engine": engine.digest, "weights": signature,
                           "runtime": runtime}, sort_keys=True)
    model = model_id or vllm_config.model_config.model
    # The page interior depends on the layout and device (vLLM's CPU backend stores K
    # transposed): never mix objects across them.
    name = fingerprint(layout, model=f"{model}|{kv_cache_layout}-{device.type}",
                       chunk_size=chunk_size, tp_rank=tp_rank, tp_size=tp_size,
                       engine=hashlib.sha256(combined.encode()).hexdigest()[:32],
                       layers=layers, codec=codec)
    return StoreFingerprint(name, engine.unsafe or weights_unsafe or layers_unsafe)


# -- what the engine's KV depends on besides the request ---------------------------------

@dataclass(frozen=True)
class EngineIdentity:
    """Everything of the engine's configuration the KV bytes depend on (no file
    hashing: the scheduler half reads `unsafe` from it at construction)."""
    fields: dict
    digest: str
    unsafe: str | None
    """Why KV of this engine cannot be keyed safely (store and load nothing), or None."""


def _jsonable(value):
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def _stable(value):
    """A JSON-able form that is the same in every process: vLLM's own normalisation
    (enums, classes, objects with `uuid()`), a callable by its qualified name."""
    from vllm.config.utils import normalize_value

    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    try:
        return _jsonable(normalize_value(value))
    except TypeError:
        if callable(value):  # a function or callable instance: its repr holds an address
            return (f"callable:{getattr(value, '__module__', '')}."
                    f"{getattr(value, '__qualname__', type(value).__qualname__)}")
        return _jsonable(value)


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
    return {f.name: _stable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if f.name not in leave_out and not f.name.startswith("_")}


# Multimodal settings that change what the tower computes (hence the text KV after an
# image): processor arguments, media decoding, normalization, the encoder's attention.
_MM_FIELDS = ("mm_processor_kwargs", "media_io_kwargs", "mm_device_do_normalize",
              "mm_encoder_tp_mode", "mm_encoder_attn_backend", "mm_encoder_attn_dtype",
              "video_pruning_rate", "video_pruning_method")
# The HF processor's own settings (resize, rescale, normalization, patching): vLLM loads
# them from the model's directory and its multimodal hash does not cover them.
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json",
                   "video_preprocessor_config.json")
# LoRA settings that change no numerics: how many adapters fit at once.
_LORA_CAPACITY = ("max_loras", "max_cpu_loras")
# CompilationConfig fields that change which code computes a batch, at any batch size:
# compiled or eager, which backend, which custom ops (e.g. vLLM's RMSNorm kernel or the
# torch-native one), where the graph is split (fusions stop there), inductor's own
# options and passes, whether the vision tower is compiled. The cudagraph and
# compile-size fields only choose among kernels by batch size (see the README).
_COMPILE_FIELDS = ("mode", "backend", "custom_ops", "splitting_ops",
                   "use_inductor_graph_partition", "ir_enable_torch_wrap",
                   "compile_mm_encoder", "inductor_compile_config", "inductor_passes")
# ParallelConfig fields that change the sums a rank computes (all-reduce algorithm,
# expert placement); where an engine runs (ranks, ports, hosts) is left out.
_PARALLEL_FIELDS = ("pipeline_parallel_size", "prefill_context_parallel_size",
                    "decode_context_parallel_size", "dcp_kv_cache_interleave_size",
                    "disable_custom_all_reduce", "enable_expert_parallel", "enable_eplb",
                    "expert_placement_strategy", "all2all_backend", "enable_dbo")
# vLLM environment variables (of `vllm.envs.compile_factors`, vLLM's own list of those
# that can change what it compiles) that only say where an engine runs and talks: two
# ranks or replicas of one deployment differ in them and compute the same KV. (Which
# CPU cores a CPU engine binds to is placement; how many threads it runs is keyed in
# `runtime_identity`.)
_PLACEMENT_ENV = frozenset({
    "VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL", "VLLM_LOOPBACK_IP", "VLLM_GPU_NIC_PCIE_MAPPING",
    "VLLM_NIC_SELECTION_VARS", "VLLM_EC_SIDE_CHANNEL_HOST", "VLLM_EC_SIDE_CHANNEL_PORT",
    "VLLM_P2P_SIDE_CHANNEL_HOST", "VLLM_P2P_SIDE_CHANNEL_PORT",
    "VLLM_MOONCAKE_BOOTSTRAP_PORT", "MOONCAKE_REQUESTER_LOCAL_HOSTNAME",
    "MOONCAKE_PREFERRED_SEGMENT", "VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_DP_PLACEMENT_NODE_IPS",
    "VLLM_PROCESS_NAME_PREFIX", "VLLM_USAGE_SOURCE", "VLLM_CPU_OMP_THREADS_BIND"})
# Compile factors that only say how an engine talks, logs, times out or bounds requests:
# a replica set differently computes the same KV (one that set insecure serialization
# for a collective_rpc missed every hit of its twin). Anything not plainly so stays in.
_NO_KV_EFFECT_ENV = frozenset({
    "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_CONFIGURE_LOGGING", "VLLM_DISABLE_LOG_LOGO",
    "VLLM_LOG_BATCHSIZE_INTERVAL", "VLLM_LOG_MODEL_INSPECTION", "VLLM_ENGINE_READY_TIMEOUT_S",
    "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT", "VLLM_REGEX_COMPILATION_TIMEOUT_S",
    "VLLM_TOOL_PARSE_REGEX_TIMEOUT_SECONDS", "VLLM_TOOL_JSON_ERROR_AUTOMATIC_RETRY",
    "VLLM_ENFORCE_STRICT_TOOL_CALLING", "VLLM_ENABLE_RESPONSES_API_STORE",
    "VLLM_ENABLE_COHERE_API", "VLLM_MAX_COMPLETION_PROMPTS", "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB",
    "VLLM_MAX_STOP_STRINGS", "VLLM_MAX_BAD_WORDS_TOTAL_TOKENS", "VLLM_MAX_NUM_BAD_WORDS",
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "VLLM_GC_DEBUG", "VLLM_DEBUG_MFU_METRICS",
    "VLLM_CUSTOM_SCOPES_FOR_PROFILING", "VLLM_NVTX_SCOPES_FOR_PROFILING", "VERBOSE",
    "VLLM_SYSTEM_START_DATE", "VLLM_MQ_MAX_CHUNK_BYTES_MB", "VLLM_MSGPACK_ZERO_COPY_THRESHOLD",
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "VLLM_P2P_HANDSHAKE_TIMEOUT_S",
    "VLLM_P2P_IDLE_TIMEOUT_S", "VLLM_MOONCAKE_CONNECTOR_TIMEOUT",
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"})
# Draft-model settings: a draft that owns KV (EAGLE) stores its layers' KV in the groups.
_SPEC_FIELDS = ("method", "model", "revision", "code_revision", "quantization",
                "kv_cache_dtype", "attention_backend")


def _compilation(cc) -> dict:
    out = {name: _stable(getattr(cc, name, None)) for name in _COMPILE_FIELDS}
    out["pass_config"] = _config(cc.pass_config)
    out["dynamic_shapes"] = _config(getattr(cc, "dynamic_shapes_config", None))
    # Which custom ops the model's layers actually took (recorded as vLLM builds the
    # model: filled on the worker, where the fingerprint is made).
    out["custom_ops_taken"] = [sorted(getattr(cc, "enabled_custom_ops", ())),
                               sorted(getattr(cc, "disabled_custom_ops", ()))]
    return out


def vllm_environment() -> dict:
    """The vLLM environment variables that can change the KV: vLLM's compile factors
    (`VLLM_BATCH_INVARIANT`, `VLLM_FLOAT32_MATMUL_PRECISION`, kernel switches, ...)
    without those that only place the engine (`_PLACEMENT_ENV`)."""
    import vllm.envs

    return {k: _stable(v) for k, v in vllm.envs.compile_factors().items()
            if k not in _PLACEMENT_ENV and k not in _NO_KV_EFFECT_ENV}


def _processor_config(model_config, load_config) -> dict | None:
    """sha256 of each HF processor file of a multimodal model (None: text only)."""
    if model_config.multimodal_config is None:
        return None
    folder = weight_files.weights_dir(model_config, load_config)
    out = {}
    for name in PROCESSOR_FILES:
        path = os.path.join(folder, name) if folder else None
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def engine_identity(vllm_config, *, weights_id: str | None = None,
                    model_id: str | None = None, generation: str = "") -> EngineIdentity:
    """The engine's configuration part of the fingerprint. `weights_id` (an
    operator-given checkpoint identity) replaces the weight files' content digest,
    `model_id` the model's path; `generation` names in-place weight updates (the
    scheduler's `RequestKeyer.generation` carries it too)."""
    import vllm
    from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

    mc, cc, lc = vllm_config.model_config, vllm_config.cache_config, vllm_config.load_config
    pc = vllm_config.parallel_config
    hf_config = json.dumps(_without_paths(mc.hf_config.to_dict()), sort_keys=True,
                           default=repr)
    overrides = mc.hf_overrides
    attn = getattr(vllm_config, "attention_config", None)
    kernel = getattr(vllm_config, "kernel_config", None)
    spec = vllm_config.speculative_config
    fields = {
        "vllm": vllm.__version__,
        "model": model_id or mc.model,
        "revision": mc.revision,
        "code_revision": mc.code_revision,
        "weights_id": weights_id,
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
        "compilation": _compilation(vllm_config.compilation_config),
        # Which GEMM, MoE and vLLM IR kernels run; warm-up switches change nothing.
        "kernel": _config(kernel, ("enable_cutedsl_warmup", "enable_jit_warmup")),
        "parallel": {k: _stable(getattr(pc, k, None)) for k in _PARALLEL_FIELDS},
        "expert_parallel_size": (pc.data_parallel_size * pc.tensor_parallel_size
                                 if getattr(pc, "enable_expert_parallel", False) else None),
        "env": vllm_environment(),
        "multimodal": {k: _jsonable(getattr(mc.multimodal_config, k, None))
                       for k in _MM_FIELDS} if mc.multimodal_config else None,
        "processor": _processor_config(mc, lc),
        "lora": _config(vllm_config.lora_config, _LORA_CAPACITY),
        "speculative": {k: _stable(getattr(spec, k, None)) for k in _SPEC_FIELDS}
        if spec is not None else None,
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
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return EngineIdentity(fields, digest[:32], unsafe)


# Kernel libraries whose version changes the bits of the kernels they hold (torch's
# own CUDA libraries come with its version, but pip can upgrade these beside it).
_LIBRARIES = ("torch", "triton", "flashinfer-python", "nvidia-cublas-cu12",
              "nvidia-cublas-cu13", "nvidia-cublas", "nvidia-cudnn-cu12",
              "nvidia-cudnn-cu13", "nvidia-cudnn", "deep-gemm", "intel-extension-for-pytorch")


def tf32_flags() -> list:
    """TF32 use of cuBLAS matmuls and cuDNN convolutions and RNNs. Read through torch's
    per-operator `fp32_precision` where it has one: the legacy `allow_tf32` getters
    raise once anything (vLLM's batch-invariant mode) set the flags the new way."""
    import torch

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(cudnn, "conv"):
        return [matmul.fp32_precision, cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision]
    return [matmul.allow_tf32, cudnn.allow_tf32]


def runtime_identity(device) -> dict:
    """What this process computes on: the device (compute capability, name and SM count
    on CUDA: kernel libraries pick kernels by them; on CPU the architecture, the ISA
    vLLM's CPU build and torch dispatch on, and the thread count), the versions of
    torch, CUDA or ROCm, cuDNN and the kernel libraries, and torch's matmul precision
    switches."""
    import torch

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    out = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "libraries": {d: v for d in _LIBRARIES if (v := version(d)) is not None},
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out["device"] = {"type": "cuda",
                         "capability": list(torch.cuda.get_device_capability(device)),
                         "name": props.name, "sms": props.multi_processor_count}
        matmul = torch.backends.cuda.matmul
        out["reduced_precision"] = [*tf32_flags(),
                                    matmul.allow_fp16_reduced_precision_reduction,
                                    matmul.allow_bf16_reduced_precision_reduction]
        out["cudnn"] = torch.backends.cudnn.version()
    else:
        flags = {name: bool(getattr(torch.cpu, f"_is_{name}_supported", lambda: None)())
                 for name in ("avx2", "avx512", "avx512_vnni", "avx512_bf16",
                              "amx_tile", "amx_fp16", "arm_sve")}
        # The thread count splits the work of the CPU kernels (vLLM's attention
        # among them) and so their sums.
        out["device"] = {"type": device.type, "machine": platform.machine(),
                         "capability": torch.backends.cpu.get_cpu_capability(),
                         "isa": flags, "threads": torch.get_num_threads()}
    return out


def layer_identity(vllm_config, layer_names: Iterable[str]) -> tuple[str, str | None]:
    """(digest, unsafe reason) of what each owning attention layer adds to its KV bytes:
    the backend vLLM selected for it (and the ISA its CPU kernels use), its KV cache
    dtype and the k/v scales the cache is written with
    (`compilation_config.static_forward_context[name]._k_scale` / `_v_scale`, loaded with
    the weights). Call on the worker after the weights are loaded (register_kv_caches)."""
    import torch

    ctx = vllm_config.compilation_config.static_forward_context
    h = hashlib.sha256(b"gemma4-kv:layers:2\n")
    unsafe = None
    for name in sorted(layer_names):
        layer = ctx.get(name)
        if layer is None:
            unsafe = unsafe or f"layer {name!r} is not in vLLM's forward context"
            continue
        impl = getattr(layer, "impl", None)
        backend = getattr(layer, "attn_backend", None)
        backend_name = getattr(backend, "get_name", None)
        desc = [name, type(impl).__name__,
                backend_name() if backend_name is not None else repr(backend),
                str(getattr(layer, "kv_cache_dtype", None)), getattr(layer, "isa", None)]
        h.update(json.dumps(desc).encode())
        for attr in ("_k_scale", "_v_scale"):
            scale = getattr(layer, attr, None)
            if not isinstance(scale, torch.Tensor):
                h.update(b"-")
                continue
            data = scale.detach().flatten().float().cpu().contiguous()
            h.update(struct.pack("<Q", data.numel()) + data.numpy().tobytes())
    return h.hexdigest()[:32], unsafe
