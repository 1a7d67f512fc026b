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
    """Collects every event published on `endpoint` from `start()` to `stop()`, in
    sequence order; writes `flag` once `until(event)` holds for one of them.

    A ZMQ SUB socket misses what is published before its subscription reaches the
    publisher (ZMQ's "slow joiner"; seen on a loaded CI machine, where the first
    document's events were lost). A router recovers them as vLLM's publisher offers:
    when the first batch it sees is not sequence 0, or a sequence number is skipped, it
    asks the publisher's `replay` endpoint (a ROUTER; vLLM's `KVEventsConfig.
    replay_endpoint`) for every batch from the first one missing."""

    REPLAY_TIMEOUT_MS = 30_000

    def __init__(self, endpoint: str, flag: str, until, replay: str | None = None):
        self.endpoint, self.flag, self.until, self.replay = endpoint, flag, until, replay
        self.batches: dict[int, list] = {}  # sequence number -> the batch's events
        self.replayed = 0  # batches recovered through the replay endpoint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def events(self) -> list:
        return [e for seq in sorted(self.batches) for e in self.batches[seq]]

    def start(self) -> "Subscriber":
        import zmq

        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(self.endpoint)
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
            _topic, seq_bytes, payload = self._sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            missing = [s for s in range(seq) if s not in self.batches]
            if missing and self.replay:
                self._replay_from(missing[0], decode)
            self._add(seq, decode(payload).events)

    def _replay_from(self, start: int, decode) -> None:
        import zmq
        from vllm.distributed.kv_events import ZmqEventPublisher

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, self.REPLAY_TIMEOUT_MS)
        sock.connect(self.replay)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                _empty, _topic, seq_bytes, payload = sock.recv_multipart()
                if seq_bytes == ZmqEventPublisher.END_SEQ:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq not in self.batches:
                    self.replayed += 1
                    self._add(seq, decode(payload).events)
        finally:
            sock.close(linger=0)

    def _add(self, seq: int, events: list) -> None:
        self.batches[seq] = list(events)
        if any(self.until(e) for e in events) and not os.path.exists(self.flag):
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
