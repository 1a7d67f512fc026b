"""Intermediate hit ends kept once a prompt branches there (`intermediate_ends`
"branched", the default; `connector/branches.py`): the memory alone, then the real
scheduler half and store (tests/scheduler_half.py) with hits derived by hand, and the
same prompts with "always" as the control."""

from __future__ import annotations

import random

import pytest

from gemma4_kv.connector.branches import BranchMemory


def chain(*parts: str) -> list[bytes]:
    """Rolling keys of chunks named by `parts` (key i names parts 0..i, as a prefix)."""
    return [("/".join(parts[:i + 1])).encode() for i in range(len(parts))]


def test_an_end_is_kept_where_a_prefix_seen_before_goes_on_differently():
    m = BranchMemory()
    a = chain("a0", "a1", "a2", "a3")  # 4 chunks of 2 tokens: ends 2 4 6 | last 8
    assert m.branch_points(a, 2, [2, 4, 6], 8) == frozenset()  # nothing seen before
    assert m.branch_points(a, 2, [2, 4, 6], 8) == frozenset()  # the same prompt again
    b = chain("a0", "a1", "b2", "b3")  # shares 4 tokens with a, then goes on differently
    assert m.branch_points(b, 2, [2, 4, 6], 8) == frozenset({4})
    c = chain("a0", "a1", "b2", "c3")  # shares 6 with b, 4 with a
    assert m.branch_points(c, 2, [2, 4, 6], 8) == frozenset({6})
    # a prompt that extends a: a's last end is where it branches from a
    d = chain("a0", "a1", "a2", "a3", "d4", "d5")
    assert m.branch_points(d, 2, [2, 4, 6, 8, 10], 12) == frozenset({8})


def test_the_memory_forgets_the_least_recently_seen_prefixes():
    m = BranchMemory(capacity=4)
    a = chain("a0", "a1")
    m.branch_points(a, 1, [1], 2)  # remembers a0, a0/a1
    m.branch_points(chain("x0", "x1"), 1, [1], 2)  # and x0, x0/x1: full
    m.branch_points(chain("y0", "y1"), 1, [1], 2)  # a0 and a0/a1 go
    assert m.branch_points(chain("a0", "z1"), 1, [1], 2) == frozenset()


# -- through the connector's scheduler half and a real store ---------------------------

_rng = random.Random(5)
DOC = [_rng.randrange(3, 500) for _ in range(600)]
"""The shared prefix: 600 tokens, so chunks 0 and 1 (512 tokens) are the same in every
prompt below and chunk 2 differs."""


def tails(n: int) -> list[list[int]]:
    return [[_rng.randrange(3, 500) for _ in range(500)] for _ in range(n)]


@pytest.mark.vllm
@pytest.mark.parametrize("mode, hits", [("branched", [0, 0, 512]), ("always", [0, 512, 512])])
def test_a_third_prompt_hits_where_the_second_branched(tmp_path, mode, hits):
    """Three prompts of 1100 tokens (chunk 256, retention_interval 512, sliding window
    100: a hit ending at E needs the full groups' chunks before E and the sliding
    groups' chunk ending at E), sharing their first 600 tokens. By hand:
    - "branched": the first stores its full chunks 0-3 and the sliding chunk 3 (its end
      at 1024) only: the second finds no window at 512, a miss; it branches at 512
      (prefix seen, its own 1024 not), so it stores sliding chunk 1; the third hits 512.
    - "always" (the control): the first stores sliding chunk 1 too; the second hits."""
    from needs import require

    require("vllm")
    from gemma4_kv.tools.harness import save_config, tiny_gemma4_config
    from scheduler_half import SchedulerHalf

    model = save_config(tiny_gemma4_config(window=100), tmp_path / "model")
    half = SchedulerHalf(model, ranks=1, extra={"intermediate_ends": mode})
    try:
        got, ends = [], []
        for tail in tails(3):
            r = half.request(DOC + tail)
            hit, meta = half.schedule(r)
            got.append(hit)
            ends.append(sorted(e for s in meta.saves for e in s.write.ends))
            half.work(meta)
            r.num_computed_tokens = r.num_tokens
            half.finish(r)
        assert got == hits
        if mode == "branched":
            assert ends == [[1024], [512, 1024], [512, 1024]]
        else:
            assert ends == [[512, 1024]] * 3
    finally:
        half.close()
