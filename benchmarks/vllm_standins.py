"""Stand-ins for two compiled vLLM ops that the GPU machine's vLLM (its Python code on
torch 2.11, `.gpu-vllm`) lacks. Used only by the GPU benchmarks and GPU end-to-end
tests, never by the connector; `install()` registers an op only where it is missing, so
a real vLLM build keeps its own.

- `_C_cache_ops::swap_blocks_batch` (vllm/_custom_ops.py): vLLM's OffloadingConnector
  copies every KV page with it (vllm/v1/kv_offload/cpu/gpu_worker.py; the Triton path
  is only for pages under 28 KiB, Gemma 4's are 256 KiB). The real op hands all copies
  to `cuMemcpyBatchAsync` in one call on the current stream; this one submits the same
  copies through the same driver call via cuda-python, in batches of 4096 (same stream
  order), after turning the addresses into Python objects (host time the C++ op does
  not spend; `STATS` counts it).
- `_C_cuda_utils::get_max_shared_memory_per_block_device_attribute`: vLLM's
  batch-invariant mode sizes its Triton kernels with it (vllm/utils/mem_utils.py); the
  real op returns cudaDevAttrMaxSharedMemoryPerBlockOptin, which torch also reports.

Import and `install()` in the process that creates `vllm.LLM`, before creating it:
vLLM forks its engine-core process, which inherits the registrations.
"""

from __future__ import annotations

import sys
import time

import torch

NAMESPACE = "_C_cache_ops"
OP_NAME = "swap_blocks_batch"
SCHEMA = ("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
          "bool is_src_access_order_any=False) -> ()")
BATCH = 4096  # descriptors per cuMemcpyBatchAsync call

# calls, copies (descriptors), bytes, host seconds spent inside the stand-in
STATS = {"calls": 0, "copies": 0, "bytes": 0, "host_s": 0.0}

_LIB = None          # the torch.library.Library that holds our registration (kept alive)
_driver = None       # cuda.bindings.driver, imported on the first call
_ATTRS = {}          # is_src_access_order_any -> CUmemcpyAttributes


def _op_exists(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def install() -> list[str]:
    """Provide each op whose compiled version is missing; returns their names."""
    global _LIB
    done = []
    if _LIB is None and not _op_exists(NAMESPACE, OP_NAME):
        _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
        _LIB.define(SCHEMA)
        _LIB.impl(OP_NAME, swap_blocks_batch, "CPU")  # the real op is registered for kCPU too
        done.append(OP_NAME)
    if not _op_exists("_C_cuda_utils", "get_max_shared_memory_per_block_device_attribute"):
        from vllm import _custom_ops as ops  # vLLM calls it through this module

        ops.get_max_shared_memory_per_block_device_attribute = _max_shared_memory_per_block
        done.append("get_max_shared_memory_per_block_device_attribute")
    return done


def _max_shared_memory_per_block(device: int) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def _load_driver():
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise RuntimeError(
                "vllm_standins: the stand-in for torch.ops._C_cache_ops.swap_blocks_batch needs "
                "cuda-python (cuda.bindings.driver), which does not import here: "
                f"{e!r}") from e
        _driver = driver
        print("[vllm_standins] swap_blocks_batch called (cuda-python cuMemcpyBatchAsync "
              "stand-in)", file=sys.stderr, flush=True)
    return _driver


def _attributes(driver, any_order: bool):
    attr = _ATTRS.get(any_order)
    if attr is None:
        order = driver.CUmemcpySrcAccessOrder
        attr = driver.CUmemcpyAttributes()
        attr.srcAccessOrder = (order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY if any_order
                               else order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        _ATTRS[any_order] = attr
    return attr


def _check_args(src_ptrs, dst_ptrs, sizes) -> int:
    """The real op's argument checks (same messages)."""
    for t, name in ((src_ptrs, "src_ptrs"), (dst_ptrs, "dst_ptrs"), (sizes, "sizes")):
        if t.device.type != "cpu":
            raise RuntimeError(f"{name} must be on CPU")
        if t.dtype != torch.int64:
            raise RuntimeError(f"{name} must be int64")
    n = src_ptrs.size(0)
    if dst_ptrs.size(0) != n:
        raise RuntimeError("dst_ptrs length must match src_ptrs")
    if sizes.size(0) != n:
        raise RuntimeError("sizes length must match src_ptrs")
    return n


def swap_blocks_batch(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                      is_src_access_order_any: bool = False) -> None:
    """Copy ``sizes[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i,
    asynchronously on the current CUDA stream (host<->device or device<->device)."""
    n = _check_args(src_ptrs, dst_ptrs, sizes)
    if n == 0:
        return
    t0 = time.perf_counter()
    driver = _load_driver()
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    attr = _attributes(driver, bool(is_src_access_order_any))
    ptr = driver.CUdeviceptr
    srcs, dsts, nbytes = src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()
    for start in range(0, n, BATCH):
        end = min(start + BATCH, n)
        res = driver.cuMemcpyBatchAsync([ptr(p) for p in dsts[start:end]],
                                        [ptr(p) for p in srcs[start:end]],
                                        nbytes[start:end], end - start, [attr], [0], 1, stream)
        # CUDA 13 bindings return (err,); 12.8/12.9 bindings return (err, failIdx)
        err = res[0] if isinstance(res, tuple) else res
        if err != driver.CUresult.CUDA_SUCCESS:
            fail = f" at index {start + res[1]}" if isinstance(res, tuple) and len(res) > 1 else ""
            raise RuntimeError(f"cuMemcpyBatchAsync failed{fail} (copies {start}..{end - 1} "
                               f"of {n}) with error {err}")
    STATS["calls"] += 1
    STATS["copies"] += n
    STATS["bytes"] += sum(nbytes)
    STATS["host_s"] += time.perf_counter() - t0
