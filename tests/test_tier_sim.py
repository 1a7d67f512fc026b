"""The tier sweep's long-document orders (bench_sweep: 12B shape with 12 layers, 16
documents of 8192 tokens + a 48-token question, 4 in flight, 1 GiB of GPU KV) through
vLLM's real scheduler and GPU prefix cache, with this connector's real scheduler half,
lookup service and embedded store, and with vLLM's OffloadingConnector (its scheduler
half and CPU LRU manager): `tests/tier_sim.py`. Counts only, no timing; the copies are
not made. Tiers are fractions of the sweep's working set: 16 documents as
OffloadingConnector stores them, 150,994,944 bytes each (32 full-attention chunks of 2
MiB, 5 sliding groups x 8 chunks of 128 tokens, 2 MiB each)."""

from __future__ import annotations

import pytest

from needs import require

require("vllm")
require("lmcache")
pytestmark = pytest.mark.vllm

import tier_sim  # noqa: E402

WORKING_SET = 16 * 150_994_944
# This connector's final hit of a document in LMCache's L1: 32 full-attention objects
# (2 MiB of KV and a 4 KiB page for the trailer) and the 4-chunk window of each of the 5
# sliding groups (4 MiB of KV, the trailer's page and 4 KiB of padding).
OUR_DOC = 32 * ((2 << 20) + (4 << 10)) + 20 * ((4 << 20) + (8 << 10))
HIT = 8192  # a document's hit: its 32 chunks (the question is shorter than a chunk)
PROMPT = 8192 + 48
FRACTIONS = (0.4, 0.6, 0.8, 1.0)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """{(system, fraction): {order: Rounds}} of the sweep's seed-0 orders."""
    out = {}
    for f in FRACTIONS:
        for system in tier_sim.SYSTEMS:
            orders = ("loop", "zipf") if f < 1.0 else ("zipf",)
            out[system, f] = tier_sim.simulate(system, f, orders, seed=0,
                                               workdir=tmp_path_factory.mktemp("sim"))
    return out


def test_a_loop_keeps_as_many_documents_as_the_tier_holds(sweep):
    """The loop (16 documents, 3 rounds in one order): floor(f x working set / OUR_DOC)
    documents fit, 6, 9 and 12 at 0.4, 0.6 and 0.8; those asked first stay (ties evict
    nothing, the intermediate windows at 4096 tokens go first) and hit in both warm
    rounds. OffloadingConnector's LRU evicts each document before it comes back. vLLM's
    GPU cache (1 GiB) holds no document a whole loop long."""
    for f, kept in ((0.4, 6), (0.6, 9), (0.8, 12)):
        assert int(f * WORKING_SET) // OUR_DOC == kept
        ours = sweep["gemma4-kv", f]["loop"].rounds
        assert [sum(r.store for r in rd) for rd in ours[1:]] == [kept * HIT] * 2, f
        assert {r.label[:-2] for r in ours[1] if r.store} == \
            {r.label[:-2] for r in ours[2] if r.store}
        lru = sweep["offloading", f]["loop"].rounds
        assert all(r.store == r.gpu == 0 for rd in lru[1:] for r in rd)
        assert all(r.gpu == 0 for rd in ours[1:] for r in rd)


def test_zipf_requests_hit_at_least_as_often_as_with_offloading(sweep):
    """The Zipf order (48 requests, exponent 1, seed 0; rounds 1 and 2 warm): warm
    prompt tokens from the CPU tier or vLLM's GPU cache, this connector against
    OffloadingConnector at the same tier. At 0.8 this connector is 2 requests short: the
    second asks of documents 3 and 1 (requests 35 and 33), first seen after the tier
    had filled, which it does not store at their first ask (asked once, as often as the
    documents it would evict); LRU stores them and evicts documents never asked again.
    The draws are independent, so such a tie is a coin flip that LRU won twice here;
    with vLLM's GPU cache holding the newcomer for its next asks, keeping the stored
    document is the better bet. `tier_sim.py`, seeds 0 to 29 at 0.4, 0.6 and 0.8:
    this connector is ahead by 163.5 requests' tokens over the 90 points, behind at 11
    (by 0.5-2). Admitting on such ties (while second asks outnumber unasked evictions,
    or when the stored one was idle longer than the distinct documents seen) passes
    seed 0 but loses more elsewhere (seeds 0-9: ahead by 35-37 requests, not 51; down
    to -3); a recency window of one document leaves seed 0 a request short, is ahead
    by 36 over seeds 0-9 and costs the loop a document per round."""
    for f in FRACTIONS:
        ours = sweep["gemma4-kv", f]["zipf"]
        lru = sweep["offloading", f]["zipf"]
        short = 2 * HIT if f == 0.8 else 0
        assert sum(ours.warm_tokens()) >= sum(lru.warm_tokens()) - short, (
            f, ours.warm_share(), lru.warm_share())
    # the documents most asked for (0: 13 of 48 requests, 4 and 2: 6 each) always hit in
    # the last round, from the tier or from vLLM's GPU cache in front of it
    for f in FRACTIONS:
        last = sweep["gemma4-kv", f]["zipf"].rounds[2]
        assert all(r.store + r.gpu >= HIT for r in last if r.label[:-2] in ("d0", "d2", "d4"))
