"""Worker half of the connector: wiring. `register_kv_caches` builds the layout from
the real tensors and opens the store, the data movement (`transfer.Loads`,
`transfer.Saves`) and the lookup service behind its private socket; each step's jobs
then go to them.
"""

from __future__ import annotations

import logging

import torch

from ..config.host_checks import check_host_resources, check_tiers_reachable
from ..config.settings import ConnectorSettings, SettingsError
from ..keys.engine import store_fingerprint
from ..layout.groups import from_vllm
from ..lookup import messages
from ..lookup.channel import LookupServer
from ..lookup.service import LookupService
from ..lookup.wait import Rates
from ..lookup.sockets import engine_core_pid, socket_address
from ..stores.factory import StoreUnavailable, open_store
from ..stores.lmcache import set_log_level
from ..transfer.loads import Loads
from ..transfer.saves import Saves
from ..transfer.staging import StagingPool
from ..transfer.step_timer import StepTimer
from ..transfer.streams import Transfer
from ..transfer.warmup import warm_up
from .metadata import Gemma4KVMetadata
from .metrics import Gemma4KVStats, StatsFile

logger = logging.getLogger(__name__)


class ConnectorWorker:
    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.chunk_size = settings.chunk_size
        self.stats = Gemma4KVStats()
        self.store = self.server = self.lookups = self.loads = self.saves = None
        self.steps = None
        self.rank = 0
        self.enabled = True
        """False when this rank cannot key its KV safely: it stores and serves nothing."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tp_group)

        world = self.vllm_config.parallel_config.tensor_parallel_size
        # Host checks before anything is allocated; every rank checks before any pins
        # its share of cpu_gb (else a late rank sees the others' memory as taken).
        check_host_resources(self.settings, ranks=world)
        check_tiers_reachable(self.settings)
        if world > 1:
            get_tp_group().barrier()
        set_log_level(self.settings.lmcache_log_level)
        self.layout = from_vllm(self.kv_cache_config, kv_caches)
        caches = {g.group_id: [kv_caches[n] for n in g.layers] for g in self.layout.groups}
        device = next(iter(kv_caches.values())).device
        self.rank = rank = get_tensor_model_parallel_rank()
        self.fingerprint = self._fingerprint(device, rank, world)
        try:
            self.store = open_store(self.settings.store_config(ranks=world), self.layout,
                                    self.fingerprint, self.chunk_size, kv_rank=rank,
                                    device=device, stats=self.stats)
        except StoreUnavailable as e:
            raise SettingsError(f'gemma4-kv: kv_connector_extra_config["lmcache_server"] '
                                f"cannot be used: {e}; fix: start the README's `lmcache "
                                "server` command line (LMCache 0.5.6, on this host) or "
                                "remove the key") from None
        transfer = Transfer(device, self.settings.num_programs, self.stats)
        pool = StagingPool(self.settings.staging_mb << 20, device) if transfer.cuda else None
        record = StatsFile(self.settings.stats_file, self.layout, rank)
        warm_up(transfer, self.layout, caches, self.chunk_size, pool)
        rates = Rates()
        self.steps = StepTimer(transfer.cuda, rates.prefill)
        self.lookups = LookupService(self.store, self.layout, self.chunk_size,
                                     self.settings.lookup_timeout_s, self.stats, record,
                                     rates)
        self.loads = Loads(self.layout, caches, transfer, self.lookups, self.chunk_size,
                           self.stats, record, rank)
        self.saves = Saves(self.store, self.layout, caches, transfer, pool, self.chunk_size,
                           self.stats, record)
        engine_id = self.vllm_config.kv_transfer_config.engine_id
        self.server = LookupServer(
            socket_address(engine_id, engine_core_pid(self.vllm_config), rank),
            self.lookups.handle if self.enabled else _nothing_cached,
            self.lookups.advance if self.enabled else None)
        record.layout_event(self.fingerprint)
        logger.info("gemma4-kv: %d groups, fingerprint %s, store %s on rank %d",
                    len(self.layout.groups), self.fingerprint,
                    self.settings.lmcache_server or f"{self.settings.cpu_gb / world:.2f} GiB",
                    rank)

    def _fingerprint(self, device: torch.device, rank: int, world: int) -> str:
        """The store's namespace: everything the objects' bytes depend on but requests."""
        fp = store_fingerprint(self.vllm_config, self.layout,
                               kv_cache_layout=self.kv_cache_config.kv_cache_layout,
                               device=device, chunk_size=self.chunk_size, tp_rank=rank,
                               tp_size=world, model_id=self.settings.model_id,
                               weights_id=self.settings.weights_id)
        if fp.unsafe:
            # The scheduler half sees the engine's configuration reasons and never asks
            # or saves; what only a worker sees (its weights, its layers' scales) it
            # enforces itself: every lookup misses and no save is made.
            self.enabled = False
            logger.warning("gemma4-kv: KV of this engine cannot be keyed safely (%s): "
                           "nothing is stored or loaded", fp.unsafe)
        return fp.name

    # -- each step --------------------------------------------------------------------
    def step_started(self) -> None:
        if self.steps is not None:
            self.steps.start()

    def start_load_kv(self, meta: Gemma4KVMetadata) -> None:
        self.loads.start(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.loads.wait_for_layer(layer_name)

    def wait_for_save(self, meta: Gemma4KVMetadata) -> None:
        self.steps.stop(meta.num_tokens)
        self.loads.end_of_forward()
        for job in meta.saves if self.enabled else ():
            self.saves.submit(job)
        for job in meta.finished:
            self.saves.finish(job)
        self.saves.poll()

    def get_finished(self) -> tuple[None, None]:
        self.loads.poll()
        self.saves.poll()
        return None, None

    def shutdown(self) -> None:
        if self.store is None:
            return
        self.loads.wait()
        self.saves.wait()
        if self.server:
            self.server.close()
        self.lookups.close()
        self.store.close()
        self.store = None


def _nothing_cached(msg: messages.Request) -> messages.Reply:
    """The lookup answers of a rank that stores and serves nothing."""
    if isinstance(msg, messages.Lookup):
        return messages.LookupReply()
    return messages.Done(not isinstance(msg, messages.Repin))
