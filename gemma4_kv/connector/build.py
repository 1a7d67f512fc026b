"""Builds the worker half's parts once its KV caches exist, as vLLM's
`OffloadingSpec.get_worker` does for its connector: host checks, the store under this
rank's fingerprint, staging, kernel warm-up, the data movement and the lookup service.
`ConnectorWorker` wires what `build_worker` returns."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..config.host_checks import check_host_resources, check_tiers_reachable
from ..config.settings import ConnectorSettings, SettingsError
from ..keys.engine import StoreFingerprint, store_fingerprint
from ..layout.groups import KVLayout, from_vllm
from ..lookup.service import LookupService
from ..lookup.priors import device_flops, model_shape, prefill_prior
from ..lookup.rate_file import RateFile, default_path
from ..lookup.wait import Rates
from ..stores.base import ChunkStore
from ..stores.config import StoreConfig
from ..stores.factory import StoreUnavailable, open_store
from ..stores.lmcache import set_log_level
from ..transfer.loads import Loads
from ..transfer.saves import Saves
from ..transfer.staging import StagingPool
from ..transfer.step_timer import StepTimer
from ..transfer.streams import DeviceStreams
from ..transfer.warmup import warm_up
from .metrics import StatsFile


@dataclass
class WorkerParts:
    layout: KVLayout
    """The groups, as the real KV tensors lay them out."""
    rank: int
    fingerprint: StoreFingerprint
    store: ChunkStore
    lookups: LookupService
    loads: Loads
    saves: Saves
    steps: StepTimer


def build_worker(vllm_config, kv_cache_config, settings: ConnectorSettings,
                 kv_caches: dict[str, torch.Tensor], stats) -> WorkerParts:
    """The parts of this tensor-parallel rank. Raises `SettingsError` where the settings
    do not fit the host or the configured server cannot be used."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

    world = vllm_config.parallel_config.tensor_parallel_size
    # Host checks before anything is allocated; every rank checks before any pins its
    # share of cpu_gb (else a late rank sees the others' memory as taken).
    check_host_resources(settings, ranks=world)
    check_tiers_reachable(settings)
    if world > 1:
        get_tp_group().barrier()
    set_log_level(settings.lmcache_log_level)
    layout = from_vllm(kv_cache_config, kv_caches)
    caches = {g.group_id: [kv_caches[n] for n in g.layers] for g in layout.groups}
    device = next(iter(kv_caches.values())).device
    rank = get_tensor_model_parallel_rank()
    config = settings.store_config(ranks=world)
    fp = store_fingerprint(vllm_config, layout, kv_cache_layout=kv_cache_config.kv_cache_layout,
                           device=device, chunk_size=settings.chunk_size, tp_rank=rank,
                           tp_size=world, model_id=settings.model_id,
                           weights_id=settings.weights_id,
                           codec=config.codec_identity()
                           if isinstance(config, StoreConfig) else "")
    try:
        store = open_store(config, layout, fp.name,
                           settings.chunk_size, kv_rank=rank, device=device, stats=stats)
    except StoreUnavailable as e:
        raise SettingsError(f'gemma4-kv: kv_connector_extra_config["lmcache_server"] '
                            f"cannot be used: {e}; fix: start the README's `lmcache "
                            "server` command line (LMCache 0.5.6, on this host) or "
                            "remove the key") from None
    transfer = DeviceStreams(device, settings.num_programs, stats)
    pool = StagingPool(settings.staging_mb << 20, device) if transfer.cuda else None
    record = StatsFile(settings.stats_file, layout, rank)
    record.layout_event(fp.name)
    warm_up(transfer, layout, caches, settings.chunk_size, pool)
    rates = worker_rates(vllm_config, layout, settings, fp.name, device)
    lookups = LookupService(store, layout, settings.chunk_size, settings.lookup_timeout_s,
                            stats, record, rates)
    return WorkerParts(
        layout, rank, fp, store, lookups,
        Loads(layout, caches, transfer, lookups, settings.chunk_size, stats, record, rank),
        Saves(store, layout, caches, transfer, pool, settings.chunk_size, stats, record),
        StepTimer(transfer.cuda, rates.prefill))


def worker_rates(vllm_config, layout: KVLayout, settings: ConnectorSettings, engine: str,
                 device) -> Rates:
    """The lookup's rates with their priors: the FLOPs estimate on a GPU of known rate,
    and what earlier engines of this fingerprint measured on this host for this tier
    (the server's URL, or the embedded tiers' specs)."""
    try:
        shape = model_shape(vllm_config.model_config.hf_text_config, layout)
        prior = prefill_prior(shape, device_flops(device))
    except (AttributeError, TypeError, ValueError):  # a config without these fields
        prior = None
    tier = settings.lmcache_server or json.dumps(
        {"disk_path": settings.disk_path, "l2_adapters": list(settings.l2_adapters)},
        sort_keys=True, default=str)
    path = default_path()
    return Rates(prior, RateFile(path) if path else None, tier=tier, engine=engine)
