"""A RESP (Redis/Valkey) client for LMCache's `NativeConnectorL2Adapter` that survives
what LMCache 0.5.6's C++ client (`lmcache_redis.LMCacheRedisClient`) does not, and keeps
its speed: it sends SET from L1 and receives GET straight into L1 (x5-x7 the `valkey`
adapter's reads, docs/scale-out.md).

What the C++ client does wrong, measured on this repo's Redis and Valkey servers
(tests/test_resp_client.py plays each):
- a batch whose values differ in size fails whole ("buffer size mismatch"): a chunk's
  groups differ in size, so a store of them all never lands;
- after the server restarts, every operation fails for good ("socket recv failed");
- a GET of an absent key (evicted or expired between lookup and load) never completes:
  that connection hangs until the client is closed; `num_workers` of them hang the
  client;
- a client built while the server is down never answers at all.

`RespClient` wraps one C++ client at a time (`connect()` builds one) and offers the same
interface (`event_fd`, `submit_batch_get/set/exists/delete`, `drain_completions`,
`close`):
- a batch is split into one C++ batch per value size and answered as one;
- a part that fails or outlives its deadline (`request_timeout_s`, plus time for its
  bytes) retires that C++ client: it is closed (its sockets with it, so nothing more is
  received into L1), every part still out on it fails, and a new client is built on
  the keeper thread, with a back-off, and used once it answers a probe;
- an idle client is pinged (EXISTS) every `ping_interval_s`, so that a restarted server
  costs the next store or lookup nothing;
- while there is none, every operation fails at once: a miss, a store not made.

Concurrency: LMCache's adapter submits under its own lock from its callers' threads and
drains on its demux thread. `_lock` guards every field below it and is never held
across a connect, a close or a wait; the C++ submit and drain calls it is held across do
no I/O (they queue to, and collect from, the client's worker threads). The keeper
thread owns connecting, probing, closing and deadlines."""

from __future__ import annotations

import enum
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

PROBE_KEY = "gemma4-kv:probe"
"""Asked with EXISTS of a new client before it is used: an answer shows its
connections work."""
SECONDS_PER_BYTE = 10.0 / 1e9
"""A part's deadline grows by 10 s per GB it moves (a tier at 0.1 GB/s still makes it)."""


class NativeClient(Protocol):
    """What `LMCacheRedisClient` offers (LMCache's native-connector interface)."""

    def event_fd(self) -> int: ...
    def submit_batch_get(self, keys: list[str], bufs: list[memoryview]) -> int: ...
    def submit_batch_set(self, keys: list[str], bufs: list[memoryview]) -> int: ...
    def submit_batch_exists(self, keys: list[str]) -> int: ...
    def submit_batch_delete(self, keys: list[str]) -> int: ...
    def drain_completions(self) -> list[tuple[int, bool, str, list[bool] | None]]: ...
    def close(self) -> None: ...


class Link(enum.Enum):
    """Whether operations go out; `_Keeper` and `_retire` move it."""

    UP = "up"  # `current` takes submits
    DOWN = "down"  # no client answers: submits fail at once while the keeper connects
    CLOSED = "closed"


@dataclass
class _Part:
    op: int  # the outer future id
    indices: list[int]  # its keys' places in the outer batch
    deadline: float
    bufs: list  # the buffers its C++ workers read or fill: alive until it is answered


@dataclass
class _Conn:
    """One C++ client and the parts out on it (its future id -> part)."""

    native: Any
    fd: int
    parts: dict[int, _Part] = field(default_factory=dict)


@dataclass
class _Op:
    """An outer batch: its answer once every part has answered."""

    parts_left: int
    found: list[bool]
    ok: bool = True
    error: str = ""


class RespClient:
    """LMCache's native-client interface over a chain of C++ RESP clients (see the
    module's docstring). `connect()` returns a new C++ client (it may connect lazily)."""

    def __init__(self, connect: Callable[[], NativeClient], *, request_timeout_s: float = 5.0,
                 probe_timeout_s: float = 1.0, backoff_s: tuple[float, float] = (0.1, 2.0),
                 ping_interval_s: float = 1.0, name: str = "resp"):
        self._connect = connect
        self.request_timeout_s = request_timeout_s
        self.ping_interval_s = ping_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._backoff = backoff_s
        self.name = name
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self._wake, select.EPOLLIN)
        self._lock = threading.Lock()
        self._link = Link.DOWN
        self._current: _Conn | None = None
        self._conns: list[_Conn] = []  # current and those whose parts are still out
        self._retired: list[_Conn] = []  # taken out of use: to close (keeper)
        self._ops: dict[int, _Op] = {}
        self._ready: list[tuple[int, bool, str, list[bool]]] = []
        self._next_id = 1
        self.reconnects = 0  # clients built after the first
        self._kick = threading.Event()
        first = self._probed()
        if first is not None:
            self._install(first)
        self._keeper = threading.Thread(target=self._keep, name=f"{name}-keeper", daemon=True)
        self._keeper.start()

    # -- the native-client interface --------------------------------------------------

    def event_fd(self) -> int:
        """Readable while completions wait for `drain_completions` (an epoll set of
        the C++ clients' event fds and this client's own)."""
        return self._epoll.fileno()

    def submit_batch_get(self, keys: list[str], bufs: list[memoryview]) -> int:
        return self._submit("get", keys, bufs)

    def submit_batch_set(self, keys: list[str], bufs: list[memoryview]) -> int:
        return self._submit("set", keys, bufs)

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit("exists", keys, None)

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit("delete", keys, None)

    def drain_completions(self) -> list[tuple[int, bool, str, list[bool]]]:
        """Every outer batch answered since the last call: (future id, ok, error,
        per-key results). Called by one thread (the adapter's demux thread)."""
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        with self._lock:
            for conn in list(self._conns):
                for fid, ok, error, found in conn.native.drain_completions():
                    part = conn.parts.pop(int(fid), None)
                    if part is not None:
                        self._answer(part, bool(ok), str(error), found)
                        if not ok:
                            self._retire(conn, f"a batch failed ({error})")
            out, self._ready = self._ready, []
        return out

    def close(self) -> None:
        with self._lock:
            self._link = Link.CLOSED
            for conn in list(self._conns):
                self._retire(conn, "closed")
        self._kick.set()
        self._keeper.join(timeout=10)
        self._close_retired()
        self._epoll.close()
        os.close(self._wake)

    @property
    def link(self) -> Link:
        return self._link

    # -- under _lock --------------------------------------------------------------------

    def _submit(self, kind: str, keys: Sequence[str], bufs: Sequence[memoryview] | None) -> int:
        n = len(keys)
        with self._lock:
            fid, self._next_id = self._next_id, self._next_id + 1
            conn = self._current
            if conn is None:  # answered at once: nothing found, nothing stored
                self._ready.append((fid, False, f"{self.name}: reconnecting", [False] * n))
                os.eventfd_write(self._wake, 1)
                return fid
            if n == 0:  # the C++ client raises on an empty batch
                self._ready.append((fid, True, "", []))
                os.eventfd_write(self._wake, 1)
                return fid
            groups: dict[int, list[int]] = {}
            for i in range(n):
                groups.setdefault(len(bufs[i]) if bufs is not None else 0, []).append(i)
            self._ops[fid] = _Op(parts_left=len(groups), found=[False] * n)
            now = time.monotonic()
            for size, idx in groups.items():
                ks = [keys[i] for i in idx]
                bs = [bufs[i] for i in idx] if bufs is not None else []
                if kind == "get":
                    sub = conn.native.submit_batch_get(ks, bs)
                elif kind == "set":
                    sub = conn.native.submit_batch_set(ks, bs)
                elif kind == "exists":
                    sub = conn.native.submit_batch_exists(ks)
                else:
                    sub = conn.native.submit_batch_delete(ks)
                conn.parts[int(sub)] = _Part(fid, idx, now + self.request_timeout_s
                                             + size * len(idx) * SECONDS_PER_BYTE, bs)
            return fid

    def _answer(self, part: _Part, ok: bool, error: str, found: list[bool] | None) -> None:
        op = self._ops.get(part.op)
        if op is None:
            return
        if ok:
            for j, i in enumerate(part.indices):
                op.found[i] = True if found is None else bool(found[j])
        else:
            op.ok, op.error = False, op.error or error
        op.parts_left -= 1
        if op.parts_left == 0:
            del self._ops[part.op]
            self._ready.append((part.op, op.ok, op.error, op.found))
            os.eventfd_write(self._wake, 1)

    def _retire(self, conn: _Conn, why: str) -> None:
        """Take `conn` out of use; the keeper closes it and fails what is still out."""
        if conn not in self._conns:
            return
        self._conns.remove(conn)
        self._epoll.unregister(conn.fd)
        self._retired.append(conn)
        if conn is self._current:
            self._current = None
            if self._link is Link.UP:
                self._link = Link.DOWN
                log.warning("gemma4-kv: %s connection retired (%s); reconnecting", self.name, why)
        self._kick.set()

    def _install(self, conn: _Conn) -> None:
        with self._lock:
            if self._link is Link.CLOSED:
                self._retired.append(conn)
                return
            self._conns.append(conn)
            self._epoll.register(conn.fd, select.EPOLLIN)
            self._current, self._link = conn, Link.UP

    # -- the keeper thread: deadlines, closing, connecting -----------------------------

    def _keep(self) -> None:
        delay = self._backoff[0]
        pinged = time.monotonic()
        while True:
            self._kick.wait(0.25)
            self._kick.clear()
            if time.monotonic() - pinged >= self.ping_interval_s:
                self._ping()
                pinged = time.monotonic()
            self._expire()
            self._close_retired()
            with self._lock:
                link = self._link
            if link is Link.CLOSED:
                return
            if link is Link.DOWN:
                conn = self._probed()
                if conn is not None:
                    self.reconnects += 1
                    self._install(conn)
                    log.warning("gemma4-kv: %s reconnected", self.name)
                    delay = self._backoff[0]
                else:
                    self._kick.wait(delay)
                    delay = min(2 * delay, self._backoff[1])

    def _ping(self) -> None:
        """An EXISTS through the current client: an idle client learns that its
        server went away (the answer fails, `drain_completions` retires it) before an
        engine's lookup or store does."""
        with self._lock:
            conn = self._current
            if conn is not None:  # op 0 is no caller's: its answer is dropped
                sub = conn.native.submit_batch_exists([PROBE_KEY])
                conn.parts[int(sub)] = _Part(0, [], time.monotonic() + self.request_timeout_s,
                                             [])

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for conn in list(self._conns):
                if any(p.deadline < now for p in conn.parts.values()):
                    self._retire(conn, f"a batch took over its deadline "
                                       f"({self.request_timeout_s:g} s + 10 s/GB)")

    def _close_retired(self) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for conn in retired:
            conn.native.close()  # closes its sockets: nothing more lands in L1 buffers
            with self._lock:
                for part in conn.parts.values():
                    self._answer(part, False, f"{self.name}: connection retired", None)
                conn.parts.clear()

    def _probed(self) -> _Conn | None:
        """A new C++ client that answered an EXISTS within `probe_timeout_s`, or None."""
        try:
            native = self._connect()
        except Exception as e:  # noqa: BLE001 - any failure to build one is a retry
            log.debug("%s: connect failed: %s", self.name, e)
            return None
        fd = int(native.event_fd())
        sub = int(native.submit_batch_exists([PROBE_KEY]))
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + self.probe_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            poller.poll(max(1, int(left * 1000)))
            for fid, ok, _, _ in native.drain_completions():
                if int(fid) == sub and ok:
                    return _Conn(native, fd)
                if int(fid) == sub:
                    deadline = 0.0
        native.close()
        return None
