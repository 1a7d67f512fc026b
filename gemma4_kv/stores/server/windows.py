"""Where a sliding-window group's objects live on the server: in window chains.

0.5.6's server reports, per registration, the leading run of a chain it holds, so
objects it stores must form runs from a chain's start. Full-attention groups store
every chunk of a prompt: their run is the prompt's chain. A sliding group is stored
only in the windows before the ends a hit can have (`plan.retained_chunks`), which are
no run of the prompt's chain; so each window gets a chain of its own, named after the
chunk `e` that holds the end's last token: position j of window chain `e` holds chunk
`e - j`, the window's chunks from the end backwards. A hit ending in chunk `e` needs the
first k positions for some k, which is exactly a leading run.

Each sliding chunk of a write is stored once, in the window of the latest end whose
window needs it (`assign`): an earlier end whose window a later one overlaps cannot be
served from the server (its window chain lacks the shared chunks). Ends in one chunk
share its window chain (it holds the most chunks any of them needs).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence

from ...layout.groups import AttentionKind, KVLayout
from ...layout.plan import needed_chunks

_TAG = b"gemma4-kv:window:1\n"


def window_hashes(chain: Sequence[bytes], e: int, k: int) -> list[bytes]:
    """The first `k` keys of window chain `e`: chunk `e`'s hash (which names its whole
    prefix) and the position, so no two windows and no prompt chain share a key."""
    base = hashlib.sha256(_TAG + chain[e]).digest()
    return [hashlib.sha256(base + j.to_bytes(4, "little")).digest() for j in range(k)]


def end_chunk(end: int, chunk_size: int) -> int:
    """The chunk holding token `end - 1`: whose window chain serves a hit of `end`."""
    return (end - 1) // chunk_size


def window_need(layout: KVLayout, start: int, end: int, chunk_size: int) -> dict[int, int]:
    """Per sliding group, how many leading positions of window chain `end_chunk(end)` a
    hit of tokens [start, end) reads (0: none)."""
    e = end_chunk(end, chunk_size)
    out = {}
    for g in layout.groups:
        if g.kind is AttentionKind.SLIDING:
            chunks = needed_chunks(g, start - start % g.block_size, end, chunk_size)
            out[g.group_id] = e - chunks.start + 1 if chunks else 0
    return out


def assign(layout: KVLayout, chunk_size: int, ends: Sequence[int],
           cells: Sequence[tuple[int, int]]) -> dict[int, dict[int, set[int]]]:
    """Window chain positions of the sliding (chunk, group) `cells` of a write, given
    the request's hit `ends`: {end chunk e: {group: positions}}. Each cell goes to the
    latest end whose window needs it; cells no end needs are not stored."""
    sliding = {g.group_id for g in layout.groups if g.kind is AttentionKind.SLIDING}
    latest: dict[tuple[int, int], int] = {}
    for end in sorted(set(ends)):
        e = end_chunk(end, chunk_size)
        for g in layout.groups:
            if g.group_id in sliding:
                for c in needed_chunks(g, 0, end, chunk_size):
                    latest[(c, g.group_id)] = e
    out: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for c, gid in cells:
        e_latest = latest.get((c, gid))
        if e_latest is not None:
            out[e_latest][gid].add(e_latest - c)
    return {e: dict(per) for e, per in out.items()}
