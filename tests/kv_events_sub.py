"""A router's side of vLLM's KV events, for the tests: a ZMQ SUB socket on the engine's
`kv_events_config` endpoint that decodes each batch with vLLM's own `KVEventBatch`
decoder, and the block hashes a router computes from a prompt's tokens (vLLM's
`sha256_cbor` scheme, written here with hashlib and cbor2, not through vLLM or
gemma4-kv).

`wait_for_file` is a collective_rpc target (the harness's "call" step): the engine
stays up until the subscriber has seen what the test waits for (bounded), since vLLM's
publisher closes its socket without lingering at exit."""

from __future__ import annotations

import hashlib
import os
import threading
import time


def router_hashes(tokens, block_size: int, seed: str = "0") -> list[int]:
    """vLLM's block hashes of `tokens` with `prefix_caching_hash_algo="sha256_cbor"`
    and PYTHONHASHSEED=`seed`, as its KV events carry them (the low 64 bits)."""
    import cbor2

    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


class Subscriber:
    """Collects every event published on `endpoint` from `start()` to `stop()`; writes
    `flag` once `until(event)` holds for one of them."""

    def __init__(self, endpoint: str, flag: str, until):
        self.endpoint, self.flag, self.until = endpoint, flag, until
        self.events: list = []
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Subscriber":
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(self.endpoint)  # before the engine binds: nothing is missed
        self._thread.start()
        return self

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            _topic, _seq, payload = self._sock.recv_multipart()
            batch = decode(payload)
            self.batches += 1
            for e in batch.events:
                self.events.append(e)
                if self.until(e) and not os.path.exists(self.flag):
                    open(self.flag, "w").close()

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close(linger=0)
        return self.events


def wait_for_file(worker, path: str, timeout_s: float = 120.0) -> bool:
    """collective_rpc target: wait (at most `timeout_s`) until `path` exists."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.path.exists(path)
