"""The embedded LMCache store: round trip, pins, fingerprints, generations, eviction, and
the L2 path: asynchronous prefetch, verification of every object that comes up from a
disk tier (corrupt, truncated, swapped, foreign objects are misses and are dropped)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from gemma4_kv.stores import integrity
from gemma4_kv.keys.engine import chunk_hashes, fingerprint
from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
from gemma4_kv.stores.embedded import ChunkStore, StoreConfig
from paged import bits, random_bits

CHUNK = 32
LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 48, 16, 2, 16, 16, torch.bfloat16, ("a", "b")),
    KVGroup(1, AttentionKind.FULL, None, 32, 1, 32, 32, torch.bfloat16, ("c",)),
))
FP = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK)
GROUPS = (0, 1)


@pytest.fixture
def store():
    s = ChunkStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=1 << 20))
    yield s
    s.close()


def put(store, hashes, gen, groups=GROUPS):
    """Store chunks as the saver does: reserve, fill, seal, commit."""
    objects = store.reserve([(h, groups) for h in hashes])
    data = {}
    for (h, g), (kv, trailer, key) in objects.items():
        data[(h, g)] = random_bits(kv.shape, kv.dtype, generator=gen)
        kv.copy_(data[(h, g)])
        integrity.seal(kv, trailer, key)
    for h in hashes:
        store.commit(h)
    return data


def wait_for(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_round_trip_is_bit_exact(store):
    gen = torch.Generator().manual_seed(1)
    hashes = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
    written = put(store, hashes, gen)
    assert store.resident(hashes) == {0: {0, 1, 2}, 1: {0, 1, 2}}
    keys = [(h, g) for h in hashes for g in GROUPS]
    pinned = store.pin(keys)
    for k in keys:
        assert torch.equal(bits(pinned.views[k]), bits(written[k]))
    store.release(pinned)
    assert store.reserve([(hashes[0], GROUPS)]) == {}  # stored already: nothing to write


def test_partial_groups_and_uncommitted_chunks(store):
    gen = torch.Generator().manual_seed(2)
    a, b = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
    put(store, [a], gen, groups=(1,))  # a retained chunk without its sliding group
    assert store.resident([a]) == {0: set(), 1: {0}}
    assert store.pin([(a, 0)]) is None
    used = store.usage()[0]
    assert set(store.reserve([(b, GROUPS)])) == {(b, 0), (b, 1)}
    assert store.resident([b]) == {0: set(), 1: set()}  # invisible until committed
    store.abort(b)
    assert store.usage()[0] == used


def test_other_fingerprint_and_generation_never_hit(store):
    gen = torch.Generator().manual_seed(3)
    h = chunk_hashes(list(range(CHUNK)), CHUNK)[0]
    put(store, [h], gen)
    other = KVLayout((LAYOUT.groups[0],
                      KVGroup(1, AttentionKind.FULL, None, 32, 1, 32, 32, torch.float16, ("c",))))
    assert fingerprint(other, model="tiny", chunk_size=CHUNK) != FP
    assert fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK, tp_rank=1, tp_size=2) != FP
    assert fingerprint(LAYOUT, model="other", chunk_size=CHUNK) != FP
    pinned = store.pin([(h, 0)])  # a load in flight across the reset keeps its objects
    assert store.reset()
    assert store.resident([h]) == {0: set(), 1: set()}
    assert torch.equal(bits(pinned.views[(h, 0)]), bits(pinned.views[(h, 0)]))
    store.release(pinned)
    put(store, [h], gen)
    assert store.resident([h]) == {0: {0}, 1: {0}}  # the new generation stores anew


def test_salt_and_prefix_change_hashes():
    toks = list(range(2 * CHUNK))
    a = chunk_hashes(toks, CHUNK)
    assert len(a) == 2 and chunk_hashes(toks + [1], CHUNK) == a
    assert chunk_hashes(toks, CHUNK, salt="s")[0] != a[0]
    changed = [7] + toks[1:]
    assert chunk_hashes(changed, CHUNK)[1] != a[1]  # second chunk's key covers the prefix


def test_a_full_tier_evicts_at_once_and_keeps_pinned_objects():
    """Usable capacity is the configured one: a write that finds no room evicts now
    (not on LMCache's 1 s tick), never a pinned object."""
    object_bytes = sum(t.numel() * t.element_size() for t in (
        torch.empty(LAYOUT.groups[0].chunk_shape(CHUNK), dtype=torch.bfloat16),
        torch.empty(LAYOUT.groups[1].chunk_shape(CHUNK), dtype=torch.bfloat16)))
    small = ChunkStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=8 * object_bytes + 4096))
    try:
        gen = torch.Generator().manual_seed(4)
        hashes = chunk_hashes(list(range(40 * CHUNK)), CHUNK)
        put(small, hashes[:4], gen)
        pinned = small.pin([(hashes[0], 0), (hashes[0], 1)])
        for h in hashes[4:]:
            assert put(small, [h], gen), "a write found no room although it could evict"
        present = small.resident(hashes)
        assert 0 in present[0] and 0 in present[1]  # pinned by the read lock
        assert 39 in present[0] and len(present[0]) < len(hashes)
        used, total = small.usage()
        assert used > 0.8 * total  # the tier is used up to its size, not to 80%
        small.release(pinned)
    finally:
        small.close()


def test_touching_a_prefix_makes_lru_evict_its_tail_before_its_head():
    object_bytes = 2 * 48 * 32 * 2 * 2 + 2 * 32 * 32 * 2 * 2 + 64
    small = ChunkStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=6 * object_bytes))
    try:
        gen = torch.Generator().manual_seed(5)
        doc = chunk_hashes(list(range(4 * CHUNK)), CHUNK)
        put(small, doc, gen)
        small.touch([(h, g) for h in doc for g in GROUPS])
        other = chunk_hashes(list(range(1000, 1000 + 3 * CHUNK)), CHUNK)
        put(small, other, gen)
        kept = small.resident(doc)
        assert 0 in kept[1] and 3 not in kept[1]  # the head outlived the tail
    finally:
        small.close()


# -- L2: a local disk tier, the real LMCache fs_native adapter ----------------------------

def disk_store(tmp_path, **kw):
    return ChunkStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=1 << 20,
                                                     disk_path=str(tmp_path), **kw))


def stored_on_disk(tmp_path, n):
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    return len(files) >= n and all(p.stat().st_size > 0 for p in files)


def prefetched(store, hashes):
    windows = {0: 3, 1: -1}
    p = store.start_prefetch(hashes, windows)
    wait_for(lambda: (store.poll(), p.finished)[1])
    return p


def test_prefetch_brings_back_evicted_objects_verified(tmp_path):
    s = disk_store(tmp_path)
    try:
        gen = torch.Generator().manual_seed(6)
        hashes = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        data = put(s, hashes, gen)
        wait_for(lambda: stored_on_disk(tmp_path, 4))
        s._sm.delete_l1_keys([s.key(h, g) for h in hashes for g in GROUPS], force=True)
        assert s.resident(hashes) == {0: set(), 1: set()}
        p = s.start_prefetch(hashes, {0: 3, 1: -1})
        assert s.resident(hashes) == {0: set(), 1: set()}  # never offered before verified
        wait_for(lambda: (s.poll(), p.finished)[1])
        assert p.loaded == {(h, g) for h in hashes for g in GROUPS} and p.rejected == 0
        keys = [(h, g) for h in hashes for g in GROUPS]
        pinned = s.pin(keys)
        for k in keys:
            assert torch.equal(bits(pinned.views[k]), bits(data[k]))
        s.release(pinned)
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
        hashes = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
        put(s, hashes, gen)
        wait_for(lambda: stored_on_disk(tmp_path, 6))
        time.sleep(0.3)
        s._sm.delete_l1_keys([s.key(h, g) for h in hashes for g in GROUPS], force=True)
        victim = disk_file(tmp_path, hashes[1], 0)
        if damage == "flip":
            raw = bytearray(victim.read_bytes())
            mid = len(raw) // 2
            raw[mid:mid + 64] = bytes(b ^ 0xFF for b in raw[mid:mid + 64])
            victim.write_bytes(bytes(raw))
        elif damage == "truncate":
            victim.write_bytes(victim.read_bytes()[:-100])
        elif damage == "swap":
            twin = disk_file(tmp_path, hashes[2], 0)
            a, b = victim.read_bytes(), twin.read_bytes()
            victim.write_bytes(b)
            twin.write_bytes(a)
        else:
            victim.unlink()
        p = prefetched(s, hashes)
        resident = s.resident(hashes)
        assert 0 in resident[0] and 0 in resident[1]  # intact objects still hit
        assert 1 not in resident[0]  # the damaged object is never offered
        if damage in ("flip", "swap"):
            assert p.rejected >= 1
        p2 = prefetched(s, hashes)  # asked again: still not offered
        assert 1 not in s.resident(hashes)[0] and (hashes[1], 0) not in p2.loaded
    finally:
        s.close()


def test_object_of_unexpected_shape_is_never_read(store):
    """Same key, other geometry (as if the fingerprint had collided): a miss, not a load."""
    gen = torch.Generator().manual_seed(8)
    h = chunk_hashes(list(range(CHUNK)), CHUNK)[0]
    put(store, [h], gen)
    wider = KVLayout((KVGroup(0, AttentionKind.SLIDING, 48, 16, 4, 16, 16, torch.bfloat16,
                              ("a", "b")), LAYOUT.groups[1]))
    from gemma4_kv.stores.embedded import object_layouts

    store._layouts = object_layouts(wider, CHUNK)
    assert store.pin([(h, 0), (h, 1)]) is None
    assert os.environ.get("PYTHONHASHSEED") == "0"
