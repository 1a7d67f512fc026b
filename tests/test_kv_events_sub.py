"""The tests' router side of KV events (tests/kv_events_sub.py) against vLLM's own
`ZmqEventPublisher`: batches published before the subscriber joined are recovered
through the publisher's replay endpoint, in sequence order; without it they are lost
(the negative control, and what made test_e2e_kv_events fail on a loaded machine)."""

from __future__ import annotations

import time

import pytest

from needs import require

require("vllm")

HANG_S = 60.0


@pytest.mark.parametrize("replay", [True, False])
def test_batches_published_before_the_subscriber_joined_are_replayed(tmp_path, replay):
    from vllm.distributed.kv_events import (AllBlocksCleared, KVEventBatch,
                                            ZmqEventPublisher)
    from kv_events_sub import Subscriber

    pub = ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/events",
                            replay_endpoint=f"ipc://{tmp_path}/replay")
    sub = None
    try:
        for i in range(3):  # nobody listens yet: sequence numbers 0, 1, 2
            pub.publish(KVEventBatch(ts=float(i), events=[AllBlocksCleared()]))
        deadline = time.monotonic() + HANG_S
        while pub._event_queue.unfinished_tasks:  # sent, and buffered for replay
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sub = Subscriber(f"ipc://{tmp_path}/events", str(tmp_path / "flag"),
                         lambda e: False,
                         replay=f"ipc://{tmp_path}/replay" if replay else None).start()
        ts = 3.0
        while not [s for s in sub.batches if s >= 3]:  # until one arrives live
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            pub.publish(KVEventBatch(ts=ts, events=[AllBlocksCleared()]))
            ts += 1
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        events = sub.stop() if sub else []
        pub.shutdown()
    seqs = sorted(sub.batches)
    if replay:
        assert seqs == list(range(seqs[-1] + 1)) and sub.replayed >= 3
        assert len(events) == len(seqs)
    else:
        assert not {0, 1, 2} & set(seqs) and sub.replayed == 0
