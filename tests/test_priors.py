"""Priors of the lookup wait (issue 33 item 2): the prefill FLOPs estimate, the rates
file a later engine reads, and the wait past its budget while bytes keep arriving. All
expected values are worked out by hand in the comments; no clock is read."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
from gemma4_kv.lookup import rate_file
from gemma4_kv.lookup.priors import (ModelShape, device_flops, model_shape, prefill_flops,
                                     prefill_prior)
from gemma4_kv.lookup.rate_file import RateFile
from gemma4_kv.lookup.wait import Rates, Wait, WaitPolicy

SHAPE = ModelShape(layers=((8, None), (8, 4)), params=100)


def test_prefill_flops_by_hand():
    """Tokens 2-5 after 2 cached: 2 x 100 weights x 4 tokens = 800; the full layer's
    queries see 3+4+5+6 = 18 keys, the window-4 layer's 3+4+4+4 = 15; 4 x 8 per pair:
    576 + 480. Total 1856."""
    assert prefill_flops(SHAPE, 2, 4) == 1856
    assert prefill_flops(SHAPE, 0, 0) == 0
    seconds = prefill_prior(SHAPE, 464.0)
    assert seconds(2, 4) == pytest.approx(4.0)  # 1856 / 464
    assert prefill_prior(SHAPE, None) is None


def test_model_shape_by_hand():
    """hidden 16, MLP 32, 2 query heads. Full layer (head 8, 1 KV head): q 16 wide,
    k+v 16: 16 x (2x16 + 16) + 3 x 16 x 32 = 768 + 1536 = 2304. Each sliding layer
    (head 4, 2 KV heads): q 8, k+v 16: 16 x 32 + 1536 = 2048. 2304 + 2 x 2048 = 6400."""
    layout = KVLayout((
        KVGroup(0, AttentionKind.FULL, None, 16, 1, 8, 8, torch.float16, ("a",)),
        KVGroup(1, AttentionKind.SLIDING, 4, 16, 2, 4, 4, torch.float16, ("b", "c")),
    ))
    cfg = SimpleNamespace(hidden_size=16, intermediate_size=32, num_attention_heads=2)
    assert model_shape(cfg, layout) == ModelShape(((16, None), (8, 4), (8, 4)), 6400)
    assert device_flops("cpu") is None  # a CPU's prior is its measured prefill


@pytest.fixture
def rates_path(tmp_path):
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    return str(d / "rates.json")


def measured(path, tier="valkey@127.0.0.1:6379", engine="fp-a") -> Rates:
    """An engine that measured 1 ms per prefilled token and 1 GB/s from the tier."""
    rates = Rates(None, RateFile(path), tier=tier, engine=engine)
    rates.prefill(1000, 1.0)
    rates.fetched(10**9, 1.0)  # a finished fetch writes the file
    return rates


def test_a_new_engine_reads_what_the_last_one_measured(rates_path):
    measured(rates_path)
    again = Rates(None, RateFile(rates_path), tier="valkey@127.0.0.1:6379", engine="fp-a")
    assert again.prefill_s(1000) == pytest.approx(1.0)
    assert again.fetch_s(4 * 10**8) == pytest.approx(0.4)
    assert not again.tier_measured  # read, not seen
    # Its first lookup: worth 5 s (5000 tokens), 2 s expected (2 GB): twice that, 4 s,
    # far past the 0.5 s timeout, from the file alone.
    assert WaitPolicy(0.5, again).budget(5000, 2 * 10**9) == pytest.approx(4.0)
    other_tier = Rates(None, RateFile(rates_path), tier="/mnt/disk", engine="fp-a")
    assert other_tier.fetch_s(10**9) is None and other_tier.prefill_s(1000) == 1.0
    other_engine = Rates(None, RateFile(rates_path), tier="valkey@127.0.0.1:6379",
                         engine="fp-b")
    assert other_engine.fetch_s(10**9) is None and other_engine.prefill_s(1000) is None
    with open(rates_path) as f:
        assert "valkey" not in f.read()  # keys are hashes: no spec (or password) inside


def test_prefill_is_written_back_from_the_lookup_thread(rates_path):
    """The model thread's `prefill` never writes; the next lookup's `start` does."""
    rates = Rates(None, RateFile(rates_path), tier="t", engine="e")
    rates.prefill(2000, 1.0)  # 0.5 ms per token
    assert not os.path.exists(rates_path)
    WaitPolicy(0.5, rates).start(100.0, 10, None)
    assert Rates(None, RateFile(rates_path), tier="t", engine="e").prefill_s(
        1000) == pytest.approx(0.5)


def test_a_file_another_uid_could_have_written_is_ignored(rates_path, monkeypatch):
    measured(rates_path)
    fresh = lambda: Rates(None, RateFile(rates_path), tier="valkey@127.0.0.1:6379",  # noqa
                          engine="fp-a")
    assert fresh().fetch_s(10**9) == pytest.approx(1.0)
    os.chmod(rates_path, 0o620)  # group-writable
    assert fresh().fetch_s(10**9) is None and fresh().prefill_s(1) is None
    os.chmod(rates_path, 0o602)  # world-writable
    assert fresh().fetch_s(10**9) is None
    os.chmod(rates_path, 0o600)
    link = rates_path + ".link"
    os.symlink(rates_path, link)  # O_NOFOLLOW: never read through a link
    assert RateFile(link).read() == {}
    os.chmod(os.path.dirname(rates_path), 0o755)  # a directory others may enter
    assert fresh().fetch_s(10**9) is None
    os.chmod(os.path.dirname(rates_path), 0o700)
    assert fresh().fetch_s(10**9) == pytest.approx(1.0)
    if os.geteuid() == 0:
        os.chown(rates_path, 4242, -1)  # really another uid's file
    else:  # the file stays ours, but this process now runs as another uid
        real = os.getuid()
        monkeypatch.setattr(rate_file.os, "getuid", lambda: real + 1)
        monkeypatch.setattr(rate_file, "check_private_dir", lambda path: None)
    assert fresh().fetch_s(10**9) is None and fresh().prefill_s(1) is None


def test_garbage_and_absurd_values_read_as_nothing(rates_path):
    for text in ("not json", '{"version": 2, "entries": {}}', '[1, 2]',
                 '{"version": 1, "entries": {"tier:x": {"value": -1}}}'):
        fd = os.open(rates_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, text.encode())
        os.close(fd)
        assert RateFile(rates_path).read() == {}


def test_a_fetch_worth_twice_its_time_is_not_given_up_while_bytes_arrive():
    """timeout 1 s; a hit worth 32 s, 20,480 bytes; budget ended at 1 s (`until`)."""
    policy = WaitPolicy(1.0)
    w = lambda: Wait(0.0, 32.0, 20480, 1.0, 1.0, 0, 0.0)  # noqa: E731
    # Half the bytes in 1.5 s: 3 s in all at that rate, worth 32 >= 2 x 3: waits.
    a = w()
    assert policy.keep_waiting(a, 0.9, 4096)
    assert policy.keep_waiting(a, 1.5, 10240)
    # The same lookup then gets nothing more: given up 1 s after the last bytes.
    assert policy.keep_waiting(a, 2.4, 10240)
    assert not policy.keep_waiting(a, 2.5, 10240)
    # A twentieth of the bytes in 1.5 s: 30 s in all, 2 x 30 > 32: given up.
    b = w()
    assert policy.keep_waiting(b, 0.9, 512)
    assert not policy.keep_waiting(b, 1.5, 1024)
    # A store that reports nothing: its blind deadline.
    assert policy.keep_waiting(w(), 0.99, None) and not policy.keep_waiting(w(), 1.0, None)
    assert WaitPolicy.still_worth(32.0, 20480, 1.5, 10240)  # 2 x 3 s <= 32 s
    assert not WaitPolicy.still_worth(None, 20480, 1.5, 10240)  # worth unknown
