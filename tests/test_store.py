"""The embedded LMCache store: round trip, pins, fingerprints, generations, eviction of
whole hits through LMCache's real L1, and the L2 path: asynchronous prefetch,
verification of every object that comes up from a disk tier (corrupt, truncated,
swapped, foreign objects are misses and are dropped)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from gemma4_kv.keys.engine import fingerprint
from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
from gemma4_kv.layout import integrity
from gemma4_kv.stores.base import HIGH, LOW, ChunkWrite
from gemma4_kv.stores.config import StoreConfig
from gemma4_kv.stores.embedded import EmbeddedStore
from model_keys import chunk_hashes
from paged import bits, random_bits

CHUNK = 32
LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 48, 16, 2, 16, 16, torch.bfloat16, ("a", "b")),
    KVGroup(1, AttentionKind.FULL, None, 32, 1, 32, 32, torch.bfloat16, ("c",)),
))
FP = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK)
GROUPS = (0, 1)
# One object of each group in LMCache's L1: the KV tensor and the 32-byte trailer,
# allocated in 4 KiB units. Group 0: 2 x 2 layers x 32 tokens x 32 bf16 = 8 KiB (+32 ->
# 12 KiB); group 1: 2 x 1 x 32 x 32 bf16 = 4 KiB (+32 -> 8 KiB).
OBJECT = {0: 12 << 10, 1: 8 << 10}


@pytest.fixture
def store():
    s = EmbeddedStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=1 << 20))
    yield s
    s.close()


def write(req, chain, first, groups, ends) -> ChunkWrite:
    """A save's write, its hit `ends` given as (tokens, HIGH or LOW) as the scheduler
    plans them for a store that ranks by them."""
    return ChunkWrite(req, list(chain), first, groups, [t for t, _ in ends],
                      frozenset(t for t, cls in ends if cls == LOW))


def put(store, chain, gen, groups=GROUPS, first=0, ends=None, req="r", finish=True):
    """Store chunks as a request's saves do: reserve, fill, seal, commit, and (with
    `finish`) the request ends. By default the chunks serve one HIGH hit at the chain's
    end."""
    n = len(chain) - first
    ends = [(len(chain) * store.chunk_size, HIGH)] if ends is None else ends
    res = store.reserve(write(req, chain, first, [groups] * n, ends))
    data = {}
    for (h, g), (kv, trailer, key) in res.objects.items():
        data[(h, g)] = random_bits(kv.shape, kv.dtype, generator=gen)
        kv.copy_(data[(h, g)])
        integrity.seal(kv, trailer, key)
    store.commit(res)
    if finish:
        store.on_request_finished(req)
    return data


def wait_for(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_round_trip_is_bit_exact(store):
    gen = torch.Generator().manual_seed(1)
    chain = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
    written = put(store, chain, gen)
    # A hit of 96 tokens needs every full chunk and the 48-token window (chunks 1-2):
    # nothing else is stored.
    assert store.resident(chain) == {0: {1, 2}, 1: {0, 1, 2}}
    pinned = store.pin(chain, 0, 3 * CHUNK)
    assert set(pinned.views) == {(h, 1) for h in chain} | {(chain[1], 0), (chain[2], 0)}
    for k, view in pinned.views.items():
        assert torch.equal(bits(view), bits(written[k]))
    store.release(pinned)
    again = store.reserve(write("r2", chain, 0, [GROUPS] * 3, [(96, HIGH)]))
    assert again.objects == {}  # stored already: nothing to write


def test_a_pin_read_locks_exactly_its_objects_and_a_miss_none(store):
    """The hit of 96 tokens reads 5 objects (3 full chunks, the window's 2 sliding ones):
    pinned, those 5 are read-locked until released. With one sliding object gone from
    L1 behind the account's back, the pin misses and leaves no lock behind (the full
    object of that chunk was found, and must not stay locked)."""
    gen = torch.Generator().manual_seed(7)
    chain = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
    put(store, chain, gen)
    locks = lambda: store.tier.status()["read_locked_count"]  # noqa: E731
    pinned = store.pin(chain, 0, 3 * CHUNK)
    assert pinned is not None and locks() == 5
    store.release(pinned)
    assert locks() == 0
    store.tier.delete([store.key(chain[2], 0)])
    assert store.pin(chain, 0, 3 * CHUNK) is None
    assert locks() == 0


def test_partial_groups_and_uncommitted_chunks(store):
    gen = torch.Generator().manual_seed(2)
    a, b = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
    put(store, [a], gen, groups=(1,), finish=False)  # a chunk without its sliding group
    assert store.resident([a]) == {0: set(), 1: {0}}
    assert store.pin([a], 0, CHUNK) is None
    used = store.usage()[0]
    res = store.reserve(write("r2", [a, b], 1, [GROUPS], [(2 * CHUNK, HIGH)]))
    assert set(res.objects) == {(b, 0), (b, 1)}
    assert store.resident([a, b]) == {0: set(), 1: {0}}  # invisible until committed
    store.abort(res)
    assert store.usage()[0] == used


def test_other_fingerprint_and_generation_never_hit(store):
    gen = torch.Generator().manual_seed(3)
    chain = chunk_hashes(list(range(CHUNK)), CHUNK)
    put(store, chain, gen)
    other = KVLayout((LAYOUT.groups[0],
                      KVGroup(1, AttentionKind.FULL, None, 32, 1, 32, 32, torch.float16, ("c",))))
    assert fingerprint(other, model="tiny", chunk_size=CHUNK) != FP
    assert fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK, tp_rank=1, tp_size=2) != FP
    assert fingerprint(LAYOUT, model="other", chunk_size=CHUNK) != FP
    pinned = store.pin(chain, 0, CHUNK)  # a load in flight across the reset keeps its objects
    view = pinned.views[(chain[0], 0)].clone()
    assert store.reset()
    assert store.resident(chain) == {0: set(), 1: set()}
    assert torch.equal(bits(pinned.views[(chain[0], 0)]), bits(view))
    store.release(pinned)
    assert store.usage()[0] == 0  # released: the old generation's objects are gone too
    put(store, chain, gen)
    assert store.resident(chain) == {0: {0}, 1: {0}}  # the new generation stores anew


def test_a_full_tier_evicts_whole_hits_and_never_a_pinned_one():
    """Documents of 4 chunks (a HIGH hit each: 4 full objects + the 2-chunk window = 56
    KiB) in a tier of 3 of them: a fourth asked twice evicts the least recent document
    asked for once, as a whole (its 6 objects leave L1), never the pinned one."""
    doc_bytes = 4 * OBJECT[1] + 2 * OBJECT[0]
    small = EmbeddedStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=3 * doc_bytes))
    try:
        gen = torch.Generator().manual_seed(4)
        docs = [chunk_hashes(list(range(1000 * d, 1000 * d + 4 * CHUNK)), CHUNK)
                for d in range(4)]
        for d in docs[:3]:
            put(small, d, gen)
        assert small.usage()[0] == 3 * doc_bytes
        pinned = small.pin(docs[0], 0, 4 * CHUNK)  # doc 0: pinned, and asked twice now
        assert put(small, docs[3], gen, req="a") == {}  # asked once: ties evict nothing
        assert put(small, docs[3], gen, req="b")  # asked twice: evicts doc 1 (least recent)
        assert small.resident(docs[1]) == {0: set(), 1: set()}
        assert small.resident(docs[0]) == {0: {2, 3}, 1: {0, 1, 2, 3}}
        assert small.usage()[0] == 3 * doc_bytes  # doc 1's objects really left L1
        small.release(pinned)
    finally:
        small.close()


def test_intermediate_windows_leave_before_any_final_hit():
    """Two documents of 4 chunks, each also with a LOW hit at chunk 2 (its own 2-chunk
    window: 2 x 12 KiB more), in a tier of 2 final hits + one LOW window: the second
    document's LOW window finds no LOW room without evicting the first's, and the final
    hits both stay."""
    doc_bytes = 4 * OBJECT[1] + 2 * OBJECT[0]
    low_bytes = 2 * OBJECT[0]
    small = EmbeddedStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=2 * doc_bytes + low_bytes))
    try:
        gen = torch.Generator().manual_seed(5)
        ends = [(4 * CHUNK, HIGH), (2 * CHUNK, LOW)]
        a = chunk_hashes(list(range(4 * CHUNK)), CHUNK)
        b = chunk_hashes(list(range(500, 500 + 4 * CHUNK)), CHUNK)
        put(small, a, gen, ends=ends, req="a")
        assert small.resident(a)[0] == {0, 1, 2, 3}
        put(small, b, gen, ends=ends, req="b")
        assert small.resident(a) == {0: {2, 3}, 1: {0, 1, 2, 3}}  # a's LOW window went
        assert small.resident(b) == {0: {0, 1, 2, 3}, 1: {0, 1, 2, 3}}
        assert small.usage()[0] == 2 * doc_bytes + low_bytes
    finally:
        small.close()


# A shape like Gemma 4 12B's: a sliding group's object holds twice the KV of a
# full-attention one (2 x 1 layer x 32 tokens x 4 heads x 1024 bf16 = 512 KiB, against
# 2 heads: 256 KiB), and the 32-byte trailer takes one 4 KiB page more on each.
WIDE = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 2 * CHUNK, 16, 4, 1024, 1024, torch.bfloat16, ("s0",)),
    KVGroup(1, AttentionKind.SLIDING, 2 * CHUNK, 16, 4, 1024, 1024, torch.bfloat16, ("s1",)),
    KVGroup(2, AttentionKind.FULL, None, 32, 2, 1024, 1024, torch.bfloat16, ("f",)),
))
FULL_OBJECT = (256 + 4) << 10
SLIDING_OBJECT = 2 * FULL_OBJECT  # 516 KiB, padded by 4 KiB to two full objects


def _wide_store(cpu_bytes: int) -> EmbeddedStore:
    return EmbeddedStore(WIDE, fingerprint(WIDE, model="wide", chunk_size=CHUNK), CHUNK,
                         StoreConfig(cpu_bytes=cpu_bytes))


def test_objects_take_whole_multiples_of_the_smallest_where_that_costs_little(store):
    """L1 allocates first fit: objects are padded to whole multiples of the smallest when
    that costs at most 2 % (WIDE: 4 KiB on 516), and left alone otherwise (LAYOUT's 12
    and 8 KiB objects would need 33 %)."""
    gen = torch.Generator().manual_seed(7)
    wide = _wide_store(1 << 22)
    try:
        chain = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        put(wide, chain, gen, groups=(0, 1, 2))
        assert wide.usage()[0] == 2 * (2 * SLIDING_OBJECT + FULL_OBJECT)
        assert wide.pin(chain, 0, 2 * CHUNK) is not None
    finally:
        wide.close()
    put(store, chunk_hashes(list(range(CHUNK)), CHUNK), gen)
    assert store.usage()[0] == OBJECT[0] + OBJECT[1]


def test_a_loop_keeps_as_many_documents_as_their_bytes_allow():
    """8 documents of 8 chunks in a loop, 3 rounds, each saved in two steps of 4 chunks
    as the scheduler half does, with LOW ends every 2 chunks and the final hit at 8: every
    chunk of both sliding groups is in the 2-chunk window of some end. A final hit is 8
    full objects and 2 groups x 2 window chunks: 16 x 266,240 bytes; the tier holds 4.5
    of them. LOW windows go first and ties evict nothing, so documents 0-3 hit in rounds
    1 and 2 and 4-7 never get in. Without the padding a sliding object is 4 KiB short of
    two full ones: a full object in a freed sliding one's place leaves 256 KiB that fits
    no object, and L1 ran out with room to spare by the account (2 documents kept)."""
    wide = _wide_store(int(4.5 * (8 * FULL_OBJECT + 4 * SLIDING_OBJECT)))
    ends = [(2 * CHUNK, LOW), (4 * CHUNK, LOW), (6 * CHUNK, LOW), (8 * CHUNK, HIGH)]
    docs = [chunk_hashes(list(range(1000 * d, 1000 * d + 8 * CHUNK)), CHUNK) for d in range(8)]
    hits, n = [], 0
    try:
        for _ in range(3):
            row = []
            for chain in docs:
                n += 1
                pinned = wide.pin(chain, 0, 8 * CHUNK, f"r{n}")
                row.append(int(pinned is not None))
                if pinned is not None:
                    wide.release(pinned)
                    continue
                for first in (0, 4):
                    wide.commit(wide.reserve(write(f"r{n}", chain, first,
                                                        [(0, 1, 2)] * 4, ends)))
                wide.on_request_finished(f"r{n}")
            hits.append(row)
        assert hits == [[0] * 8, [1] * 4 + [0] * 4, [1] * 4 + [0] * 4]
    finally:
        wide.close()


def test_an_aborted_prefill_leaves_nothing_behind(store):
    """A request that ends before its hit's last chunk is written: what it wrote serves
    no hit and leaves L1 when it finishes."""
    gen = torch.Generator().manual_seed(6)
    chain = chunk_hashes(list(range(4 * CHUNK)), CHUNK)
    ends = [(4 * CHUNK, HIGH)]
    res = store.reserve(write("r", chain, 0, [GROUPS] * 2, ends))  # chunks 0-1
    for (h, g), (kv, trailer, key) in res.objects.items():
        kv.copy_(random_bits(kv.shape, kv.dtype, generator=gen))
        integrity.seal(kv, trailer, key)
    store.commit(res)
    assert store.usage()[0] > 0
    store.on_request_finished("r")
    assert store.usage()[0] == 0 and store.resident(chain) == {0: set(), 1: set()}


# -- L2: a local disk tier, the real LMCache fs_native adapter ----------------------------

def disk_store(tmp_path, **kw):
    return EmbeddedStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=1 << 20,
                                                        disk_path=str(tmp_path), **kw))


def stored_on_disk(tmp_path, n):
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    return len(files) >= n and all(p.stat().st_size > 0 for p in files)


def evict(store, chain):
    """Delete a chain's objects from L1 (once LMCache's writes to L2 let go of them)."""
    cells = [(h, g) for h in chain for g in GROUPS]
    wait_for(lambda: (store.delete(cells), store.resident(chain) == {0: set(), 1: set()})[1])


def prefetched(store, chain):
    p = store.start_prefetch(chain, 0, len(chain) * CHUNK)
    wait_for(lambda: (store.poll(), p.finished)[1])
    return p


def test_prefetch_brings_back_evicted_objects_verified(tmp_path):
    s = disk_store(tmp_path)
    try:
        gen = torch.Generator().manual_seed(6)
        chain = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        data = put(s, chain, gen)
        wait_for(lambda: stored_on_disk(tmp_path, 4))
        evict(s, chain)
        assert s.resident(chain) == {0: set(), 1: set()}
        p = s.start_prefetch(chain, 0, 2 * CHUNK)
        assert s.resident(chain) == {0: set(), 1: set()}  # never offered before verified
        wait_for(lambda: (s.poll(), p.finished)[1])
        assert p.loaded == {(h, g) for h in chain for g in GROUPS} and p.rejected == 0
        pinned = s.pin(chain, 0, 2 * CHUNK)
        s.finish_prefetch(p)
        for k, view in pinned.views.items():
            assert torch.equal(bits(view), bits(data[k]))
        s.release(pinned)
    finally:
        s.close()


def test_a_prefetch_nobody_pins_leaves_l1_as_it_found_it(tmp_path):
    """What a prefetch brought up stays only while its lookup may pin it."""
    s = disk_store(tmp_path)
    try:
        gen = torch.Generator().manual_seed(9)
        chain = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        put(s, chain, gen)
        wait_for(lambda: stored_on_disk(tmp_path, 4))
        evict(s, chain)
        p = prefetched(s, chain)
        assert s.resident(chain) == {0: {0, 1}, 1: {0, 1}}
        s.finish_prefetch(p)  # the lookup gave up (or pinned nothing)
        assert s.usage()[0] == 0
    finally:
        s.close()


def disk_file(tmp_path, h: bytes, g: int):
    """The fs_native file of object (h, g): <namespace>@<rank>@<group hex>@<hash hex>."""
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file() and h.hex() in p.name
               and int(p.name.split("@")[2], 16) == g]
    return path


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "delete"])
def test_damaged_disk_objects_are_misses_and_dropped(tmp_path, damage):
    """64 bytes flipped, a file cut short, two files swapped, a file deleted: each is a
    miss (recomputed), never offered; the intact objects still hit."""
    s = disk_store(tmp_path)
    try:
        gen = torch.Generator().manual_seed(7)
        chain = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
        put(s, chain, gen, ends=[(3 * CHUNK, HIGH), (CHUNK, LOW)])
        wait_for(lambda: stored_on_disk(tmp_path, 6))
        evict(s, chain)
        victim = disk_file(tmp_path, chain[1], 0)
        if damage == "flip":
            raw = bytearray(victim.read_bytes())
            mid = len(raw) // 2
            raw[mid:mid + 64] = bytes(b ^ 0xFF for b in raw[mid:mid + 64])
            victim.write_bytes(bytes(raw))
        elif damage == "truncate":
            victim.write_bytes(victim.read_bytes()[:-100])
        elif damage == "swap":
            twin = disk_file(tmp_path, chain[2], 0)
            a, b = victim.read_bytes(), twin.read_bytes()
            victim.write_bytes(b)
            twin.write_bytes(a)
        else:
            victim.unlink()
        p = prefetched(s, chain)
        resident = s.resident(chain)
        assert 0 in resident[0] and 0 in resident[1]  # intact objects still hit
        assert 1 not in resident[0]  # the damaged object is never offered
        if damage in ("flip", "swap"):
            assert p.rejected >= 1
        s.finish_prefetch(p)
        p2 = prefetched(s, chain)  # asked again: still not offered
        assert 1 not in s.resident(chain)[0] and (chain[1], 0) not in p2.loaded
        s.finish_prefetch(p2)
    finally:
        s.close()


def hang_l2(s):
    """The disk tier stops answering (a stuck mount): LMCache's lookup of a prefetch
    gets no answer until `release()`. Reaches into LMCache's real adapter, as the
    engine faults of tests/faults.py do."""
    adapter = s.tier.storage_manager.l2_adapters()[0][1]
    adapter = getattr(adapter, "_inner", adapter)
    original = adapter.query_lookup_and_lock_result
    state = {"held": True, "asked": 0}

    def query(task_id):
        state["asked"] += 1
        return None if state["held"] else original(task_id)

    adapter.query_lookup_and_lock_result = query

    def release():
        state["held"] = False
        adapter._lookup_efd.notify()
    return state, release


def pin_exact_then_unlocked(s, chain, data, prefetch=None):
    """The whole chain pins bit-exact to what was stored, and once released and deleted
    nothing of it stays in L1 (no read lock was left behind)."""
    pinned = s.pin(chain, 0, len(chain) * CHUNK)
    if prefetch is not None:
        s.finish_prefetch(prefetch)
    for k, view in pinned.views.items():
        assert torch.equal(bits(view), bits(data[k]))
    s.release(pinned)
    s.delete([(h, g) for h in chain for g in GROUPS])
    assert s.resident(chain) == {0: set(), 1: set()}


def hung_prefetch(s, tmp_path, monkeypatch, damaged=False):
    """Chunk 0 in L1, chunk 1 only on disk, the disk stops answering, and a prefetch of
    both: (chain, stored data, release of the disk), once the prefetch was given up."""
    from gemma4_kv.stores import embedded_l2

    monkeypatch.setattr(embedded_l2, "L2_TASK_LIMIT_S", 0.5)
    gen = torch.Generator().manual_seed(12)
    chain = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
    data = put(s, chain, gen, ends=[(2 * CHUNK, HIGH), (CHUNK, LOW)])
    wait_for(lambda: stored_on_disk(tmp_path, 4))
    evict(s, chain[1:])
    assert s.resident(chain) == {0: {0}, 1: {0}}  # chunk 0 serves a hit of its own
    if damaged:
        victim = disk_file(tmp_path, chain[1], 0)
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x80
        victim.write_bytes(bytes(raw))
    state, release = hang_l2(s)
    p = s.start_prefetch(chain, 0, 2 * CHUNK)
    s.poll()
    assert not p.finished
    wait_for(lambda: (s.poll(), p.finished)[1])
    assert state["asked"] >= 1 and p.loaded == set() and s.l2.counts()["hung"] == 1
    return chain, data, release


def test_a_hung_l2_prefetch_is_given_up_and_blocks_no_fresh_copy(tmp_path, monkeypatch):
    """While the disk hangs, a save of chunk 1 is offered at once (it used to be held
    back, as possibly coming up unverified, for as long as the prefetch did not answer);
    once the disk answers, the prefetch's locks go and nothing stays locked."""
    s = disk_store(tmp_path)
    try:
        chain, _, release = hung_prefetch(s, tmp_path, monkeypatch)
        fresh = put(s, chain[1:], torch.Generator().manual_seed(13))
        assert s.resident(chain) == {0: {0, 1}, 1: {0, 1}}
        pinned = s.pin(chain, CHUNK, 2 * CHUNK)
        for (h, g), view in pinned.views.items():
            assert torch.equal(bits(view), bits(fresh[(h, g)]))
        s.release(pinned)
        release()
        wait_for(lambda: (s.poll(), not s.l2.counts()["hung"])[1])
        s.delete([(h, g) for h in chain for g in GROUPS])
        assert s.resident(chain) == {0: set(), 1: set()}  # no lock left behind
    finally:
        s.close()


@pytest.mark.parametrize("damaged", [False, True])
def test_what_a_given_up_prefetch_brings_up_late_is_verified_before_it_is_offered(
        tmp_path, monkeypatch, damaged):
    """The disk answers after the prefetch was given up: chunk 1 lands in L1 with nobody
    verifying it as it lands. It is offered once verified (bit-exact), or dropped from
    every tier if its file was damaged."""
    s = disk_store(tmp_path)
    try:
        chain, data, release = hung_prefetch(s, tmp_path, monkeypatch, damaged)
        release()
        wait_for(lambda: (s.poll(), not s.l2.counts()["hung"])[1])
        if damaged:
            assert s.resident(chain) == {0: {0}, 1: {0, 1}}
            assert s.l2.is_bad(s.key(chain[1], 0))
        else:
            assert s.resident(chain) == {0: {0, 1}, 1: {0, 1}}
            pin_exact_then_unlocked(s, chain, data)
    finally:
        s.close()


def test_a_verification_read_that_raises_leaks_no_lock_and_offers_nothing_unverified(
        tmp_path):
    """LMCache's read of an object that came up from disk raises once, as the prefetch
    settles: nothing stays locked, the object is not counted as loaded, and it is
    offered (bit-exact) only once a later read verified it."""
    s = disk_store(tmp_path)
    try:
        gen = torch.Generator().manual_seed(14)
        chain = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        data = put(s, chain, gen)
        wait_for(lambda: stored_on_disk(tmp_path, 4))
        evict(s, chain)
        sm, fired = s.tier.storage_manager, []
        original = sm.unsafe_read

        def unsafe_read(*a, **kw):
            if not fired:
                fired.append(1)
                raise RuntimeError("injected: the CPU tier's read failed")
            return original(*a, **kw)

        sm.unsafe_read = unsafe_read
        p = prefetched(s, chain)
        assert fired and p.rejected == 0 and len(p.loaded) == 3  # one read failed
        # verified when next asked for (the prefetch's own second look may do it first)
        assert s.resident(chain) == {0: {0, 1}, 1: {0, 1}}
        assert not s.l2.counts()["unverified"]
        pin_exact_then_unlocked(s, chain, data, prefetch=p)
    finally:
        s.close()


def test_object_of_unexpected_shape_is_never_read(store):
    """Same key, other geometry (as if the fingerprint had collided): a miss, not a load."""
    gen = torch.Generator().manual_seed(8)
    chain = chunk_hashes(list(range(CHUNK)), CHUNK)
    put(store, chain, gen)
    wider = EmbeddedStore(KVLayout((KVGroup(0, AttentionKind.SLIDING, 48, 16, 4, 16, 16,
                                            torch.bfloat16, ("a", "b")), LAYOUT.groups[1])),
                          FP, CHUNK, StoreConfig(cpu_bytes=1 << 20))
    try:
        store._layouts = wider._layouts  # this store now expects the wider objects
    finally:
        wider.close()
    assert store.pin(chain, 0, CHUNK) is None
    assert os.environ.get("PYTHONHASHSEED") == "0"


def test_a_queued_prefetch_given_up_never_offers_what_it_brings_back_unverified(
        tmp_path, monkeypatch):
    """LMCache runs 8 prefetches at once: a 9th waits in its queue. The disk hangs, 8
    prefetches of other prefixes hold every slot, and the 9th asks for a chain whose
    chunk 0 sits in L1 (good) and on disk (damaged). All are given up; chunk 0 is then
    evicted from L1; the disk answers, LMCache runs the queued prefetch, and it brings
    the damaged chunk 0 back from disk. It is never offered: verified, found bad, and
    dropped (it was pinned, not bit-exact, when only the keys the prefetch was still
    fetching were marked unverified)."""
    from gemma4_kv.stores import embedded_l2

    monkeypatch.setattr(embedded_l2, "L2_TASK_LIMIT_S", 0.5)
    s = disk_store(tmp_path)
    try:
        gen = torch.Generator().manual_seed(15)
        chain = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        put(s, chain, gen, ends=[(2 * CHUNK, HIGH), (CHUNK, LOW)])
        wait_for(lambda: stored_on_disk(tmp_path, 4))
        evict(s, chain[1:])
        assert s.resident(chain) == {0: {0}, 1: {0}}
        victim = disk_file(tmp_path, chain[0], 1)  # full group: every hit reads it
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x80
        victim.write_bytes(bytes(raw))
        state, release = hang_l2(s)
        others = [s.start_prefetch(chunk_hashes([1000 + i] * CHUNK, CHUNK), 0, CHUNK)
                  for i in range(8)]
        queued = s.start_prefetch(chain, 0, 2 * CHUNK)
        wait_for(lambda: (s.poll(), queued.finished and all(p.finished for p in others))[1])
        assert s.l2.counts()["hung"] == 9 and queued.loaded == set()
        evict(s, chain[:1])  # nothing holds chunk 0 any more: evicted
        release()
        wait_for(lambda: (s.poll(), not s.l2.counts()["hung"])[1])
        # the queued prefetch ran at last, and brought chunk 0 back from disk
        present = s.tier.resident(1, [s.key(chain[0], 1)], s._layouts[1], False)
        assert present == [0] or s.l2.is_bad(s.key(chain[0], 1))
        assert 0 not in s.resident(chain)[1]
        assert s.pin(chain, 0, CHUNK) is None
        assert s.l2.is_bad(s.key(chain[0], 1))
    finally:
        s.close()
