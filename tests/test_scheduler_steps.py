"""Requests that end between vLLM's calls, on two real lookup ranks: the connector's real
scheduler half (vLLM's VllmConfig, KVCacheManager and block hasher) and, per rank, the
real LookupService and EmbeddedStore behind a real lookup socket. The multiprocess
executor hands a step to its workers after `schedule` returned: an abort or a request
turning uncacheable lands in between."""

from __future__ import annotations

import random

import pytest

from needs import require
from scheduler_half import CHUNK, SchedulerHalf

require("vllm")
pytestmark = pytest.mark.vllm

_rng = random.Random(11)
PROMPT = [_rng.randrange(3, 500) for _ in range(1100)]
HIT = 1024  # 4 full chunks of 256; the prompt's last token is computed by vLLM
NONE = [set(), set()]


@pytest.fixture(scope="module")
def half(tmp_path_factory):
    from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

    model = save_config(tiny_gemma4_config(window=100), tmp_path_factory.mktemp("model"))
    h = SchedulerHalf(model, ranks=2)
    first = h.request(PROMPT)
    assert h.serve(first)[0] == 0
    assert len(h.saved[first.request_id]) == HIT // CHUNK
    yield h
    h.close()


def test_an_abort_after_the_step_was_scheduled_leaves_the_pins_to_the_workers(half):
    """vLLM aborts a request whose load went out with step N before the workers run
    step N: every rank still finds the pinned hit and frees it after loading."""
    r = half.request(PROMPT)
    hit, meta = half.schedule(r)
    assert hit == HIT and [j.req_id for j in meta.loads] == [r.request_id]
    half.finish(r)  # the abort: before any rank started step N
    assert half.pinned() == [{r.request_id}] * 2
    half.work(meta)  # raised RuntimeError when the scheduler released ahead of the load
    assert half.pinned() == NONE
    nxt = half.schedule(half.request(PROMPT))
    assert nxt[0] == HIT and not nxt[1].finished  # nothing stored: nothing to finish
    half.work(nxt[1])


def test_the_release_the_fix_withholds_would_have_broken_the_load(half):
    """Negative control: a Release that reaches the ranks before step N's load (what
    `request_finished` sent) makes that load fail on every rank."""
    from gemma4_kv.lookup import messages

    r = half.request(PROMPT)
    _, meta = half.schedule(r)
    half.connector._scheduler.ranks.client.ask_all(messages.Release(r.request_id, meta.loads[0].pin))
    with pytest.raises(RuntimeError, match=f"rank 0 did not pin the hit of {r.request_id}"):
        half.work(meta)
    half.finish(r)
    assert half.pinned() == NONE


def test_an_abort_before_the_load_went_out_releases_on_every_rank(half):
    """Looked up (pinned on both ranks), never allocated (vLLM had no blocks), then
    aborted: no step carries its load, so the scheduler releases it at once."""
    r = half.request(PROMPT)
    assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
    assert half.pinned() == [{r.request_id}] * 2
    half.connector.request_finished_all_groups(r, ((),) * len(half.layout.groups))
    assert half.pinned() == NONE
    hit, meta = half.schedule(again := half.request(PROMPT))
    assert hit == HIT and [j.req_id for j in meta.loads] == [again.request_id]
    half.work(meta)
    half.finish(again)
    assert half.pinned() == NONE


def _lookups(half) -> list[int]:
    """Lookups each rank has answered so far (its service's own counter)."""
    return [s.stats.data.get("lookups", 0) for s in half.services]


def test_a_request_asked_again_before_it_allocates_is_not_looked_up_again(half):
    """vLLM asks a waiting request again every step until it can allocate: the hit its
    first ask pinned is offered again and no rank is asked (it released the pin and
    pinned the same objects again); the load reads that first pin."""
    r = half.request(PROMPT)
    before = _lookups(half)
    assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
    assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
    assert [n - b for n, b in zip(_lookups(half), before)] == [1, 1]
    hit, meta = half.schedule(r, hit=HIT)
    assert [(j.start, j.hit, j.pin) for j in meta.loads] == [(0, HIT, 1)]
    half.work(meta)
    half.finish(r)
    assert half.pinned() == NONE


def test_a_request_asked_again_after_more_was_computed_is_looked_up_again(half):
    """Asked again with other computed tokens (vLLM's own cache grew meanwhile), the
    request is looked up again from there, and the first pin is released."""
    r = half.request(PROMPT)
    before = _lookups(half)
    assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
    assert half.connector.get_num_new_matched_tokens(r, 2 * CHUNK) == (HIT - 2 * CHUNK,
                                                                        False)
    assert [n - b for n, b in zip(_lookups(half), before)] == [2, 2]
    assert all(s.take(r.request_id, 1) is None for s in half.services)
    half.finish(r)
    assert half.pinned() == NONE


def test_a_preempted_request_that_pins_again_and_is_aborted_unscheduled_holds_no_pin(half):
    """A request loads its hit; it is preempted and asked again, and the new lookup pins
    a hit; it is not scheduled that step (no blocks), then aborted: no rank keeps the
    pin (it leaked for the engine's lifetime, and pins count towards MAX_PINNED)."""
    r = half.request(PROMPT)
    hit, meta = half.schedule(r)
    assert hit == HIT
    half.work(meta)
    assert half.pinned() == NONE
    half.preempt(r)
    assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
    assert half.pinned() == [{r.request_id}] * 2
    half.connector.request_finished_all_groups(r, ((),) * len(half.layout.groups))
    assert half.pinned() == NONE


def test_a_lookup_after_a_preemption_keeps_off_the_pins_of_a_load_in_flight(half):
    """Preempted after its load went out with step N and before the ranks ran it, a
    request is looked up again: step N's load still reads its own pins, and the new
    lookup's pins serve the request's next load (the second lookup released the
    first's pins, so one of the two loads found none: RuntimeError)."""
    r = half.request(PROMPT)
    hit, meta = half.schedule(r)
    half.preempt(r)
    assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
    half.work(meta)
    assert half.pinned() == [{r.request_id}] * 2  # the second lookup's
    again, meta2 = half.schedule(r, hit=HIT)
    assert [(j.start, j.hit) for j in meta2.loads] == [(0, HIT)]
    half.work(meta2)
    half.finish(r)
    assert half.pinned() == NONE


@pytest.mark.parametrize("loaded_first", [False, True])
def test_a_request_that_turns_uncacheable_while_waiting_releases_its_pins(half, tmp_path,
                                                                          loaded_first):
    """A request pinned a hit but waits for blocks; meanwhile its LoRA id is re-pointed
    at other adapter weights (uncacheable from then on). Its next lookup releases what
    the ranks hold for it, instead of leaving the pins to LMCache's 300 s TTL. With
    `loaded_first` it had loaded a hit and been preempted before (its pins leaked)."""
    from vllm.lora.request import LoRARequest

    from e2e_requests_common import write_adapter

    text = half.text_config
    path = write_adapter(tmp_path / "adapter", 1, text)
    lora = LoRARequest(f"A{int(loaded_first)}", 7 + loaded_first, path)  # ids never reused
    first = half.request(PROMPT, lora=lora)
    assert half.serve(first)[0] == 0  # other keys than the base model's: stored anew
    waiting = half.request(PROMPT, lora=lora)
    if loaded_first:
        hit, meta = half.schedule(waiting)
        assert hit == HIT
        half.work(meta)
        half.preempt(waiting)
    assert half.connector.get_num_new_matched_tokens(waiting, 0) == (HIT, False)
    assert half.pinned() == [{waiting.request_id}] * 2
    write_adapter(path, 2, text)  # the same id and path, other weights
    assert half.connector.get_num_new_matched_tokens(half.request(PROMPT, lora=lora),
                                                     0) == (0, False)
    assert half.connector.get_num_new_matched_tokens(waiting, 0) == (0, False)
    assert half.pinned() == NONE
    half.connector.request_finished_all_groups(waiting, ((),) * len(half.layout.groups))
    assert half.pinned() == NONE



def test_a_rank_that_cannot_key_its_kv_safely_makes_every_lookup_a_miss(half):
    """A worker that finds its layers' KV cannot be keyed (a layer missing from vLLM's
    forward context, say: the scheduler cannot see it) answers every lookup with
    nothing, so the engine's hits stop although the other rank holds the chunks."""
    from gemma4_kv.connector.worker import _nothing_cached
    from gemma4_kv.lookup.channel import LookupServer

    address = half.servers[1].address
    half.servers[1].close()
    half.servers[1] = LookupServer(address, _nothing_cached)
    try:
        r = half.request(PROMPT)
        hit, meta = half.schedule(r)
        assert hit == 0 and not meta.loads
        half.work(meta)
        half.finish(r)
        assert half.pinned() == NONE  # rank 0's answer was released too
    finally:
        half.servers[1].close()
        half.servers[1] = LookupServer(address, half.services[1].handle)
    hit, meta = half.schedule(again := half.request(PROMPT))
    assert hit == HIT  # negative control: both ranks answering, the same prompt hits
    half.work(meta)
    half.finish(again)
    assert half.pinned() == NONE


def test_one_unanswered_lookup_is_a_miss_and_pauses_no_other(half):
    """Rank 1 holds one lookup past the scheduler's timeout (a long GC pause, say): that
    request misses, and the next request is asked as usual and hits (a single
    unanswered lookup paused every lookup for 10 s). Nothing stays pinned."""
    import threading

    from gemma4_kv.lookup import messages
    from gemma4_kv.lookup.channel import LookupServer

    go, held = threading.Event(), []

    def handle(msg):
        if isinstance(msg, messages.Lookup) and not held:
            held.append(msg.req_id)
            go.wait(30)
        return half.services[1].handle(msg)

    address = half.servers[1].address
    half.servers[1].close()
    half.servers[1] = LookupServer(address, handle)
    stats = half.connector._scheduler.stats
    try:
        before = stats.data.get("lookups_unanswered", 0)
        slow = half.request(PROMPT)
        assert half.connector.get_num_new_matched_tokens(slow, 0) == (0, False)
        assert stats.data["lookups_unanswered"] == before + 1 and held == [slow.request_id]
        go.set()
        hit, meta = half.schedule(r := half.request(PROMPT))
        assert hit == HIT
        half.work(meta)
        half.finish(r)
        half.connector.request_finished_all_groups(slow, ((),) * len(half.layout.groups))
        assert half.pinned() == NONE
    finally:
        go.set()
        half.servers[1].close()
        half.servers[1] = LookupServer(address, half.services[1].handle)


def test_a_hit_never_ends_inside_an_image(half):
    """Gemma 4 attends both ways within an image: a hit must stop before an image it
    would end inside, so vLLM computes the whole image in one step. By hand (chunk 256,
    retention 512, window 100, hit multiple 64): a 1100-token prompt's longest hit is
    1024; an image at [1000, 1064) cuts it to 1000, i.e. 960 (a multiple of 64), which
    chunk 3's sliding-window object (tokens 768-1023, kept for the end at 1024) serves."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(1100)]
    image = [("sha256-of-image-X", 1000, 64)]
    assert half.serve(half.request(prompt, images=image))[0] == 0
    hit, meta = half.schedule(r := half.request(prompt, images=image))
    assert hit == 960 and [(j.start, j.hit) for j in meta.loads] == [(0, 960)]
    half.work(meta)
    half.finish(r)
    # An image that starts after the hit's end leaves it alone.
    other = [rng.randrange(3, 500) for _ in range(1100)]
    later = [("sha256-of-image-Y", 1030, 60)]
    assert half.serve(half.request(other, images=later))[0] == 0
    assert half.serve(half.request(other, images=later))[0] == 1024
    assert half.pinned() == NONE


def test_a_save_names_low_ends_only_for_a_store_that_ranks_them(half):
    """A prompt of 1100 tokens (chunk 256, retention 512) serves hits ending at 512
    (LOW: kept only so that a hit can stop there) and 1024 (HIGH: its last full chunk,
    which is also where the same prompt asked again stops: 1099 tokens down to a
    chunk). The embedded store ranks by class, so the save names 512 as LOW. Negative
    control: for a store that does not rank (the server's capabilities) none is named."""
    scheduler = half.connector._scheduler
    assert scheduler.ranks_hit_ends  # the embedded store's capability
    for shift, ranks, low in ((7, True, {512}), (8, False, set())):
        scheduler.ranks_hit_ends = ranks
        try:
            r = half.request([t + shift for t in PROMPT])
            hit, meta = half.schedule(r)
        finally:
            scheduler.ranks_hit_ends = True
        (save,) = meta.saves
        assert hit == 0 and sorted(save.write.ends) == [512, 1024] and save.write.low == low
        half.work(meta)
        half.finish(r)
    assert half.pinned() == NONE


def test_cut_before_by_hand():
    from gemma4_kv.layout.plan import cut_before

    assert cut_before(1024, [], 64) == 1024
    assert cut_before(1024, [(1000, 1064)], 64) == 960
    assert cut_before(1024, [(1024, 1100)], 64) == 1024  # a hit may end where one starts
    assert cut_before(1024, [(900, 1024)], 64) == 1024  # ... or where one ends
    assert cut_before(1024, [(950, 1000), (1000, 1064)], 64) == 896  # 1000 -> 960 -> 950


class _RankAnswers:
    """Rank `rank` of `half` behind a handler that changes its answers the way a rank
    with other tiers would (`change(msg, real_answer) -> answer`), on the real service:
    restored by `close`."""

    def __init__(self, half, rank: int, change):
        from gemma4_kv.lookup.channel import LookupServer

        self.half, self.rank = half, rank
        self.address = half.servers[rank].address
        service = half.services[rank]
        half.servers[rank].close()
        half.servers[rank] = LookupServer(self.address,
                                          lambda msg: change(msg, service.handle))

    def close(self):
        from gemma4_kv.lookup.channel import LookupServer

        self.half.servers[self.rank].close()
        self.half.servers[self.rank] = LookupServer(self.address,
                                                    self.half.services[self.rank].handle)


def test_a_rank_still_asking_an_l2_tier_while_another_pinned_leaks_no_pin(half):
    """Rank 0 answers each request's first lookup `pending` (its L2 tier is slower),
    rank 1 pins at once. Before the fix the next lookup pinned under a new name and
    the request's end released only that one: rank 1 kept one pin per request for
    good (3 after 3 requests; at MAX_PINNED every lookup on it missed)."""
    from gemma4_kv.lookup import messages

    first: set[str] = set()

    def slower(msg, handle):
        if isinstance(msg, messages.Lookup) and msg.req_id not in first:
            first.add(msg.req_id)
            handle(messages.Release(msg.req_id, msg.pin))  # what a new lookup does first
            return messages.LookupReply(pending=True)
        return handle(msg)

    rank0 = _RankAnswers(half, 0, slower)
    try:
        for _ in range(3):
            r = half.request(PROMPT)
            assert half.connector.get_num_new_matched_tokens(r, 0) == (None, False)
            assert half.pinned() == [set(), {r.request_id}]  # mixed: pending and pinned
            hit, meta = half.schedule(r)  # asked again: both ranks answer and pin
            assert hit == HIT
            half.work(meta)
            r.num_computed_tokens = r.num_tokens
            half.finish(r)
        assert half.pinned() == NONE
        aborted = half.request(PROMPT)  # pending on rank 0, pinned on rank 1, aborted
        assert half.connector.get_num_new_matched_tokens(aborted, 0) == (None, False)
        half.connector.request_finished_all_groups(aborted, ((),) * len(half.layout.groups))
        assert half.pinned() == NONE
    finally:
        rank0.close()


class _Clock:
    def __init__(self):
        import time

        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


def test_a_hit_is_offered_again_only_while_every_ranks_pin_is_fresh(half, monkeypatch):
    """A store whose hold on a hit lapses (the `lmcache server`'s read TTL) says for
    how long its pin may be offered (`fresh_s`). A request that waits for blocks is
    offered the same pin each step only within it; past it, every rank pins anew.
    Before the fix the scheduler re-offered the first pin for as long as the request
    waited. The scheduler's clock is the test's (`_Clock`); by hand: fresh for 100 s
    on rank 0 and 40 s on rank 1, so offered again at +39 s, looked up again at +41 s."""
    import msgspec

    from gemma4_kv.connector import scheduler as scheduler_module
    from gemma4_kv.lookup import messages

    lookups = []

    def fresh_for(seconds):
        def change(msg, handle):
            reply = handle(msg)
            if isinstance(msg, messages.Lookup):
                lookups.append(msg.pin)
                return msgspec.structs.replace(reply, fresh_s=seconds)
            return reply
        return change

    clock = _Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    ranks = [_RankAnswers(half, 0, fresh_for(100.0)), _RankAnswers(half, 1, fresh_for(40.0))]
    try:
        r = half.request(PROMPT)
        assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
        first = list(lookups)
        assert len(first) == 2
        clock.now += 39
        assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
        assert lookups == first  # offered again: no rank asked
        clock.now += 2
        assert half.connector.get_num_new_matched_tokens(r, 0) == (HIT, False)
        assert len(lookups) == 4 and lookups[2:] == [first[0] + 1] * 2  # pinned anew
        hit, meta = half.schedule(r, hit=HIT)
        assert [j.pin for j in meta.loads] == [first[0] + 1]
        half.work(meta)
        r.num_computed_tokens = r.num_tokens
        half.finish(r)
        assert half.pinned() == NONE  # the first pins went back when it pinned anew
    finally:
        for rank in ranks:
            rank.close()


def test_a_repin_left_unanswered_counts_as_an_unanswered_lookup(half, monkeypatch):
    """Ranks that answer different hits are asked to re-pin; one that leaves the Repin
    unanswered (a server store looking the shorter hit up) is the request's miss and
    counts towards the pause after unanswered lookups, and the release after it is
    told, not waited for. Before the fix it counted nothing, and the scheduler then
    waited for the release behind the same busy rank: twice the rank timeout."""
    import threading

    import msgspec

    from gemma4_kv.lookup import messages

    go = threading.Event()

    def disagree(msg, handle):
        if isinstance(msg, messages.Lookup):
            reply = handle(msg)  # pins 1024 like rank 0 but says it pinned 768
            return msgspec.structs.replace(reply, pinned=768)
        if isinstance(msg, messages.Repin):
            go.wait(30)
        return handle(msg)

    stats = half.connector._scheduler.stats
    rank1 = _RankAnswers(half, 1, disagree)
    sent = []
    client = half.connector._scheduler.ranks.client
    real_ask = client.ask_all
    monkeypatch.setattr(client, "ask_all", lambda msg: (sent.append(type(msg).__name__),
                                                       real_ask(msg))[1])
    try:
        before = stats.data.get("lookups_unanswered", 0)
        r = half.request(PROMPT)
        assert half.connector.get_num_new_matched_tokens(r, 0) == (0, False)
        assert stats.data["lookups_unanswered"] == before + 1
        assert sent == ["Lookup", "Repin"]  # the releases after it were told
        go.set()
        monkeypatch.undo()
        half.connector.request_finished_all_groups(r, ((),) * len(half.layout.groups))
        assert half.pinned() == NONE
    finally:
        go.set()
        rank1.close()
