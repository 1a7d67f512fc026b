"""The embedded LMCache store: round trip, all-groups commit, fingerprints, eviction, disk."""

from __future__ import annotations

import time

import pytest
import torch

from gemma4_kv.keys import chunk_hashes, fingerprint
from gemma4_kv.layout import AttentionKind, KVGroup, KVLayout
from gemma4_kv.store import ChunkStore, StoreConfig, object_layouts
from paged import bits, random_bits

CHUNK = 32
LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 48, 16, 2, 16, 16, torch.bfloat16, ("a", "b")),
    KVGroup(1, AttentionKind.FULL, None, 32, 1, 32, 32, torch.bfloat16, ("c",)),
))
FP = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK)


@pytest.fixture
def store():
    s = ChunkStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=1 << 20))
    yield s
    s.close()


def put(store, h, gen):
    objs = store.reserve(h)
    data = {}
    for gid, t in objs.items():
        data[gid] = random_bits(t.shape, t.dtype, generator=gen)
        t.copy_(data[gid])
    store.commit(h)
    return data


def test_round_trip_is_bit_exact(store):
    gen = torch.Generator().manual_seed(1)
    hashes = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
    written = [put(store, h, gen) for h in hashes]
    assert store.present(hashes) == {0: {0, 1, 2}, 1: {0, 1, 2}}
    keys = [(h, g) for h in hashes for g in (0, 1)]
    assert store.lock(keys)
    got = store.read(keys)
    for (h, g), t in zip(keys, got):
        assert torch.equal(bits(t), bits(written[hashes.index(h)][g]))
    store.release(keys)
    assert store.reserve(hashes[0]) == {}  # already stored: nothing to write


def test_uncommitted_chunks_are_invisible_and_abort_frees(store):
    h = chunk_hashes(list(range(CHUNK)), CHUNK)[0]
    used = store.usage()[0]
    assert set(store.reserve(h)) == {0, 1}
    assert store.present([h]) == {0: set(), 1: set()}
    store.abort(h)
    assert store.usage()[0] == used
    assert store.present([h]) == {0: set(), 1: set()}


def test_other_fingerprint_never_hits(store):
    gen = torch.Generator().manual_seed(2)
    h = chunk_hashes(list(range(CHUNK)), CHUNK)[0]
    put(store, h, gen)
    other = KVLayout((LAYOUT.groups[0],
                      KVGroup(1, AttentionKind.FULL, None, 32, 1, 32, 32, torch.float16, ("c",))))
    assert fingerprint(other, model="tiny", chunk_size=CHUNK) != FP
    assert fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK, tp_rank=1, tp_size=2) != FP
    assert fingerprint(LAYOUT, model="other", chunk_size=CHUNK) != FP
    s2 = ChunkStore.__new__(ChunkStore)  # same LMCache storage, another layout's keys
    s2.__dict__.update(store.__dict__)
    s2.layout, s2.fingerprint = other, fingerprint(other, model="tiny", chunk_size=CHUNK)
    s2._layouts = object_layouts(other, CHUNK)
    assert s2.present([h]) == {0: set(), 1: set()}


def test_salt_and_prefix_change_hashes():
    toks = list(range(2 * CHUNK))
    a = chunk_hashes(toks, CHUNK)
    assert len(a) == 2 and chunk_hashes(toks + [1], CHUNK) == a
    assert chunk_hashes(toks, CHUNK, salt="s")[0] != a[0]
    changed = [7] + toks[1:]
    assert chunk_hashes(changed, CHUNK)[1] != a[1]  # second chunk's key covers the prefix


def test_lru_eviction_keeps_locked_objects():
    small = ChunkStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=96 << 10))
    try:
        gen = torch.Generator().manual_seed(3)
        hashes = chunk_hashes(list(range(40 * CHUNK)), CHUNK)
        stored = []
        for h in hashes[:6]:
            put(small, h, gen)
            stored.append(h)
        assert small.lock([(stored[0], 0), (stored[0], 1)])
        for h in hashes[6:]:
            if small.reserve(h) is None:
                time.sleep(1.2)  # LMCache evicts on a 1 s tick
                continue
            small.commit(h)
        present = small.present(hashes)
        assert 0 in present[0] and 0 in present[1]  # pinned by the read lock
        assert len(present[0]) < len(hashes)  # others were evicted
        small.release([(stored[0], 0), (stored[0], 1)])
    finally:
        small.close()


def test_disk_tier_brings_back_evicted_objects(tmp_path):
    s = ChunkStore(LAYOUT, FP, CHUNK, StoreConfig(cpu_bytes=1 << 20, disk_path=str(tmp_path)))
    try:
        gen = torch.Generator().manual_seed(4)
        h = chunk_hashes(list(range(CHUNK)), CHUNK)[0]
        data = put(s, h, gen)
        deadline = time.time() + 10
        while not any(tmp_path.iterdir()) and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        s._sm.delete_l1_keys([s.key(h, g) for g in (0, 1)], force=True)
        assert s.present([h]) == {0: {0}, 1: {0}}  # reloaded from disk
        keys = [(h, 0), (h, 1)]
        assert s.lock(keys)
        for (_, g), t in zip(keys, s.read(keys)):
            assert torch.equal(bits(t), bits(data[g]))
        s.release(keys)
    finally:
        s.close()


def test_object_of_unexpected_shape_is_never_read(store):
    """Same key, other geometry (as if the fingerprint had collided): a miss, not a load."""
    gen = torch.Generator().manual_seed(5)
    h = chunk_hashes(list(range(CHUNK)), CHUNK)[0]
    put(store, h, gen)
    wider = KVLayout((KVGroup(0, AttentionKind.SLIDING, 48, 16, 4, 16, 16, torch.bfloat16,
                              ("a", "b")), LAYOUT.groups[1]))
    other = ChunkStore.__new__(ChunkStore)
    other.__dict__.update(store.__dict__)
    other._layouts = object_layouts(wider, CHUNK)
    keys = [(h, 0), (h, 1)]
    assert other.lock(keys)
    assert other.read(keys) is None
    other.release(keys)
