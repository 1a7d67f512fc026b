"""`l2_codec` as an LMCache serde: LMCache's own L2 adapters call it on every object
they store (encode) and load (decode), through its `SerdeL2AdapterWrapper`, which a
spec's `"serde": {"type": "gemma4_kv", ...}` puts around the adapter
(`StoreConfig.adapter_specs`).

It works on the object's bytes as laid out (KV, then the integrity trailer), so what an
L2 tier holds is a frame of `codec.py`, checked before it is decoded; what it decodes
to is then verified against its trailer as every object from L2 is (`embedded_l2`). A
damaged frame fails its load task: LMCache reports every key of that task as not
loaded, a miss, and nothing is offered. An object that does not fit its frame fails
its store task: nothing of that task is stored in that tier.
"""

from __future__ import annotations

import torch

from . import codec, lmcache
from .config import CODEC_SERDE


def _layout_bytes(layout_desc) -> int:
    return layout_bytes(layout_desc.shapes, layout_desc.dtypes)


def layout_bytes(shapes, dtypes) -> int:
    """Bytes of an object of this layout, as a serde reads it (no alignment)."""
    return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
               for s, d in zip(shapes, dtypes))


class Encode:
    """Object bytes -> a frame of `codec.frame_size` bytes (LMCache's `Serializer`).
    Every frame of a store has one size, that of its largest object (`object_bytes`):
    LMCache 0.5.6's store and load batches mix the groups' objects, whose sizes differ,
    and size every buffer of a batch by its first object's layout."""

    def __init__(self, frame: float, level: int, object_bytes: int):
        self.frame, self.level, self.object_bytes = frame, level, object_bytes

    def serialize(self, src, dst, key) -> int:
        width = src.get_dtypes()[0].itemsize  # the KV's element: bf16 2, fp32 4
        return codec.encode_into(src.byte_array, dst.byte_array, width, self.level)

    def estimate_serialized_size(self, layout_desc) -> int:
        # Exact, not an upper bound: the tiers load only values of this size.
        return codec.frame_size(max(self.object_bytes, _layout_bytes(layout_desc)),
                                self.frame)


class Decode:
    """A checked frame -> the object's bytes, in place (LMCache's `Deserializer`)."""

    def deserialize(self, src, dst, key) -> None:
        codec.decode_into(src.byte_array, dst.byte_array)


def make(kwargs: dict) -> tuple[Encode, Decode]:
    """The serde of a spec's `"serde"` object (`StoreConfig.adapter_specs` writes it)."""
    mode, frame = kwargs.get("mode"), kwargs.get("frame")
    if mode not in codec.MODES or isinstance(frame, bool) or \
            not isinstance(frame, (int, float)) or not 0 < frame <= 1:
        raise ValueError(f"{CODEC_SERDE} serde: bad mode {mode!r} or frame {frame!r}")
    return Encode(float(frame), int(kwargs.get("level", codec.DEFAULT_LEVEL)),
                  int(kwargs.get("object_bytes", 0))), Decode()


def register() -> None:
    """Make the serde known to LMCache before a storage layer that names it is built."""
    lmcache.register_serde(CODEC_SERDE, make)
