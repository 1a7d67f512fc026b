"""Planner against a brute-force per-token oracle over random groups and lengths."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings, strategies as st

from gemma4_kv.layout import AttentionKind, KVGroup, KVLayout
from gemma4_kv.plan import (NULL_BLOCK, chunk_blocks, load_blocks, max_servable_hit,
                            needed_blocks, save_blocks)


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 4))
    groups = []
    for gid in range(n):
        sliding = draw(st.booleans())
        groups.append(KVGroup(
            group_id=gid, kind=AttentionKind.SLIDING if sliding else AttentionKind.FULL,
            window=draw(st.integers(1, 300)) if sliding else None,
            block_size=draw(st.sampled_from([1, 2, 4, 8, 16, 32])), num_kv_heads=1,
            head_size=8, head_size_v=8, dtype=torch.float16, layers=(f"g{gid}",)))
    layout = KVLayout(tuple(groups))
    chunk = layout.chunk_multiple * draw(st.integers(1, 4))
    return layout, chunk


def oracle_needed_tokens(g: KVGroup, start: int, hit: int) -> set[int]:
    lo = 0 if g.kind is AttentionKind.FULL else hit - g.window + 1
    return {t for t in range(start, hit) if t >= lo}


def oracle_needed_blocks(g, start, hit):
    # vLLM frees only blocks *wholly* before the window: a block with any needed
    # token is needed.
    return sorted({t // g.block_size for t in oracle_needed_tokens(g, start, hit)})


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_needed_blocks_match_oracle(lc, data):
    layout, chunk = lc
    for g in layout.groups:
        hit = data.draw(st.integers(0, 40)) * g.block_size
        start = data.draw(st.integers(0, hit // g.block_size)) * g.block_size
        assert list(needed_blocks(g, start, hit)) == oracle_needed_blocks(g, start, hit)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.data())
def test_chunk_blocks_match_per_token_mapping(lc, data):
    layout, chunk = lc
    n_chunks = data.draw(st.integers(1, 5))
    for g in layout.groups:
        ids = data.draw(st.lists(st.integers(1, 10_000), min_size=n_chunks * chunk // g.block_size,
                                 max_size=n_chunks * chunk // g.block_size))
        c = data.draw(st.integers(0, n_chunks - 1))
        cb = chunk_blocks(g, c, chunk, ids)
        want = {(t - c * chunk) // g.block_size: ids[t // g.block_size]
                for t in range(c * chunk, (c + 1) * chunk)}
        assert dict(zip(cb.slots, cb.block_ids)) == want
        assert len(cb.slots) == chunk // g.block_size


@settings(max_examples=300, deadline=None)
@given(layouts(), st.data())
def test_max_servable_hit_matches_oracle(lc, data):
    layout, chunk = lc
    max_chunks = data.draw(st.integers(0, 8))
    present = {(g.group_id, c): data.draw(st.booleans())
               for g in layout.groups for c in range(max_chunks)}
    start = data.draw(st.integers(0, max_chunks)) * layout.chunk_multiple
    limit = data.draw(st.integers(0, max_chunks * chunk // layout.chunk_multiple)) \
        * layout.chunk_multiple

    def oracle():
        for hit in range(limit, start, -1):  # every token count; the first servable wins
            if hit % layout.chunk_multiple or (hit % chunk and hit != limit):
                continue  # hits end on a chunk boundary, or at the limit
            if all(present[(g.group_id, t // chunk)] for g in layout.groups
                   for t in oracle_needed_tokens(g, min(start, hit), hit)):
                return hit
        return 0

    got = max_servable_hit(layout, chunk, max_chunks, lambda g, c: present[(g, c)], start,
                           limit)
    assert got == oracle()


def test_load_blocks_window_only():
    full = KVGroup(0, AttentionKind.FULL, None, 16, 1, 8, 8, torch.float16, ("f",))
    slide = KVGroup(1, AttentionKind.SLIDING, 100, 32, 1, 8, 8, torch.float16, ("s",))
    layout = KVLayout((full, slide))
    hit = 512  # 2 chunks of 256
    ids = (list(range(1, 33)), [NULL_BLOCK] * 12 + list(range(100, 104)))
    plan = load_blocks(layout, 0, hit, 256, ids)
    assert [(p.group_id, p.chunk, len(p.slots)) for p in plan] == [(0, 0, 16), (0, 1, 16), (1, 1, 4)]
    # window 100 before 512: tokens 413.., blocks 12..15 of the sliding group
    assert plan[-1].block_ids == (100, 101, 102, 103) and plan[-1].slots == (4, 5, 6, 7)


def test_save_refuses_freed_blocks():
    slide = KVGroup(0, AttentionKind.SLIDING, 8, 4, 1, 8, 8, torch.float16, ("s",))
    layout = KVLayout((slide,))
    assert save_blocks(layout, 0, 8, [[5, 6, 7, 8]]) is not None
    assert save_blocks(layout, 0, 8, [[0, 6, 7, 8]]) is None


def test_chunk_size_must_fit_every_group():
    g = KVGroup(0, AttentionKind.FULL, None, 32, 1, 8, 8, torch.float16, ("f",))
    with pytest.raises(ValueError, match="multiple"):
        max_servable_hit(KVLayout((g,)), 48, 2, lambda *_: True)
