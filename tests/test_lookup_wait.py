"""How long a lookup waits for a slower tier (`lookup.wait`): the real LookupService on a
real embedded store whose disk tier (LMCache's fs_native) stops answering, with the
service's clock in the test's hands, so waits are counted, never timed.

Sizes by hand (test_store's layout, chunk 32): a 2-chunk prompt asks for up to 64
tokens; chunk 0 is in L1 (a 32-token hit), chunk 1 only on disk, so a fetch adds 32
tokens and brings up chunk 1's objects of both groups (12 KiB + 8 KiB = 20,480 bytes:
`test_store.OBJECT`).
"""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.lookup import messages
from gemma4_kv.lookup.service import LookupService
from gemma4_kv.lookup.wait import PAUSE_AFTER, Rates, WaitPolicy
from gemma4_kv.stores.base import HIGH, LOW
from model_keys import chunk_hashes
from test_store import (CHUNK, LAYOUT, OBJECT, disk_store, evict, hang_l2, put,
                        stored_on_disk, wait_for)

FETCH_BYTES = OBJECT[0] + OBJECT[1]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counts:
    def __init__(self):
        self.data = {}

    def add(self, name, value, group=None):
        self.data[name] = self.data.get(name, 0) + value

    def lookup(self, *a):
        self.add("lookups", 1)


def test_budgets_by_hand():
    rates = Rates()
    policy = WaitPolicy(0.5, rates)
    assert policy.budget(1000, 10**8) == 0.5  # nothing measured: the timeout
    rates.prefill(1000, 1.0)  # 1 ms per token
    assert policy.budget(1000, None) == 0.5  # worth 1 s; fetch time unknown
    rates.fetched(10**9, 1.0)  # 1 GB/s
    assert policy.budget(1000, 10**8) == 0.5  # 0.1 s expected: 2x that < the timeout
    assert policy.budget(1000, 4 * 10**8) == pytest.approx(0.8)  # 2 x 0.4 s
    assert policy.budget(1000, 6 * 10**8) == pytest.approx(1.0)  # capped by its worth
    assert policy.budget(1000, 2 * 10**9) == 0.0  # 2 s to fetch what 1 s recomputes
    assert policy.budget(300, 10**8) == pytest.approx(0.3)  # worth 0.3 s only
    assert policy.budget(100, 4 * 10**8) == 0.0  # 0.4 s to fetch what 0.1 s recomputes


@pytest.fixture
def tier(tmp_path, monkeypatch):
    """(service, store, clock, counts, chain, release of the disk): chunk 0 in L1,
    chunk 1 only on a disk that stops answering."""
    from gemma4_kv.stores import embedded_l2

    monkeypatch.setattr(embedded_l2, "L2_TASK_LIMIT_S", 10**6)  # never given up here
    s = disk_store(tmp_path)
    gen = torch.Generator().manual_seed(21)
    chain = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
    put(s, chain, gen, ends=[(2 * CHUNK, HIGH), (CHUNK, LOW)])
    wait_for(lambda: stored_on_disk(tmp_path, 4))
    evict(s, chain[1:])
    assert s.resident(chain) == {0: {0}, 1: {0}}
    state, release = hang_l2(s)
    clock, counts, rates = Clock(), Counts(), Rates()
    service = LookupService(s, LAYOUT, CHUNK, timeout_s=1.0, stats=counts, rates=rates,
                            clock=clock)
    yield service, s, clock, counts, chain, release
    release()
    service.close()
    s.close()


def ask(service, chain, req="r"):
    return service.lookup(messages.Lookup(req, chain, 0, 2 * CHUNK))


def test_a_slow_but_progressing_tier_keeps_the_lookup_pending_until_the_hit_arrives(tier):
    """Measured: prefill 1 s per token (32 tokens: worth 32 s), the tier 1,024 B/s (the
    fetch: 20 s expected). The lookup stays pending 10 s in, far past `timeout_s` (it
    gave up there before), and serves the whole 64 tokens once the disk delivers."""
    service, store, clock, counts, chain, release = tier
    service.wait.rates.prefill(64, 64.0)
    service.wait.rates.fetched(1024, 1.0)
    assert service.wait.budget(CHUNK, FETCH_BYTES) == pytest.approx(32.0)
    assert ask(service, chain).pending
    clock.now += 10.0
    assert ask(service, chain).pending
    release()
    wait_for(lambda: (store.poll(), service._pending["r"].prefetch.finished)[1])
    reply = ask(service, chain)
    assert reply.pinned == 2 * CHUNK and reply.from_l2 == CHUNK
    assert counts.data.get("l2_waits_given_up", 0) == 0
    service.release("r", 0)


def test_a_stalled_tier_is_bounded_and_pauses_no_other_lookup(tier):
    """Nothing measured: a lookup waits `timeout_s` for a disk that never answers, then
    serves chunk 0 from L1. The next request still asks the disk (a single give-up
    pauses nothing); only PAUSE_AFTER give-ups in a row skip it."""
    service, store, clock, counts, chain, release = tier
    assert ask(service, chain, "a").pending
    clock.now += 0.99
    assert ask(service, chain, "a").pending
    clock.now += 0.02
    reply = ask(service, chain, "a")
    assert not reply.pending and reply.pinned == CHUNK
    assert counts.data["l2_waits_given_up"] == 1
    service.release("a", 0)
    for i in range(1, PAUSE_AFTER):
        assert ask(service, chain, f"b{i}").pending  # asked again: not paused
        clock.now += 1.01
        assert ask(service, chain, f"b{i}").pinned == CHUNK
        service.release(f"b{i}", 0)
    assert counts.data["l2_waits_given_up"] == PAUSE_AFTER
    reply = ask(service, chain, "c")  # paused now: answered from L1 at once
    assert not reply.pending and reply.pinned == CHUNK
    assert counts.data["l2_lookups_paused"] == 1
    service.release("c", 0)


def test_a_fetch_slower_than_recomputing_is_not_waited_for(tier):
    """Measured: prefill 1 ms per token (32 tokens: worth 32 ms), the tier 1,024 B/s
    (20 s for the fetch): the lookup answers from L1 at once and asks the disk nothing."""
    service, store, clock, counts, chain, release = tier
    service.wait.rates.prefill(1000, 1.0)
    service.wait.rates.fetched(1024, 1.0)
    reply = ask(service, chain)
    assert not reply.pending and reply.pinned == CHUNK
    assert counts.data["l2_fetches_not_worth_it"] == 1 and not store.in_flight()
    service.release("r", 0)


def test_the_step_timer_reports_each_step_once_with_its_tokens(monkeypatch):
    from types import SimpleNamespace

    from gemma4_kv.transfer import step_timer
    from gemma4_kv.transfer.step_timer import StepTimer

    clock = iter([10.0, 10.25, 20.0, 20.5, 30.0, 30.5])  # start / stop of each step
    monkeypatch.setattr(step_timer, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    seen = []
    timer = StepTimer(False, lambda tokens, seconds: seen.append((tokens, seconds)))
    timer.stop(100)  # no step started: nothing to report
    timer.start()
    timer.stop(300)
    timer.stop(300)  # the same step again: reported once
    timer.start()
    timer.stop(0)  # a step that computed nothing
    assert seen == [(300, 0.25)]  # 10.25 - 10.0 on the clock above
    rates = Rates()
    rates.prefill(32, 1.0)  # too few tokens to say anything about prefill
    assert rates.prefill_s(1) is None
    rates.prefill(300, 0.3)
    assert rates.prefill_s(1000) == pytest.approx(1.0)


def with_priors(service, tier_bytes_per_s: float, tmp_path) -> None:
    """A new engine's rates: prefill from a prior of 1 s per token (32 tokens: worth
    32 s), the tier's throughput from a rates file an earlier engine wrote."""
    from gemma4_kv.lookup.rate_file import RateFile

    d = tmp_path / "rates"
    d.mkdir(mode=0o700)
    path = str(d / "rates.json")
    earlier = Rates(None, RateFile(path), tier="disk", engine="fp")
    earlier.fetched(int(tier_bytes_per_s), 1.0)
    service.wait.rates = Rates(lambda start, tokens: 1.0 * tokens, RateFile(path),
                               tier="disk", engine="fp")


def test_a_new_engines_first_lookup_waits_while_bytes_arrive(tier, tmp_path):
    """Priors only (1,024 B/s from the file: 20 s for the fetch; worth 32 s): budget
    min(32, 2 x 20) = 32 s, past `timeout_s` (1 s). The store reports bytes (the test
    stands in for it: `progress_bytes`): the lookup stays pending 1.8 s in, past the
    timeout, while they arrive; 1 s after the last ones it is given up."""
    service, store, clock, counts, chain, release = tier
    with_priors(service, 1024, tmp_path)
    assert service.wait.budget(CHUNK, FETCH_BYTES) == pytest.approx(32.0)
    assert ask(service, chain).pending
    prefetch = service._pending["r"].prefetch
    prefetch.progress_bytes = 0
    for progress in (4096, 8192):
        clock.now += 0.9
        prefetch.progress_bytes = progress
        assert ask(service, chain).pending
    clock.now += 0.9  # nothing new for 0.9 s: still waiting
    assert ask(service, chain).pending
    clock.now += 0.2  # nothing new for 1.1 s: stalled
    reply = ask(service, chain)
    assert not reply.pending and reply.pinned == CHUNK
    assert counts.data["l2_waits_given_up"] == 1
    service.release("r", 0)


def test_a_stalled_tier_costs_the_timeout_whatever_the_priors_promise(tier, tmp_path):
    """The same priors (budget 32 s), but a store that reports no progress and a tier
    this engine has not seen finish a fetch: given up at `timeout_s`."""
    service, store, clock, counts, chain, release = tier
    with_priors(service, 1024, tmp_path)
    assert ask(service, chain).pending
    clock.now += 0.99
    assert ask(service, chain).pending
    clock.now += 0.02
    reply = ask(service, chain)
    assert not reply.pending and reply.pinned == CHUNK
    assert counts.data["l2_waits_given_up"] == 1
    service.release("r", 0)
