"""The KV layout vLLM would build for a Gemma 4 config, without starting vLLM.

Reproduces vLLM's hybrid-allocator planning (`vllm/v1/core/kv_cache_utils.py`:
`unify_kv_cache_spec_page_size` then `_get_kv_cache_groups_uniform_page_size`) on the
per-layer specs a Gemma 4 model registers, so users and benchmarks can inspect a
model's groups. `tests/test_hf_layout.py` checks it against vLLM's own code.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .groups import AttentionKind, KVGroup, KVLayout, UnsupportedLayout


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer asks of the KV cache (vLLM's AttentionSpec, reduced)."""

    kind: AttentionKind
    window: int | None
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        elt = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * 2 * self.head_size * elt


def load_text_config(path: str | Path):
    """A Gemma 4 text config from a checkpoint directory or a config JSON file."""
    import transformers

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    data = json.loads(file.read_text())
    data = data.get("text_config", data)
    data = {k: v for k, v in data.items() if k not in ("model_type", "architectures")}
    return transformers.Gemma4TextConfig(**data)


def _owning_types(text_config) -> list[str]:
    """Types of the layers that own KV: all but the last `num_kv_shared_layers`."""
    shared = getattr(text_config, "num_kv_shared_layers", 0) or 0
    return list(text_config.layer_types)[:text_config.num_hidden_layers - shared]


def _last_owner(owning_types: list[str], layer_type: str) -> int:
    """The last layer of `layer_type` that owns KV: what vLLM's Gemma 4 KV-shared layers
    and MTP draft layers read (`kv_sharing_target_layer_name`)."""
    return len(owning_types) - 1 - owning_types[::-1].index(layer_type)


def layer_specs(text_config, *, dtype: torch.dtype = torch.bfloat16, block_size: int = 16,
                tp_size: int = 1, prefix: str = "model.layers"
                ) -> tuple[dict[str, LayerSpec], dict[str, str]]:
    """Per-layer specs of the layers that own KV, and KV-shared layer -> target layer."""
    types = list(text_config.layer_types)
    owning = _owning_types(text_config)
    specs: dict[str, LayerSpec] = {}
    shared: dict[str, str] = {}
    for i in range(text_config.num_hidden_layers):
        name = f"{prefix}.{i}.self_attn.attn"
        if i >= len(owning):
            shared[name] = f"{prefix}.{_last_owner(owning, types[i])}.self_attn.attn"
            continue
        per_layer = text_config.per_layer_config[i]
        heads = per_layer.num_key_value_heads
        if heads >= tp_size and heads % tp_size:
            raise UnsupportedLayout(f"{heads} KV heads do not split over TP {tp_size}")
        sliding = types[i] == "sliding_attention"
        specs[name] = LayerSpec(
            kind=AttentionKind.SLIDING if sliding else AttentionKind.FULL,
            window=text_config.sliding_window if sliding else None,
            block_size=block_size, num_kv_heads=max(1, heads // tp_size),
            head_size=per_layer.head_dim, dtype=dtype)
    return specs, shared


def assistant_aliases(text_config, assistant_config, *, prefix: str = "model.layers",
                      draft_prefix: str = "draft_model.layers") -> dict[str, str]:
    """Gemma 4 MTP assistants own no KV: each draft layer reads the last target layer
    of its attention type (`vllm/model_executor/models/gemma4_mtp.py`)."""
    owning = _owning_types(text_config)
    return {f"{draft_prefix}.{j}.self_attn.attn":
            f"{prefix}.{_last_owner(owning, t)}.self_attn.attn"
            for j, t in enumerate(assistant_config.layer_types)}


def unify_page_sizes(specs: dict[str, LayerSpec]) -> dict[str, LayerSpec]:
    """Give layers with smaller pages proportionally larger blocks (vLLM's rule)."""
    largest = max(s.page_bytes for s in specs.values())
    out = {}
    for name, s in specs.items():
        if largest % s.page_bytes:
            raise UnsupportedLayout(f"{name}: page {s.page_bytes} B does not divide "
                                    f"{largest} B (vLLM would pad it)")
        ratio = largest // s.page_bytes
        out[name] = LayerSpec(s.kind, s.window, s.block_size * ratio, s.num_kv_heads,
                              s.head_size, s.dtype)
    return out


def group_layers(specs: dict[str, LayerSpec]) -> list[tuple[LayerSpec, list[str]]]:
    """Split layers into equally sized groups of one spec, interleaved (vLLM's rule)."""
    buckets: dict[LayerSpec, list[str]] = {}
    for name, s in specs.items():
        buckets.setdefault(s, []).append(name)
    sizes = [len(v) for v in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups = []
    for s, names in buckets.items():
        count = math.ceil(len(names) / group_size)
        groups += [(s, names[i::count]) for i in range(count)]
    return groups


def hf_layout(text_config, *, assistant_config=None, dtype: torch.dtype = torch.bfloat16,
              block_size: int = 16, tp_size: int = 1) -> KVLayout:
    """The `KVLayout` vLLM's hybrid allocator gives this Gemma 4 config."""
    specs, shared = layer_specs(text_config, dtype=dtype, block_size=block_size,
                                tp_size=tp_size)
    if assistant_config is not None:
        shared.update(assistant_aliases(text_config, assistant_config))
    if len({(s.kind, s.window, s.num_kv_heads, s.head_size) for s in specs.values()}) == 1:
        grouped = [(next(iter(specs.values())), list(specs))]
    else:
        grouped = group_layers(unify_page_sizes(specs))
    groups = []
    for gid, (s, names) in enumerate(grouped):
        groups.append(KVGroup(
            group_id=gid, kind=s.kind, window=s.window, block_size=s.block_size,
            num_kv_heads=s.num_kv_heads, head_size=s.head_size, head_size_v=s.head_size,
            dtype=s.dtype, layers=tuple(names),
            aliases=tuple(sorted((a, o) for a, o in shared.items() if o in names))))
    return KVLayout(groups=tuple(groups))
