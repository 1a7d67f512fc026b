"""Which blocks of which group a chunk of tokens covers, and what a cache hit needs.

A chunk is `chunk_size` tokens (LMCache's default 256), a multiple of every group's
block size, so chunk `c` of group `g` is exactly blocks
`[c * chunk_size / bs_g, (c + 1) * chunk_size / bs_g)` of the request. Full-attention
groups need every token before a hit; sliding-window groups only the window before
it, exactly as vLLM's `SlidingWindowManager` keeps it: after `H` computed tokens it
frees the blocks wholly before token `H - window + 1` (they become the null block 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .layout import AttentionKind, KVGroup, KVLayout

NULL_BLOCK = 0
"""vLLM's null block: stands for freed (out-of-window) sliding-window blocks."""


def check_chunk_size(layout: KVLayout, chunk_size: int) -> None:
    if chunk_size <= 0 or chunk_size % layout.chunk_multiple:
        raise ValueError(f"chunk size {chunk_size} is not a multiple of every group's "
                         f"block size (lcm {layout.chunk_multiple})")


def first_needed_token(group: KVGroup, hit_len: int) -> int:
    """First token whose KV the next token after a hit of `hit_len` can attend to."""
    if group.kind is AttentionKind.FULL:
        return 0
    return max(0, hit_len - group.window + 1)


def needed_blocks(group: KVGroup, start: int, hit_len: int) -> range:
    """Logical blocks of `group` to load so that tokens [start, hit_len) are usable.

    `start` is where the local (already cached) prefix ends; it and `hit_len` are
    multiples of the group's block size. Sliding groups skip blocks vLLM will have
    replaced by the null block: those wholly before the window.
    """
    bs = group.block_size
    if start % bs or hit_len % bs:
        raise ValueError(f"[{start}, {hit_len}) is not aligned to block size {bs}")
    first = max(start, first_needed_token(group, hit_len) // bs * bs)
    return range(first // bs, hit_len // bs)


def needed_chunks(group: KVGroup, start: int, hit_len: int, chunk_size: int) -> range:
    blocks = needed_blocks(group, start, hit_len)
    if not blocks:
        return range(0)
    per_chunk = chunk_size // group.block_size
    return range(blocks.start // per_chunk, (blocks.stop - 1) // per_chunk + 1)


def hit_chunks(layout: KVLayout, start: int, hit: int, chunk_size: int) -> list[tuple[int, int]]:
    """(group id, chunk) of every stored object a hit of `hit` tokens after a local
    prefix of `start` tokens needs: full groups every chunk from `start`, sliding
    groups only those overlapping their window."""
    return [(g.group_id, c) for g in layout.groups
            for c in needed_chunks(g, start - start % g.block_size, hit, chunk_size)]


def max_servable_hit(layout: KVLayout, chunk_size: int, max_chunks: int,
                     present: Callable[[int, int], bool], start: int = 0,
                     limit: int | None = None) -> int:
    """Largest hit length every group can serve from the first `max_chunks` chunks.

    `present(group_id, chunk)` says whether that group's object for that chunk is
    stored. Full groups need every chunk from `start` on; sliding groups only the
    chunks that overlap their window before the hit. A hit never exceeds `limit` (a
    multiple of every block size; vLLM must compute at least the last prompt token),
    so it may end inside the last chunk it uses: only that chunk's blocks before the
    hit are loaded, as vLLM's own prefix cache would reuse them.
    """
    check_chunk_size(layout, chunk_size)
    limit = max_chunks * chunk_size if limit is None else min(limit, max_chunks * chunk_size)
    if limit % layout.chunk_multiple:
        raise ValueError(f"limit {limit} is not a multiple of {layout.chunk_multiple}")
    for n in range(-(-limit // chunk_size), start // chunk_size, -1):
        hit = min(n * chunk_size, limit)
        if hit <= start:
            break
        if all(present(g, c) for g, c in hit_chunks(layout, start, hit, chunk_size)):
            return hit
    return 0


@dataclass(frozen=True)
class ChunkBlocks:
    """The blocks of one group that travel with one chunk.

    `slots[i]` is the position (in blocks) of `block_ids[i]` inside the chunk's
    object: token `slots[i] * block_size + t` of the chunk is token `t` of the block.
    """

    group_id: int
    chunk: int
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]


def chunk_blocks(group: KVGroup, chunk: int, chunk_size: int,
                 block_ids: Sequence[int], wanted: range | None = None) -> ChunkBlocks:
    """Blocks of `group` in `chunk`, restricted to the logical blocks in `wanted`."""
    per_chunk = chunk_size // group.block_size
    first = chunk * per_chunk
    logical = range(first, first + per_chunk)
    if wanted is not None:
        logical = range(max(logical.start, wanted.start), min(logical.stop, wanted.stop))
    if logical and logical.stop > len(block_ids):
        raise ValueError(f"group {group.group_id}: chunk {chunk} needs block "
                         f"{logical.stop - 1}, request has {len(block_ids)}")
    return ChunkBlocks(group.group_id, chunk, tuple(i - first for i in logical),
                       tuple(block_ids[i] for i in logical))


def save_blocks(layout: KVLayout, chunk: int, chunk_size: int,
                block_ids: Sequence[Sequence[int]]) -> list[ChunkBlocks] | None:
    """All groups' blocks of a chunk to store, or None if any block was freed.

    A chunk is stored for all groups or not at all; vLLM frees out-of-window
    sliding blocks only more than `window` tokens behind the newest computed token,
    so this happens only for windows smaller than a chunk under chunked prefill.
    """
    out = [chunk_blocks(g, chunk, chunk_size, block_ids[g.group_id]) for g in layout.groups]
    if any(b == NULL_BLOCK for cb in out for b in cb.block_ids):
        return None
    return out


def load_blocks(layout: KVLayout, start: int, hit_len: int, chunk_size: int,
                block_ids: Sequence[Sequence[int]]) -> list[ChunkBlocks]:
    """Per group and chunk, the blocks to fill so tokens [start, hit_len) are usable."""
    out = []
    for g in layout.groups:
        lo = start - start % g.block_size
        wanted = needed_blocks(g, lo, hit_len)
        for c in needed_chunks(g, lo, hit_len, chunk_size):
            cb = chunk_blocks(g, c, chunk_size, block_ids[g.group_id], wanted)
            if any(b == NULL_BLOCK for b in cb.block_ids):
                raise ValueError(f"group {g.group_id}: vLLM gave the null block for a "
                                 f"block of chunk {c} the hit needs")
            out.append(cb)
    return out
