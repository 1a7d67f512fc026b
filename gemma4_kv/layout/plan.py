"""Which blocks of which group a chunk of tokens covers, and what a cache hit needs.

A chunk is `chunk_size` tokens (LMCache's default 256), a multiple of every group's
block size, so chunk `c` of group `g` is exactly blocks
`[c * chunk_size / bs_g, (c + 1) * chunk_size / bs_g)` of the request. Full-attention
groups need every token before a hit; sliding-window groups only the window before
it, exactly as vLLM's `SlidingWindowManager` keeps it: after `H` computed tokens it
frees the blocks wholly before token `H - window + 1 - extra_retained_tokens` (they
become the null block 0).

Retention: a sliding group's objects are useful only where a hit can end, so they are
stored only for the chunks in the window before a request's planned hit ends
(`retained_chunks`, `retention`); full-attention groups store every chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .groups import AttentionKind, KVGroup, KVLayout

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
    reach = group.reach
    assert reach is not None  # a sliding group has a window
    return max(0, hit_len - reach + 1)


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


def servable_hits(layout: KVLayout, chunk_size: int, max_chunks: int,
                  present: Callable[[int, int], bool], start: int = 0,
                  limit: int | None = None) -> list[int]:
    """Every hit length (descending) that every group can serve from the first
    `max_chunks` chunks: chunk ends, and `limit` itself when it falls inside a chunk.

    `present(group_id, chunk)` says whether that group's object for that chunk is
    stored. Full groups need every chunk from `start` on; sliding groups only the
    chunks that overlap their window before the hit. A hit never exceeds `limit` (a
    multiple of every block size; vLLM must compute at least the last prompt token),
    so it may end inside the last chunk it uses: only that chunk's blocks before the
    hit are loaded, as vLLM's own prefix cache would reuse them. Tensor-parallel ranks
    answer this list so the scheduler can take the longest hit all of them can serve."""
    check_chunk_size(layout, chunk_size)
    limit = max_chunks * chunk_size if limit is None else min(limit, max_chunks * chunk_size)
    if limit % layout.chunk_multiple:
        raise ValueError(f"limit {limit} is not a multiple of {layout.chunk_multiple}")
    # Each candidate needs a contiguous run of chunks per group: prefix counts of the
    # present chunks answer each in O(groups), not O(chunks).
    n_max = -(-limit // chunk_size)
    counts = {}
    for g in layout.groups:
        c = [0]
        for i in range(n_max):
            c.append(c[-1] + bool(present(g.group_id, i)))
        counts[g.group_id] = c
    out = []
    for n in range(n_max, start // chunk_size, -1):
        hit = min(n * chunk_size, limit)
        if hit <= start:
            break
        if all(counts[g.group_id][r.stop] - counts[g.group_id][r.start] == len(r)
               for g in layout.groups
               for r in [needed_chunks(g, start - start % g.block_size, hit, chunk_size)]):
            out.append(hit)
    return out


def window_chunks(group: KVGroup, chunk_size: int) -> int:
    """Trailing chunks a group needs to serve a hit ending on a chunk boundary
    (LMCache's `sliding_window_size`; -1 for full attention). A hit ending inside a
    chunk may need one chunk more (`hit_chunks` says which)."""
    if group.kind is AttentionKind.FULL:
        return -1
    reach = group.reach
    assert reach is not None  # a sliding group has a window
    return max(1, -(-(reach - 1) // chunk_size))


def hit_ends(num_chunks: int, chunk_size: int, limit: int, interval: int) -> list[int]:
    """Where a request's stored chunks may serve hits: every `interval` tokens
    (0: every chunk end), its last full chunk, and `limit` (the hit of the same prompt
    asked again, at most one token short of it on a block boundary)."""
    last = num_chunks * chunk_size
    step = interval or chunk_size
    ends = set(range(step, last + 1, step)) | {last}
    if 0 < limit < last:
        ends.add(limit)
    return sorted(e for e in ends if e > 0)


def retained_chunks(group: KVGroup, chunk_size: int, ends: Sequence[int]) -> set[int]:
    """Chunks of `group` to store so that hits ending at `ends` can be served: all for
    full attention, the windows before the ends for sliding groups."""
    if group.kind is AttentionKind.FULL:
        return set(range(max(ends, default=0) // chunk_size))
    return {c for e in ends for c in needed_chunks(group, 0, e, chunk_size)}


@dataclass(frozen=True)
class Retention:
    """What the saves of one prompt keep (`retention`): every chunk of full-attention
    groups; a sliding group's only in the windows before the prompt's hit ends; every
    group's for generated tokens, whose end is open."""

    ends: tuple[int, ...]
    """Where the prompt's stored chunks serve hits (`hit_ends`), ascending."""
    main: frozenset[int]
    """The ends a whole prompt's hit stops at: its last full chunk and the hit of the
    same prompt asked again. The others are kept only so that a hit can stop there (a
    store that ranks ends evicts them first)."""
    prompt_chunks: int
    kept: tuple[tuple[int, frozenset[int] | None], ...]
    """(group id, its prompt chunks to store) per group; None: every chunk."""

    def groups(self, chunk: int) -> tuple[int, ...]:
        """The groups to store chunk `chunk` for."""
        if chunk >= self.prompt_chunks:
            return tuple(g for g, _ in self.kept)
        return tuple(g for g, chunks in self.kept if chunks is None or chunk in chunks)


def retention(layout: KVLayout, chunk_size: int, prompt_len: int, interval: int,
              lookahead: int = 0, intermediate: frozenset[int] | None = None) -> Retention:
    """The retention of a prompt of `prompt_len` tokens: hit ends every `interval`
    tokens (`hit_ends`; of those other than the main ones only `intermediate`, unless
    None), with `lookahead` tokens past a chunk in its key (drafts)."""
    m, c = layout.chunk_multiple, chunk_size
    last = prompt_len // c * c
    again = min((prompt_len - lookahead) // c * c, (prompt_len - 1) // m * m)
    ends = hit_ends(last // c, c, again, interval)
    if intermediate is not None:
        ends = [e for e in ends if e in (last, again) or e in intermediate]
    kept = tuple((g.group_id, None if g.kind is AttentionKind.FULL
                  else frozenset(retained_chunks(g, c, ends))) for g in layout.groups)
    return Retention(tuple(ends), frozenset({last, again}), last // c, kept)


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
                block_ids: Sequence[Sequence[int]],
                groups: Sequence[int] | None = None) -> list[ChunkBlocks]:
    """The blocks of a chunk to store, for `groups` (default: all).

    A group whose blocks of this chunk were freed is left out: vLLM frees sliding
    blocks more than `window` tokens behind the newest computed token, which for a
    window smaller than a chunk can happen before the chunk completes. Full-attention
    blocks are never freed while the request runs.
    """
    wanted = layout.groups if groups is None else [layout.groups[g] for g in groups]
    out = [chunk_blocks(g, chunk, chunk_size, block_ids[g.group_id]) for g in wanted]
    return [cb for cb in out if NULL_BLOCK not in cb.block_ids]


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


def cut_before(limit: int, spans: Sequence[tuple[int, int]], multiple: int = 1) -> int:
    """The largest multiple of `multiple` <= `limit` that ends inside none of `spans`
    ([a, b) ranges: a hit may end at a or b, not strictly between)."""
    limit -= limit % multiple
    moved = True
    while moved:
        moved = False
        for a, b in spans:
            if a < limit < b:
                limit, moved = a - a % multiple, True
    return limit
