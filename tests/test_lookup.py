"""The scheduler's lookup client against real worker-side servers (ZMQ IPC)."""

from __future__ import annotations

import threading
import time

from gemma4_kv.lookup import LookupClient, LookupServer, socket_path


def test_every_rank_answers_and_ranks_work_in_parallel(tmp_path):
    started = []

    def slow_lookup(rank):
        def lookup(n):
            started.append((rank, time.perf_counter()))
            time.sleep(0.3)
            return n * 10 + rank
        return lookup

    servers = [LookupServer(socket_path(f"t{id(tmp_path)}", r), {"lookup": slow_lookup(r)})
               for r in range(2)]
    client = LookupClient([socket_path(f"t{id(tmp_path)}", r) for r in range(2)])
    try:
        assert client.ask_all("lookup", 7) == [70, 71]
        # rank 1 started before rank 0 finished: the requests were in flight together
        assert abs(started[0][1] - started[1][1]) < 0.25
    finally:
        client.close()
        for s in servers:
            s.close()


def test_a_failing_or_silent_rank_is_a_miss_and_the_client_recovers(tmp_path):
    fail = threading.Event()

    def lookup(n):
        if fail.is_set():
            raise RuntimeError("store closed")
        return n

    good = LookupServer(socket_path(f"f{id(tmp_path)}", 0), {"lookup": lookup})
    silent = socket_path(f"f{id(tmp_path)}", 1)  # nobody serves this rank yet
    client = LookupClient([socket_path(f"f{id(tmp_path)}", 0), silent], timeout_ms=200)
    try:
        assert client.ask_all("lookup", 3) is None
        late = LookupServer(silent, {"lookup": lookup})
        assert client.ask_all("lookup", 3) == [3, 3]  # both sockets usable again
        fail.set()
        assert client.ask_all("lookup", 3) is None
        fail.clear()
        assert client.ask_all("lookup", 4) == [4, 4]
        late.close()
    finally:
        client.close()
        good.close()
