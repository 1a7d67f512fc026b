"""Descriptors of vLLM's KV cache groups: what each group is and where its bytes live.

One `KVGroup` per vLLM KV cache group (the hybrid allocator keeps one per layer kind
and pattern slot); one `KVLayout` for the whole model. They are built from what vLLM
really hands a connector (`KVCacheConfig` plus the tensors of `register_kv_caches`),
see `from_vllm`, or from a Hugging Face config without starting vLLM (`hf_layout`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch


class UnsupportedLayout(ValueError):
    """vLLM handed us a KV cache this library does not know how to move."""


class AttentionKind(str, enum.Enum):
    FULL = "full"
    SLIDING = "sliding"


@dataclass(frozen=True)
class PagedStrides:
    """Element strides of one layer's paged cache, logical [block, head, token, channel].

    vLLM may split a scheduler block into `kernel_block_size`-token pieces for the
    attention kernel; `kernel_block` is the stride between those pieces. The channel
    stride is always 1 (K and V are concatenated in the last dimension).
    """

    block: int
    head: int
    token: int
    kernel_block_size: int
    kernel_block: int


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: layers sharing a block table, block size and geometry."""

    group_id: int
    kind: AttentionKind
    window: int | None
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    layers: tuple[str, ...]
    """Layers that own memory, in vLLM's group order (the chunk's layer axis)."""
    draft_layers: tuple[str, ...] = ()
    """Subset of `layers` that belong to a draft (MTP/EAGLE) model and own KV."""
    aliases: tuple[tuple[str, str], ...] = ()
    """(layer, owner) pairs: layers that only read an owner's memory (KV sharing)."""
    strides: PagedStrides | None = None
    """Physical addressing of every owning layer; None when built from a config."""
    eagle: bool = False
    """vLLM marks the group as holding EAGLE/MTP draft attention layers (is_eagle_group)."""
    extra_retained_tokens: int = 0
    """Sliding groups: tokens vLLM keeps beyond the window (multi-module MTP re-prefills
    them); their blocks are allocated for a hit, so a load fills them too."""

    @property
    def reach(self) -> int | None:
        """Sliding groups: how many tokens before the next one vLLM keeps."""
        return None if self.window is None else self.window + self.extra_retained_tokens

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.num_kv_heads * (self.head_size + self.head_size_v) * self.element_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer (vLLM's page)."""
        return self.block_size * self.bytes_per_token_per_layer

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in this group, all owning layers together."""
        return len(self.layers) * self.bytes_per_token_per_layer

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        """LMCache KV_2LTD object shape: [2 (K, V), layers, tokens, heads * head_size]."""
        if self.head_size != self.head_size_v:
            raise UnsupportedLayout(
                f"group {self.group_id}: KV_2LTD needs equal K and V head sizes, "
                f"got {self.head_size} and {self.head_size_v}")
        return (2, len(self.layers), num_tokens, self.num_kv_heads * self.head_size)


@dataclass(frozen=True)
class KVLayout:
    """Every KV cache group of a model, plus the layers that own no memory."""

    groups: tuple[KVGroup, ...]
    unknown_layers: tuple[str, ...] = field(default=())
    """Layers vLLM registered that belong to no group and alias no group layer."""

    def __post_init__(self):
        if not self.groups:
            raise UnsupportedLayout("a KV layout needs at least one group")

    @property
    def chunk_multiple(self) -> int:
        """Chunk sizes must be a multiple of this (lcm of group block sizes)."""
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def aliases(self) -> dict[str, str]:
        return {layer: owner for g in self.groups for layer, owner in g.aliases}

    def geometry(self) -> tuple:
        """What a stored chunk depends on: kinds, windows, block sizes, shapes, dtype.

        Layer names and physical strides are left out: the chunk format does not
        depend on them (the mover normalises any stride order).
        """
        return tuple((g.kind.value, g.window, g.block_size, g.num_kv_heads, g.head_size,
                      g.head_size_v, str(g.dtype), len(g.layers), len(g.draft_layers))
                     for g in self.groups)


def _spec_kind(spec) -> tuple[AttentionKind, int | None]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    # Exact types only: MLA, chunked-local and sink specs subclass these but
    # store other things.
    if type(spec) is SlidingWindowSpec:
        return AttentionKind.SLIDING, spec.sliding_window
    if type(spec) is FullAttentionSpec:
        # With the hybrid allocator off, sliding layers become FullAttentionSpec with
        # `sliding_window` set; they still keep every block, so they are full here.
        return AttentionKind.FULL, None
    raise UnsupportedLayout(f"KV cache spec {type(spec).__name__} is not supported "
                            "(only full and sliding-window attention)")


def _strides_of(tensor: torch.Tensor, num_blocks: int, block_size: int) -> PagedStrides:
    if tensor.dim() != 4 or tensor.stride(3) != 1:
        raise UnsupportedLayout(
            f"expected a [blocks, heads, tokens, K|V] view with unit channel stride, "
            f"got shape {tuple(tensor.shape)} strides {tensor.stride()}")
    pieces = tensor.shape[0] // num_blocks
    if pieces * num_blocks != tensor.shape[0] or tensor.shape[2] * pieces != block_size:
        raise UnsupportedLayout(f"tensor of shape {tuple(tensor.shape)} does not hold "
                                f"{num_blocks} blocks of {block_size} tokens")
    return PagedStrides(block=tensor.stride(0) * pieces, head=tensor.stride(1),
                        token=tensor.stride(2), kernel_block_size=tensor.shape[2],
                        kernel_block=tensor.stride(0))


def from_vllm(kv_cache_config, kv_caches: Mapping[str, torch.Tensor] | None = None,
              kv_sharing: Mapping[str, str] | None = None,
              draft_layers: Collection[str] = ()) -> KVLayout:
    """Build the layout from vLLM's `KVCacheConfig` and, on workers, its KV tensors.

    `kv_sharing` maps KV-shared layers to their target (vLLM's
    `kv_sharing_target_layer_name`); without it, aliases are found among the
    registered tensors: a layer outside every group whose tensor is a group
    layer's tensor object. `draft_layers` names layers of a draft model.
    """
    owner_of: dict[str, str] = dict(kv_sharing or {})
    grouped = {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names}
    unknown: list[str] = []
    if kv_caches is not None:
        by_id = {id(kv_caches[n]): n for n in grouped if n in kv_caches}
        for name, t in kv_caches.items():
            if name in grouped or name in owner_of:
                continue
            if id(t) in by_id:
                owner_of[name] = by_id[id(t)]
            else:
                unknown.append(name)
    # Resolve chains (a -> b -> c) to the layer that owns memory.
    for name in list(owner_of):
        seen = {name}
        while owner_of[name] not in grouped and owner_of[name] in owner_of:
            owner_of[name] = owner_of[owner_of[name]]
            if owner_of[name] in seen:
                raise UnsupportedLayout(f"KV sharing cycle through {name}")
            seen.add(owner_of[name])

    groups = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            raise UnsupportedLayout(f"group {gid} is not transferable or lives in host memory "
                                    "(vLLM's ephemeral / HiSparse groups are not supported)")
        spec = g.kv_cache_spec
        kind, window = _spec_kind(spec)
        layers = tuple(g.layer_names)
        strides = None
        if kv_caches is not None:
            missing = [n for n in layers if n not in kv_caches]
            if missing:
                raise UnsupportedLayout(f"group {gid}: no KV tensor for {missing}")
            per_layer = {_strides_of(kv_caches[n], kv_cache_config.num_blocks,
                                     spec.block_size) for n in layers}
            dtypes = {kv_caches[n].dtype for n in layers}
            if len(per_layer) != 1 or dtypes != {spec.dtype}:
                raise UnsupportedLayout(f"group {gid}: layers differ in strides or dtype "
                                        f"({per_layer}, {dtypes}, spec {spec.dtype})")
            strides = per_layer.pop()
        drafts = tuple(n for n in layers if n in draft_layers)
        aliases = tuple(sorted((a, o) for a, o in owner_of.items() if o in layers))
        groups.append(KVGroup(
            group_id=gid, kind=kind, window=window, block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            head_size_v=spec.head_size_v, dtype=spec.dtype, layers=layers,
            draft_layers=drafts, aliases=aliases, strides=strides,
            eagle=bool(getattr(g, "is_eagle_group", False)),
            extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0) or 0))
    return KVLayout(groups=tuple(groups), unknown_layers=tuple(unknown))
