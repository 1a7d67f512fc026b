"""Scheduler half of the connector: how many tokens are cached, what to load and save.

Runs in vLLM's engine core. It sees token ids and block ids; the bytes live in the
worker processes, which it asks through `lookup.LookupClient`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .keys import chunk_hashes
from .layout import from_vllm
from .lookup import LookupClient, socket_path
from .metadata import Gemma4KVMetadata, LoadRequest, SaveRequest
from .plan import check_chunk_size
from .settings import ConnectorSettings

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    tokens: list[int]
    hashes: list[bytes]
    next_chunk: int = 0
    """First chunk not yet stored or loaded."""
    hit: tuple[int, int] | None = field(default=None)
    """(start, hit) of a lookup whose objects the workers hold pinned."""


class ConnectorScheduler:
    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings):
        self.layout = from_vllm(kv_cache_config)
        self.chunk_size = settings.chunk_size
        check_chunk_size(self.layout, self.chunk_size)
        for g in self.layout.groups:
            if g.window is not None and g.window < self.chunk_size:
                logger.warning(
                    "gemma4-kv: sliding window %d < chunk size %d: under chunked prefill, "
                    "a chunk that spans a step boundary loses early sliding blocks before "
                    "it completes and is not stored; a chunk_size <= %d avoids it",
                    g.window, self.chunk_size, g.window)
        ktc = vllm_config.kv_transfer_config
        self.can_load, self.can_save = ktc.is_kv_consumer, ktc.is_kv_producer
        world = vllm_config.parallel_config.tensor_parallel_size
        self.client = LookupClient([socket_path(ktc.engine_id, r) for r in range(world)])
        self.kv_cache_manager = None  # bound by vLLM (bind_kv_cache_manager)
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadRequest] = []

    def _state(self, request) -> _Request | None:
        st = self._requests.get(request.request_id)
        if st is None and request.prompt_token_ids is not None:
            tokens = list(request.prompt_token_ids)
            st = _Request(tokens, chunk_hashes(tokens, self.chunk_size,
                                               getattr(request, "cache_salt", None)))
            self._requests[request.request_id] = st
        return st

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        if st is None or not self.can_load:
            return 0, False
        self._release(request.request_id, st)
        # At least one prompt token must be computed by vLLM (it needs its logits); a
        # hit ends on a boundary of every group's blocks, possibly inside a chunk.
        m = self.layout.chunk_multiple
        limit = min(len(st.hashes) * self.chunk_size, (len(st.tokens) - 1) // m * m)
        if limit <= num_computed_tokens:
            return 0, False
        replies = self.client.ask_all("lookup", request.request_id, st.hashes,
                                      num_computed_tokens, limit)
        hit = min(replies) if replies else 0
        if hit <= num_computed_tokens:
            self.client.ask_all("release", request.request_id)
            return 0, False
        st.hit = (num_computed_tokens, hit)
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
        st.hit = None  # the worker releases the pins once loaded
        st.next_chunk = max(st.next_chunk, hit // self.chunk_size)
        self._loads.append(LoadRequest(request.request_id, start, hit,
                                       st.hashes[:-(-hit // self.chunk_size)],
                                       tuple(list(b) for b in blocks.get_block_ids())))

    def build_connector_meta(self, scheduler_output) -> Gemma4KVMetadata:
        meta = Gemma4KVMetadata(loads=self._loads)
        self._loads = []
        if not self.can_save:
            return meta
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            st = self._requests.get(req_id)
            if st is None or req_id not in computed:
                continue
            done = min(computed[req_id] + scheduled, len(st.tokens)) // self.chunk_size
            done = min(done, len(st.hashes))
            if done <= st.next_chunk:
                continue
            # The live block table: out-of-window sliding blocks are the null block here,
            # and their old ids may already belong to another request.
            block_ids = tuple(list(b) for b in self.kv_cache_manager.get_block_ids(req_id))
            meta.saves.append(SaveRequest(req_id, st.next_chunk,
                                          st.hashes[st.next_chunk:done], block_ids))
            st.next_chunk = done
        return meta

    def request_finished(self, request) -> tuple[bool, None]:
        st = self._requests.pop(request.request_id, None)
        if st is not None:
            self._release(request.request_id, st)
        return False, None

    def _release(self, req_id: str, st: _Request) -> None:
        if st.hit is not None:
            st.hit = None
            self.client.ask_all("release", req_id)
