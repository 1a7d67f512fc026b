"""What a shared `lmcache server` keeps of a loop of prompts larger than its L1: with
gemma4-kv's admission (`stores/server/admission.py`) a stable subset, hit every round;
with the server's LRU alone, nothing (the negative control). Real server processes,
two `ServerStore`s as two engines' ranks; the admission's state machine alone with a
clock of the test's own.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from gemma4_kv.layout import integrity
from gemma4_kv.lookup import messages
from gemma4_kv.lookup.service import LookupService
from gemma4_kv.lookup.wait import Rates
from gemma4_kv.stores.base import ChunkWrite
from gemma4_kv.stores.server.admission import Admission, Pressure
from lmcache_servers import Server
from model_keys import chunk_hashes
from paged import bits
from test_mp_server import CHUNK, cells, open_store, payload, tokens_of

DOCS, CHUNKS = 16, 8  # the loop: 16 prompts of 8 chunks
PAGE = 4096  # the server's L1 allocations are whole pages (measured: 24960 B -> 28672)
# Bytes of one prompt's objects, by hand (tests/test_mp_server.py LAYOUT; a row is a
# token's K and V of every layer; an object holds the chunk's 64 rows plus the 32-byte
# trailer, rounded up to a page):
#   group 2 (full, 3 layers x 1 head x 32 x fp16): row 384 B, 65 rows = 24960 -> 28672 B,
#     stored for all 8 chunks;
#   group 0 (sliding 128, 2 layers x 2 heads x 16): row 256 B, 65 rows -> 20480 B, the
#     2 chunks before the end; group 1 (sliding 256, 1 x 1 x 64): 20480 B, 4 chunks.
DOC_BYTES = 8 * 28672 + (2 + 4) * 20480  # 352256
L1_BYTES = int(0.8 * DOCS * DOC_BYTES)  # the L1 holds 0.8 of the loop: 12.8 prompts
TODAY = dict(eviction_watermark=0.8, eviction_ratio=0.2)  # LMCache's defaults
SETTLE_S = 10.0  # bound on a wait for the eviction loop (it runs once a second)


def save(store, seed: int, req: str) -> int:
    """Save prompt `seed` as the connector does for request `req` (its end the prompt's
    end); returns the objects reserved."""
    hashes = chunk_hashes(tokens_of(seed, CHUNKS), CHUNK)
    res = store.reserve(ChunkWrite(req, hashes, 0, [(0, 1, 2)] * CHUNKS, [CHUNKS * CHUNK]))
    index = {h: i for i, h in enumerate(hashes)}
    for (h, g), (kv, trailer, key) in res.objects.items():
        kv.copy_(payload((index[h], g), kv, seed))
        integrity.seal(kv, trailer, key)
    store.commit(res)
    return len(res.objects)


def ask(store, seed: int, req: str) -> bool:
    """Whether request `req` for prompt `seed` hits all of it, bit-exact (a wrong byte
    fails the test: a hit is never wrong)."""
    hashes = chunk_hashes(tokens_of(seed, CHUNKS), CHUNK)
    p = store.start_prefetch(hashes, 0, CHUNKS * CHUNK)
    deadline = time.monotonic() + SETTLE_S
    while not p.finished:
        assert time.monotonic() < deadline
        store.poll()
        time.sleep(0.002)
    pinned = store.pin(hashes, 0, CHUNKS * CHUNK, req_id=req)
    store.finish_prefetch(p)
    if pinned is None:
        return False
    assert all(torch.equal(bits(pinned.views[(hashes[c], g)]),
                           bits(payload((c, g), pinned.views[(hashes[c], g)], seed)))
               for c, g in cells(0, CHUNKS * CHUNK))
    store.release(pinned)
    return True


def settle(server, watermark: float) -> None:
    """Wait (bounded) until the server's eviction loop has brought its L1 below the
    watermark, as it does between saves when prompts take a while to compute."""
    deadline = time.monotonic() + SETTLE_S
    while server.status()["storage_manager"]["l1_manager"]["memory_usage_ratio"] \
            >= watermark:
        assert time.monotonic() < deadline, "the server never evicted"
        time.sleep(0.05)


def loop(rounds: int, admit: bool) -> list[int]:
    """Hits per round of the loop, prompts alternating between two engines; each miss
    is saved. Without `admit`, today's behaviour: every save reserves, and the server
    evicts as LMCache's defaults say."""
    server = Server(l1_gb=L1_BYTES / 2**30, **({} if admit else TODAY))
    watermark = 0.9 if admit else TODAY["eviction_watermark"]
    stores = [open_store(server.url) for _ in range(2)]
    try:
        assert server.status()["storage_manager"]["l1_manager"]["memory_total_bytes"] \
            == L1_BYTES
        if not admit:
            for s in stores:
                s.admission.admit = lambda *a: True
        hits = []
        for r in range(rounds):
            n = 0
            for d in range(DOCS):
                store, req = stores[d % 2], f"r{r}-d{d}"
                if ask(store, d, req):
                    n += 1
                elif save(store, d, req):
                    settle(server, watermark)
            hits.append(n)
        return hits
    finally:
        for s in stores:
            s.close()
        server.stop()


def test_a_loop_larger_than_the_servers_l1_keeps_a_subset_that_hits():
    """By hand: the L1 holds 0.8 x 16 = 12.8 prompts; the server (`server_argv`) evicts
    (LRU) 3 % of its objects once a second while 90 % of it (11.52 prompts) is used.
    Round 1 saves all 16 (nothing is known full yet); a save starts below 90 % and
    adds 7.8 %, so it always finds room. Waiting after each save until the server is
    below 90 % again, it ends holding the most recent prompts' objects: below 11.52
    prompts, and above 11.52 less one eviction, at most int(0.03 x 220) = 6 objects
    (the L1 holds at most 4508876 / 20480 = 220) of at most 28672 B, 0.49 prompt:
    11.03. LRU evicts a prompt's objects together (they were stored together), so at
    most one prompt is cut: exactly 11 whole prompts stay.
    Round 2: prompt 0 was stored by engine 0 and is asked again without a hit: the
    server evicted it, the engine is FULL; every missing prompt was asked once before,
    as often as the least recent one the engine holds, so none is saved: nothing more
    is evicted and the 11 held prompts hit: 11/16 = 0.69 >= 0.8 x 0.8, and >= the
    embedded store's 0.62 at the same ratio. Round 3 hits the same.
    Negative control, by hand: today (every save reserves; LRU evicts 20 % once 80 %,
    10.24 prompts, is used), after prompt d is saved the server holds at most the 10
    most recent prompts, d-9..d (and part of d-10), and the next asked, d+1 = d-15 (mod
    16), is never among them: 0 hits in round 2."""
    with ThreadPoolExecutor(2) as pool:  # two servers of their own: side by side
        control = pool.submit(loop, 2, admit=False)
        kept = loop(3, admit=True)
    assert kept[0] == 0
    assert kept[1:] == [11, 11]
    assert control.result() == [0, 0]


def test_full_lasts_while_evicted_prompts_come_back_then_everything_is_saved_again():
    """The state machine alone (a clock of the test's own): ROOM saves everything; a
    prompt stored and asked again without a hit makes it FULL; FULL refuses a prompt no
    more frequent than the least recent one held, admits a more frequent one (which
    displaces it), and lapses `hold_s` after the last evicted prompt came back."""
    now = [0.0]
    a = Admission(hold_s=100.0, clock=lambda: now[0])
    k = [(bytes([i]) * 32, 512) for i in range(4)]
    assert all(a.admit("r1", key, 1) for key in k)  # ROOM: everything
    assert a.state is Pressure.ROOM
    a.hit("r2", k[1], 1)  # k[0] is now the least recent held
    assert a.admit("r2", k[1], 1)  # a save after its own hit: no sign of anything
    assert a.state is Pressure.ROOM
    assert not a.admit("r3", k[2], 1)  # k[2] evicted: asked once before, as k[0]
    assert a.state is Pressure.FULL and a.refused == 1
    now[0] = 50.0
    new = (b"n" * 32, 512)
    assert not a.admit("a", new, 1)  # never asked before; k[0]: once
    assert not a.admit("b", new, 1)  # once before: as often as k[0]
    assert a.admit("c", new, 1)  # twice before: displaces k[0]
    now[0] = 149.0
    assert not a.admit("r4", k[3], 1)  # k[3] evicted too (FULL again until 249)
    now[0] = 249.0
    assert a.admit("r5", (b"m" * 32, 512), 1)  # no sign for 100 s: ROOM
    assert a.state is Pressure.ROOM
    assert a.admit("r6", (b"o" * 32, 512), 2)  # another server process: ROOM, empty


def test_a_save_past_the_lookups_reach_is_no_sign_of_eviction():
    """With a draft that owns KV, a 768-token prompt's lookup can name 2 chunks (reach
    512), while its save after a token is generated names the end 768 again. Stored
    by r1, that end saved again by r2 (reach 512, hit 512) says nothing of the server:
    ROOM stays. The control: a lookup that could reach 768 and missed it is the sign
    (FULL). On 4d4f0ed the first case turned FULL and refused every later new end
    (tests/test_e2e_eagle.py's server case then hit 512 where 1024 is due)."""
    a = Admission(hold_s=100.0, clock=lambda: 0.0)
    end768 = (b"c" * 32, 768)
    assert a.admit("r1", end768, 1)
    a.looked_up("r2", 512)
    a.hit("r2", (b"b" * 32, 512), 1)
    assert a.admit("r2", end768, 1)
    assert a.state is Pressure.ROOM and a.refused == 0
    assert a.admit("r3", (b"d" * 32, 1024), 1)  # a new end: stored (ROOM)
    a.looked_up("r4", 768)  # the control: it could have hit 768, and did not
    a.admit("r4", end768, 1)  # (admitted or not by frequency: 2 before, against 1)
    assert a.state is Pressure.FULL


def _lookup_until_answered(service, req: str, hashes) -> messages.LookupReply:
    """A lookup as the scheduler asks it: again while it is pending (bounded)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        reply = service.lookup(messages.Lookup(req, hashes, 0, len(hashes) * CHUNK))
        if not reply.pending:
            return reply
        assert time.monotonic() < deadline, "the lookup never settled"
        service.advance()
        time.sleep(0.002)


def test_a_miss_the_server_was_not_asked_about_is_no_sign_of_eviction():
    """On a busy machine a lookup may not wait for the server (its fetch is not worth
    the prefill it saves, or it was given up): the request misses without the server
    having answered, and saves its prompt again. That says nothing of the server's L1.
    On 69509a6 the lookup recorded its reach before the server answered, so the second
    save of a stored end turned the engine FULL and refused every new end for
    `HOLD_S` (CI: tests/test_e2e_eagle.py's server case hit [0, 0, 512, 512] where
    [0, 512, 512, 1024] is due). Real server, real ServerStore, the real
    LookupService; only its rates are set, by hand: 1 ns of prefill per token against
    1 byte per second from the server, so no fetch is worth waiting for. The control:
    the same prompt looked up with the server answering is a hit, bit-exact."""
    server = Server(l1_gb=0.25)
    store = open_store(server.url)
    try:
        assert save(store, 1, "r1") > 0
        hashes = chunk_hashes(tokens_of(1, CHUNKS), CHUNK)
        hurried = Rates()
        hurried.prefill(1000, 1e-6)
        hurried.fetched(1, 1.0)
        busy = LookupService(store, store.layout, CHUNK, timeout_s=SETTLE_S, rates=hurried)
        reply = _lookup_until_answered(busy, "r2", hashes)
        assert reply.pinned == 0  # not asked: a miss
        save(store, 1, "r2")  # the miss is saved again (the server holds it: no objects)
        assert store.admission.state is Pressure.ROOM and store.admission.refused == 0
        assert save(store, 2, "r3") > 0  # a new prompt's end is stored
        patient = LookupService(store, store.layout, CHUNK, timeout_s=SETTLE_S)
        reply = _lookup_until_answered(patient, "r4", hashes)
        assert reply.pinned == CHUNKS * CHUNK  # the control: answered, a hit
        hit = patient.take("r4", 0)
        assert all(torch.equal(bits(hit.pinned.views[(hashes[c], g)]),
                               bits(payload((c, g), hit.pinned.views[(hashes[c], g)], 1)))
                   for c, g in cells(0, CHUNKS * CHUNK))
        patient.done(hit)
    finally:
        store.close()
        server.stop()
