"""The store on a running `lmcache server` (engine-driven, SHM L1) against real server
processes: `ServerStore` (what the connector uses) and the reads under it (`ServerReads`).

Each store is one registration, as an engine's rank is (engines in other processes:
tests/test_e2e_mp_server.py); the server's own status page is the oracle for locks and
sessions left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from gemma4_kv.layout import integrity
from gemma4_kv.keys.engine import fingerprint
from model_keys import chunk_hashes
from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
from gemma4_kv.layout.plan import hit_chunks
from gemma4_kv.stores.base import ChunkWrite
from gemma4_kv.connector.metrics import Gemma4KVStats
from gemma4_kv.config.host_checks import check_tiers_reachable
from gemma4_kv.config.settings import ConnectorSettings, SettingsError
from gemma4_kv.stores.server import (ServerConnection, ServerStore, UnsupportedServer,
                                     object_slots, server_argv)
from gemma4_kv.stores.server.reads import ServerReads
from lmcache_servers import ENV, Server, free_port
from paged import bits, random_bits

CHUNK = 64  # our chunk: tokens per object (the server's own chunk is 8 "tokens": a hash)
LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 128, 16, 2, 16, 16, torch.bfloat16, ("a", "b")),
    KVGroup(1, AttentionKind.SLIDING, 256, 32, 1, 64, 64, torch.bfloat16, ("c",)),
    KVGroup(2, AttentionKind.FULL, None, 32, 1, 32, 32, torch.float16, ("d", "e", "f")),
))
FP = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK)
NONE = {0: set(), 1: set(), 2: set()}
# Stated bounds (seconds) for a server that is gone; healthy calls take milliseconds.
TIMEOUT = 1.0  # lmcache_server_timeout_s in these tests
RECOVERY_BOUND = 30.0  # a restarted server is used again (heartbeat: 1 s while down)
HANG_S = 60.0  # a wait for something that comes in milliseconds: only a hang fails it


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def own_server():
    """A server of the test's own, for tests that leave it locked or kill it."""
    s = Server()
    yield s
    s.stop()


def tokens_of(seed: int, chunks: int) -> list[int]:
    return torch.randint(0, 1 << 20, (chunks * CHUNK,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def payload(key: tuple[int, int], like: torch.Tensor, seed: int) -> torch.Tensor:
    """The bytes of object (chunk, group): a function of the seed, so another process can
    regenerate what was written."""
    gen = torch.Generator().manual_seed(seed * 1000 + key[0] * 10 + key[1])
    return random_bits(like.shape, like.dtype, generator=gen)


def open_store(url: str, fp: str = FP, **kw) -> ServerStore:
    return ServerStore(LAYOUT, fp, CHUNK, url=url, timeout_s=TIMEOUT, **kw)


def put(store: ServerStore, seed: int, chunks: int, groups=(0, 1, 2), seal: bool = True,
        ends=None):
    """Store chunks 0..chunks-1 of prompt `seed` as the Saver does, for hits ending at
    `ends` (default: the prompt's end); returns what was reserved as sorted (chunk,
    group). Sliding groups keep only the windows before the ends: by hand, group 0
    (window 128) needs the two chunks before an end, group 1 (window 256) the four."""
    hashes = chunk_hashes(tokens_of(seed, chunks), CHUNK)
    ends = [chunks * CHUNK] if ends is None else ends
    res = store.reserve(ChunkWrite("put", hashes, 0, [groups] * chunks, ends))
    index = {h: i for i, h in enumerate(hashes)}
    for (h, g), (kv, trailer, key) in res.objects.items():
        kv.copy_(payload((index[h], g), kv, seed))
        if seal:
            integrity.seal(kv, trailer, key)
    store.commit(res)
    return sorted((index[h], g) for h, g in res.objects)


def lookup(store: ServerStore, hashes, keep: bool = True) -> dict[int, set[int]]:
    """What the lookup service sees: a prefetch, polled until settled, then resident.
    With `keep` the verified hit stays held for a `pin`; else it goes back."""
    p = store.start_prefetch(hashes, 0, len(hashes) * CHUNK)
    deadline = time.monotonic() + 10
    while not p.finished:
        assert time.monotonic() < deadline
        store.poll()
        time.sleep(0.002)
    resident = store.resident(hashes)
    if not keep:
        store.finish_prefetch(p)
    return resident


def cells(start: int, hit: int) -> list[tuple[int, int]]:
    """(chunk, group) of the objects a hit of tokens [start, hit) reads."""
    return [(c, g) for g, c in hit_chunks(LAYOUT, start, hit, CHUNK)]


def read_back(store: ServerStore, seed: int, chunks: int):
    """(present per group, pinned?, bit-exact?) of a window-aware hit on prompt `seed`."""
    hashes = chunk_hashes(tokens_of(seed, chunks), CHUNK)
    present = lookup(store, hashes)
    pinned = store.pin(hashes, 0, chunks * CHUNK)
    exact = pinned is not None and set(pinned.views) == {
        (hashes[c], g) for c, g in cells(0, chunks * CHUNK)} and all(
        torch.equal(bits(pinned.views[(hashes[c], g)]),
                    bits(payload((c, g), pinned.views[(hashes[c], g)], seed)))
        for c, g in cells(0, chunks * CHUNK))
    store.release(pinned)
    return {g: sorted(c) for g, c in present.items()}, pinned is not None, exact


# -- tests ------------------------------------------------------------------------------
def test_objects_hold_the_kv_and_its_trailer():
    g = LAYOUT.groups[0]  # 2 x 2 layers x 32 B rows: one more token slot holds 32 bytes
    assert object_slots(g, CHUNK) == CHUNK + 1
    big = KVGroup(0, AttentionKind.FULL, None, 16, 1, 1, 1, torch.bfloat16, ("a",))
    assert object_slots(big, CHUNK) == CHUNK + 8  # 4-byte rows: 8 slots for the trailer


def test_one_client_stores_another_reads_bit_exact(server):
    """Two registrations (engines); engines in other processes: tests/test_e2e_mp_server.py."""
    writer = open_store(server.url)
    # Group 0 (window 128) is stored only in the window before the end: chunks 1-2.
    assert put(writer, 1, 3) == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1),
                                 (2, 2)]
    writer.close()
    # A window-aware hit of 192 tokens: group 0 (window 128) needs tokens 65-191, its
    # chunks 1-2; group 1 (window 256) and group 2 (full) every chunk.
    assert sorted(cells(0, 192)) == sorted([(1, 0), (2, 0)] + [(c, g) for c in range(3)
                                                                for g in (1, 2)])
    store = open_store(server.url)
    try:
        present, pinned, exact = read_back(store, 1, 3)
    finally:
        store.close()
    assert present == {0: [1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert pinned and exact
    assert server.locks() == (0, 0, 0)  # every lock and session given back


def test_a_hit_holds_only_what_it_loads(server):
    store = open_store(server.url)
    try:
        put(store, 2, 4)
        hashes = chunk_hashes(tokens_of(2, 4), CHUNK)
        # By hand: group 0's window before 256 is chunks 2-3; group 1's (256) all four.
        assert lookup(store, hashes) == {0: {2, 3}, 1: {0, 1, 2, 3}, 2: {0, 1, 2, 3}}
        assert store.flush(10)  # frees are answered on a thread of their own
        wanted = cells(0, 256)
        assert len(wanted) == 10
        assert server.locks()[0] == 10  # the verified hit holds its objects' locks only
        pinned = store.pin(hashes, 0, 256)
        assert pinned is not None
        store.release(pinned)
        assert store.flush(10)
        assert server.locks() == (0, 0, 0)
        # Without a settled lookup a pin looks up itself; beyond what is stored: None.
        longer = hashes + chunk_hashes(tokens_of(9, 1), CHUNK)
        assert store.pin(longer, 256, 320) is None
        assert store.pin(hashes, 0, 64) is None  # no window was stored for an end at 64
        pinned = store.pin(hashes, 0, 256)
        assert pinned is not None
        store.release(pinned)
        assert store.flush(10)
        assert server.locks() == (0, 0, 0)
    finally:
        store.close()


def test_a_lookup_runs_its_phases_between_the_schedulers_asks(server):
    """The server's lookup takes several phases (ask, status, hold, read, verify). The
    lookup thread runs them back to back between messages: the scheduler's second ask
    finds the hit pinned. Before, each phase waited for an ask (a step) of its own."""
    from gemma4_kv.lookup import messages
    from gemma4_kv.lookup.channel import LookupClient, LookupServer
    from gemma4_kv.lookup.service import LookupService
    from gemma4_kv.lookup.sockets import socket_address

    store = open_store(server.url)
    service = LookupService(store, LAYOUT, CHUNK, timeout_s=30.0)
    address = socket_address(f"phases{uuid.uuid4().hex[:6]}", os.getpid(), 0)
    lookup_server = LookupServer(address, service.handle, service.advance)
    client = LookupClient([address])
    try:
        put(store, 31, 4)
        hashes = chunk_hashes(tokens_of(31, 4), CHUNK)
        ask = messages.Lookup("r", hashes, 0, 4 * CHUNK)
        assert client.ask_all(ask) == [messages.LookupReply(pending=True)]
        assert _poll_until(lambda: not store.in_flight(), 10), \
            "the lookup advanced only when asked"
        (reply,) = client.ask_all(ask)
        assert reply.pinned == 4 * CHUNK  # the whole prompt, by hand
        assert client.ask_all(messages.Release("r")) == [messages.Done(True)]
        assert store.flush(10)
        assert server.locks() == (0, 0, 0)
    finally:
        client.close()
        lookup_server.close()
        service.close()
        store.close()


def test_a_lookup_job_moves_through_its_phases(server):
    """A lookup job asks, checks, then has FOUND the hit (or MISSED, holding nothing);
    only `advance` moves it on, and a finished job stays where it ended."""
    from gemma4_kv.stores.server.lookup import LookupJob, Phase

    store = open_store(server.url)
    try:
        put(store, 32, 2)
        hashes = chunk_hashes(tokens_of(32, 2), CHUNK)
        job = store.start_prefetch(hashes, 0, 2 * CHUNK)
        assert isinstance(job, LookupJob) and job.phase is Phase.ASKING
        seen = [job.phase]
        assert _poll_until(lambda: (store.poll(), seen.append(job.phase), job.finished)[2],
                           10)
        assert job.phase is Phase.FOUND and job.hit is not None
        # (On a CPU the check ends in the step that starts it: no poll sees CHECKING.)
        assert seen[0] is Phase.ASKING and seen[-1] is Phase.FOUND
        assert set(seen) <= {Phase.ASKING, Phase.CHECKING, Phase.FOUND}
        assert job.advance() is Phase.FOUND  # finished: nothing moves it
        store.finish_prefetch(job)
        missing = chunk_hashes(tokens_of(33, 2), CHUNK)
        job = store.start_prefetch(missing, 0, 2 * CHUNK)
        assert _poll_until(lambda: (store.poll(), job.finished)[1], 10)
        assert job.phase is Phase.MISSED and job.hit is None
        store.finish_prefetch(job)
        with pytest.raises(TypeError):  # another store's prefetch is refused on entry
            store.finish_prefetch(type(job).__mro__[1](0.0))
        assert store.flush(10)
        assert server.locks()[0] == 0
    finally:
        store.close()


def test_a_hit_that_would_cost_more_than_recomputing_is_not_fetched(server):
    """The server's hit is fetched whole: 196,608 bytes for [0, 256) here (by hand: group
    0 chunks 2-3 x 16 KiB, group 1 chunks 0-3 x 16 KiB, group 2 chunks 0-3 x 24 KiB).
    At 1 MB/s that is 0.2 s, where recomputing 256 tokens takes 0.26 ms: no lookup is
    sent, the request misses at once. A fast tier is asked (pending)."""
    from gemma4_kv.lookup import messages
    from gemma4_kv.lookup.service import LookupService
    from gemma4_kv.lookup.wait import Rates

    store = open_store(server.url)
    try:
        put(store, 32, 4)
        hashes = chunk_hashes(tokens_of(32, 4), CHUNK)
        assert store.fetch_bytes(hashes, 0, 4 * CHUNK) == 196_608
        slow, fast = Rates(), Rates()
        for rates, tier_s in ((slow, 1.0), (fast, 0.001)):
            rates.prefill(1000, 0.001)
            rates.fetched(10**6, tier_s)
        ask = messages.Lookup("r", hashes, 0, 4 * CHUNK)
        assert LookupService(store, LAYOUT, CHUNK, 30.0, rates=slow).lookup(ask) \
            == messages.LookupReply()
        assert not store.in_flight()
        service = LookupService(store, LAYOUT, CHUNK, 30.0, rates=fast)
        assert service.lookup(ask).pending
        assert _poll_until(lambda: not service.advance(), 10)
        service.close()  # the verified hit goes back
        assert store.flush(10)
        assert server.locks() == (0, 0, 0)
    finally:
        store.close()


def _poll_until(condition, limit_s: float) -> bool:
    """Whether `condition` came true within `limit_s` (a bound on a hang, not a timing)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.cuda
def test_on_a_gpu_a_hit_is_loaded_from_its_verified_copy_and_the_locks_go(server):
    """With the KV on a GPU the verified copies stay there: the pin's views are device
    tensors holding the stored bytes, and the server's read locks went back when the
    verification finished (the 10 objects of [0, 256), by hand, as in
    test_a_hit_holds_only_what_it_loads)."""
    store = open_store(server.url, cuda=True, device="cuda")
    try:
        put(store, 34, 4)
        hashes = chunk_hashes(tokens_of(34, 4), CHUNK)
        assert lookup(store, hashes) == {0: {2, 3}, 1: {0, 1, 2, 3}, 2: {0, 1, 2, 3}}
        pinned = store.pin(hashes, 0, 256)
        assert pinned is not None and len(pinned.views) == 10
        assert store.flush(10)
        assert server.locks() == (0, 0, 0)
        for (h, g), view in pinned.views.items():
            assert view.is_cuda
            c = hashes.index(h)
            assert torch.equal(bits(view.cpu()), bits(payload((c, g), view.cpu(), 34)))
        store.release(pinned)
        assert store.device_bytes == 0
    finally:
        store.close()


def test_requests_with_one_prefix_each_get_their_own_lookup(server):
    """Two requests of one prompt looked up together: each pin takes the locks of one
    settled lookup (none asks the server again, none is left without a hit)."""
    store = open_store(server.url)
    try:
        put(store, 11, 2)
        hashes = chunk_hashes(tokens_of(11, 2), CHUNK)
        a, b = store.start_prefetch(hashes, 0, 128), store.start_prefetch(hashes, 0, 128)
        assert _poll_until(lambda: (store.poll(), a.finished and b.finished)[1], HANG_S)
        assert server.locks()[0] == 6  # 2 chunks x 3 groups, each locked twice
        pins = [store.pin(hashes, 0, 128) for _ in range(2)]
        assert all(pins) and not store._ready
        for pin in pins:
            store.release(pin)
        assert store.flush(10)
        assert server.locks() == (0, 0, 0)
    finally:
        store.close()


def test_only_the_windows_hits_can_use_are_stored_and_each_end_hits(server):
    """A 512-token prompt with hit ends 256 and 512 (retention 256). By hand: group 0
    (window 128) needs chunks 2-3 before 256 and 6-7 before 512; group 1 (window 256)
    chunks 0-3 and 4-7; the full group all 8: 20 objects, as the embedded store's
    `retained_chunks` keeps (dense storage held 24). A prompt sharing the first 256
    tokens hits 256 from the other window."""
    store = open_store(server.url, retention_interval=256)
    try:
        stored = put(store, 21, 8, ends=[256, 512])
        assert stored == sorted([(c, 0) for c in (2, 3, 6, 7)] + [(c, g) for c in range(8)
                                                                  for g in (1, 2)])
        assert len(stored) == 20
        hashes = chunk_hashes(tokens_of(21, 8), CHUNK)
        assert lookup(store, hashes, keep=False) == {0: {6, 7}, 1: {4, 5, 6, 7},
                                                     2: set(range(8))}
        other = chunk_hashes(tokens_of(21, 8)[:256] + tokens_of(22, 4), CHUNK)
        assert other[:4] == hashes[:4] and other[4] != hashes[4]
        assert lookup(store, other) == {0: {2, 3}, 1: {0, 1, 2, 3}, 2: {0, 1, 2, 3}}
        pinned = store.pin(other, 0, 256)
        assert pinned is not None and all(
            torch.equal(bits(v), bits(payload((hashes.index(h), g), v, 21)))
            for (h, g), v in pinned.views.items())
        store.release(pinned)
        assert store.flush(10)
        assert server.locks()[:2] == (0, 0)
    finally:
        store.close()


def test_an_end_whose_window_a_later_one_overlaps_is_not_stored_twice(server):
    """Ends 128 and 192 of a 3-chunk prompt: group 0's windows (chunks 0-1 and 1-2)
    share chunk 1, which goes to the later end only; group 1's window before 128
    (chunks 0-1) lies inside the one before 192 (0-2). So 128 cannot be served from the
    server, 192 can, and no object is stored twice: 3 + 3 + 3 = 9 objects."""
    store = open_store(server.url, retention_interval=64)
    try:
        assert len(put(store, 23, 3, ends=[128, 192])) == 9
        hashes = chunk_hashes(tokens_of(23, 3), CHUNK)
        assert lookup(store, hashes, keep=False) == {0: {1, 2}, 1: {0, 1, 2},
                                                     2: {0, 1, 2}}
        shorter = chunk_hashes(tokens_of(23, 3)[:128] + tokens_of(24, 1), CHUNK)
        assert lookup(store, shorter) == NONE
        assert store.flush(10)
        assert server.locks()[:2] == (0, 0)
    finally:
        store.close()


def test_two_pins_of_one_range_share_the_servers_read(server):
    """The server keys pending reads by (instance, key) without the request id; two pins
    of the same range must not lose each other's locks."""
    conn = ServerConnection(server.url, LAYOUT, FP, CHUNK)
    tier = ServerReads(conn)
    try:
        writer = open_store(server.url)
        put(writer, 3, 2)
        writer.close()
        hashes = chunk_hashes(tokens_of(3, 2), CHUNK)
        wanted = [(0, 2), (1, 2)]
        a, b = tier.lock(hashes, wanted), tier.lock(hashes, wanted)
        va, vb = tier.read(a), tier.read(b)
        assert all(torch.equal(bits(x[0]), bits(y[0])) for x, y in zip(va, vb))
        assert server.locks()[0] == 2  # objects read-locked (twice each)
        tier.release(a)
        assert conn.flush(10)
        assert server.locks()[0] == 2  # b still holds them
        tier.release(b)
        assert conn.flush(10)
        assert server.locks() == (0, 0, 0)
    finally:
        tier.close()
        conn.close()


def test_presence_is_a_prefix_on_lmcache_056(server):
    """0.5.6 counts leading chunks for every registration: chunks stored after a gap are
    not reported (a window-aware hit past an unstored early chunk is impossible, hence
    dense sliding-window storage with lmcache_server)."""
    store = open_store(server.url)
    try:
        hashes = chunk_hashes(tokens_of(4, 3), CHUNK)
        res = store.reserve(ChunkWrite("gap", hashes, 1, [(0, 1, 2)] * 2, [192]))
        assert sorted(res.objects) == sorted((h, g) for h in hashes[1:] for g in range(3))
        for (h, g), (kv, trailer, key) in res.objects.items():
            integrity.seal(kv, trailer, key)
        store.commit(res)
        assert lookup(store, hashes) == NONE
        assert store.pin(hashes, 128, 192) is None
        store.poll()
        assert store.flush(10)
        assert server.locks() == (0, 0, 0)
    finally:
        store.close()


def test_other_fingerprint_never_hits(server):
    writer = open_store(server.url)
    put(writer, 5, 1)
    writer.close()
    other = open_store(server.url, fingerprint(LAYOUT, model="other", chunk_size=CHUNK))
    try:
        assert lookup(other, chunk_hashes(tokens_of(5, 1), CHUNK)) == NONE
    finally:
        other.close()


def test_unfinished_writes_made_visible_are_never_offered(server):
    """0.5.6 commits a client's open reservations when its registration goes (reaped
    after a crash, or unregistered): their bytes are whatever was there. The store
    verifies every object it reads and never offers a bad one."""
    hashes = chunk_hashes(tokens_of(6, 2), CHUNK)
    crashed = crash_while_writing(server.url, 6)
    reader = open_store(server.url, stats=Gemma4KVStats())
    try:
        # The server holds all 6 objects; chunk 1's 3 fail verification: no hit offered.
        assert lookup(reader, hashes) == NONE
        assert reader.stats.take().data["rejected_objects"] == 3
        assert reader.pin(hashes, 0, 128) is None
        # Known bad from now on: not read (nor counted) again, never offered.
        assert lookup(reader, hashes) == NONE
        assert "rejected_objects" not in (reader.stats.take() or Gemma4KVStats()).data
        reader.poll()
    finally:
        reader.close()
        crashed.conn._stop.set()
        crashed.conn.wire.close()


def crash_while_writing(url: str, seed: int) -> ServerStore:
    """A client that reserved 2 chunks of prompt `seed`, filled them, sealed chunk 0
    only and died: the server's reaper commits all 6 objects (chunk 1's are bad)."""
    crashed = open_store(url)
    hashes = chunk_hashes(tokens_of(seed, 2), CHUNK)
    res = crashed.reserve(ChunkWrite("crashed", hashes, 0, [(0, 1, 2)] * 2, [128]))
    assert len(res.objects) == 6
    for (h, g), (kv, trailer, key) in res.objects.items():
        kv.copy_(payload((hashes.index(h), g), kv, seed))  # never committed
        if h == hashes[0]:
            integrity.seal(kv, trailer, key)
    for iid in crashed.conn.space.ids.values():  # what the reaper does to a dead client
        crashed.conn.wire.unregister(iid).result(5)
    return crashed


def test_reset_makes_this_engines_objects_unreachable_to_it_only(server):
    a, b = open_store(server.url), open_store(server.url)
    try:
        put(a, 7, 2)
        hashes = chunk_hashes(tokens_of(7, 2), CHUNK)
        assert a.reset()
        assert lookup(a, hashes) == NONE
        assert lookup(b, hashes) == {g: {0, 1} for g in range(3)}
        assert put(a, 7, 2) == [(c, g) for c in range(2) for g in range(3)]  # stored anew
        assert lookup(a, hashes) == {g: {0, 1} for g in range(3)}
        pinned = a.pin(hashes, 64, 128)
        assert pinned is not None
        a.release(pinned)
    finally:
        a.close()
        b.close()


def test_reset_during_a_load_keeps_the_loads_locks(server):
    """A reset (weights changed) while a load reads pinned objects: the old registrations
    stay until the pin is given back (unregistering dropped the server's read locks
    under the load: 6 -> 0, and the release then went unanswered for `timeout_s` and
    marked the server down); then they go, and nothing of the old space is offered."""
    before = set(server.status()["registered_non_cuda_instance_ids"])
    sessions = server.locks()[2]  # earlier tests' crashed clients may leave some
    store = open_store(server.url)
    try:
        old_ids = set(server.status()["registered_non_cuda_instance_ids"]) - before
        assert len(old_ids) == 3  # one registration per group
        put(store, 11, 2)
        hashes = chunk_hashes(tokens_of(11, 2), CHUNK)
        assert lookup(store, hashes) == {g: {0, 1} for g in range(3)}
        held = store.pin(hashes, 0, 128)  # a load in flight: 2 chunks x 3 groups
        assert held is not None and store.flush(10) and server.locks()[0] == 6
        assert store.reset()
        assert store.flush(10)
        assert server.locks()[0] == 6  # the load's locks survive the reset
        assert old_ids <= set(server.status()["registered_non_cuda_instance_ids"])
        assert torch.equal(bits(held.views[(hashes[1], 2)]),
                           bits(payload((1, 2), held.views[(hashes[1], 2)], 11)))
        store.release(held)
        assert store.flush(10)
        assert store.slow_tier_up()  # every release call was answered
        assert server.locks() == (0, 0, sessions)
        registered = set(server.status()["registered_non_cuda_instance_ids"])
        assert not old_ids & registered  # unregistered once nothing read in them
        assert len(registered - before) == 3  # the new space's
        assert lookup(store, hashes) == NONE
    finally:
        store.close()


def test_a_lookup_in_flight_at_a_reset_is_never_offered(server):
    """A lookup asked before a reset settles after it: its objects belong to the old
    weights and must not be pinned (nor its locks kept)."""
    store = open_store(server.url)
    try:
        put(store, 13, 2)
        hashes = chunk_hashes(tokens_of(13, 2), CHUNK)
        p = store.start_prefetch(hashes, 0, 128)
        store.reset()
        deadline = time.monotonic() + 10
        while not p.finished:
            assert time.monotonic() < deadline
            store.poll()
            time.sleep(0.002)
        assert store.resident(hashes) == NONE
        assert store.pin(hashes, 0, 128) is None
        assert store.flush(10)
        assert server.locks()[:2] == (0, 0)
    finally:
        store.close()


def _mapped_segments(shm: str) -> set[int]:
    """Inodes of the server L1 segments named `shm` mapped in this process (the kernel's
    own account: /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if f"lmcache_l1_pool_{shm}" in line}


def test_a_dead_servers_l1_is_unmapped_once_nothing_reads_it():
    """Every restart used to keep the dead server's L1 mapped (populated): N restarts,
    N x L1 of RAM. A load still reading the old segment keeps it until released."""
    s = Server()
    store = None
    try:
        store = open_store(s.url, ping_interval_s=0.5)
        put(store, 12, 2)
        hashes = chunk_hashes(tokens_of(12, 2), CHUNK)
        assert lookup(store, hashes) == {g: {0, 1} for g in range(3)}
        held = store.pin(hashes, 64, 128)
        assert held is not None and len(_mapped_segments(s.shm)) == 1
        for restart in range(2):
            epoch = store.conn.epoch
            s.restart()
            deadline = time.monotonic() + RECOVERY_BOUND
            while (store.conn.epoch == epoch or not store.slow_tier_up()) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            assert store.conn.epoch == epoch + 1 and store.slow_tier_up()
            # the first restart's old segment is still read by `held`
            assert len(_mapped_segments(s.shm)) == (2 if held is not None else 1), restart
            if held is not None:
                assert torch.equal(bits(held.views[(hashes[1], 2)]),
                                   bits(payload((1, 2), held.views[(hashes[1], 2)], 12)))
                store.release(held)
                held = None
                assert store.flush(10)
                assert len(_mapped_segments(s.shm)) == 1
        assert put(store, 12, 2) == [(c, g) for c in range(2) for g in range(3)]
        present, pinned, exact = read_back(store, 12, 2)
        assert present == {g: [0, 1] for g in range(3)} and pinned and exact
    finally:
        if store is not None:
            store.close()
        s.stop()
    assert not _mapped_segments(s.shm)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP), by the kernel's own account."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_a_release_does_not_wait_for_the_servers_answers(server):
    """A load gives its pin back on the model thread: the release sends its calls and
    returns, their answers are waited for on a thread of its own (`flush`). With the
    server stopped (SIGSTOP) the release used to wait `timeout_s` for it and then mark
    it down; now the server is still counted up, its answers owed until it runs again,
    and then every lock and session is given back."""
    sessions = server.locks()[2]  # earlier tests' crashed clients may leave some
    store = ServerStore(LAYOUT, FP, CHUNK, url=server.url, timeout_s=5.0)
    try:
        put(store, 15, 2)
        hashes = chunk_hashes(tokens_of(15, 2), CHUNK)
        assert lookup(store, hashes) == {g: {0, 1} for g in range(3)}
        pinned = store.pin(hashes, 0, 128)
        assert pinned is not None and store.flush(10)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while not _stopped(server.proc.pid):
                assert time.monotonic() < deadline
                time.sleep(0.002)
            store.release(pinned)
            assert store.slow_tier_up()  # nothing waited for the stopped server
            assert not store.flush(0)  # its answers are owed
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert store.flush(10) and store.slow_tier_up()
        assert server.locks() == (0, 0, sessions)
    finally:
        store.close()


def test_a_release_does_not_wait_for_a_read_in_flight(server):
    """A read on the lookup thread used to hold the tier's state lock while the server
    prepared its objects, and a release on the model thread waited for it (2 releases
    took 36.7 ms together in an engine). A read's lock now guards in-memory state only,
    and a release only queues its work, even while that lock is held."""
    store = open_store(server.url)
    try:
        put(store, 18, 2)
        hashes = chunk_hashes(tokens_of(18, 2), CHUNK)
        assert lookup(store, hashes) == {g: {0, 1} for g in range(3)}
        pinned = store.pin(hashes, 0, 128)
        assert pinned is not None
        with store.reads._lock:  # what a read holds (never across a call)
            releasing = threading.Thread(target=store.release, args=(pinned,))
            releasing.start()
            releasing.join(10)
            assert not releasing.is_alive()  # returned while the lock was held
        assert store.flush(10)
    finally:
        store.close()


def test_a_read_holds_no_lock_while_the_server_prepares_its_objects(server, monkeypatch):
    """Whenever a read waits for the server's answer to a prepare_retrieve, the lock
    of `ServerReads` is free (it guards in-memory state only): a release, or another
    thread's bookkeeping, never waits behind a call. Negative control: the check sees
    the lock held."""
    store = open_store(server.url)
    try:
        put(store, 19, 2)
        hashes = chunk_hashes(tokens_of(19, 2), CHUNK)
        lock, free = store.reads._lock, []

        def lock_is_free() -> bool:
            if not lock.acquire(timeout=0.5):
                return False
            lock.release()
            return True

        class Watched:
            def __init__(self, f):
                self.f = f

            def wait(self, timeout):
                free.append(lock_is_free())
                return self.f.wait(timeout)

            def result(self, timeout=None):
                return self.f.result(timeout)

        client = store.conn.wire.client
        real = client.prepare_retrieve
        monkeypatch.setattr(client, "prepare_retrieve", lambda *a: Watched(real(*a)))
        assert lookup(store, hashes) == {g: {0, 1} for g in range(3)}
        assert free and all(free), free
        with lock:
            assert not lock_is_free()
    finally:
        store.close()


def test_handles_of_another_store_are_refused_on_entry(server):
    """A pin's handle and a reservation are the store's own types: a release, commit or
    abort of something else raises instead of releasing nothing; a caller's empty
    plain `Reservation` (a save with nothing to store) is accepted."""
    from gemma4_kv.stores.base import Pinned, Reservation

    store = open_store(server.url)
    try:
        put(store, 20, 1)
        hashes = chunk_hashes(tokens_of(20, 1), CHUNK)
        assert lookup(store, hashes) == {g: {0} for g in range(3)}
        pinned = store.pin(hashes, 0, CHUNK)
        assert pinned is not None
        with pytest.raises(TypeError):
            store.release(Pinned(dict(pinned.views), ["a namespace", []]))
        store.release(pinned)
        store.release(pinned)  # idempotent
        assert pinned.handles is None
        store.commit(Reservation({}))
        store.abort(Reservation({}))
        with pytest.raises(TypeError):
            store.commit(Reservation({(hashes[0], 0): pinned.views[(hashes[0], 0)]}))
        assert store.flush(10)
        assert server.locks()[0] == 0
    finally:
        store.close()


def test_a_save_after_a_hit_does_not_ask_for_what_the_hit_found(server):
    """After a hit vLLM recomputes the tokens past it and the connector saves their chunk
    again; the lookup behind the pin found it on the server, so the reservation asks
    nothing (it cost the model thread a round trip). With the server stopped, such a
    reserve used to wait `timeout_s` and mark the server down."""
    store = ServerStore(LAYOUT, FP, CHUNK, url=server.url, timeout_s=5.0)
    try:
        put(store, 16, 2)
        hashes = chunk_hashes(tokens_of(16, 2), CHUNK)
        assert lookup(store, hashes) == {g: {0, 1} for g in range(3)}
        pinned = store.pin(hashes, 0, 96)  # ends inside chunk 1
        assert pinned is not None and store.flush(10)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while not _stopped(server.proc.pid):
                assert time.monotonic() < deadline
                time.sleep(0.002)
            res = store.reserve(ChunkWrite("after-hit", hashes, 1, [(0, 1, 2)]))
            assert res.objects == {} and store.slow_tier_up()  # the server was not asked
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        store.release(pinned)
        assert put(store, 17, 1) == [(0, g) for g in range(3)]  # never found: asked
    finally:
        store.close()


def test_unfilled_reservations_are_never_committed_by_close(own_server):
    """0.5.6 commits an instance's open reservations when it is unregistered; `close`
    must not unregister while one is open. (On a server of its own: the reservation
    stays write-locked until its TTL.)"""
    server = own_server
    store = open_store(server.url)
    hashes = chunk_hashes(tokens_of(10, 1), CHUNK)
    assert store.reserve(ChunkWrite("zz", hashes, 0, [(0, 1, 2)])).objects
    store.close()
    probe = open_store(server.url)
    try:
        assert lookup(probe, hashes) == NONE
    finally:
        probe.close()


def test_killed_server_fails_fast_and_a_restarted_one_is_used_again(own_server):
    """(On a server of its own: it kills it and starts another in its place.)"""
    s, store = own_server, None
    try:
        store = open_store(s.url, ping_interval_s=0.5)
        put(store, 8, 2)
        hashes = chunk_hashes(tokens_of(8, 2), CHUNK)
        held = store.pin(hashes, 64, 128)  # a load in flight
        assert held is not None
        crashed = crash_while_writing(s.url, 33)  # prompt 33's chunk 1: bad on this server
        torn = chunk_hashes(tokens_of(33, 2), CHUNK)
        assert lookup(store, torn) == NONE
        crashed.conn._stop.set()
        crashed.conn.wire.close()
        assert store.flush(10)  # no hand-back is still waiting for the server
        waited = store.conn.waited_out
        s.kill()
        p = store.start_prefetch(hashes, 0, 128)
        assert _poll_until(lambda: (store.poll(), p.finished)[1], 10 * TIMEOUT)  # a hang
        assert store.resident(hashes) == NONE
        assert store.pin(hashes, 0, 64) is None
        assert store.reserve(ChunkWrite("down", hashes, 0, [(0, 1, 2)] * 2)).objects == {}
        assert not store.slow_tier_up()  # lookups are answered from nothing, without asking
        # Fails fast: at most the lookup waited out the timeout (none if the heartbeat's
        # ping found the server gone first); every call after it failed at once.
        assert store.conn.waited_out - waited <= 1, store.conn.waited_out - waited
        s.restart()  # a new process: new L1 segment, no registrations
        deadline = time.monotonic() + RECOVERY_BOUND
        while not store.slow_tier_up() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.slow_tier_up()
        # The load in flight read our mapping of the dead server's segment; giving it
        # back asks nothing of the new server (it knows none of it).
        assert torch.equal(bits(held.views[(hashes[1], 2)]),
                           bits(payload((1, 2), held.views[(hashes[1], 2)], 8)))
        store.release(held)
        assert store.flush(10)
        assert store.slow_tier_up()
        assert lookup(store, hashes) == NONE  # the old server's objects went with it
        assert put(store, 8, 2) == [(c, g) for c in range(2) for g in range(3)]
        reader = open_store(s.url)
        try:
            present, pinned, exact = read_back(reader, 8, 2)
        finally:
            reader.close()
        assert present == {0: [0, 1], 1: [0, 1], 2: [0, 1]} and pinned and exact
        # What failed on the dead server is no verdict on the new one's objects.
        put(store, 33, 2)
        assert lookup(store, torn, keep=False) == {0: {0, 1}, 1: {0, 1}, 2: {0, 1}}
    finally:
        if store is not None:
            store.close()


@pytest.mark.skipif(not os.environ.get("G4KV_LMCACHE_OTHER"),
                    reason="set G4KV_LMCACHE_OTHER to an unpacked LMCache wheel of another "
                           "wire format (0.5.7rc2) to run")
def test_a_server_of_another_wire_format_is_refused_at_connect():
    """0.5.7 renamed IPCCacheServerKey.token_ids to token_bytes: registration and pings
    still work, every keyed call goes unanswered. The client must say so at once."""
    port, http, shm = free_port(), free_port(), f"g4kvother{uuid.uuid4().hex[:8]}"
    env = dict(ENV, PYTHONPATH=os.environ["G4KV_LMCACHE_OTHER"])
    argv = server_argv(sys.executable, port=port, shm_name=shm, l1_gb=0.25, http_port=http)
    argv[1:2] = ["-m", "lmcache.cli.main", "server"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/status", timeout=5)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.5)
        with pytest.raises(UnsupportedServer, match="versions must match"):
            ServerConnection(f"tcp://localhost:{port}", LAYOUT, FP, CHUNK, timeout_s=2.0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        Path(f"/dev/shm/lmcache_l1_pool_{shm}").unlink(missing_ok=True)


# -- settings ---------------------------------------------------------------------------
URL = "tcp://127.0.0.1:5555"


def test_settings_keep_retention_and_refuse_embedded_tiers():
    s = ConnectorSettings.from_extra_config({"lmcache_server": URL})
    assert s.retention_interval == 4096 and not s.embedded_store
    assert s.lmcache_server_timeout_s == 1.0
    assert s.store_config().retention_interval == 4096
    assert ConnectorSettings.from_extra_config(
        {"lmcache_server": URL, "retention_interval": 512}).retention_interval == 512
    for extra, match in [
            ({"cpu_gb": 8}, r'\["cpu_gb"\] cannot be combined with lmcache_server'),
            ({"disk_path": "/tmp"}, r'\["disk_path"\] cannot be combined'),
            ({"l2_adapters": []}, r'\["l2_adapters"\] cannot be combined'),
            ({"verify_checksums": False}, r"cannot be false with lmcache_server"),
            ({"lmcache_server_timeout_s": 3}, r"must be at most 1.5")]:
        with pytest.raises(SettingsError, match=match):
            ConnectorSettings.from_extra_config({"lmcache_server": URL, **extra})
    for bad, match in [("127.0.0.1:5555", r'write "tcp://127.0.0.1:5555"'),
                       ("http://x:1", "must be tcp://HOST:PORT"), (5555, "URL string"),
                       ("tcp://h:0", "must be tcp://HOST:PORT")]:
        with pytest.raises(SettingsError, match=match):
            ConnectorSettings.from_extra_config({"lmcache_server": bad})


def test_an_unreachable_server_stops_start_up_naming_the_key():
    s = ConnectorSettings.from_extra_config({"lmcache_server": f"tcp://127.0.0.1:{free_port()}"})
    with pytest.raises(SettingsError, match=r'\["lmcache_server"\] cannot be reached'):
        check_tiers_reachable(s)


def test_something_else_on_the_port_is_not_taken_for_a_server():
    """Reachable, but no lmcache server answers there: the store does not open (the
    worker turns this into a SettingsError naming lmcache_server, `worker.open_store`)."""
    import socket

    from gemma4_kv.stores.server import ServerUnavailable

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        check_tiers_reachable(ConnectorSettings.from_extra_config({"lmcache_server": url}))
        with pytest.raises(ServerUnavailable, match="no answer to ping"):
            ServerStore(LAYOUT, FP, CHUNK, url=url, timeout_s=0.5)
