"""The connection to a running `lmcache server` (LMCache 0.5.6, engine-driven mode):
calls with a timeout, the registrations of our groups, the key encoding, and the
heartbeat that keeps the registrations alive and finds the server again after an outage.

0.5.6's engine-driven protocol (`lmcache/v1/multiprocess/modules/engine_driven_transfer.py`)
takes one object layout per registration and forms keys itself from token ids, so:

- each KV cache group registers as an instance of its own, under the model name
  `<namespace>.g<group>`; its objects are the group's KV_2LTD bytes followed by the
  integrity trailer (`integrity.py`): the registration asks for a few token slots more
  than a chunk (`object_slots`), and the client reads the bytes as (KV, trailer);
- our 32-byte chunk hashes travel as the "tokens" of their chunk (8 big-endian uint32
  words, zero padded to the server's chunk size; `--chunk-size 8` sends no padding).
  The server's rolling blake3 over them depends on our hash chain only, so a key
  names one exact prefix; every call sends the hashes from chunk 0.

A call with no answer within `timeout_s` raises `ServerUnavailable` and marks the server
down (0.5.6 sends no reply when a handler raises, so a dead server and a refused call
look alike); calls then fail at once until the heartbeat gets answers again and
registers anew.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TypeVar

from ...layout.groups import KVGroup, KVLayout
from ...layout import integrity
from ..lmcache import GroupShape, Pending, ServerWire
from .shm import SharedL1, UnsupportedServer
from .space import Lease, Space, Use

logger = logging.getLogger(__name__)
T = TypeVar("T")

HASH_BYTES = 32
"""Length of gemma4-kv's chunk hashes (sha256): 8 uint32 "tokens"."""
SEAL_BYTES = 8 * integrity.SEAL_SHAPE[0]
CONNECT_TIMEOUT_S = 10.0
"""How long each call of the handshake when a store opens (ping, chunk size, the
registrations, the wire probe) may wait: a server on a busy host answers its first
calls late, and an engine's start is no hot path. Calls after it wait `timeout_s`."""


class ServerUnavailable(ConnectionError):
    """The server did not answer in time: dead, restarting, or it refused the call."""


class Later:
    """Work that waits for the server on a thread of its own, in submission order: the
    answers to calls that hand locks and sessions back, which no caller needs (the
    lookup thread answers the scheduler, the model thread runs the forward). `flush`
    waits until everything submitted so far has run."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._submitted = self._finished = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> None:
        with self._done:
            self._submitted += 1
        self._jobs.put((fn, args))

    def flush(self, timeout: float | None = None) -> bool:
        """Whether everything submitted before this call has run (within `timeout`)."""
        with self._done:
            target = self._submitted
            return self._done.wait_for(lambda: self._finished >= target, timeout)

    def close(self, timeout: float | None = None) -> None:
        self.flush(timeout)
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except ServerUnavailable:
                pass  # what it held on the server expires there
            except Exception:  # noqa: BLE001 - one failed job must not stop the others
                logger.exception("gemma4-kv: a deferred call to the lmcache server failed")
            finally:
                with self._done:
                    self._finished += 1
                    self._done.notify_all()


def server_argv(lmcache: str, *, port: int, shm_name: str, l1_gb: float, http_port: int,
                host: str = "localhost", chunk_size: int = 8, write_ttl_s: int = 30,
                read_ttl_s: int = 300, workers: int = 2,
                l2_adapters: Sequence[str] = (), eviction_policy: str = "LRU",
                eviction_watermark: float = 0.9,
                eviction_ratio: float = 0.03) -> list[str]:
    """Command line of a server this client can use (the README shows the same).

    The write TTL must stay below the reap timeout (120 s): 0.5.6 commits a dead client's
    unfinished reservations when it reaps the client (`_release_entry` -> `finish_write`),
    unless they expired first. The read TTL is stated, not left to LMCache's default:
    clients trust a pin only within it (`lmcache_server_read_ttl_s`). `--l2-prefetch-policy
    retain` keeps objects brought up from L2 in L1 after their first read.
    The server evicts (LRU) 3 % of its objects once a second while 90 % of its L1 is
    used (LMCache's defaults: 20 % from 80 %): once it is full, engines stop saving what
    is no more frequent than what it holds (`admission.py`), so the L1 stays about 87 to
    90 % full rather than 64 to 80 %. The 10 % left is room for a save made between two
    evictions (a prompt larger than that finds none: only part of it is stored).
    """
    argv = [lmcache, "server", "--supported-transfer-mode", "engine_driven",
            "--shm-name", shm_name, "--no-l1-use-lazy", "--l1-size-gb", str(l1_gb),
            "--chunk-size", str(chunk_size), "--eviction-policy", eviction_policy,
            "--host", host, "--port", str(port), "--http-port", str(http_port),
            "--l1-write-ttl-seconds", str(write_ttl_s),
            "--l1-read-ttl-seconds", str(read_ttl_s), "--max-workers", str(workers),
            "--l2-prefetch-policy", "retain", "--disable-observability",
            "--periodic-notifier-interval-ms", "1"]
    argv += ["--eviction-trigger-watermark", str(eviction_watermark),
             "--eviction-ratio", str(eviction_ratio)]
    for spec in l2_adapters:
        argv += ["--l2-adapter", spec]
    return argv


def check_speaks_zmq(url: str, timeout_s: float) -> None:
    """Refuse (ServerUnavailable) an address whose peer does not open with ZMQ's
    greeting (ZMTP 3: a 0xFF ... 0x7F signature, sent by both sides at once) within
    `timeout_s`. LMCache 0.5.6's clients share one polling thread per process, whose
    send to a peer that accepted TCP but never completes the ZMQ handshake blocks
    every client of the process for good (seen in the tests: one store opened on a
    plain TCP listener left every later store unanswered)."""
    import socket

    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            greeting = b""
            while len(greeting) < 10:
                part = s.recv(10 - len(greeting))
                if not part:
                    break
                greeting += part
    except (OSError, ValueError) as e:
        raise ServerUnavailable(f"{url}: no answer to ping ({e})") from None
    if len(greeting) < 10 or greeting[0] != 0xFF or greeting[9] != 0x7F:
        raise ServerUnavailable(f"{url}: no answer to ping (the peer does not speak ZMQ: "
                                f"{greeting[:10]!r})")


def object_slots(group: KVGroup, chunk_size: int) -> int:
    """Token slots registered per object: the chunk, plus enough for the trailer."""
    row = 2 * len(group.layers) * group.num_kv_heads * group.head_size * group.dtype.itemsize
    return chunk_size + -(-SEAL_BYTES // row)


def runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted indices as half-open runs [a, b)."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [(a, b) for a, b in out]


class ServerConnection:
    """One client's registrations on a server, the heartbeat that keeps them, and the
    calls of `reads.ServerReads` and `writes.ServerWrites` (`call`, `key`, `later`).

    Every read and write holds a `Lease` on the space it runs in (`lease`), which
    unregisters a replaced space once the last one closes. `on_new_server` callbacks
    run when another server process answers (its predecessor's locks and reads went
    with it). No lock of this class is held across a call to the server."""

    def __init__(self, url: str, layout: KVLayout, namespace: str, chunk_size: int, *,
                 timeout_s: float = 1.0, ping_interval_s: float = 20.0,
                 prefault: bool = True, cuda_register: bool = False):
        self.url, self.layout, self.chunk_size = url, layout, chunk_size
        self.timeout_s = timeout_s
        self.waited_out = 0
        """Calls for the store's users (the heartbeat's probes left out) that waited
        `timeout_s` for an answer that never came: a `call` past its deadline, a lookup
        unanswered that long. Each marks the server down, and calls after that fail at
        once without waiting: while it stays down, this grows only by calls that were
        already waiting when it went."""
        self._counting = threading.Lock()
        check_speaks_zmq(url, max(timeout_s, CONNECT_TIMEOUT_S))
        self.wire = ServerWire(url)
        self._healthy = True
        self.groups = {g.group_id: g for g in layout.groups}
        self._slots = {gid: object_slots(g, chunk_size) for gid, g in self.groups.items()}
        self.l1 = SharedL1(url, prefault=prefault, cuda_register=cuda_register)
        self.on_new_server: list = []
        self._space = self._new_space(namespace)
        try:
            wait = max(timeout_s, CONNECT_TIMEOUT_S)
            if not self.call(self.wire.ping(None), "ping", timeout_s=wait):
                raise ServerUnavailable(f"{url}: ping refused")
            self.server_chunk = self.call(self.wire.chunk_size(), "get_chunk_size",
                                          timeout_s=wait)
            if self.server_chunk * 4 < HASH_BYTES:
                raise UnsupportedServer(f"server chunk size {self.server_chunk} holds no "
                                        f"{HASH_BYTES}-byte hash: start it with --chunk-size 8")
            self._register(self._space, timeout_s=wait)
            self._probe_wire(timeout_s=wait)
        except Exception:
            self.wire.close()
            raise
        self.later = Later("gemma4kv-mp-later")
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(ping_interval_s,),
                                           name="gemma4kv-mp-ping", daemon=True)
        self._heartbeat.start()

    @property
    def epoch(self) -> int:
        """Server processes seen (see `SharedL1.epoch`)."""
        return self.l1.epoch

    @property
    def space(self) -> Space:
        """The registrations in use now (a `rename` replaces them)."""
        return self._space

    @property
    def pool_size(self) -> int:
        return self.l1.size

    # -- connection -------------------------------------------------------------------
    def call(self, future: Pending[T], what: str, *, probing: bool = False,
             timeout_s: float | None = None) -> T:
        """The answer of one RPC within `timeout_s` (default: the connection's), or
        ServerUnavailable. Gives up at once when another thread has found the server
        down (unless `probing`)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not future.wait(0.02):
            if not self._healthy and not probing:
                raise ServerUnavailable(f"{self.url} is not answering")
            if time.monotonic() > deadline:
                if not probing:
                    self.waited_out_once()
                if self._healthy:
                    logger.warning("gemma4-kv: %s gave no answer to %s within %g s",
                                   self.url, what, timeout_s)
                self._healthy = False
                raise ServerUnavailable(f"{self.url}: no answer to {what} within "
                                        f"{timeout_s} s")
        return future.result(0)

    def waited_out_once(self) -> None:
        """Count a call that waited out `timeout_s` (`waited_out`)."""
        with self._counting:
            self.waited_out += 1

    def mark_down(self, reason: str) -> None:
        """The server failed to answer: down until the heartbeat gets answers again."""
        if self._healthy:
            logger.warning("gemma4-kv: %s: %s", self.url, reason)
        self._healthy = False
        raise ServerUnavailable(f"{self.url}: {reason}")

    def check(self) -> None:
        if not self._healthy:
            raise ServerUnavailable(f"{self.url} is not answering (waiting for a ping)")

    def _new_space(self, namespace: str) -> Space:
        names = {gid: f"{namespace}.g{gid}" for gid in self.groups}
        if any("@" in n or "/" in n for n in names.values()):
            raise ValueError("LMCache model names must not contain '@' or '/'")
        base = int.from_bytes(os.urandom(5), "big") << 8  # ids are global to the server
        return Space(namespace, names, {gid: base + gid for gid in self.groups})

    def _register(self, space: Space, probing: bool = False,
                  timeout_s: float | None = None) -> None:
        """Register every group of `space` (idempotent on the server), map its L1."""
        futures = [self.wire.register(space.ids[gid], space.names[gid], GroupShape(
            g.block_size, len(g.layers), g.num_kv_heads * g.head_size,
            str(g.dtype).removeprefix("torch."), self._slots[gid]))
            for gid, g in self.groups.items()]
        pools = {(r.shm_name, r.pool_size) for r in
                 (self.call(f, "register", probing=probing, timeout_s=timeout_s)
                  for f in futures)}
        (name, size), = pools
        if not name or size <= 0:
            raise UnsupportedServer(
                f"{self.url} has no shared-memory L1: start it with --supported-transfer-mode "
                "engine_driven --shm-name NAME --no-l1-use-lazy and a /dev/shm larger than L1")
        self._mapped(name, size)
        for iid in space.ids.values():  # ping-proven: reaped after 120 s of silence, not 3600
            self.call(self.wire.ping(iid), "ping", probing=probing, timeout_s=timeout_s)

    def _probe_wire(self, probing: bool = False, timeout_s: float | None = None) -> None:
        """A keyed call that does nothing (an empty range): a server of another wire
        format (0.5.7 sends `token_bytes`) cannot decode the key and never answers,
        while registration and pings still work."""
        space = self._space
        g = next(iter(space.names))
        try:
            self.call(self.wire.free_lookup_locks(
                self.key(space, g, self.tokens([bytes(HASH_BYTES)]), 0, 0, self.new_rid(),
                         None)), "free_lookup_locks", probing=probing, timeout_s=timeout_s)
        except ServerUnavailable:
            for iid in space.ids.values():  # nothing was reserved: safe to unregister
                self.wire.unregister(iid)
            raise UnsupportedServer(
                f"{self.url} does not decode LMCache 0.5.6 keys (IPCCacheServerKey.token_ids):"
                " client and server LMCache versions must match") from None

    def _beat(self, interval: float) -> None:
        """Keep the registrations alive; after an outage register again (a restarted
        server knows none of them and has a new L1 segment)."""
        while not self._stop.wait(interval if self._healthy else min(interval, 1.0)):
            was = self._healthy
            space = self._space
            # While it is down, one ping a second: calls to a dead server queue up in
            # the client (ZMQ) and are all delivered when one comes back.
            ids = list(space.ids.values()) if was else list(space.ids.values())[:1]
            try:
                for iid in ids:
                    self.call(self.wire.ping(iid), "ping", probing=True)
                if not was:
                    self._register(space, probing=True)
                    self._probe_wire(probing=True)  # it may have come back as another version
                    logger.warning("gemma4-kv: %s answers again", self.url)
                self._healthy = True
            except Exception as e:  # noqa: BLE001 - any failure means "not now"
                if was:
                    logger.warning("gemma4-kv: %s not answering: %s", self.url, e)
                self._healthy = False

    @property
    def healthy(self) -> bool:
        return self._healthy

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every lock and session handed back so far has been answered (or
        given up): what the server reports after this includes them."""
        return self.later.flush(timeout)

    def rename(self, namespace: str) -> None:
        """Use new registrations under `namespace` from now on (`ChunkStore.reset`); the
        old ones are unregistered once nothing is open in them (`Space.retire`)."""
        old, new = self._space, self._new_space(namespace)
        self._space = new
        try:
            self.check()
            self._register(new)
        except Exception as e:
            self._healthy = False  # the heartbeat registers `new` once the server answers
            raise ServerUnavailable(f"{self.url}: cannot register {namespace}: {e}") from e
        if old.retire():
            self._unregister(old)

    def lease(self, use: Use) -> Lease:
        """A read or write opened now, in the registrations in use now: a replaced
        space is unregistered once its last lease closes."""
        return self._space.lease(use, self._unregister)

    def _unregister(self, space: Space) -> None:
        """Unregister a retired space nothing is open in any more (open writes:
        unregistering would commit them unwritten; they expire, the reaper takes the
        rest; open reads: the server would drop their locks under a load)."""
        if space is self._space or not self._healthy:
            return
        for f in [self.wire.unregister(i)
                  for i in space.ids.values()]:
            self.call(f, "unregister")

    # -- keys -------------------------------------------------------------------------
    def tokens(self, hashes: Sequence[bytes]) -> tuple[int, ...]:
        pad = (0,) * (self.server_chunk - HASH_BYTES // 4)
        out: list[int] = []
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise ValueError(f"chunk hashes must be {HASH_BYTES} bytes, got {len(h)}")
            out += struct.unpack(">8I", h)
            out += pad
        return tuple(out)

    def key(self, space: Space, gid: int, tokens: tuple[int, ...], a: int, b: int,
             request_id: str, worker: int | None = 0):
        s = self.server_chunk
        return self.wire.key(space.names[gid], tokens, a * s, b * s, request_id, worker)

    @staticmethod
    def new_rid() -> str:
        return f"g4kv-{uuid.uuid4().hex}"

    def _mapped(self, name: str, size: int) -> None:
        """The server's L1 segment is `name` (a restarted server has a new one)."""
        if self.l1.map(name, size):
            for callback in self.on_new_server:
                callback()

    def views(self, slots: list[dict], gid: int) -> list | None:
        """(KV, trailer) views of reserved or retrieved slots of group `gid`, or None if
        the server's objects are not what this client registered."""
        views = self.l1.views(self.groups[gid], self.chunk_size, slots, self._slots[gid])
        if views is None:
            logger.warning("gemma4-kv: server objects of group %d are not what this client "
                           "registered: treated as a miss", gid)
        return views

    def finish(self, futures: Iterable, rids: Iterable[str]) -> None:
        """Wait for `futures`, then end the sessions. Not both at once: the server runs
        them on several threads, and a call that lands after its session ended recreates
        an empty one (a free then releases nothing)."""
        for f in list(futures):
            self.call(f, "free/commit")
        for f in [self.wire.end_session(r) for r in rids]:
            self.call(f, "end_session")

    def stale(self, thing) -> bool:
        """Made on a server process that is gone (its state went with it)."""
        return thing.epoch != self.epoch

    def close(self) -> None:
        """Stop pinging and unregister, unless reservations are still open: unregistering
        would commit them unwritten (0.5.6 `_release_entry`); they expire instead."""
        self._stop.set()
        self._heartbeat.join(timeout=self.timeout_s + 1)
        # Hand back what is still owed first: unregistering drops the locks it holds.
        self.later.close(timeout=4 * self.timeout_s)
        space = self._space
        if self._healthy and not space.open_writes:
            try:
                for f in [self.wire.unregister(i)
                          for i in space.ids.values()]:
                    self.call(f, "unregister")
            except ServerUnavailable:
                pass
        self.wire.close()
        self.l1.close()
