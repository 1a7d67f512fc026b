"""`l2_codec` as an LMCache serde: LMCache's own L2 adapters call it on every object
they store (encode) and load (decode), through its `SerdeL2AdapterWrapper`, which a
spec's `"serde": {"type": "gemma4_kv", ...}` puts around the adapter
(`StoreConfig.adapter_specs`).

It works on the object's bytes as laid out (KV, then the integrity trailer), so what an
L2 tier holds is a frame of `codec.py` (`lossless`) or `cachegen.py`, checked before it
is decoded; what it decodes to is then verified against its trailer as every object
from L2 is (`embedded_l2`). A damaged frame fails its load task: LMCache reports every
key of that task as not loaded, a miss, and nothing is offered. An object that does not
fit its frame fails its store task: nothing of that task is stored in that tier.
"""

from __future__ import annotations

import torch

from . import cachegen, codec, lmcache
from .config import CODEC_SERDE, StoreConfig


def layout_bytes(shapes, dtypes) -> int:
    """Bytes of an object of this layout, as a serde reads it (no alignment)."""
    return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
               for s, d in zip(shapes, dtypes))


def frame_bytes(config: StoreConfig, objects) -> int:
    """The frame every object of a store takes under its codec: the largest object's
    (`objects`: (shapes, dtypes) per group; 0 without a codec). LMCache 0.5.6's store
    and load batches mix the groups' objects, whose sizes differ, and size every buffer
    of a batch by its first object's layout, so one size serves all."""
    if config.codec == "none":
        return 0
    if config.codec == "cachegen":
        return max(cachegen.frame_size(shapes[0], config.codec_bits) for shapes, _ in objects)
    return max(codec.frame_size(layout_bytes(*o), config.codec_frame) for o in objects)


class Encode:
    """Object bytes -> a frame of `frame_bytes` (LMCache's `Serializer`)."""

    def __init__(self, mode: str, frame_bytes: int, level: int, bits: int,
                 device: torch.device):
        self.mode, self.frame_bytes, self.level, self.bits = mode, frame_bytes, level, bits
        self.device = device

    def serialize(self, src, dst, key) -> int:
        if self.mode == "cachegen":
            return cachegen.encode_into(src.byte_array, dst.byte_array, src.get_shapes()[0],
                                        src.get_dtypes()[0], self.bits, self.device)
        width = src.get_dtypes()[0].itemsize  # the KV's element: bf16 2, fp32 4
        return codec.encode_into(src.byte_array, dst.byte_array, width, self.level)

    def estimate_serialized_size(self, layout_desc) -> int:
        # Exact, not an upper bound: the tiers load only values of this size.
        return self.frame_bytes


class Decode:
    """A checked frame -> the object's bytes, in place (LMCache's `Deserializer`)."""

    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device

    def deserialize(self, src, dst, key) -> None:
        if self.mode == "cachegen":
            cachegen.decode_into(src.byte_array, dst.byte_array, self.device)
        else:
            codec.decode_into(src.byte_array, dst.byte_array)


def make(kwargs: dict) -> tuple[Encode, Decode]:
    """The serde of a spec's `"serde"` object (`StoreConfig.adapter_specs` writes it).
    Built on the thread that builds the store, whose CUDA device is the engine's: a
    `cachegen` serde codes there (`"device": "auto"`) or on the CPU (`"cpu"`)."""
    mode, size, bits = kwargs.get("mode"), kwargs.get("frame_bytes"), kwargs.get("bits", 4)
    if mode not in codec.MODES or isinstance(size, bool) or not isinstance(size, int) \
            or size <= codec.HEADER or isinstance(bits, bool) or bits not in range(2, 9):
        raise ValueError(f"{CODEC_SERDE} serde: bad mode {mode!r}, frame_bytes {size!r} "
                         f"or bits {bits!r}")
    device = cachegen.device_for(kwargs.get("device", "auto"))
    return Encode(mode, size, int(kwargs.get("level", codec.DEFAULT_LEVEL)), bits, device), \
        Decode(mode, device)


def register() -> None:
    """Make the serde known to LMCache before a storage layer that names it is built."""
    lmcache.register_serde(CODEC_SERDE, make)
