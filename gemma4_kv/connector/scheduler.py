"""Scheduler half of the connector: how many tokens are cached, what to load and save.

Runs in vLLM's engine core. It sees requests and block ids; the bytes live in the
worker ranks, which it asks over `lookup.channel.LookupClient` in `lookup.messages`. A
lookup is answered by every rank with the hit it pinned and every hit it could serve;
the scheduler offers the longest hit all ranks can serve and makes every rank pin
exactly that (`Repin`). A rank still asking an L2 tier answers `pending`, and vLLM is
told to ask again next step (None), so a slow tier never stalls the scheduler.

What is stored: every completed chunk of full-attention groups; sliding-window groups
only in the windows before the hits a request can serve later (`plan.hit_ends`: its
prompt's end and every `retention_interval` tokens), and for generated tokens; see
`_groups_to_store`. Each save names those hit ends and their class (`_ends`): where
the prompt or its generated tokens end is HIGH, the extra ends LOW, which the store
evicts first.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from ..config.settings import ConnectorSettings
from ..keys.engine import engine_identity
from ..keys.request import (ChunkKeys, RequestKeyer, Uncacheable,
                            mm_identifiers_are_content_hashes, placeholder_spans)
from ..layout.groups import AttentionKind, from_vllm
from ..layout.plan import check_chunk_size, cut_before, hit_ends, retained_chunks
from ..lookup import messages
from ..lookup.channel import LookupClient
from ..lookup.ranks import RanksDown, lookup_all_ranks
from ..lookup.sockets import socket_address
from ..stores.base import HIGH, LOW, ChunkWrite
from ..stores.factory import capabilities
from ..transfer.jobs import FinishJob, LoadJob, SaveJob
from .metadata import Gemma4KVMetadata
from .metrics import Gemma4KVStats

logger = logging.getLogger(__name__)


RANK_TIMEOUT_S = 2.0
"""A worker rank that has not answered a lookup in this long: that request's miss."""
RANKS_DOWN_AFTER = 2
"""Unanswered lookups in a row after which lookups are skipped for `RANK_BACKOFF_S`
(the scheduler must not stall on a dead rank; one slow answer pauses nothing)."""
RANK_BACKOFF_S = 10.0


@dataclass
class _Request:
    request: object
    keys: ChunkKeys
    prompt_len: int
    next_chunk: int = 0
    """First chunk not yet stored or loaded."""
    pin: int = 0
    """Number of its latest lookup: the workers name what it pinned (req_id, pin)."""
    hit: tuple[int, int] | None = None
    """(start, hit) of pin `pin` while the scheduler owns it: released here unless a
    load takes it over (the workers free a load's pins once loaded, in step order)."""
    from_l2: int = 0
    pending: bool = False
    """Its latest lookup was answered pending: a rank may hold a prefetch for it."""
    stored: list[tuple[int, ...]] = field(default_factory=list)
    """Groups stored for each chunk so far (to touch them when the request ends)."""
    impure: set[int] = field(default_factory=set)
    """Chunks holding draft KV that a one-step prefill would not have computed (see
    `ConnectorScheduler._mark_impure`): never stored."""
    ends: list[tuple[int, int]] = field(default_factory=list)
    """The prompt's hit ends and their class (`ConnectorScheduler._ends`)."""
    retained: dict[int, set[int]] | None = None
    """Per sliding group, the prompt chunks stored for it (the windows before `ends`)."""


def drafts_own_kv(vllm_config, layout) -> bool:
    """Whether a draft model's attention layers own KV in the groups: more layers own KV
    than the target model has (its layers minus the KV-shared ones)."""
    text = vllm_config.model_config.hf_text_config
    target = text.num_hidden_layers - (getattr(text, "num_kv_shared_layers", 0) or 0)
    return sum(len(g.layers) for g in layout.groups) > target


class ConnectorScheduler:
    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings,
                 stats=None):
        self.stats = stats if stats is not None else Gemma4KVStats()
        self.layout = from_vllm(kv_cache_config)
        self.chunk_size = settings.chunk_size
        check_chunk_size(self.layout, self.chunk_size)
        self.settings = settings
        # A store that cannot serve hits ending among generated tokens stores none.
        self.save_generated = settings.save_decode_tokens and capabilities(
            settings.store_config()).stores_generated
        for g in self.layout.groups:
            if g.window is not None and g.window < self.chunk_size:
                logger.warning(
                    "gemma4-kv: sliding window %d < chunk size %d: under chunked prefill, "
                    "a chunk that spans a step boundary loses early sliding blocks before "
                    "it completes and is not stored; a chunk_size <= %d avoids it",
                    g.window, self.chunk_size, g.window)
        ktc = vllm_config.kv_transfer_config
        self.can_load, self.can_save = ktc.is_kv_consumer, ktc.is_kv_producer
        unsafe = engine_identity(vllm_config, weights_id=settings.weights_id,
                                 model_id=settings.model_id).unsafe
        if unsafe:
            logger.warning("gemma4-kv: nothing is stored or loaded: %s", unsafe)
            self.can_load = self.can_save = False
        spec = vllm_config.speculative_config
        # EAGLE-style drafts that own KV compute a position's draft KV from the next
        # token: a chunk's key then covers one token more, and generated chunks are
        # stored only once no later step can rewrite them. (Gemma 4 assistants own no
        # KV: their layers read the target's, so nothing changes for them.)
        self.draft_lookahead = int(spec is not None and drafts_own_kv(vllm_config,
                                                                     self.layout))
        self.decode_margin = (spec.num_speculative_tokens + 1) if self.draft_lookahead else 0
        # vLLM's V1 model runner (the CPU build's; a GPU's when V2 is off or lacks a
        # feature) writes draft KV that a one-step prefill would not: at the last
        # position of a prefill step that is not the prompt's last, its padded drafter
        # batch reads the request's last token instead of the next one (the "backup"
        # token of `prepare_next_token_ids_padded`), and no draft KV at all in a step
        # whose batch ends within the draft length of the drafter's max_model_len
        # (`_input_fits_in_drafter`). Neither is rewritten later; such chunks are not
        # stored (`_mark_impure`). The V2 runner feeds the next prompt token.
        v1 = bool(self.draft_lookahead) and not getattr(vllm_config, "use_v2_model_runner",
                                                         False)
        self.impure_step_ends = v1 and not spec.disable_padded_drafter_batch
        self.drafter_room = None
        if v1:
            draft_len = getattr(spec.draft_model_config, "max_model_len", None)
            queries = spec.num_speculative_tokens + int(spec.method == "dflash")
            self.drafter_room = (draft_len or vllm_config.model_config.max_model_len) - queries
        world = vllm_config.parallel_config.tensor_parallel_size
        self.client = LookupClient([socket_address(ktc.engine_id, os.getpid(), r)
                                    for r in range(world)],
                                   timeout_ms=int(RANK_TIMEOUT_S * 1000))
        self._ranks_down_until = 0.0
        self._unanswered = 0  # lookups in a row a rank did not answer
        self.keyer = RequestKeyer(self.chunk_size,
                                  mm_content_hashed=mm_identifiers_are_content_hashes(vllm_config))
        self.kv_cache_manager = None  # bound by vLLM (bind_kv_cache_manager)
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadJob] = []
        self._finished: list[FinishJob] = []

    def _state(self, request) -> _Request | None:
        """The request's keys (refreshed after a reset), or None if it is not cached."""
        st = self._requests.get(request.request_id)
        keys = self.keyer.refresh(st.keys, request) if st else \
            self.keyer.keys(request, request.num_prompt_tokens)
        if isinstance(keys, Uncacheable):
            if st is not None:  # uncacheable from now on: what the ranks hold for it goes
                self._forget(request.request_id, st)
            logger.debug("gemma4-kv: request %s is not cached: %s", request.request_id,
                         keys.reason)
            return None
        if st is None:
            st = self._requests[request.request_id] = _Request(
                request, keys, request.num_prompt_tokens)
        st.keys = keys
        return st

    def _hashes(self, st: _Request, num_tokens: int) -> list[bytes]:
        """Keys of the first `num_tokens // chunk_size` chunks. With drafts that own KV,
        chunk c's key also names token (c + 1) * chunk_size (`ChunkKeys.lookahead`)."""
        n = num_tokens // self.chunk_size
        if self.draft_lookahead:
            return st.keys.lookahead(st.request, n)
        st.keys.extend(st.request, num_tokens)
        return st.keys.hashes[:n]

    # -- lookups ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        st = self._state(request) if self.can_load or self.can_save else None
        if st is None or not self.can_load or getattr(request, "skip_reading_prefix_cache",
                                                      False):
            return 0, False
        if st.hit is not None and st.hit[0] == num_computed_tokens:
            # Offered last step, not allocated (vLLM asks a waiting request again each
            # step): its pin still holds that hit, so it is offered again without asking
            # every rank to release it and pin the same objects again.
            return st.hit[1] - num_computed_tokens, False
        self._release(request.request_id, st)
        # At least one prompt token must be computed by vLLM (it needs its logits); a
        # hit ends on a boundary of every group's blocks, possibly inside a chunk.
        m = self.layout.chunk_multiple
        full = (st.prompt_len - self.draft_lookahead) // self.chunk_size * self.chunk_size
        hashes = self._hashes(st, full)
        limit = min(full, (st.prompt_len - 1) // m * m)
        spans = placeholder_spans(request)
        limit = cut_before(limit, spans, m)
        if limit <= num_computed_tokens or time.monotonic() < self._ranks_down_until:
            return 0, False
        st.pin += 1
        try:
            hit, from_l2 = lookup_all_ranks(self.client, messages.Lookup(
                request.request_id, hashes, num_computed_tokens, limit, spans, st.pin))
        except RanksDown:
            self._unanswered += 1
            self.stats.add("lookups_unanswered", 1)
            if self._unanswered >= RANKS_DOWN_AFTER:
                logger.warning("gemma4-kv: a worker rank did not answer %d lookups in a "
                               "row; no lookups for %.0f s", self._unanswered, RANK_BACKOFF_S)
                self._ranks_down_until = time.monotonic() + RANK_BACKOFF_S
                self._unanswered = 0
            else:
                logger.warning("gemma4-kv: a worker rank did not answer a lookup within "
                               "%.0f s: a miss", RANK_TIMEOUT_S)
            # without waiting: the rank that did not answer would hold the scheduler again
            self.client.tell_all(messages.Release(request.request_id, st.pin))
            st.pending = False
            return 0, False
        self._unanswered = 0
        st.pending = hit is None
        if hit is None:
            return None, False  # an L2 tier is being asked: vLLM asks again next step
        if hit <= num_computed_tokens:
            return 0, False
        st.hit = (num_computed_tokens, hit)
        st.from_l2 = min(from_l2, hit - num_computed_tokens)
        return hit - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None or st.hit is None:
            return
        start, hit = st.hit
        if num_external_tokens == 0:
            self._release(request.request_id, st)
            return
        if start + num_external_tokens != hit:
            raise RuntimeError(f"vLLM allocated {num_external_tokens} external tokens after "
                               f"{start}, the connector offered up to {hit}")
        st.hit = None  # the load owns pin st.pin now: the workers free it once loaded
        n = -(-hit // self.chunk_size)
        st.next_chunk = max(st.next_chunk, hit // self.chunk_size)
        self._loads.append(LoadJob(request.request_id, start, hit,
                                   self._hashes(st, n * self.chunk_size),
                                   tuple(list(b) for b in blocks.get_block_ids()), st.pin))

    def hit_sources(self, request, num_external_tokens: int) -> tuple[int, int]:
        """(tokens from the CPU tier, tokens brought up from an L2 tier) of a hit."""
        st = self._requests.get(request.request_id)
        l2 = min(st.from_l2, num_external_tokens) if st else 0
        return num_external_tokens - l2, l2

    # -- saves ------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> Gemma4KVMetadata:
        meta = Gemma4KVMetadata(loads=self._loads, finished=self._finished,
                                num_tokens=scheduler_output.total_num_scheduled_tokens)
        self._loads, self._finished = [], []
        if not self.can_save:
            return meta
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        scheduled_tokens = scheduler_output.num_scheduled_tokens
        drafter_skipped = self.drafter_room is not None and max(
            (computed[r] + n for r, n in scheduled_tokens.items() if r in computed),
            default=0) > self.drafter_room
        for req_id, scheduled in scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None or req_id not in computed:
                continue
            if self._state(st.request) is None:  # reset while in flight: stop saving
                continue
            self._mark_impure(st, computed[req_id], scheduled, drafter_skipped)
            done = self._chunks_done(st, computed[req_id], scheduled)
            if done <= st.next_chunk:
                continue
            # The live block table: out-of-window sliding blocks are the null block here,
            # and their old ids may already belong to another request.
            block_ids = tuple(list(b) for b in self.kv_cache_manager.get_block_ids(req_id))
            prompt_chunks = (st.prompt_len - self.draft_lookahead) // self.chunk_size
            chain = self._hashes(st, max(done, prompt_chunks) * self.chunk_size)
            groups = [() if c in st.impure else self._groups_to_store(st, c)
                      for c in range(st.next_chunk, done)]
            ends = list(self._ends(st))
            if done > st.prompt_len // self.chunk_size:  # a generated chunk ends here
                ends.append((done * self.chunk_size, HIGH))
            meta.saves.append(SaveJob(ChunkWrite(req_id, chain, st.next_chunk, groups, ends),
                                      block_ids))
            st.stored += [()] * (st.next_chunk - len(st.stored)) + groups
            st.next_chunk = done
        return meta

    def _mark_impure(self, st: _Request, computed: int, scheduled: int,
                     drafter_skipped: bool) -> None:
        """Chunks whose draft KV this step leaves other than a one-step prefill would
        (V1 model runner, see `__init__`): all it computes if the drafter does not run,
        else the one holding the step's last position if the request's known tokens go
        on past it (a prefill step that is not the last)."""
        end = computed + scheduled
        if drafter_skipped:
            st.impure.update(range(computed // self.chunk_size,
                                   (end - 1) // self.chunk_size + 1))
        elif self.impure_step_ends and end < st.request.num_tokens:
            st.impure.add((end - 1) // self.chunk_size)

    def _chunks_done(self, st: _Request, computed: int, scheduled: int) -> int:
        """Chunks whose KV is final after this step: prompt chunks this step computes,
        and (with `save_decode_tokens`) generated chunks computed in earlier steps."""
        known = len(st.request.all_token_ids) - self.draft_lookahead
        prompt = min(computed + scheduled, st.prompt_len, known)
        done = prompt // self.chunk_size
        if self.save_generated and computed >= st.prompt_len:
            done = max(done, min(computed - self.decode_margin, known) // self.chunk_size)
        return done

    def _ends(self, st: _Request) -> list[tuple[int, int]]:
        """Where the prompt's stored chunks serve hits (`plan.hit_ends`), as (tokens,
        class): HIGH the prompt's last full chunk and the hit of the same prompt asked
        again (at most one token short of it, on a block boundary); LOW every
        `retention_interval` tokens, kept only so that a hit can stop there."""
        if not st.ends:
            m, c = self.layout.chunk_multiple, self.chunk_size
            last = st.prompt_len // c * c
            again = min((st.prompt_len - self.draft_lookahead) // c * c,
                        (st.prompt_len - 1) // m * m)
            ends = hit_ends(last // c, c, again, self.settings.retention_interval)
            st.ends = [(e, HIGH if e in (last, again) else LOW) for e in ends]
        return st.ends

    def _groups_to_store(self, st: _Request, chunk: int) -> tuple[int, ...]:
        """Full groups always; sliding groups where a later hit can end (`_ends`)."""
        if chunk >= st.prompt_len // self.chunk_size:  # generated tokens: the end is open
            return tuple(g.group_id for g in self.layout.groups)
        if st.retained is None:
            ends = [e for e, _ in self._ends(st)]
            st.retained = {g.group_id: retained_chunks(g, self.chunk_size, ends)
                           for g in self.layout.groups if g.kind is AttentionKind.SLIDING}
        return tuple(g.group_id for g in self.layout.groups
                     if g.kind is AttentionKind.FULL or chunk in st.retained[g.group_id])

    # -- end of a request, reset --------------------------------------------------------
    def request_finished(self, request) -> tuple[bool, None]:
        st = self._requests.get(request.request_id)
        if st is not None:
            self._forget(request.request_id, st)
        return False, None

    def _forget(self, req_id: str, st: _Request) -> None:
        """The request is done here (finished, aborted, or uncacheable from now on): the
        ranks drop the pin the scheduler owns and any prefetch, and the store what it
        kept for its writes. A load already sent keeps its pin: the workers free it
        once it has run; one not sent yet never will be, so its pin goes too."""
        self._requests.pop(req_id, None)
        queued = [j for j in self._loads if j.req_id == req_id]
        if queued:
            self._loads = [j for j in self._loads if j.req_id != req_id]
        for job in queued:
            self._release_all(req_id, job.pin)
        self._release(req_id, st)
        if st.pending:
            st.pending = False
            self._release_all(req_id, st.pin)
        if st.stored:
            self._finished.append(FinishJob(req_id))

    def reset_cache(self) -> bool:
        """Every rank makes what it stored unreachable (new generation in its keys)."""
        for req_id, st in self._requests.items():
            self._release(req_id, st)
        self.keyer.reset()
        replies = self.client.ask_all(messages.Reset())
        ok = replies is not None and all(isinstance(r, messages.Done) and r.ok
                                         for r in replies)
        if not ok:
            logger.error("gemma4-kv: a worker rank did not reset its store")
        return ok

    def _release(self, req_id: str, st: _Request) -> None:
        """Drop the pin the scheduler owns (a hit offered but not loaded)."""
        if st.hit is not None:
            st.hit = None
            self._release_all(req_id, st.pin)

    def _release_all(self, req_id: str, pin: int) -> None:
        """Without waiting for the answers: a rank handles its messages in order, so a
        later lookup of the same request is handled after the release."""
        self.client.tell_all(messages.Release(req_id, pin))

    def close(self) -> None:
        self.client.close()
