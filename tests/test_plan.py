"""Planner against a brute-force per-token oracle over random groups and lengths."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings, strategies as st

from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
from gemma4_kv.layout.from_hf import hf_layout, load_text_config
from gemma4_kv.layout.plan import (NULL_BLOCK, chunk_blocks, hit_ends, load_blocks,
                                   needed_blocks, retained_chunks, retention, save_blocks,
                                   servable_hits)
from model_keys import max_servable_hit


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
            head_size=8, head_size_v=8, dtype=torch.float16, layers=(f"g{gid}",),
            extra_retained_tokens=draw(st.integers(0, 3)) if sliding else 0))
    layout = KVLayout(tuple(groups))
    chunk = layout.chunk_multiple * draw(st.integers(1, 4))
    return layout, chunk


def oracle_needed_tokens(g: KVGroup, start: int, hit: int) -> set[int]:
    # vLLM skips max(0, T - W + 1 - extra_retained_tokens) tokens
    lo = 0 if g.kind is AttentionKind.FULL else hit - g.window + 1 - g.extra_retained_tokens
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


def test_save_leaves_out_groups_whose_blocks_were_freed():
    slide = KVGroup(0, AttentionKind.SLIDING, 8, 4, 1, 8, 8, torch.float16, ("s",))
    full = KVGroup(1, AttentionKind.FULL, None, 4, 1, 8, 8, torch.float16, ("f",))
    layout = KVLayout((slide, full))
    assert [cb.group_id for cb in save_blocks(layout, 0, 8, [[5, 6], [7, 8]])] == [0, 1]
    assert [cb.group_id for cb in save_blocks(layout, 0, 8, [[0, 6], [7, 8]])] == [1]
    assert save_blocks(layout, 0, 8, [[5, 6], [7, 8]], groups=(1,))[0].group_id == 1


def test_skipped_tokens_agree_with_vllms_sliding_window_manager():
    """What a load fills is what vLLM keeps: its own skipped-token count, extra retained
    tokens (multi-module MTP) included."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    for window, extra, bs in ((100, 0, 32), (100, 2, 16), (512, 3, 32)):
        g = KVGroup(0, AttentionKind.SLIDING, window, bs, 1, 8, 8, torch.float16, ("s",),
                    extra_retained_tokens=extra)
        manager = SlidingWindowManager.__new__(SlidingWindowManager)
        manager.sliding_window, manager.extra_retained_tokens = window, extra
        for hit in range(bs, 2048, bs):
            skipped = manager.get_num_skipped_tokens(hit)
            assert needed_blocks(g, 0, hit).start == skipped // bs


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(1, 40), st.sampled_from([0, 1, 2, 4]))
def test_retained_chunks_serve_every_planned_end(lc, num_chunks, every):
    """Sliding groups store only the windows before a request's planned ends, yet a
    lookup of that prompt or of any prefix ending at an interval boundary finds a hit
    exactly there."""
    layout, chunk = lc
    m = layout.chunk_multiple
    prompt = num_chunks * chunk + (m if num_chunks % 2 else 0)
    limit = (prompt - 1) // m * m
    ends = hit_ends(num_chunks, chunk, limit, every * chunk)
    kept = {g.group_id: retained_chunks(g, chunk, ends) for g in layout.groups}

    def present(g, c):
        return c in kept[g]

    assert max_servable_hit(layout, chunk, num_chunks, present, limit=limit) == \
        min(limit, num_chunks * chunk)
    for e in ends:
        assert max_servable_hit(layout, chunk, num_chunks, present, limit=e) == e
    for g in layout.groups:
        if g.kind is AttentionKind.FULL:
            assert kept[g.group_id] == set(range(num_chunks))


def test_servable_hits_lists_every_end_in_descending_order():
    full = KVGroup(0, AttentionKind.FULL, None, 16, 1, 8, 8, torch.float16, ("f",))
    slide = KVGroup(1, AttentionKind.SLIDING, 100, 16, 1, 8, 8, torch.float16, ("s",))
    layout = KVLayout((full, slide))
    stored = {0: set(range(8)), 1: {1, 2, 5, 6}}
    hits = servable_hits(layout, 64, 8, lambda g, c: c in stored[g], limit=480)
    assert hits == [448, 192]  # windows [349, 448) and [93, 192) lie in stored chunks
    assert max_servable_hit(layout, 64, 8, lambda g, c: c in stored[g], limit=480) == 448


def test_retention_of_a_prompt_by_hand():
    """Chunk 64, blocks of 16, a sliding window of 40, hit ends every 128 tokens. A
    256-token prompt asked again hits 240 (one token short, on a block boundary); with
    a draft lookahead its last chunk's key needs token 256, so it hits 192. A hit at e
    needs the sliding blocks from (e - 40 + 1) // 16: chunk 1 for 128, 2 for 192, 3 for
    240 and 256."""
    full = KVGroup(0, AttentionKind.FULL, None, 16, 1, 8, 8, torch.float16, ("f",))
    slide = KVGroup(1, AttentionKind.SLIDING, 40, 16, 1, 8, 8, torch.float16, ("s",))
    layout = KVLayout((full, slide))
    plain = retention(layout, 64, 256, 128)
    assert plain.ends == (128, 240, 256) and plain.main == {240, 256}
    assert [plain.groups(c) for c in range(5)] == [(0,), (0, 1), (0,), (0, 1), (0, 1)]
    drafts = retention(layout, 64, 256, 128, lookahead=1)
    assert drafts.ends == (128, 192, 256) and drafts.main == {192, 256}
    assert [drafts.groups(c) for c in range(4)] == [(0,), (0, 1), (0, 1), (0, 1)]


def test_retention_stores_a_third_of_the_dense_bytes_of_a_31b_shape():
    """31B-like groups (5 sliding of window 1024, 1 full), R = 4096, a 32K-token prompt:
    at most a third of the dense bytes per stored token."""
    from gemma4_kv.tools.cli import bundled_config

    layout = hf_layout(load_text_config(bundled_config("gemma4-31b-like")),
                       dtype=torch.bfloat16, block_size=16)
    chunk, prompt = 256, 32768
    m = layout.chunk_multiple
    ends = hit_ends(prompt // chunk, chunk, (prompt - 1) // m * m, 4096)
    stored = sum(len(retained_chunks(g, chunk, ends)) * chunk * g.bytes_per_token
                 for g in layout.groups)
    dense = prompt * sum(g.bytes_per_token for g in layout.groups)
    assert stored / dense <= 1 / 3, stored / dense


def test_chunk_size_must_fit_every_group():
    g = KVGroup(0, AttentionKind.FULL, None, 32, 1, 8, 8, torch.float16, ("f",))
    with pytest.raises(ValueError, match="multiple"):
        max_servable_hit(KVLayout((g,)), 48, 2, lambda *_: True)
