"""Scheduler-to-worker lookups over a private local ZMQ socket.

The store lives in each worker process (that is where the KV bytes are copied), but
vLLM asks the scheduler, in the engine-core process, how many tokens are cached. Each
worker rank serves `protocol.Request`s on an IPC socket; the scheduler asks every rank.

What arrives on the socket is never code: messages are msgspec msgpack decoded into
`protocol` structs only, and anything else is dropped unanswered. The socket sits in a
directory only this user can open, is named after the engine-core PID so two engines
never share one, is guarded by a lock file so a second server cannot steal a live
engine's socket, and is removed on close.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import multiprocessing
import os
import re
import stat
import tempfile
import threading
import time
import typing
from collections.abc import Callable

import msgspec
import zmq

from . import messages as protocol

logger = logging.getLogger(__name__)

_REPLY_TYPES = typing.get_args(protocol.Reply)
_ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SUN_PATH_MAX = 107  # bytes of a Unix socket path (sun_path is 108 with the NUL)
_RID_BYTES = 8  # request id: the first frame after the peer identity, big-endian


# -- where the socket lives ---------------------------------------------------------------
def socket_dir() -> str:
    """This user's private directory for lookup sockets, created 0700 if missing.

    `$XDG_RUNTIME_DIR/gemma4-kv` when the runtime dir is ours and not writable by
    others, else `{tempdir}/gemma4-kv-{uid}`. An existing directory that others could
    enter or that is not plainly ours is refused rather than tightened: we did not make
    it that way, so someone else may have put files in it."""
    uid = os.getuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _owned_dir(runtime, uid, 0o022):
        path = os.path.join(runtime, "gemma4-kv")
    else:
        path = os.path.join(tempfile.gettempdir(), f"gemma4-kv-{uid}")
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # a umask may have taken owner bits away
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def _owned_dir(path: str, uid: int, forbidden: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & forbidden


def check_private_dir(path: str) -> None:
    """Raise unless `path` is a real directory (not a symlink), ours, mode 0700."""
    st = os.lstat(path)
    problem = (
        "is a symlink" if stat.S_ISLNK(st.st_mode)
        else "is not a directory" if not stat.S_ISDIR(st.st_mode)
        else f"belongs to uid {st.st_uid}, not {os.getuid()}" if st.st_uid != os.getuid()
        else f"has mode {stat.S_IMODE(st.st_mode):04o}, group/other may use it"
        if st.st_mode & 0o077 else None)
    if problem:
        raise RuntimeError(f"gemma4-kv: refusing lookup socket directory {path}: it {problem}; "
                           "remove it (it is re-created private) or make it ours with mode 0700")


def socket_address(engine_id: str, engine_pid: int, rank: int) -> str:
    """`ipc://` address of a worker rank's lookup socket, unique per engine process
    (two engines given the same engine_id still get different sockets)."""
    if not _ENGINE_ID.fullmatch(engine_id):
        raise ValueError(f"gemma4-kv: engine_id {engine_id!r} cannot name a socket file "
                         "(letters, digits, '.', '_', '-' only)")
    path = os.path.join(socket_dir(), f"{engine_id}-{engine_pid}-r{rank}.sock")
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ValueError(f"gemma4-kv: lookup socket path {path} is longer than "
                         f"{_SUN_PATH_MAX} bytes; use a shorter engine_id or TMPDIR")
    return f"ipc://{path}"


def engine_core_pid(vllm_config) -> int:
    """PID of vLLM's engine-core process (where the scheduler half runs), seen from a
    worker. The uni and external_launcher executors run the worker inside the engine
    core; the mp executor starts each worker as a multiprocessing child (fork or spawn)
    of the engine core. Ray workers may sit on other hosts, out of reach of IPC."""
    pc = vllm_config.parallel_config
    backend = pc.distributed_executor_backend
    if backend is None and pc.world_size_across_dp == 1:
        backend = "uni"  # what ParallelConfig.__post_init__ resolves it to
    if isinstance(backend, type):
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        backend = ("ray" if getattr(backend, "uses_ray", False)
                   else "mp" if issubclass(backend, MultiprocExecutor)
                   else "uni" if issubclass(backend, UniProcExecutor) else backend)
    if backend == "ray":
        raise RuntimeError("gemma4-kv does not support the ray executor: its lookups use "
                           "local IPC sockets, which workers on other hosts cannot reach")
    if backend in ("uni", "external_launcher"):
        return os.getpid()
    if backend == "mp":
        if pc.nnodes_within_dp > 1:
            raise RuntimeError("gemma4-kv does not support one engine spread over several "
                               f"nodes (nnodes_within_dp={pc.nnodes_within_dp}): lookups "
                               "use local IPC sockets")
        parent = multiprocessing.parent_process()
        if parent is None or parent.pid is None:
            raise RuntimeError("gemma4-kv: mp executor, but this worker was not started "
                               "by multiprocessing; cannot tell the engine-core PID")
        return parent.pid
    raise RuntimeError(f"gemma4-kv: cannot tell the engine-core process for "
                       f"distributed_executor_backend {backend!r} (supported: uni, mp, "
                       "external_launcher, or subclasses of their executors)")


# -- server (worker side) -----------------------------------------------------------------
def _ipc_path(address: str) -> str:
    if not address.startswith("ipc://"):
        raise ValueError(f"gemma4-kv: lookup address {address!r} is not ipc://")
    return address[len("ipc://"):]


def _take_lock(lock_path: str, sock_path: str) -> int:
    """fd holding an exclusive flock on `lock_path`, or a clear error if a live server
    holds it. A closing server unlinks the file it locked, so retry until the locked
    file is the one on disk (else two servers could each lock a different file)."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"gemma4-kv: lookup socket {sock_path} is served by another "
                               f"live engine (it holds {lock_path}); not taking it over") from None
        try:
            st = os.stat(lock_path, follow_symlinks=False)
            here = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


class LookupServer:
    """Answers each `protocol.Request` with `handle(request)` on a daemon thread.

    A ROUTER socket, so what is not one of our requests ([request id, payload] frames
    decoding to a `protocol.Request`) gets no answer at all: it is logged and counted in
    `dropped`, and serving goes on. A handler exception is answered `Failed`."""

    def __init__(self, address: str, handle: Callable[[protocol.Request], protocol.Reply]):
        self.address = address
        self.path = _ipc_path(address)
        self.dropped = 0
        self._handle = handle
        self._decoder = msgspec.msgpack.Decoder(protocol.Request)
        self._encoder = msgspec.msgpack.Encoder()
        check_private_dir(os.path.dirname(self.path))
        self._lock_path = self.path + ".lock"
        self._lock_fd: int | None = _take_lock(self._lock_path, self.path)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
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
        while not self._stop.is_set():
            try:
                if not self._sock.poll(100):
                    continue
                frames = self._sock.recv_multipart()
                reply = self._answer(frames)
                if reply is not None:
                    self._sock.send_multipart([frames[0], frames[1], reply])
            except Exception:  # a dead lookup thread would make every later lookup miss
                logger.exception("gemma4-kv lookup %s: serving error", self.path)

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
            logger.warning("gemma4-kv lookup %s: dropped a message that is not a lookup "
                           "request (%d frames, %d bytes)", self.path, len(frames),
                           sum(len(f) for f in frames[1:]))
            return None
        try:
            reply = self._handle(msg)
            if not isinstance(reply, _REPLY_TYPES):
                raise TypeError(f"handler returned {type(reply).__name__}, not a Reply")
            return self._encoder.encode(reply)
        except Exception as e:  # answer, never kill the server
            logger.exception("gemma4-kv lookup %s failed", type(msg).__name__)
            return self._encoder.encode(protocol.Failed(repr(e)))

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
        self._ctx = zmq.Context()
        self._socks = []
        for address in self.addresses:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            self._socks.append(s)
        self._rank = {s: r for r, s in enumerate(self._socks)}
        self._poller = zmq.Poller()
        for s in self._socks:
            self._poller.register(s, zmq.POLLIN)
        self._ids = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(protocol.Reply)

    def ask_all(self, msg: protocol.Request) -> list[protocol.Reply] | None:
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
                    if isinstance(reply, protocol.Failed):
                        logger.warning("gemma4-kv worker at %s: %s failed: %s",
                                       self.addresses[rank], name, reply.error)
                        ok = False
        for rank in sorted(waiting):
            logger.warning("gemma4-kv worker at %s did not answer %s in %d ms",
                           self.addresses[rank], name, self.timeout_ms)
            ok = False
        return [replies[r] for r in range(len(self._socks))] if ok else None

    def tell_all(self, msg: protocol.Request) -> None:
        """Send to every rank without waiting for the replies (they are dropped as late
        ones by the next `ask_all`). A rank handles its messages in order, so whatever
        is asked of it later is handled after this."""
        self._send_all(msg)

    def _send_all(self, msg: protocol.Request) -> tuple[bytes, set[int]]:
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
