"""Scheduler half of the connector: how many tokens are cached, what to load and save.

Runs in vLLM's engine core. It sees requests and block ids; the bytes live in the
worker ranks, which it asks over `lookup.ranks.RankLookups` in `lookup.messages`. A
lookup is answered by every rank with the hit it pinned and every hit it could serve;
the scheduler offers the longest hit all ranks can serve and makes every rank pin
exactly that (`Repin`). A rank still asking an L2 tier answers `pending`, and vLLM is
told to ask again next step (None), so a slow tier never stalls the scheduler.

What is stored is the retention policy's (`plan.retention`); each save names the hit
ends and their class: where the prompt or its generated tokens end HIGH, the extra
ends LOW, which the store evicts first. Drafts that own KV change what is keyed and
stored (`layout.drafts.DraftPolicy`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from ..config.settings import ConnectorSettings
from ..keys.engine import engine_identity
from ..keys.request import (RequestKeyer, Uncacheable, mm_identifiers_are_content_hashes,
                            placeholder_spans)
from ..layout.drafts import DraftPolicy
from ..layout.groups import from_vllm
from ..layout.plan import check_chunk_size, cut_before
from ..lookup import messages
from ..lookup.ranks import RankLookups
from ..lookup.sockets import socket_address
from ..transfer.jobs import FinishJob, LoadJob, SaveJob
from .branches import BranchMemory
from .events import RouterEvents
from .metadata import Gemma4KVMetadata
from .metrics import Gemma4KVStats
from .request_state import RequestState

logger = logging.getLogger(__name__)


RANK_TIMEOUT_S = 2.0
"""A worker rank that has not answered a lookup in this long: that request's miss."""
RANKS_DOWN_AFTER = 2
"""Unanswered lookups in a row after which lookups are skipped for `RANK_BACKOFF_S`
(the scheduler must not stall on a dead rank; one slow answer pauses nothing)."""
RANK_BACKOFF_S = 10.0


class ConnectorScheduler:
    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings,
                 stats=None):
        self.stats = stats if stats is not None else Gemma4KVStats()
        self.layout = from_vllm(kv_cache_config)
        self.chunk_size = settings.chunk_size
        check_chunk_size(self.layout, self.chunk_size)
        self.settings = settings
        store = settings.store_config().capabilities
        # A store that cannot serve hits ending among generated tokens stores none.
        self.save_generated = settings.save_decode_tokens and store.stores_generated
        self.ranks_hit_ends = store.ranks_hit_ends
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
        self.drafts = DraftPolicy.from_vllm(vllm_config, self.layout, self.chunk_size)
        world = vllm_config.parallel_config.tensor_parallel_size
        self.ranks = RankLookups([socket_address(ktc.engine_id, os.getpid(), r)
                                  for r in range(world)], self.stats,
                                 timeout_s=RANK_TIMEOUT_S, down_after=RANKS_DOWN_AFTER,
                                 backoff_s=RANK_BACKOFF_S)
        self.keyer = RequestKeyer(self.chunk_size,
                                  mm_content_hashed=mm_identifiers_are_content_hashes(vllm_config))
        self.kv_cache_manager: Any = None  # bound by vLLM (bind_kv_cache_manager)
        self._requests: dict[str, RequestState] = {}
        self.branches = BranchMemory() if settings.intermediate_ends == "branched" else None
        self._loads: list[LoadJob] = []
        self._finished: list[FinishJob] = []
        self.events = RouterEvents.from_vllm(vllm_config, kv_cache_config, self.layout,
                                             self.chunk_size)  # None: events off

    def _state(self, request) -> RequestState | None:
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
            st = self._requests[request.request_id] = RequestState(
                request, keys, self.drafts, request.num_prompt_tokens)
        st.keys = keys
        return st

    # -- lookups ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        st = self._state(request) if self.can_load or self.can_save else None
        if st is None or not self.can_load or getattr(request, "skip_reading_prefix_cache",
                                                      False):
            return 0, False
        if st.offered is not None and st.offered[0] == num_computed_tokens \
                and time.monotonic() < st.offered_until:
            # Offered last step, not allocated (vLLM asks a waiting request again each
            # step): its pin still holds that hit, so it is offered again without asking
            # every rank to release it and pin the same objects again, until the store
            # says its hold may lapse (`Pinned.fresh_until`): then it is looked up anew.
            return st.offered[1] - num_computed_tokens, False
        self._release(request.request_id, st)
        # At least one prompt token must be computed by vLLM (it needs its logits); a
        # hit ends on a boundary of every group's blocks, possibly inside a chunk.
        m = self.layout.chunk_multiple
        full = st.prompt_chunks * self.chunk_size
        hashes = st.hashes(full)
        limit = min(full, (st.prompt_len - 1) // m * m)
        spans = placeholder_spans(request)
        limit = cut_before(limit, spans, m)
        if limit <= num_computed_tokens or self.ranks.paused():
            return 0, False
        if not st.pending:
            # A new name for what this lookup pins. After an answer `pending` the name
            # is reused: ranks that did pin then release it before pinning again, so a
            # pin of a rank that answered while another was still asking never leaks.
            st.pin += 1
        asked = time.monotonic()
        hit, from_l2, fresh_s = self.ranks.lookup(messages.Lookup(
            request.request_id, hashes, num_computed_tokens, limit, spans, st.pin))
        st.pending = hit is None
        if hit is None:
            return None, False  # an L2 tier is being asked: vLLM asks again next step
        if hit <= num_computed_tokens:
            return 0, False
        st.offered = (num_computed_tokens, hit)
        st.offered_until = math.inf if fresh_s is None else asked + fresh_s
        st.from_l2 = min(from_l2, hit - num_computed_tokens)
        return hit - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None or st.offered is None:
            return
        start, hit = st.offered
        if num_external_tokens == 0:
            self._release(request.request_id, st)
            return
        if start + num_external_tokens != hit:
            raise RuntimeError(f"vLLM allocated {num_external_tokens} external tokens after "
                               f"{start}, the connector offered up to {hit}")
        st.offered = None  # the load owns pin st.pin now: the workers free it once loaded
        n = -(-hit // self.chunk_size)
        st.next_chunk = max(st.next_chunk, hit // self.chunk_size)
        self._loads.append(LoadJob(request.request_id, start, hit,
                                   st.hashes(n * self.chunk_size),
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
        drafter_skipped = self.drafts.drafter_skipped(
            computed[r] + n for r, n in scheduled_tokens.items() if r in computed)
        for req_id, scheduled in scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None or req_id not in computed:
                continue
            st.impure.update(self.drafts.impure_chunks(
                computed[req_id], scheduled, st.request.num_tokens, drafter_skipped))
            if (computed[req_id] + scheduled) // self.chunk_size <= st.next_chunk:
                continue  # no chunk can complete in this step (most decode steps)
            if self._state(st.request) is None:  # reset while in flight: stop saving
                continue
            done = st.chunks_done(computed[req_id], scheduled, self.save_generated)
            if done <= st.next_chunk:
                continue
            # The live block table: out-of-window sliding blocks are the null block here,
            # and their old ids may already belong to another request.
            block_ids = tuple(list(b) for b in self.kv_cache_manager.get_block_ids(req_id))
            write = st.write(req_id, done, self.layout, self.settings.retention_interval,
                             self.ranks_hit_ends, self.branches)
            if self.events is not None:
                self.events.record(write, st.request)
            meta.saves.append(SaveJob(write, block_ids))
        return meta

    # -- end of a request, reset --------------------------------------------------------
    def request_finished(self, request) -> tuple[bool, None]:
        st = self._requests.get(request.request_id)
        if st is not None:
            self._forget(request.request_id, st)
        return False, None

    def _forget(self, req_id: str, st: RequestState) -> None:
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
        replies = self.ranks.client.ask_all(messages.Reset())
        ok = replies is not None and all(isinstance(r, messages.Done) and r.ok
                                         for r in replies)
        if not ok:
            logger.error("gemma4-kv: a worker rank did not reset its store")
        return ok

    def _release(self, req_id: str, st: RequestState) -> None:
        """Drop the pin the scheduler owns (a hit offered but not loaded)."""
        if st.offered is not None:
            st.offered = None
            self._release_all(req_id, st.pin)

    def _release_all(self, req_id: str, pin: int) -> None:
        """Without waiting for the answers: a rank handles its messages in order, so a
        later lookup of the same request is handled after the release."""
        self.ranks.client.tell_all(messages.Release(req_id, pin))

    def close(self) -> None:
        self.ranks.client.close()
