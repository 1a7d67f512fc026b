"""`connector/events.py` `RouterEvents` without an engine: tensor-parallel agreement
(stored once every rank holds an object, removed when the first drops it), resets, and
removals of what was never published (the e2e path: tests/test_e2e_kv_events.py)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace as NS

import pytest

from needs import require

require("vllm")

from gemma4_kv.connector.events import RouterEvents, TierReports  # noqa: E402
from gemma4_kv.stores.base import ChunkWrite  # noqa: E402
from gemma4_kv.stores.events import CLEARED, REMOVED, STORED, TIER_L1  # noqa: E402

CHUNK, BLOCK = 256, 32


def _router(world: int) -> RouterEvents:
    layout = NS(groups=[NS(group_id=0, block_size=BLOCK)])
    return RouterEvents(NS(hash_block_size=BLOCK, kv_cache_groups=[]), layout, CHUNK, world)


def _request(n_chunks: int):
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(n_chunks * CHUNK // BLOCK)]
    return NS(block_hashes=hashes, all_token_ids=list(range(n_chunks * CHUNK)),
              lora_request=None)


def _ints(raw):
    return [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in raw]


@pytest.fixture
def chunks():
    req = _request(2)
    chain = [b"c0", b"c1"]
    return req, chain, ChunkWrite("r", chain, 0, [(0,), (0,)], [CHUNK * 2])


def test_stored_once_every_rank_holds_it_and_removed_when_the_first_drops_it(chunks):
    req, chain, write = chunks
    ev = _router(world=2)
    ev.record(write, req)
    ev.add(TierReports([(0, STORED, TIER_L1, ((b"c0", 0), (b"c1", 0)))]))
    assert ev.take() == []
    ev.add(TierReports([(1, STORED, TIER_L1, ((b"c0", 0), (b"c1", 0)))]))
    (stored,) = ev.take()  # two chunks of one run: one event
    assert stored.block_hashes == _ints(req.block_hashes)
    assert stored.token_ids == req.all_token_ids and stored.parent_block_hash is None
    assert (stored.medium, stored.group_idx, stored.block_size) == ("CPU", 0, BLOCK)
    ev.add(TierReports([(1, REMOVED, TIER_L1, ((b"c1", 0),)),
                        (0, REMOVED, TIER_L1, ((b"c1", 0),))]))
    (removed,) = ev.take()
    assert removed.block_hashes == _ints(req.block_hashes[8:]) and removed.medium == "CPU"
    ev.add(TierReports([(0, CLEARED, TIER_L1, ())]))
    (cleared,) = ev.take()
    assert cleared.block_hashes == _ints(req.block_hashes[:8])
    ev.add(TierReports([(1, CLEARED, TIER_L1, ()), (0, REMOVED, TIER_L1, ((b"x", 0),))]))
    assert ev.take() == []


def test_a_chunk_saved_without_a_snapshot_is_not_published(chunks):
    req, chain, write = chunks
    ev = _router(world=1)
    ev.add(TierReports([(0, STORED, TIER_L1, ((b"c0", 0),))]))
    assert ev.take() == []
