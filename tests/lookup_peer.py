"""Other processes for tests/test_lookup.py: foreign senders, a server to kill, a worker.

    python lookup_peer.py send ADDRESS dealer|req WAIT_MS HEXFRAME...
        sends the frames, prints "answered" or "silent" after WAIT_MS
    python lookup_peer.py serve ADDRESS
        serves Done(ok=True) to every request, prints "ready"; SIGTERM closes it
"""

from __future__ import annotations

import signal
import sys
import threading


def send(address: str, kind: str, wait_ms: int, frames: list[bytes]) -> str:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER if kind == "dealer" else zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    s.send_multipart(frames)
    answered = bool(s.poll(wait_ms))
    s.close()
    ctx.term()
    return "answered" if answered else "silent"


def send_as(conn, uid: int, address: str, frames: list[bytes]) -> None:
    """Runs in a forked child: become `uid` (this interpreter may be in a directory that
    uid cannot read, so no exec), then send."""
    import os

    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    conn.send(send(address, "dealer", 1000, frames))


def serve(address: str) -> None:
    from gemma4_kv.lookup import messages
    from gemma4_kv.lookup.channel import LookupServer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = LookupServer(address, lambda msg: messages.Done(ok=True))
    print("ready", flush=True)
    stop.wait()
    server.close()


def report_engine_core_pid(conn, backend: str) -> None:
    """Runs in a multiprocessing child, as a vLLM mp worker does."""
    from types import SimpleNamespace

    from gemma4_kv.lookup.sockets import engine_core_pid

    pc = SimpleNamespace(distributed_executor_backend=backend, world_size=2,
                         world_size_across_dp=2, nnodes_within_dp=1)
    conn.send(engine_core_pid(SimpleNamespace(parallel_config=pc)))


if __name__ == "__main__":
    if sys.argv[1] == "send":
        print(send(sys.argv[2], sys.argv[3], int(sys.argv[4]),
                   [bytes.fromhex(f) for f in sys.argv[5:]]), flush=True)
    elif sys.argv[1] == "serve":
        serve(sys.argv[2])
