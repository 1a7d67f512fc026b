"""Scheduler-to-worker lookups over a local ZMQ socket.

The store lives in each worker process (that is where the KV bytes are copied), but
vLLM asks the scheduler, often in another process, how many tokens are cached. Each
worker rank serves `lookup` (largest servable hit, with the needed objects pinned
against eviction until the load) and `release` on an IPC socket; the scheduler asks
every rank and takes the smallest hit. This is how LMCache's own connector splits it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)


def socket_path(engine_id: str, rank: int) -> str:
    return f"ipc://{tempfile.gettempdir()}/gemma4kv-{engine_id}-r{rank}.sock"


class LookupServer:
    """Answers `(op, *args)` requests with `handlers[op](*args)` on a daemon thread."""

    def __init__(self, address: str, handlers: dict[str, Callable]):
        self._address = address
        self._handlers = handlers
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        if address.startswith("ipc://"):
            try:
                os.unlink(address[len("ipc://"):])
            except FileNotFoundError:
                pass
        self._sock.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="gemma4kv-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            op, *args = self._sock.recv_pyobj()
            try:
                reply = ("ok", self._handlers[op](*args))
            except Exception as e:  # answer, never kill the server
                logger.exception("gemma4-kv lookup %s failed", op)
                reply = ("error", repr(e))
            self._sock.send_pyobj(reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


class LookupClient:
    """Asks every worker rank; a rank that does not answer in time counts as a miss."""

    def __init__(self, addresses: list[str], timeout_ms: int = 10_000):
        self._addresses = addresses
        self._timeout_ms = timeout_ms
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}

    def _socket(self, address: str) -> zmq.Socket:
        if address not in self._socks:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
            s.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            self._socks[address] = s
        return self._socks[address]

    def ask_all(self, op: str, *args) -> list | None:
        """Replies of every rank, or None if any rank failed or timed out. All ranks
        are asked before any reply is awaited, so they answer in parallel."""
        asked, ok = [], True
        for address in self._addresses:
            try:
                self._socket(address).send_pyobj((op, *args))
                asked.append(address)
            except zmq.Again:
                ok = self._drop(address, op)
        replies = []
        for address in asked:  # every asked socket must receive, or it stays stuck
            try:
                status, value = self._socks[address].recv_pyobj()
            except zmq.Again:
                ok = self._drop(address, op)
                continue
            if status != "ok":
                logger.warning("gemma4-kv worker at %s: %s failed: %s", address, op, value)
                ok = False
            replies.append(value)
        return replies if ok else None

    def _drop(self, address: str, op: str) -> bool:
        """Forget a socket that timed out (a REQ socket is stuck after one)."""
        logger.warning("gemma4-kv worker at %s did not answer %s", address, op)
        self._socks.pop(address).close(linger=0)
        return False

    def close(self) -> None:
        for s in self._socks.values():
            s.close(linger=0)
        self._socks.clear()
