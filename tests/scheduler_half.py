"""The connector's real scheduler half on a real VllmConfig / KVCacheConfig, with each
worker rank's real store and LookupService behind its real lookup socket in this
process: vLLM's call order played by hand, so a test can stop between any two calls
(an abort after a step was scheduled and before its workers ran, say)."""

from __future__ import annotations

import os

import torch


CHUNK = 256
RETENTION = 512
BLOCK = 32  # sliding groups get 64-token blocks, full ones 32: the hit multiple is 64


def engine_configs(model_dir, extra: dict, ranks: int = 1, kv_mib: int = 64, **engine):
    """(VllmConfig, KVCacheConfig) of a CPU engine over the model in `model_dir` with the
    connector's `extra` config (`engine`: more vLLM EngineArgs), as the engine core
    builds them, with `kv_mib` of KV cache; the scheduler half asks one lookup socket
    per rank."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from gemma4_kv.layout.from_hf import layer_specs

    args = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                dtype="float32", max_model_len=4096, block_size=BLOCK,
                kv_transfer_config=KVTransferConfig(
                    kv_connector="Gemma4KVConnector",
                    kv_connector_module_path="gemma4_kv.connector",
                    kv_role="kv_both", kv_connector_extra_config=extra))
    vc = EngineArgs(**{**args, **engine}).create_engine_config()
    vc.cache_config.kv_cache_layout = "LBHNC"  # what the engine core picks on CPU
    vc.parallel_config.tensor_parallel_size = ranks
    specs = {}
    for name, s in layer_specs(vc.model_config.hf_text_config, dtype=torch.float32,
                               block_size=BLOCK)[0].items():
        kw = dict(block_size=BLOCK, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                  dtype=torch.float32)
        specs[name] = (SlidingWindowSpec(sliding_window=s.window, **kw) if s.window
                       else FullAttentionSpec(**kw))
    return vc, get_kv_cache_configs(vc, [specs], [kv_mib << 20])[0]


class SchedulerHalf:
    """The connector in vLLM's SCHEDULER role with `ranks` worker ranks' stores and lookup
    services; `serve` plays one request through vLLM's call order (lookup, allocate,
    update_state_after_alloc, build_connector_meta, request_finished) and does every
    rank's part of the step (`work`). With `serve_ranks=False` no rank is served here
    (a test puts real workers behind the lookup sockets); `engine`: more EngineArgs."""

    def __init__(self, model_dir, ranks: int = 1, extra: dict | None = None,
                 serve_ranks: bool = True, engine: dict | None = None, kv_mib: int = 64):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                                 resolve_kv_cache_block_sizes)

        from gemma4_kv.config.settings import ConnectorSettings
        from gemma4_kv.connector import Gemma4KVConnector
        from gemma4_kv.connector.metrics import Gemma4KVStats
        from gemma4_kv.keys.engine import fingerprint
        from gemma4_kv.layout.groups import from_vllm
        from gemma4_kv.lookup.channel import LookupServer
        from gemma4_kv.lookup.service import LookupService
        from gemma4_kv.lookup.sockets import socket_address
        from gemma4_kv.stores.factory import open_store

        # Every intermediate end kept (the tests here derive their hits with them);
        # tests/test_branches.py plays the default.
        extra = {"cpu_gb": 0.25, "retention_interval": RETENTION,
                 "intermediate_ends": "always", **(extra or {})}
        vc, self.kv_cache_config = engine_configs(model_dir, extra, ranks, kv_mib,
                                                  **(engine or {}))
        self.vllm_config = vc
        self.text_config = vc.model_config.hf_text_config
        block, self.hash_block = resolve_kv_cache_block_sizes(self.kv_cache_config, vc)
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(self.hash_block, hash_fn)
        self.layout = from_vllm(self.kv_cache_config)
        settings = ConnectorSettings.from_extra_config(extra)
        self.stores, self.services, self.servers = [], [], []
        for rank in range(ranks if serve_ranks else 0):
            store = open_store(settings.store_config(), self.layout,
                               fingerprint(self.layout, model="tiny", chunk_size=CHUNK,
                                           tp_rank=rank, tp_size=ranks), CHUNK)
            service = LookupService(store, self.layout, CHUNK, 2.0, Gemma4KVStats())
            self.stores.append(store)
            self.services.append(service)
            self.servers.append(LookupServer(
                socket_address(vc.kv_transfer_config.engine_id, os.getpid(), rank),
                service.handle))
        self.store, self.lookups = (self.stores[0], self.services[0]) if serve_ranks else \
            (None, None)
        self.kvm = KVCacheManager(self.kv_cache_config, max_model_len=4096,
                                  scheduler_block_size=block, hash_block_size=self.hash_block,
                                  enable_caching=False)
        self.connector = Gemma4KVConnector(vc, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.connector.bind_kv_cache_manager(self.kvm)
        self.saved: dict[str, list[bytes]] = {}  # request id -> keys of the chunks saved
        self._gen = torch.Generator().manual_seed(0)
        self._ids = iter(range(10**6))

    def request(self, tokens, images=(), lora=None):
        from vllm import SamplingParams
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.v1.request import Request

        feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                       mm_position=PlaceholderRange(offset=off, length=n))
                 for ident, off, n in images]
        return Request(f"req-{next(self._ids)}", tokens, SamplingParams(max_tokens=1), None,
                       mm_features=feats, block_hasher=self.block_hasher, lora_request=lora)

    def schedule(self, req, hit: int | None = None):
        """(hit, this step's connector metadata) of a request scheduled alone: what the
        engine core hands the workers for the step. With `hit`, the lookup that found
        it was made already (an earlier step that could not allocate, say)."""
        from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

        rid = req.request_id
        if hit is None:
            hit, load_async = self.connector.get_num_new_matched_tokens(req, 0)
            assert hit is not None and not load_async  # no L2 tier: never pending
        assert self.kvm.allocate_slots(req, req.num_tokens - hit,
                                       num_external_computed_tokens=hit) is not None
        self.connector.update_state_after_alloc(req, self.kvm.get_blocks(rid), hit)
        req.num_computed_tokens = hit
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(req, self.kvm.get_block_ids(rid))]
        out.num_scheduled_tokens = {rid: req.num_tokens - hit}
        out.total_num_scheduled_tokens = req.num_tokens - hit
        return hit, self.connector.build_connector_meta(out)

    def work(self, meta) -> None:
        """Every rank's part of a step: read each pinned hit (as `start_load_kv`: a hit
        the rank did not pin is a RuntimeError), then write what the step saves."""
        from gemma4_kv.layout.plan import load_blocks

        for rank, (service, store) in enumerate(zip(self.services, self.stores)):
            for load in meta.loads:
                pinned = service.take(load.req_id, load.pin)
                if pinned is None or (pinned.start, pinned.hit) != (load.start, load.hit):
                    raise RuntimeError(f"rank {rank} did not pin the hit of {load.req_id}")
                for cb in load_blocks(self.layout, load.start, load.hit, CHUNK,
                                      load.block_ids):
                    assert (load.hashes[cb.chunk], cb.group_id) in pinned.pinned.views
                service.done(pinned)
            for job in meta.finished:  # requests of earlier steps
                store.on_request_finished(job.req_id)
            for save in meta.saves:
                self._put(store, save)
        for save in meta.saves:
            w = save.write
            self.saved[w.req_id] = list(w.chain[w.first:w.first + len(w.groups)])

    def preempt(self, req) -> None:
        """vLLM's preemption: the request's blocks are freed and it waits again from
        token 0 (the connector is not told; it is asked for a hit again)."""
        from vllm.v1.request import RequestStatus

        self.kvm.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0

    def finish(self, req) -> None:
        """vLLM's end of a request (finished or aborted): the connector, then its blocks."""
        self.connector.request_finished_all_groups(req,
                                                   self.kvm.get_block_ids(req.request_id))
        self.kvm.free(req)

    def serve(self, req):
        """(hit, this step's connector metadata) of a request served alone."""
        hit, meta = self.schedule(req)
        self.work(meta)
        req.num_computed_tokens = req.num_tokens
        self.finish(req)
        return hit, meta

    def pinned(self) -> list[set[str]]:
        """Per rank, the requests holding a pinned hit there, once every message sent so
        far has been handled (a rank handles its messages in order: the answer to a
        later one says the earlier ones are done)."""
        from gemma4_kv.lookup import messages

        assert self.connector._scheduler.ranks.client.ask_all(messages.Release("sync")) == \
            [messages.Done(ok=True)] * len(self.services)
        return [s.pinned_requests() for s in self.services]

    def _put(self, store, save):
        from gemma4_kv.layout import integrity

        res = store.reserve(save.write)
        for kv, trailer, key in res.objects.values():
            kv.copy_(torch.randn(kv.shape, generator=self._gen).to(kv.dtype))
            integrity.seal(kv, trailer, key)
        store.commit(res)

    def close(self):
        self.connector.shutdown()
        for server, service, store in zip(self.servers, self.services, self.stores):
            server.close()
            service.close()
            store.close()
