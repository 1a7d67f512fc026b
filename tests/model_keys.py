"""Stand-ins the tests predict with: chunk keys of plain token lists (equal exactly
where two requests' keys must be equal), and the longest servable hit."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

from gemma4_kv.layout.plan import servable_hits


def chunk_hashes(tokens: Sequence[int], chunk_size: int, salt: str | None = None) -> list[bytes]:
    """sha256 rolling hash of each full chunk: h_i = H(h_{i-1} || tokens of chunk i)."""
    prev = hashlib.sha256(b"gemma4-kv" + (salt or "").encode()).digest()
    out = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        chunk = tokens[start:start + chunk_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(chunk)}q", *chunk)).digest()
        out.append(prev)
    return out


def max_servable_hit(layout, chunk_size: int, max_chunks: int,
                     present: Callable[[int, int], bool], start: int = 0,
                     limit: int | None = None) -> int:
    """Largest hit every group can serve from the first `max_chunks` chunks."""
    hits = servable_hits(layout, chunk_size, max_chunks, present, start, limit)
    return hits[0] if hits else 0
