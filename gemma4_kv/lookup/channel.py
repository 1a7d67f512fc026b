"""Scheduler-to-worker lookups over a private local ZMQ socket.

The store lives in each worker process (that is where the KV bytes are copied), but
vLLM asks the scheduler, in the engine-core process, how many tokens are cached. Each
worker rank serves `messages.Request`s on an IPC socket; the scheduler asks every rank.

What arrives on the socket is never code: messages are msgspec msgpack decoded into
`messages` structs only, and anything else is dropped unanswered. The socket sits in a
directory only this user can open, is named after the engine-core PID so two engines
never share one, is guarded by a lock file so a second server cannot steal a live
engine's socket, and is removed on close.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import typing
from collections.abc import Callable

import msgspec
import zmq

from . import messages
from .sockets import check_private_dir, ipc_path, take_lock

logger = logging.getLogger(__name__)

_REPLY_TYPES = typing.get_args(messages.Reply)
_RID_BYTES = 8  # request id: the first frame after the peer identity, big-endian
MAX_MESSAGE_BYTES = 16 << 20
"""Larger ZMQ messages are refused by the socket itself (a Lookup of a 1M-token prompt
carries 4096 keys, 132 KiB)."""
WARN_EVERY_S = 10.0
"""Dropped messages are logged at most this often (the rest counted in `dropped`)."""


# -- server (worker side) -----------------------------------------------------------------
class LookupServer:
    """Answers each `messages.Request` with `handle(request)` on a daemon thread.

    A ROUTER socket, so what is not one of our requests ([request id, payload] frames
    decoding to a `messages.Request`) gets no answer at all: it is logged and counted in
    `dropped`, and serving goes on. A handler exception is answered `Failed`. Between
    messages the thread calls `advance` (if given) every `BUSY_POLL_MS` while it returns
    True (work in flight), every 100 ms otherwise."""

    BUSY_POLL_MS = 1
    """How often `advance` runs while it reports work in flight."""

    def __init__(self, address: str, handle: Callable[[messages.Request], messages.Reply],
                 advance: Callable[[], bool] | None = None):
        self.address = address
        self._advance = advance
        self.path = ipc_path(address)
        self.dropped = 0
        self._handle = handle
        self._decoder = msgspec.msgpack.Decoder(messages.Request)
        self._encoder = msgspec.msgpack.Encoder()
        check_private_dir(os.path.dirname(self.path))
        self._lock_path = self.path + ".lock"
        self._lock_fd: int | None = take_lock(self._lock_path, self.path)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._warned_at, self._unlogged = -WARN_EVERY_S, 0
        try:
            try:  # a dead engine's socket: the lock says nobody serves it
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._sock.bind(address)
            os.chmod(self.path, 0o600)
        except BaseException:
            self._sock.close()
            self._ctx.term()
            self._unlink_and_unlock()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="gemma4kv-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        busy = False
        while not self._stop.is_set():
            try:
                if self._sock.poll(self.BUSY_POLL_MS if busy else 100):
                    frames = self._sock.recv_multipart()
                    reply = self._answer(frames)
                    if reply is not None:
                        self._sock.send_multipart([frames[0], frames[1], reply])
            except Exception:  # a dead lookup thread would make every later lookup miss
                logger.exception("gemma4-kv lookup %s: serving error", self.path)
            if self._advance is not None:
                try:
                    busy = self._advance()
                except Exception:  # the next message's lookup polls (and reports) again
                    busy = False
                    logger.debug("gemma4-kv lookup %s: advance failed", self.path,
                                 exc_info=True)

    def _answer(self, frames: list[bytes]) -> bytes | None:
        """The encoded reply to `frames`, or None for a message that is not ours."""
        msg = None
        if len(frames) == 3 and len(frames[1]) == _RID_BYTES:
            try:
                msg = self._decoder.decode(frames[2])
            except msgspec.DecodeError:
                pass
        if msg is None:
            self.dropped += 1
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY_S:
                logger.warning("gemma4-kv lookup %s: dropped a message that is not a lookup "
                               "request (%d frames, %d bytes; %d more since the last "
                               "warning)", self.path, len(frames),
                               sum(len(f) for f in frames[1:]), self._unlogged)
                self._warned_at, self._unlogged = now, 0
            else:
                self._unlogged += 1
            return None
        try:
            reply = self._handle(msg)
            if not isinstance(reply, _REPLY_TYPES):
                raise TypeError(f"handler returned {type(reply).__name__}, not a Reply")
            return self._encoder.encode(reply)
        except Exception as e:  # answer, never kill the server
            logger.exception("gemma4-kv lookup %s failed", type(msg).__name__)
            return self._encoder.encode(messages.Failed(repr(e)))

    def _unlink_and_unlock(self) -> None:
        """Remove the files while still holding the lock, then release it."""
        if self._lock_fd is None:
            return
        for p in (self.path, self._lock_path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        os.close(self._lock_fd)
        self._lock_fd = None

    def close(self) -> None:
        """Stop serving, close the socket, remove the socket and lock files. Idempotent."""
        if self._lock_fd is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():  # a handler is stuck: leave its socket to it
            logger.warning("gemma4-kv lookup %s: handler still running at close", self.path)
        else:
            self._sock.close()
            self._ctx.term()
        self._unlink_and_unlock()

    def __enter__(self) -> LookupServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- client (scheduler side) --------------------------------------------------------------
class LookupClient:
    """Asks every worker rank; a rank that fails or does not answer in time is a miss.

    One DEALER socket per rank. Every request carries a fresh id that its reply echoes,
    so a late reply to a request that already timed out is discarded, never taken as
    the answer to a later one; the rank's socket stays usable. A request to a rank that
    was down is delivered when it comes up (and answered into the void), so handlers
    must tolerate stale requests (a Lookup re-pins, a Release is idempotent).
    Use from one thread (ZMQ sockets are not thread-safe)."""

    def __init__(self, addresses: list[str], timeout_ms: int = 10_000):
        self.addresses = list(addresses)
        self.timeout_ms = timeout_ms
        """Time for a whole round of `ask_all`, not per rank."""
        self.waited_out = 0
        """Rounds of `ask_all` that waited the whole `timeout_ms` for a rank that never
        answered. `tell_all` never waits and counts nothing."""
        self._ctx = zmq.Context()
        self._socks = []
        for address in self.addresses:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            s.connect(address)
            self._socks.append(s)
        self._rank = {s: r for r, s in enumerate(self._socks)}
        self._poller = zmq.Poller()
        for s in self._socks:
            self._poller.register(s, zmq.POLLIN)
        self._ids = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(messages.Reply)

    def ask_all(self, msg: messages.Request) -> list[messages.Reply] | None:
        """Every rank's reply, in rank order, or None if any rank failed, timed out or
        answered `Failed`. All ranks are asked before any reply is awaited, so they
        answer in parallel."""
        name = type(msg).__name__
        rid, waiting = self._send_all(msg)
        ok, replies = len(waiting) == len(self._socks), {}
        deadline = time.monotonic() + self.timeout_ms / 1000
        while waiting and (left := deadline - time.monotonic()) > 0:
            for s, _ in self._poller.poll(left * 1000):
                rank = self._rank[s]
                while (frames := self._recv(s)) is not None:
                    if rank not in waiting or len(frames) != 2 or frames[0] != rid:
                        continue  # a late reply to an earlier request
                    waiting.discard(rank)
                    try:
                        replies[rank] = reply = self._decoder.decode(frames[1])
                    except msgspec.DecodeError:
                        logger.warning("gemma4-kv worker at %s: undecodable reply to %s",
                                       self.addresses[rank], name)
                        ok = False
                        continue
                    if isinstance(reply, messages.Failed):
                        logger.warning("gemma4-kv worker at %s: %s failed: %s",
                                       self.addresses[rank], name, reply.error)
                        ok = False
        if waiting:  # the deadline passed
            self.waited_out += 1
        for rank in sorted(waiting):
            logger.warning("gemma4-kv worker at %s did not answer %s in %d ms",
                           self.addresses[rank], name, self.timeout_ms)
            ok = False
        return [replies[r] for r in range(len(self._socks))] if ok else None

    def tell_all(self, msg: messages.Request) -> None:
        """Send to every rank without waiting for the replies (they are dropped as late
        ones by the next `ask_all`). A rank handles its messages in order, so whatever
        is asked of it later is handled after this."""
        self._send_all(msg)

    def _send_all(self, msg: messages.Request) -> tuple[bytes, set[int]]:
        """(request id, ranks it was sent to)."""
        rid = next(self._ids).to_bytes(_RID_BYTES, "big")
        payload = self._encoder.encode(msg)
        sent = set()
        for rank, s in enumerate(self._socks):
            try:
                s.send_multipart([rid, payload], flags=zmq.NOBLOCK)
                sent.add(rank)
            except zmq.Again:  # its queue is full: that rank has been gone a while
                logger.warning("gemma4-kv worker at %s: cannot send %s", self.addresses[rank],
                               type(msg).__name__)
        return rid, sent

    @staticmethod
    def _recv(s: zmq.Socket) -> list[bytes] | None:
        try:
            return s.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks = []
        self._ctx.term()
