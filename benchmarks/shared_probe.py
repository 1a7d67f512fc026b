"""Timing counters inside one engine (harness "call" steps of `bench_shared_cpu.py
--probe`): wall time and calls of the connector's lookup, load and save paths, the
store's calls, `integrity.verify`, and the RPCs its `lmcache server` client sends, per
operation and per thread. Engine core and worker share the harness process (the
benchmark's engines run as the tests' do), so the scheduler half is probed too.

Wrapping only: the code under test is unchanged; the counters add a few microseconds
per call.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict

_seconds: dict[str, float] = defaultdict(float)
_calls: Counter = Counter()
_rpcs: Counter = Counter()
_rounds: Counter = Counter()
"""Scheduler lookups per request until one is answered (pending answers included)."""
_lock = threading.Lock()


def _add(label: str, dt: float) -> None:
    with _lock:
        _seconds[label] += dt
        _calls[label] += 1


def _wrap(owner, name: str, label: str, per_thread: bool = False) -> None:
    fn = getattr(owner, name)
    if getattr(fn, "_probed", False):
        return

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            where = f" [{threading.current_thread().name}]" if per_thread else ""
            _add(label + where, time.perf_counter() - t)

    timed._probed = True
    setattr(owner, name, timed)


class _CountingClient:
    def __init__(self, client):
        self._client = client

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr) or name == "close":
            return attr

        def call(*a, **kw):
            with _lock:
                _rpcs[name] += 1
            return attr(*a, **kw)

        return call


def install(worker) -> str:
    """Wrap the connector's paths in this process (once)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from gemma4_kv.layout import integrity

    conn = get_kv_transfer_group()
    w = conn._worker
    store = w.store
    cls = type(conn)
    _wrap(cls, "get_num_new_matched_tokens", "scheduler.get_num_new_matched_tokens")
    if not getattr(cls, "_rounds_probed", False):
        inner = cls.get_num_new_matched_tokens

        def counted(self, request, num_computed_tokens):
            out = inner(self, request, num_computed_tokens)
            with _lock:
                _rounds[request.request_id] += 1
            return out

        cls.get_num_new_matched_tokens = counted
        cls._rounds_probed = True
    _wrap(cls, "start_load_kv", "worker.start_load_kv (model thread)")
    _wrap(cls, "wait_for_save", "worker.wait_for_save (model thread)")
    _wrap(w.lookups, "lookup", "service.lookup (lookup thread)")
    for name in ("poll", "resident", "pin", "start_prefetch", "finish_prefetch", "release",
                 "reserve", "commit"):
        if hasattr(store, name):
            _wrap(store, name, f"store.{name}", per_thread=name == "release")
    _wrap(integrity, "verify", "integrity.verify")
    _wrap(integrity, "seal", "integrity.seal")
    reads, conn = getattr(store, "reads", None), getattr(store, "conn", None)
    if reads is not None and conn is not None:  # ServerStore: its reads and connection
        for name in ("start_lookup", "poll_lookup", "keep", "read", "release"):
            _wrap(reads, name, f"reads.{name}")
        for name in ("tokens", "key", "views", "finish"):
            _wrap(conn, name, f"conn.{name}")
        if not isinstance(conn.wire.client, _CountingClient):
            conn.wire.client = _CountingClient(conn.wire.client)
    return type(store).__name__


def report(worker) -> dict:
    """The counters since the last report (then reset)."""
    with _lock:
        out = dict(seconds=dict(_seconds), calls=dict(_calls), rpcs=dict(_rpcs),
                   rounds=dict(_rounds))
        _seconds.clear()
        _calls.clear()
        _rpcs.clear()
        _rounds.clear()
    return out
