"""Keys of stored chunks: a rolling prefix hash per chunk plus a layout fingerprint.

The chunk hash covers every token up to the end of the chunk (and the request's
cache salt), so a key names one exact prefix. The fingerprint covers everything a
stored object's bytes depend on besides the tokens: model, dtype, group geometry,
chunk size, the object format and its version, tensor-parallel rank and size. It
goes into LMCache's `ObjectKey.model_name`, so KV of another model, dtype, layout or
format version is a different key: it can only miss, never be loaded.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from . import FORMAT_VERSION
from .layout import KVLayout

OBJECT_FORMAT = "KV_2LTD"


def chunk_hashes(tokens: Sequence[int], chunk_size: int, salt: str | None = None) -> list[bytes]:
    """sha256 rolling hash of each full chunk: h_i = H(h_{i-1} || tokens of chunk i)."""
    prev = hashlib.sha256(b"gemma4-kv" + (salt or "").encode()).digest()
    out = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        chunk = tokens[start:start + chunk_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(chunk)}q", *chunk)).digest()
        out.append(prev)
    return out


def fingerprint(layout: KVLayout, *, model: str, chunk_size: int, tp_rank: int = 0,
                tp_size: int = 1) -> str:
    """Name of everything a stored object depends on besides its tokens."""
    desc = repr((FORMAT_VERSION, OBJECT_FORMAT, model, chunk_size, tp_rank, tp_size,
                 layout.geometry()))
    digest = hashlib.sha256(desc.encode()).hexdigest()[:24]
    return f"gemma4kv-v{FORMAT_VERSION}-tp{tp_rank}of{tp_size}-{digest}"
