"""Tensor-parallel lookups against two real ranks (LookupService + EmbeddedStore behind real
ZMQ sockets): when ranks can serve different hits, the scheduler takes the longest
hit both can serve, and each rank then pins exactly the objects that hit's load reads
(nothing unpinned is read, nothing else stays pinned)."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from gemma4_kv.lookup import messages
from gemma4_kv.keys.engine import fingerprint
from model_keys import chunk_hashes
from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
from gemma4_kv.lookup.channel import LookupClient, LookupServer
from gemma4_kv.lookup.sockets import socket_address
from gemma4_kv.lookup.service import LookupService
from gemma4_kv.layout.plan import hit_chunks
from gemma4_kv.lookup.ranks import lookup_all_ranks
from gemma4_kv.stores.base import HIGH, LOW
from gemma4_kv.stores.config import StoreConfig
from gemma4_kv.stores.embedded import EmbeddedStore
from test_store import put

CHUNK = 64
# A sliding window spanning two chunks and a full group: a shorter hit needs sliding
# chunks a longer one does not.
LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 100, 16, 1, 16, 16, torch.bfloat16, ("s",)),
    KVGroup(1, AttentionKind.FULL, None, 16, 1, 16, 16, torch.bfloat16, ("f",)),
))


@pytest.fixture
def ranks():
    engine = f"tp-{uuid.uuid4().hex[:8]}"
    stores, services, servers = [], [], []
    for rank in range(2):
        fp = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK, tp_rank=rank, tp_size=2)
        store = EmbeddedStore(LAYOUT, fp, CHUNK, StoreConfig(cpu_bytes=4 << 20), kv_rank=rank)
        service = LookupService(store, LAYOUT, CHUNK, timeout_s=1.0)
        stores.append(store)
        services.append(service)
        servers.append(LookupServer(socket_address(engine, os.getpid(), rank), service.handle))
    client = LookupClient([socket_address(engine, os.getpid(), r) for r in range(2)],
                          timeout_ms=2000)
    yield stores, services, client
    client.close()
    for server, service, store in zip(servers, services, stores):
        server.close()
        service.close()
        store.close()


def sync(client) -> None:
    """Wait until every rank has handled what was told it so far (releases are told,
    not asked: a rank handles its messages in order)."""
    assert client.ask_all(messages.Release("sync")) == [messages.Done(ok=True)] * 2


def pinned_keys(store, service, req_id):
    hit = service._hits.get((req_id, 0))
    return set() if hit is None else set(hit.pinned.handles.keys)


def locked(store, hashes):
    """(chunk, group) of every object the store holds read-locked: what is left in L1
    after deleting everything (a read-locked object is not deleted). Destructive."""
    store.delete([(h, g) for h in hashes for g in (0, 1)])
    resident = store.resident(hashes)
    return {(c, g) for g in (0, 1) for c in resident[g]}


def test_ranks_answering_different_hits_pin_exactly_the_common_one(ranks):
    stores, services, client = ranks
    gen = torch.Generator().manual_seed(0)
    hashes = chunk_hashes(list(range(16 * CHUNK)), CHUNK)
    # Rank 0 can serve 1024 (chunks 0-15 full, the window before 1024: chunks 14-15)
    # and 768 (its window: chunks 10-11); rank 1 only 768 (chunks 12-15 never stored).
    put(stores[0], hashes[:16], gen, ends=[(1024, HIGH), (768, LOW)])
    put(stores[1], hashes[:12], gen, ends=[(768, HIGH)])
    assert stores[0].resident(hashes)[0] == {10, 11, 14, 15}
    lookup = messages.Lookup("r1", hashes, 0, 16 * CHUNK)

    replies = client.ask_all(lookup)  # what each rank would pin on its own
    assert [r.pinned for r in replies] == [1024, 768]
    client.ask_all(messages.Release("r1"))

    hit, _, _ = lookup_all_ranks(client, lookup)
    assert hit == 768
    need = set(hit_chunks(LAYOUT, 0, 768, CHUNK))
    assert (0, 10) in need and (0, 14) not in need  # the 768 hit reads other sliding chunks
    for store, service in zip(stores, services):
        want = {store.key(hashes[c], g) for g, c in need}
        assert pinned_keys(store, service, "r1") == want
    for service in services:  # what the load takes is exactly what was pinned
        h = service.take("r1", 0)
        assert (h.start, h.hit) == (0, 768)
        assert set(h.pinned.views) == {(hashes[c], g) for g, c in need}
        assert locked(service.store, hashes) == {(c, g) for g, c in need}
        service.done(h)
    for store in stores:
        assert locked(store, hashes) == set()


def test_no_common_hit_releases_every_pin(ranks):
    stores, services, client = ranks
    gen = torch.Generator().manual_seed(1)
    hashes = chunk_hashes(list(range(4 * CHUNK)), CHUNK)
    put(stores[0], hashes, gen)  # rank 1 stores nothing
    assert lookup_all_ranks(client, messages.Lookup("r2", hashes, 0, 4 * CHUNK)) == (0, 0, None)
    sync(client)
    for store in stores:
        assert locked(store, hashes) == set()
    assert all(not s._hits for s in services)


def test_a_store_read_that_raises_on_one_rank_is_that_requests_miss_only(ranks, monkeypatch):
    """Rank 1's store raises inside the Repin's pin (after rank 0 pinned its own, longer
    answer): the request misses, no rank keeps a lock, and the rank is not taken for
    down: the next lookup, once the store reads again, hits on both."""
    stores, services, client = ranks
    gen = torch.Generator().manual_seed(2)
    hashes = chunk_hashes(list(range(8 * CHUNK)), CHUNK)
    both = [(8 * CHUNK, HIGH), (6 * CHUNK, LOW)]
    put(stores[0], hashes, gen, ends=both)  # serves 384 and up to 496
    put(stores[1], hashes[:6], gen)  # rank 1 serves 384: the scheduler re-pins rank 0
    original = stores[1].pin

    def failing(*a, **kw):
        raise RuntimeError("injected: the CPU tier's read failed")

    lookup = messages.Lookup("r3", hashes, 0, 8 * CHUNK - 16)
    monkeypatch.setattr(stores[1], "pin", failing)
    assert lookup_all_ranks(client, lookup) == (0, 0, None)  # not RanksDown
    sync(client)
    for store in stores:
        assert locked(store, hashes) == set()
    assert all(not s._hits and not s._pending for s in services)
    put(stores[0], hashes, gen, ends=both)  # `locked` emptied the stores
    put(stores[1], hashes[:6], gen)
    monkeypatch.setattr(stores[1], "pin", original)
    hit, _, _ = lookup_all_ranks(client, messages.Lookup("r4", hashes, 0, 8 * CHUNK - 16))
    # By hand: rank 1 holds chunks 0-5 of the full group and, for its one end at 384,
    # the sliding window before it (tokens 284-383: chunks 4-5), so 384 is the only hit
    # it can serve; rank 0 holds the same objects (its LOW end at 384) and more. The
    # longest hit both serve: 384.
    assert hit == 384
    for service in services:
        h = service.take("r4", 0)
        assert (h.start, h.hit) == (0, 384)
        service.done(h)
    for store in stores:
        assert locked(store, hashes) == set()


def test_pinned_requests_are_capped_per_engine_and_a_lookup_beyond_misses(ranks, monkeypatch):
    """A same-uid peer that pins and never loads holds at most MAX_PINNED requests'
    objects; beyond that lookups miss, and a release makes room again."""
    from gemma4_kv.lookup import service as service_module

    stores, services, client = ranks
    monkeypatch.setattr(service_module, "MAX_PINNED", 2)
    gen = torch.Generator().manual_seed(3)
    hashes = chunk_hashes(list(range(4 * CHUNK)), CHUNK)
    for store in stores:
        put(store, hashes, gen, ends=[(4 * CHUNK, HIGH)])
    ask = lambda r: lookup_all_ranks(client, messages.Lookup(r, hashes, 0, 4 * CHUNK))  # noqa: E731
    assert ask("p1") == (4 * CHUNK, 0, None) and ask("p2") == (4 * CHUNK, 0, None)
    assert ask("p3") == (0, 0, None)
    sync(client)
    assert all(s.pinned_requests() == {"p1", "p2"} for s in services)
    client.ask_all(messages.Release("p1"))
    assert ask("p3") == (4 * CHUNK, 0, None)
    for r in ("p2", "p3"):
        client.ask_all(messages.Release(r))
    for store in stores:
        assert locked(store, hashes) == set()


@pytest.mark.parametrize("start,hit", [(0, 10**9), (0, 4 * CHUNK + 1), (0, -5), (0, 0),
                                       (-CHUNK, CHUNK), (2 * CHUNK, CHUNK)])
def test_a_repin_the_chunks_cannot_hold_is_a_miss_without_a_store_read(ranks, monkeypatch,
                                                                       start, hit):
    """A Repin beyond the chunks it names (10**9 tokens held the lookup thread for 40 s
    and several GB, then raised), a negative or empty one (answered ok): a miss on every
    rank, and the store is never asked to pin it. A valid one on the same chunks pins."""
    stores, services, client = ranks
    gen = torch.Generator().manual_seed(4)
    hashes = chunk_hashes(list(range(4 * CHUNK)), CHUNK)
    for store in stores:
        put(store, hashes, gen, ends=[(4 * CHUNK, HIGH)])
    asked = []
    for store in stores:
        original = store.pin
        monkeypatch.setattr(store, "pin", lambda *a, _o=original, **kw: (asked.append(a),
                                                                         _o(*a, **kw))[1])
    assert client.ask_all(messages.Repin("bad", hashes, start, hit)) == \
        [messages.Done(ok=False)] * 2  # embedded pins never go stale: fresh_s None
    assert asked == [] and all(not s.pinned_requests() for s in services)
    assert client.ask_all(messages.Repin("good", hashes, 0, 4 * CHUNK)) == \
        [messages.Done(ok=True)] * 2
    assert len(asked) == 2
    client.ask_all(messages.Release("good"))
    for store in stores:
        assert locked(store, hashes) == set()


def test_a_lookup_with_a_negative_start_is_a_miss(ranks):
    stores, services, client = ranks
    gen = torch.Generator().manual_seed(5)
    hashes = chunk_hashes(list(range(4 * CHUNK)), CHUNK)
    for store in stores:
        put(store, hashes, gen, ends=[(4 * CHUNK, HIGH)])
    assert client.ask_all(messages.Lookup("neg", hashes, -CHUNK, 4 * CHUNK)) == \
        [messages.LookupReply()] * 2
    assert all(not s.pinned_requests() for s in services)
