"""Build vLLM-shaped paged KV caches for tests: any KVCacheLayout, random bits."""

from __future__ import annotations

import torch

# Physical order of the logical axes [L, B, H, N, C] (vllm/v1/kv_cache_layout.py).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def random_bits(shape, dtype, device="cpu", generator=None) -> torch.Tensor:
    """Random bit patterns of `dtype` (never zeros; NaN patterns included: we compare bits)."""
    width = torch.empty((), dtype=dtype).element_size()
    info = torch.iinfo(_INT[width])
    t = torch.randint(info.min, info.max, shape, dtype=_INT[width], generator=generator)
    return t.to(device).view(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def make_paged(num_layers: int, num_blocks: int, heads: int, block_size: int, head_size: int,
               dtype: torch.dtype, layout: str = "LBNHC", device="cpu", pieces: int = 1,
               generator=None) -> list[torch.Tensor]:
    """Per-layer logical [blocks * pieces, heads, block_size / pieces, 2 * head_size] views
    of one buffer laid out physically in `layout` order, as vLLM builds them."""
    logical = (num_layers, num_blocks * pieces, heads, block_size // pieces, 2 * head_size)
    order = LAYOUTS[layout]
    raw = random_bits(tuple(logical[d] for d in order), dtype, device, generator)
    inverse = tuple(order.index(d) for d in range(5))
    view = raw.permute(inverse)
    assert tuple(view.shape) == logical
    return [view[l] for l in range(num_layers)]
