"""The vLLM KV connector: a thin facade over the scheduler and worker halves.

    --kv-transfer-config '{"kv_connector": "Gemma4KVConnector",
                           "kv_connector_module_path": "gemma4_kv.connector",
                           "kv_role": "kv_both"}'

It implements `SupportsHMA`, so vLLM keeps its hybrid allocator (one block table
per KV cache group) on.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                              KVConnectorRole, SupportsHMA)

from .metrics import Gemma4KVPromMetrics, Gemma4KVStats, step_kind
from ..config.settings import ConnectorSettings
from ..keys import weights
from ..stores.lmcache import set_log_level

if TYPE_CHECKING:
    from .scheduler import ConnectorScheduler
    from .worker import ConnectorWorker


class _StepHostTime:
    """Host time of one half, per step and per kind of step (`metrics.step_kind`):
    calls add to the step in progress; `step(kind)` books it as a step of that kind."""

    def __init__(self, stats, half: str):
        self.stats, self.half, self.us = stats, half, 0.0

    def add(self, us: float) -> None:
        self.us += us
        self.stats.add(f"{self.half}_us", us)

    def step(self, kind: str) -> None:
        self.stats.add(f"{self.half}_us_{kind}", self.us)
        self.stats.add(f"{self.half}_steps_{kind}", 1)
        self.us = 0.0


def _timed(half: str, step: bool = False):
    """Count the host time a call of vLLM's spends in this connector (`<half>_us`) and,
    for the call made once per step, the steps."""
    def wrap(fn):
        @functools.wraps(fn)
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self._host.add(1e6 * (time.perf_counter() - t0))
                if step:
                    self._stats.add(f"{half}_steps", 1)
        return timed
    return wrap


class Gemma4KVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        settings = ConnectorSettings.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        set_log_level(settings.lmcache_log_level)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import ConnectorScheduler

            self._stats = Gemma4KVStats()
            self._scheduler = ConnectorScheduler(vllm_config, kv_cache_config, settings,
                                                 self._stats)
            self._host = _StepHostTime(self._stats, "scheduler")
        else:
            from .worker import ConnectorWorker

            if settings.weights_id is None:  # the fingerprint waits for it
                weights.start(vllm_config.model_config, vllm_config.load_config)
            self._worker = ConnectorWorker(vllm_config, kv_cache_config, settings)
            self._stats = self._worker.stats
            self._host = _StepHostTime(self._stats, "worker")

    @property
    def _sched(self) -> ConnectorScheduler:
        """The scheduler half: vLLM calls the scheduler's methods on that role only."""
        if self._scheduler is None:
            raise RuntimeError("gemma4-kv: a scheduler call on a worker's connector")
        return self._scheduler

    @property
    def _work(self) -> ConnectorWorker:
        """The worker half: vLLM calls the worker's methods on that role only."""
        if self._worker is None:
            raise RuntimeError("gemma4-kv: a worker call on the scheduler's connector")
        return self._worker

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """No layout is required. vLLM asks this in the engine core before it profiles
        (and compiles) the model, its first call to the connector that carries the
        config: the weights start hashing there, beside that work (a worker then waits
        for its host's digest, not for a hash of its own)."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        if extra.get("weights_id") is None:
            weights.start(vllm_config.model_config, vllm_config.load_config)
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Loads wait per layer (`wait_for_layer_load`), which a full CUDA graph replays
        without calling: vLLM must run piecewise graphs, with Python between layers."""
        return True

    # -- scheduler side ---------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched.kv_cache_manager = kv_cache_manager

    @_timed("scheduler")
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed("scheduler")
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        host, l2 = self._sched.hit_sources(request, num_external_tokens)
        sources = {CacheHitSource.HOST: host, CacheHitSource.DISK: l2}
        return {k: v for k, v in sources.items() if v}

    def build_connector_meta(self, scheduler_output):
        meta = self._build_connector_meta(scheduler_output)
        self._host.step(step_kind(meta))  # this step's calls, this one included
        return meta

    @_timed("scheduler", step=True)
    def _build_connector_meta(self, scheduler_output):
        return self._sched.build_connector_meta(scheduler_output)

    @_timed("scheduler")
    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request)

    @_timed("scheduler")
    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request)

    def update_connector_output(self, connector_output) -> None:
        events = self._sched.events
        if events is not None:
            events.add(connector_output.kv_cache_events)

    def take_events(self):
        """The tiers' stores and removals as vLLM KV events (`events.py`)."""
        events = self._sched.events
        return events.take() if events is not None else ()

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self._work.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        """Called before each forward (vLLM may call `start_load_kv` after it, when the
        step loads nothing synchronously): the step's time counts from here."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_started()

    @_timed("worker")
    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._work.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:  # per layer: not timed
        self._work.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # whole chunks of all layers are stored in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        self._wait_for_save(meta)
        self._host.step(step_kind(meta))  # this step's calls (and the last one's tail)

    @_timed("worker", step=True)
    def _wait_for_save(self, meta) -> None:
        self._work.wait_for_save(meta)

    @_timed("worker")
    def get_finished(self, finished_req_ids):
        return self._work.get_finished()

    def get_kv_connector_kv_cache_events(self):
        """This rank's store reports since the last step (`events.py`)."""
        return self._worker.take_events() if self._worker is not None else None

    def get_kv_connector_stats(self):
        """This half's counters since the last call (vLLM sums the scheduler's and every
        rank's)."""
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return Gemma4KVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return Gemma4KVPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()
