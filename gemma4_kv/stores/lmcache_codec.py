"""`l2_codec` as an LMCache serde: LMCache's own L2 adapters call it on every object
they store (encode) and load (decode), through `SerdeL2AdapterWrapper`, which a spec's
`"serde": {"type": "gemma4_kv", ...}` puts around the adapter (`StoreConfig`).

It works on the object's bytes as laid out (KV, then the integrity trailer), so what an
L2 tier holds is a frame of `codec.py`, checked before it is decoded; what it decodes
to is verified against its trailer as every object from L2 is (`embedded_l2`). A
frame that is damaged fails its load task (LMCache then reports every key of that task
as not loaded: a miss, nothing is offered). An object that does not fit its frame fails
its store task (nothing of that task is stored in that tier).
"""

from __future__ import annotations

import logging

import torch

from . import codec

SERDE_TYPE = "gemma4_kv"
logger = logging.getLogger(__name__)


def _layout_bytes(shapes, dtypes) -> int:
    return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
               for s, d in zip(shapes, dtypes))


def serde_spec(mode: str, frame: float) -> dict:
    """The `"serde"` object of an adapter spec that encodes with this codec."""
    if mode not in codec.MODES:
        raise ValueError(f"unknown codec mode {mode!r}")
    return {"type": SERDE_TYPE, "mode": mode, "frame": frame}


def register() -> None:
    """Register the serde with LMCache's factory (once per process), before any
    storage layer whose specs name it is built."""
    from lmcache.v1.distributed.serde import get_registered_serde_types, \
        register_serde_factory

    if SERDE_TYPE not in get_registered_serde_types():
        register_serde_factory(SERDE_TYPE, _create)


def _create(kwargs: dict):
    from lmcache.v1.distributed.serde import AsyncSerdeProcessor, Deserializer, Serializer

    mode, frame = kwargs.get("mode"), kwargs.get("frame")
    if mode not in codec.MODES or isinstance(frame, bool) or \
            not isinstance(frame, (int, float)) or not 0 < frame <= 1:
        raise ValueError(f"gemma4_kv serde: bad mode {mode!r} or frame {frame!r}")
    level = int(kwargs.get("level", codec.DEFAULT_LEVEL))

    class Encode(Serializer):
        """Object bytes -> a frame of `codec.frame_size` bytes."""

        def serialize(self, src, dst, key) -> int:
            width = src.get_dtypes()[0].itemsize
            return codec.encode_into(src.byte_array, dst.byte_array, width, level)

        def estimate_serialized_size(self, layout_desc) -> int:
            # Exact, not an upper bound: the tiers load only values of this size.
            return codec.frame_size(_layout_bytes(layout_desc.shapes, layout_desc.dtypes),
                                    frame)

    class Decode(Deserializer):
        """A checked frame -> the object's bytes, in place."""

        def deserialize(self, src, dst, key) -> None:
            codec.decode_into(src.byte_array, dst.byte_array)

    # One worker: two cores are shared by the engine's threads; zstd releases the GIL.
    return AsyncSerdeProcessor(Encode(), Decode(), max_workers=1)
