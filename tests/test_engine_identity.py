"""The store fingerprint against the engine's numerics: two engines that differ in one
input that changes KV bits get disjoint keys (every key of a store is its fingerprint
plus a chunk hash), two that differ only in what changes no bits share them.

The expectations are listed by hand, input by input (`DIFFER`, `SAME`); engines are
real vLLM configs (`EngineArgs(...).create_engine_config()`) with real attention and
RMSNorm layers built under them, as vLLM's model builder does.
"""

from __future__ import annotations

import copy
import platform
import shutil

import pytest
import torch

from needs import require

require("vllm")

from vllm.config import CUDAGraphMode, set_current_vllm_config  # noqa: E402
from vllm.config.multimodal import MultiModalConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention.attention import Attention  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from gemma4_kv.keys.engine import runtime_identity, store_fingerprint  # noqa: E402
from gemma4_kv.layout.from_hf import hf_layout  # noqa: E402
from gemma4_kv.tools.harness import save_config, tiny_gemma4_config  # noqa: E402

CPU = torch.device("cpu")
LAYOUT = hf_layout(tiny_gemma4_config(window=100), dtype=torch.float32, block_size=32)
# What a CUDA worker reports (`runtime_identity` on an H200), for the device cases.
H200 = {"torch": "2.13.0+cu130", "cuda": "13.0", "hip": None,
        "libraries": {"torch": "2.13.0+cu130", "triton": "3.8.0"},
        "float32_matmul_precision": "highest", "deterministic_algorithms": False,
        "device": {"type": "cuda", "capability": [9, 0], "name": "NVIDIA H200", "sms": 132},
        "reduced_precision": [False, True, True, True], "cudnn": 91900}


def _with(d: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(d)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_config(tiny_gemma4_config(window=100), tmp_path_factory.mktemp("model"))


def engine_fingerprint(model_dir, *, args=None, post=None, backend=None, runtime=None,
                       model_id="tiny", weights_id="ckpt-1", mm=None):
    """The fingerprint a worker of this engine makes in register_kv_caches: its config,
    its layers (built as vLLM's model builder builds them, with `backend` forced as a
    model may force it), its runtime (`runtime_identity(cpu)` unless given)."""
    cfg = EngineArgs(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                     dtype="float32", max_model_len=2048, **(args or {})).create_engine_config()
    if post:
        post(cfg)
    if mm is not None:
        cfg.model_config.multimodal_config = MultiModalConfig(**mm)
    attn_backend = AttentionBackendEnum[backend].get_class() if backend else None
    with set_current_vllm_config(cfg):
        for g in LAYOUT.groups:
            for name in g.layers:
                Attention(g.num_kv_heads, g.head_size, 1.0, num_kv_heads=g.num_kv_heads,
                          cache_config=cfg.cache_config, prefix=name,
                          attn_backend=attn_backend)
        RMSNorm(64)  # records whether vLLM's kernel or torch's ops run it
    fp = store_fingerprint(cfg, LAYOUT, kv_cache_layout="LBHNC", device=CPU, chunk_size=256,
                           tp_rank=0, tp_size=1, model_id=model_id, weights_id=weights_id,
                           runtime=runtime)
    assert fp.unsafe is None, fp.unsafe
    return fp.name


def _set(**fields):
    def post(cfg):
        for k, v in fields.items():
            setattr(cfg.compilation_config, k, v)
    return post


CPU_RUNTIME = runtime_identity(CPU)
# input: (how the second engine differs). Each gives KV of other bits.
DIFFER = {
    "custom op on (vLLM's RMSNorm kernel, not torch's)":
        dict(args={"compilation_config": {"custom_ops": ["+rms_norm"]}}),
    "not compiled (eager)": dict(args={"compilation_config": {"mode": 0}}),
    "compiled by another torch.compile backend": dict(post=_set(backend="eager")),
    "a compile pass off": dict(args={"compilation_config": {
        "pass_config": {"eliminate_noops": False}}}),
    "an inductor option": dict(args={"compilation_config": {
        "inductor_compile_config": {"max_autotune": True}}}),
    "other GEMM kernels": dict(args={"kernel_config": {"linear_backend": "torch"}}),
    "VLLM_BATCH_INVARIANT=1": dict(env={"VLLM_BATCH_INVARIANT": "1"}),
    "VLLM_FLOAT32_MATMUL_PRECISION=high": dict(env={"VLLM_FLOAT32_MATMUL_PRECISION": "high"}),
    "attention backend FLEX_ATTENTION": dict(backend="FLEX_ATTENTION"),
    # The other ISA than this host's (AVX512 hosts run the AVX2 kernels' other side).
    "CPU of the other ISA": dict(runtime=_with(CPU_RUNTIME, ("device", "capability"),
                                               "AVX2" if CPU_RUNTIME["device"].get(
                                                   "capability") == "AVX512" else "AVX512")),
    "CPU with(out) AMX": dict(runtime=_with(CPU_RUNTIME, ("device", "isa", "amx_tile"),
                                           not CPU_RUNTIME["device"]["isa"]["amx_tile"])),
    "GPU compute capability 9.0": dict(runtime=H200),
    "GPU compute capability 8.0": dict(runtime=_with(H200, ("device", "capability"), [8, 0])),
    "GPU with other SM count": dict(runtime=_with(H200, ("device", "sms"), 114)),
    "torch 2.14": dict(runtime=_with(H200, ("torch",), "2.14.0+cu130")),
    "CUDA 12.9": dict(runtime=_with(H200, ("cuda",), "12.9")),
    "TF32 matmuls": dict(runtime=_with(H200, ("reduced_precision",), [True, True, True, True])),
    "vLLM 0.33.0": dict(vllm_version="0.33.0"),
    "other weights": dict(weights_id="ckpt-2"),
}
# input: the second engine differs only in this; its KV has the same bits.
SAME = {
    "the same engine again": {},
    "CUDA graph capture sizes (choose kernels by batch size only)":
        dict(post=_set(cudagraph_capture_sizes=[1, 2, 4], cudagraph_mode=CUDAGraphMode.PIECEWISE)),
    "inductor compile sizes": dict(args={"compilation_config": {"compile_sizes": [8]}}),
    "torch.compile cache dir (a path)": dict(post=_set(cache_dir="/tmp/elsewhere")),
    "max_num_seqs (scheduling)": dict(args={"max_num_seqs": 8}),
    "VLLM_DP_RANK=1 (placement)": dict(env={"VLLM_DP_RANK": "1"}),
    "VLLM_CPU_OMP_THREADS_BIND=1 (which cores)": dict(env={"VLLM_CPU_OMP_THREADS_BIND": "1"}),
    "VLLM_ALLOW_INSECURE_SERIALIZATION=1 (how RPCs are encoded)":
        dict(env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}),
}


def _case(model_dir, monkeypatch, case: dict) -> str:
    import vllm

    case = dict(case)
    with monkeypatch.context() as m:
        for k, v in case.pop("env", {}).items():
            m.setenv(k, v)
        if "vllm_version" in case:
            m.setattr(vllm, "__version__", case.pop("vllm_version"))
        return engine_fingerprint(model_dir, **case)


def test_every_input_that_changes_kv_bits_gives_disjoint_keys(model_dir, monkeypatch):
    base = engine_fingerprint(model_dir)
    differ = {name: _case(model_dir, monkeypatch, c) for name, c in DIFFER.items()}
    same = {name: _case(model_dir, monkeypatch, c) for name, c in SAME.items()}
    assert {name for name, fp in same.items() if fp != base} == set()
    assert {name for name, fp in differ.items() if fp == base} == set()
    by_fp = {}
    for name, fp in differ.items():
        by_fp.setdefault(fp, []).append(name)
    assert [names for names in by_fp.values() if len(names) > 1] == []


def test_processor_config_is_named_for_multimodal_models(model_dir, tmp_path, monkeypatch):
    """vLLM's multimodal hash names the image, not the processor that turns it into the
    tower's input: its config file is part of the key, by content."""
    def with_processor(name: str, text: str | None):
        d = shutil.copytree(model_dir, tmp_path / name)
        if text is not None:
            (d / "preprocessor_config.json").write_text(text)
        return engine_fingerprint(d, mm={})

    a = with_processor("a", '{"do_resize": true, "image_mean": [0.5, 0.5, 0.5]}')
    assert with_processor("a-copy", '{"do_resize": true, "image_mean": [0.5, 0.5, 0.5]}') == a
    assert with_processor("b", '{"do_resize": true, "image_mean": [0.4, 0.5, 0.5]}') != a
    assert with_processor("none", None) not in (a, engine_fingerprint(model_dir))


def test_runtime_identity_reads_this_process():
    """On CPU: torch's version, no CUDA, the architecture and the ISA torch dispatches on
    (vLLM's CPU build loads `_C`, `_C_AVX512` or `_C_AVX2` and picks attention kernels by
    the same flags)."""
    r = runtime_identity(CPU)
    assert r["torch"] == torch.__version__ and r["cuda"] == torch.version.cuda
    assert r["device"]["type"] == "cpu" and r["device"]["machine"] == platform.machine()
    assert r["device"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert r["device"]["isa"]["avx512"] == torch.cpu._is_avx512_supported()
    assert r["device"]["isa"]["amx_tile"] == torch.cpu._is_amx_tile_supported()
    before = torch.get_float32_matmul_precision()
    assert r["float32_matmul_precision"] == before
    try:  # as vLLM sets it from VLLM_FLOAT32_MATMUL_PRECISION in each worker
        torch.set_float32_matmul_precision("high" if before != "high" else "highest")
        assert runtime_identity(CPU) != r
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.cuda
def test_runtime_identity_reads_the_gpu():
    dev = torch.device("cuda", 0)
    r = runtime_identity(dev)
    assert r["device"]["capability"] == list(torch.cuda.get_device_capability(dev))
    assert r["device"]["name"] == torch.cuda.get_device_name(dev)
    assert r["cuda"] == torch.version.cuda


def test_tf32_flags_read_after_vllm_set_them_the_new_way():
    """vLLM's batch-invariant mode sets TF32 through torch's per-operator API; the legacy
    `allow_tf32` getters then raise, and every GPU engine failed to start (H200,
    2026-12-02). The flags read, and a change of them shows."""
    from gemma4_kv.keys.engine import tf32_flags

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "ieee"
        ieee = tf32_flags()
        matmul.fp32_precision = "tf32"
        assert tf32_flags() != ieee
    finally:
        matmul.fp32_precision = before
