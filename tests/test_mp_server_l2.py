"""One `lmcache server` per host, every server with the same Valkey as its L2 (issue 33
item 4), against real processes: two servers stand for two hosts (each its own L1
segment; nothing passes between them but Valkey), and a `ServerStore` on each is what
an engine's rank uses (engines: tests/test_e2e_hosts.py).

A write committed on server 1 reaches Valkey (the server's store policy writes every
object to its L2s); a lookup on server 2 makes that server bring the objects up into
its own L1 (`query_prefetch_status` answers once they are there), and the client
verifies them against their trailers before offering them, bit-exact. Negative
control: a server with another, empty Valkey finds nothing. Objects changed in Valkey
by anyone are brought up but never offered.

Sizes by hand (tests/test_mp_server.py's layout, chunk 64): a 3-chunk prompt stores 8
objects (group 0, window 128: chunks 1-2; groups 1 and 2: chunks 0-2), so 8 keys.
"""

from __future__ import annotations

import time

import pytest

from lmcache_servers import Server
from model_keys import chunk_hashes
from test_mp_server import CHUNK, NONE, lookup, open_store, put, read_back, tokens_of
from tier_servers import TierServer, require_server

OBJECTS = 8  # a 3-chunk prompt, by hand (module doc)
STORED_BOUND_S = 20.0  # Valkey holds a committed write (milliseconds when healthy)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """(Valkey, server 1, server 2): both servers with that Valkey as their L2."""
    tmp = tmp_path_factory.mktemp("hosts")
    valkey = TierServer(require_server(), workdir=tmp / "valkey").start()
    servers = []
    try:
        for _ in range(2):
            servers.append(Server(log_dir=str(tmp), l2_adapters=(valkey.valkey_spec(),)))
        yield valkey, *servers
    finally:
        for s in servers:
            s.stop()
        valkey.kill()


def l1_objects(server: Server) -> int:
    return server.status()["storage_manager"]["l1_manager"]["total_object_count"]


def in_valkey(valkey: TierServer, n: int) -> bool:
    """Whether Valkey holds `n` keys (more: fail), waiting at most STORED_BOUND_S."""
    deadline = time.monotonic() + STORED_BOUND_S
    while time.monotonic() < deadline:
        have = len(valkey.keys())
        assert have <= n, valkey.keys()
        if have == n:
            return True
        time.sleep(0.05)
    return False


def test_a_write_on_one_host_is_read_bit_exact_on_another(hosts):
    valkey, s1, s2 = hosts
    writer = open_store(s1.url)
    try:
        assert len(put(writer, 1, 3)) == OBJECTS
    finally:
        writer.close()
    assert in_valkey(valkey, OBJECTS)
    assert l1_objects(s2) == 0  # server 2 never saw the write: only Valkey has it
    reader = open_store(s2.url)
    try:
        present, pinned, exact = read_back(reader, 1, 3)
    finally:
        reader.close()
    assert present == {0: [1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert pinned and exact
    assert l1_objects(s2) == OBJECTS  # brought up from Valkey, kept (`retain`)
    assert s1.locks() == (0, 0, 0) and s2.locks() == (0, 0, 0)


def test_a_server_on_another_valkey_finds_nothing(hosts, tmp_path):
    """Negative control: the same write, read through a server whose L2 is another
    (empty) Valkey."""
    valkey, s1, _ = hosts
    writer = open_store(s1.url)
    try:
        put(writer, 2, 3)
    finally:
        writer.close()
    assert in_valkey(valkey, 2 * OBJECTS)
    hashes = chunk_hashes(tokens_of(2, 3), CHUNK)
    other = TierServer(require_server(), workdir=tmp_path / "other").start()
    server = None
    try:
        server = Server(log_dir=str(tmp_path), l2_adapters=(other.valkey_spec(),))
        store = open_store(server.url)
        try:
            assert lookup(store, hashes) == NONE
            assert store.pin(hashes, 0, 3 * CHUNK) is None
        finally:
            store.close()
        assert other.keys() == [] and l1_objects(server) == 0
    finally:
        if server is not None:
            server.stop()
        other.kill()


def test_objects_changed_in_valkey_are_never_offered(hosts):
    """Any client of the Valkey may write under our names: a full-attention object
    whose bytes changed there fails its trailer check on server 2, and no hit is
    offered (group 2 holds every chunk of the hit, chunk 0 included)."""
    valkey, s1, s2 = hosts
    before = set(valkey.keys())
    writer = open_store(s1.url)
    try:
        put(writer, 3, 3)
    finally:
        writer.close()
    assert in_valkey(valkey, len(before) + OBJECTS)
    full = [k for k in set(valkey.keys()) - before if ".g2@" in k]
    assert len(full) == 3
    for key in full:  # 8 bytes in the middle of the value (the KV, not a header);
        middle = int(valkey.cli("STRLEN", key)) // 2  # random bits: 2^-64 to be equal
        valkey.cli("SETRANGE", key, str(middle), "g4kvBAD!")
    held = l1_objects(s2)
    reader = open_store(s2.url)
    try:
        hashes = chunk_hashes(tokens_of(3, 3), CHUNK)
        assert lookup(reader, hashes) == NONE
        assert l1_objects(s2) == held + OBJECTS  # the server brought them up: the
        # client's check refused them
        assert reader.pin(hashes, 0, 3 * CHUNK) is None
        assert reader.flush(10)
    finally:
        reader.close()
    assert s2.locks() == (0, 0, 0)
