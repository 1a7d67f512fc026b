"""Closing the embedded store's LMCache storage layer (`stores/lmcache.py`) at shutdown
(issue 22, item 9).

The leaked segment at the end of `scripts/demo.sh` is vLLM's: the EngineCore's
`rpc_broadcast_mq` ring buffer (`shm_broadcast.py`), which the EngineCore unlinks only
once its workers have exited. vLLM's front end SIGKILLs the EngineCore 5 s after its
SIGTERM; a worker slow to exit leaves the EngineCore killed before the unlink, and
Python's resource tracker reports the segment. Our share of the worker's exit was
LMCache's `StorageManager.close`: it joins LMCache's two eviction threads, which sleep
`time.sleep(1)` between passes and cannot be woken, so the close waited for up to a
second per thread (0.6 s and 1.6 s in the audit's traced demo runs).

Why not an end-to-end test: whether the EngineCore is killed depends on how long vLLM's
own teardown takes beside ours. In the audit's three runs without the connector, vLLM's
front end force-killed the EngineCore in every run; the segment was unlinked about a
second before the kill. An engine test would pass or fail with the machine's load.
These tests hold LMCache's eviction threads asleep instead (their `time.sleep` waits on
an event the test opens), so "close waited for them" is a fact the test reads, not a
duration: close either returns while both are still asleep or cannot return until the
test opens the gate. The timeouts below only end a test whose close hangs; no assertion
compares a time."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("lmcache")

from gemma4_kv.stores import lmcache as adapter  # noqa: E402

HANG_S = 60.0
"""How long a test waits for something that should happen at once before calling it a
hang (with the gate closed, a close that joins the eviction threads never returns)."""


class _Gate:
    """Stands in for the `time` module of LMCache's eviction controllers: their
    `time.sleep` waits until the gate opens; who is asleep is counted."""

    def __init__(self):
        self.open = threading.Event()
        self.cond = threading.Condition()
        self.asleep: set[threading.Thread] = set()

    def __getattr__(self, name):
        return getattr(time, name)

    def sleep(self, _seconds):
        me = threading.current_thread()
        with self.cond:
            self.asleep.add(me)
            self.cond.notify_all()
        self.open.wait()
        with self.cond:
            self.asleep.discard(me)

    def wait_asleep(self, n: int) -> set[threading.Thread]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.asleep) >= n, HANG_S)
            return set(self.asleep)


@pytest.fixture
def gate(monkeypatch):
    from lmcache.v1.distributed.storage_controllers import eviction_controller

    g = _Gate()
    monkeypatch.setattr(eviction_controller, "time", g)
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    g.errors = errors
    yield g
    g.open.set()
    adapter.wait_closed()


def test_close_does_not_wait_for_lmcache_eviction_threads(gate):
    """With both of LMCache's eviction threads held asleep, `StorageLayer.close` returns;
    once they wake they see the stop and end without error, and the rest of LMCache's
    close (L1 freed) completes behind it (`wait_closed`)."""
    layer = adapter.StorageLayer(16 << 20)
    sleepers = gate.wait_asleep(2)  # L1's and L2's eviction loops
    still_asleep = []
    closer = threading.Thread(target=lambda: (layer.close(),
                                              still_asleep.append(len(gate.asleep))),
                              daemon=True)
    closer.start()
    closer.join(HANG_S)  # with the gate shut, a close that joins them cannot return
    gate.open.set()
    closer.join(HANG_S)
    assert still_asleep == [2], "close() waited for LMCache's eviction threads"
    adapter.wait_closed()
    assert not any(t.is_alive() for t in sleepers)  # the close joined them, after us
    assert not gate.errors, gate.errors
    layer.close()  # a second close is a no-op


def test_a_new_layer_waits_for_the_last_close():
    """LMCache's periodic notifier is one per process: `StorageManager.close` shuts it
    down and `create` does nothing while one exists. A layer made while another's close
    still runs would lose its notifier to that close; the new layer waits for it."""
    from lmcache.lmcache_native import PeriodicEventNotifier

    first = adapter.StorageLayer(16 << 20)
    first.close()
    second = adapter.StorageLayer(16 << 20)
    try:
        adapter.wait_closed()
        assert PeriodicEventNotifier.get() is not None
    finally:
        second.close()
        adapter.wait_closed()
