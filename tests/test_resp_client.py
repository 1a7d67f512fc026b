"""`stores/resp_client.RespClient` over LMCache's own C++ RESP client and a real server
process (tests/tier_servers.py): values of several sizes in one batch, an absent key's
GET, a server restart, a server started late, a server stopped mid-fetch. Each case
first shows LMCache's client alone failing it (the negative control), then RespClient
answering it: every batch answered within its deadline, and the link back once the
server is.

Expected bytes are the values the test wrote; deadlines are the test's own bounds."""

from __future__ import annotations

import select
import time

import pytest

from needs import require

require("lmcache")
from tier_servers import require_server, TierServer  # noqa: E402

require_server()

from lmcache.lmcache_redis import LMCacheRedisClient  # noqa: E402

from gemma4_kv.stores.resp_client import Link, RespClient  # noqa: E402

WORKERS = 2
BOUND_S = 10.0  # no answer may take longer than this (deadlines below are 1-2 s)


def native(server: TierServer):
    return LMCacheRedisClient(server.host, server.port, WORKERS, "", "")


def answers(client, fids: set[int], within: float) -> dict[int, tuple]:
    """The completions of `fids` that arrive within `within` seconds."""
    poller = select.poll()
    poller.register(client.event_fd(), select.POLLIN)
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + within
    while not fids <= set(got) and (left := deadline - time.monotonic()) > 0:
        poller.poll(max(1, int(left * 1000)))
        for fid, ok, error, found in client.drain_completions():
            got[int(fid)] = (bool(ok), str(error), None if found is None else list(found))
    return got


def answer(client, fid: int, within: float = BOUND_S):
    return answers(client, {fid}, within).get(fid)


def values(n: int, sizes=(3000, 1000, 7000)) -> list[bytearray]:
    """Values to send. The C++ client reads a buffer after its submit returns: a test
    keeps its own until the batch is answered (LMCache's L1 objects are, too)."""
    return [bytearray(bytes([i % 251 + 1]) * sizes[i % len(sizes)]) for i in range(n)]


def views(bufs) -> list[memoryview]:
    return [memoryview(b) for b in bufs]


@pytest.fixture
def server(tmp_path):
    s = TierServer(workdir=tmp_path / "valkey").start()
    yield s
    s.kill()


@pytest.fixture
def resp(server):
    c = RespClient(lambda: native(server), request_timeout_s=1.0, probe_timeout_s=0.5,
                   backoff_s=(0.05, 0.2))
    yield c
    c.close()


def wait_link(c: RespClient, link: Link, within: float = BOUND_S) -> None:
    deadline = time.monotonic() + within
    while c.link is not link:
        assert time.monotonic() < deadline, f"still {c.link}, waiting for {link}"
        answers(c, set(), 0.05)  # drain, as LMCache's demux thread does


# -- the C++ client alone: what RespClient is for --------------------------------------

def test_control_lmcache_client_fails_mixed_sizes_an_absent_get_and_a_restart(server):
    c = native(server)
    try:
        two = values(2)
        ok, error, _ = answer(c, c.submit_batch_set(["a", "b"], views(two)))
        assert not ok and "size mismatch" in error
        # An absent key's GET never answers (its connection waits for bytes that never come).
        absent = bytearray(1000)
        assert answer(c, c.submit_batch_get(["absent"], views([absent])), 1.0) is None
        ten = bytearray(10)
        assert answer(c, c.submit_batch_set(["a"], views([ten])))[0]
        server.kill()
        server.start()
        for _ in range(3):  # a restart breaks it for good
            got = answer(c, c.submit_batch_exists(["a"]))
            assert got is not None and not got[0], got
    finally:
        c.close()


# -- RespClient ---------------------------------------------------------------------

def test_a_batch_of_several_sizes_is_stored_and_read_back(resp, server):
    keys = [f"k{i}" for i in range(7)]
    sent = values(7)
    assert answer(resp, resp.submit_batch_set(keys, views(sent))) == (True, "", [True] * 7)
    assert server.cli("STRLEN", "k2").strip() == "7000"
    back = [bytearray(len(v)) for v in sent]
    ok, _, found = answer(resp, resp.submit_batch_get(keys, views(back)))
    assert ok and found == [True] * 7 and back == sent
    assert answer(resp, resp.submit_batch_exists(["k0", "nope", "k6"])) == \
        (True, "", [True, False, True])
    assert answer(resp, resp.submit_batch_delete(["k0"]))[0]
    assert answer(resp, resp.submit_batch_exists(["k0"])) == (True, "", [False])
    assert answer(resp, resp.submit_batch_exists([])) == (True, "", [])


def test_an_absent_keys_get_fails_by_its_deadline_and_the_link_comes_back(resp, server):
    sent = values(2, sizes=(1000,))
    assert answer(resp, resp.submit_batch_set(["x", "y"], views(sent)))[0]
    back = [bytearray(1000), bytearray(1000), bytearray(1000)]
    t0 = time.monotonic()
    got = answer(resp, resp.submit_batch_get(["x", "gone", "y"], views(back)))
    assert got is not None and not got[0], got  # a miss (1 s deadline), not a hang
    assert time.monotonic() - t0 < BOUND_S
    wait_link(resp, Link.UP)
    assert resp.reconnects == 1
    back = [bytearray(1000), bytearray(1000)]
    assert answer(resp, resp.submit_batch_get(["x", "y"], views(back))) == \
        (True, "", [True, True])
    assert back == sent


def test_a_restarted_server_is_used_again(resp, server):
    one, two = bytearray(b"1" * 500), bytearray(b"2" * 500)
    assert answer(resp, resp.submit_batch_set(["a"], views([one])))[0]
    server.kill()
    server.start()  # empty: nothing persisted
    got = answer(resp, resp.submit_batch_exists(["a"]))
    assert got is not None and not got[0]  # the broken connection: a miss
    wait_link(resp, Link.UP)
    assert answer(resp, resp.submit_batch_set(["a"], views([two])))[0]
    back = bytearray(500)
    assert answer(resp, resp.submit_batch_get(["a"], views([back]))) == (True, "", [True])
    assert back == two


def test_a_server_down_at_start_fails_fast_until_it_is_up(server):
    server.kill()
    c = RespClient(lambda: native(server), request_timeout_s=1.0, probe_timeout_s=0.3,
                   backoff_s=(0.05, 0.2))
    try:
        assert c.link is Link.DOWN
        t0 = time.monotonic()
        assert answer(c, c.submit_batch_exists(["a"]), 1.0) == \
            (False, f"{c.name}: reconnecting", [False])
        assert time.monotonic() - t0 < 1.0
        server.start()
        wait_link(c, Link.UP)
        assert answer(c, c.submit_batch_exists(["a"])) == (True, "", [False])
    finally:
        c.close()


def test_a_server_stopped_mid_fetch_is_a_miss_then_served_again(resp, server):
    big = bytearray(b"q" * (4 << 20))
    assert answer(resp, resp.submit_batch_set(["big"], views([big])))[0]
    server.pause()  # SIGSTOP: connections open, nothing answers
    try:
        back = bytearray(4 << 20)
        t0 = time.monotonic()
        got = answer(resp, resp.submit_batch_get(["big"], views([back])))
        assert got is not None and not got[0], got
        assert time.monotonic() - t0 < BOUND_S
    finally:
        server.resume()
    wait_link(resp, Link.UP)
    back = bytearray(4 << 20)
    assert answer(resp, resp.submit_batch_get(["big"], views([back]))) == (True, "", [True])
    assert back == big


# -- through LMCache's adapter and the embedded store ----------------------------------

def test_an_embedded_store_shares_through_resp_and_survives_a_restart(server):
    """Two stores (two engines' CPU tiers) on one server through a `resp` spec, the
    groups' objects of different sizes (test_remote_tier.LAYOUT): B serves what A stored,
    bit-exact; with the server killed B's lookup settles as a miss; restarted (empty),
    what A stores again reaches B."""
    import torch

    from model_keys import chunk_hashes
    from test_remote_tier import (cells, copied, drop_cpu_tier, lookup, needed, open_store,
                                  put, reads_back, wait_until, wire_key)

    spec = {"type": "resp", "host": server.host, "port": server.port,
            "num_workers": WORKERS, "request_timeout": 1.0}
    a, b = open_store(spec), open_store(spec)
    try:
        gen = torch.Generator().manual_seed(5)
        hashes = chunk_hashes(list(range(3 * 32)), 32)
        written = put(a, hashes, gen)
        assert copied(a, server, 6) == sorted(wire_key(a, h, g) for h, g in cells(hashes))
        p = lookup(b, hashes)
        assert p.loaded == needed(hashes) and p.rejected == 0
        assert reads_back(b, hashes, written)

        drop_cpu_tier(b, hashes)
        server.kill()
        p = lookup(b, hashes)  # settles on its own: a miss
        assert p.finished and not p.loaded
        server.start()  # empty
        wait_until(lambda: server.clients() >= 2 * WORKERS, "both stores reconnected")
        drop_cpu_tier(a, hashes[:1])  # so that A writes it again
        again = put(a, hashes[:1], gen)
        assert len(copied(a, server, 2)) == 2
        p = lookup(b, hashes[:1])
        assert p.loaded == cells(hashes[:1]) and reads_back(b, hashes[:1], again)
    finally:
        a.close()
        b.close()
