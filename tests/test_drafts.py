"""The draft policy's chunk arithmetic, against values derived by hand (chunks of 64
tokens). `DraftPolicy.from_vllm` runs in tests/test_e2e_eagle.py on a real engine."""

from __future__ import annotations

from gemma4_kv.layout.drafts import DraftPolicy


def test_without_drafts_that_own_kv_nothing_is_impure():
    plain = DraftPolicy(64)
    assert (plain.lookahead, plain.decode_margin) == (0, 0)
    assert not plain.drafter_skipped([10**9])
    assert list(plain.impure_chunks(0, 100, 300, skipped=False)) == []


def test_the_v1_runner_makes_a_prefill_step_end_impure():
    """The padded drafter batch reads the wrong token at a step's last position (99, in
    chunk 1) unless the prompt ends there (300 of 300)."""
    v1 = DraftPolicy(64, 1, 4, impure_step_ends=True, drafter_room=1000)
    assert list(v1.impure_chunks(0, 100, 300, skipped=False)) == [1]
    assert list(v1.impure_chunks(100, 200, 300, skipped=False)) == []
    assert list(DraftPolicy(64, 1, 4).impure_chunks(0, 100, 300, skipped=False)) == []


def test_a_step_the_drafter_skips_makes_all_it_computes_impure():
    """A batch ending past the drafter's room (1000) runs no drafter: tokens 100..199
    lie in chunks 1, 2 and 3."""
    v1 = DraftPolicy(64, 1, 4, impure_step_ends=True, drafter_room=1000)
    assert v1.drafter_skipped([500, 1001]) and not v1.drafter_skipped([1000])
    assert not v1.drafter_skipped([])
    assert list(v1.impure_chunks(100, 100, 300, skipped=True)) == [1, 2, 3]
