"""What a stuck or slow L2 tier may cost the lookup thread (issue 32, items 5 and 6),
on a real embedded store whose disk tier (LMCache's fs_native) is made to hang
(`test_store.hang_l2`) or whose verification is held on a gate. Costs are counted
(LMCache queries per poll, prefetches kept), never timed.

- Given-up prefetches are capped: past the cap the slow tier counts as down and no new
  prefetch is asked, and each poll queries LMCache for a bounded batch of them in turn.
- Objects a prefetch brought up are verified off the lookup thread: a lookup served
  from L1 is answered while a verification is held, and what is being verified is not
  offered until it passed.
"""

from __future__ import annotations

import threading

import torch

from gemma4_kv.layout import integrity
from gemma4_kv.lookup import messages
from gemma4_kv.lookup.service import LookupService
from gemma4_kv.lookup.wait import Rates
from gemma4_kv.stores import embedded_l2
from gemma4_kv.stores.base import HIGH, LOW
from model_keys import chunk_hashes
from test_lookup_wait import Clock, Counts
from test_store import CHUNK, disk_store, evict, hang_l2, put, stored_on_disk, wait_for

CAP, BATCH = 12, 4
"""The test's own cap on given-up prefetches and batch of them polled per `poll`."""


def spy(obj, name: str, calls: list) -> None:
    """Record every call's first argument of the real `obj.name`, then make it."""
    real = getattr(obj, name)

    def recorded(*a, **kw):
        calls.append(a[0] if a else None)
        return real(*a, **kw)

    setattr(obj, name, recorded)


def test_given_up_prefetches_are_capped_and_polled_a_bounded_batch_at_a_time(
        tmp_path, monkeypatch):
    """The disk hangs; 20 lookups in a row each start a prefetch (of a prefix L1 lacks)
    that is given up at once. Only CAP are asked of LMCache: then the tier counts as
    down (`slow_tier_up` False) and `start_prefetch` asks nothing. A poll queries at
    most BATCH of the hung ones, each in turn (all CAP within CAP / BATCH polls). Once
    the disk answers, all of them settle, nothing stays read-locked, and the tier is
    up again."""
    monkeypatch.setattr(embedded_l2, "L2_TASK_LIMIT_S", -1.0)  # given up at first poll
    monkeypatch.setattr(embedded_l2, "MAX_HUNG", CAP, raising=False)
    monkeypatch.setattr(embedded_l2, "HUNG_POLL_BATCH", BATCH, raising=False)
    s = disk_store(tmp_path)
    try:
        _, release = hang_l2(s)
        submitted, queried = [], []  # L2 prefetches asked of LMCache, and their queries
        spy(s.tier, "prefetch", submitted)
        spy(s.tier, "prefetch_outcome", queried)
        refused = []
        for i in range(20):
            p = s.start_prefetch(chunk_hashes([2000 + i] * CHUNK, CHUNK), 0, CHUNK)
            if p.finished:  # asked nothing
                refused.append(p)
            s.poll()
        assert len(submitted) == CAP and s.l2.counts()["hung"] == CAP
        assert len(refused) == 20 - CAP and all(not p.loaded for p in refused)
        assert not s.slow_tier_up()
        seen = set()
        for _ in range(CAP // BATCH):
            queried.clear()
            s.poll()
            assert len(queried) <= BATCH
            seen.update(id(h) for h in queried)
        assert len(seen) == CAP  # round robin: every hung task was asked again
        release()
        wait_for(lambda: (s.poll(), not s.l2.counts()["hung"])[1])
        assert s.slow_tier_up()
        assert s.tier.status()["read_locked_count"] == 0  # nothing leaked
    finally:
        s.close()


def test_an_l1_lookup_is_answered_while_a_prefetch_is_being_verified(tmp_path, monkeypatch):
    """Chain A sits in L1, chain B only on disk. B's lookup starts a prefetch; as its
    objects land, their verification is held on a gate. Meanwhile verification never
    runs on the lookup thread, B's objects are not offered, A's lookup is answered
    (pinned) at once, and B's stays pending. Once the gate opens, B is served from L2."""
    lookup_thread = threading.current_thread()
    entered, gate, on_lookup_thread = threading.Event(), threading.Event(), []
    real = integrity.verify

    def held(kv, trailer, key):
        if threading.current_thread() is lookup_thread:
            on_lookup_thread.append(key)  # not held here: the test would hang
        else:
            entered.set()
            assert gate.wait(60)
        return real(kv, trailer, key)

    monkeypatch.setattr(integrity, "verify", held)
    s = disk_store(tmp_path)
    service = LookupService(s, s.layout, CHUNK, timeout_s=1.0, stats=Counts(),
                            rates=Rates(), clock=Clock())
    try:
        gen = torch.Generator().manual_seed(31)
        a = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        b = chunk_hashes(list(range(100, 100 + 2 * CHUNK)), CHUNK)
        put(s, a, gen)
        put(s, b, gen, req="rb", ends=[(2 * CHUNK, HIGH), (CHUNK, LOW)])
        wait_for(lambda: stored_on_disk(tmp_path, 8))
        evict(s, b)

        def ask(chain, req):
            return service.lookup(messages.Lookup(req, chain, 0, 2 * CHUNK))

        assert ask(b, "b").pending
        wait_for(lambda: (s.poll(), entered.is_set() or on_lookup_thread)[1])
        assert not on_lookup_thread
        assert s.resident(b) == {0: set(), 1: set()}  # landed, not verified: not offered
        reply = ask(a, "a")
        assert not reply.pending and reply.pinned == 2 * CHUNK
        assert ask(b, "b").pending  # its verification is still held
        gate.set()
        wait_for(lambda: (s.poll(), service._pending["b"].prefetch.finished)[1])
        reply = ask(b, "b")
        assert reply.pinned == 2 * CHUNK and reply.from_l2 == 2 * CHUNK
        assert not on_lookup_thread
        service.release("a", 0)
        service.release("b", 0)
    finally:
        gate.set()
        service.close()
        s.close()
