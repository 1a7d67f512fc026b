"""Worker half of the connector: owns the store and moves the bytes.

`register_kv_caches` builds the layout from the real tensors and opens the store, the
lookup service (`lookups.py`, answering the scheduler on a private socket) and the
saver (`saves.py`). `start_load_kv` queues this step's loads from objects the lookup
pinned (on CUDA layer by layer beside the forward); `wait_for_save` stores the chunks
this step completed.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict

import torch

from ..keys.engine import engine_identity, fingerprint, layer_identity
from ..layout.groups import from_vllm
from ..lookup.channel import LookupServer, engine_core_pid, socket_address
from ..lookup.service import LookupService
from .metadata import Gemma4KVMetadata
from .metrics import Gemma4KVStats, StatsFile
from ..layout.plan import ChunkBlocks, load_blocks
from ..transfer.saves import Saver
from ..config.host_checks import check_host_resources, check_tiers_reachable
from ..config.settings import ConnectorSettings, SettingsError
from ..transfer.staging import StagingPool
from ..stores.embedded import ChunkStore, set_lmcache_log_level
from ..transfer.streams import Transfer

logger = logging.getLogger(__name__)


def forward_order(layout) -> list[tuple[int, int, str]]:
    """(group id, position in the group, layer name) of every owning layer, in the
    order the forward runs them: target layers by index, then draft layers."""
    def key(item):
        name = item[2]
        index = re.search(r"\.(\d+)\.", name)
        return (name in drafts, int(index.group(1)) if index else -1, name)

    drafts = {n for g in layout.groups for n in g.draft_layers}
    return sorted(((g.group_id, p, n) for g in layout.groups for p, n in enumerate(g.layers)),
                  key=key)


def open_store(settings: ConnectorSettings, layout, fingerprint: str, chunk_size: int,
               world: int, rank: int, device: torch.device, stats):
    """The embedded ChunkStore, or the store on `lmcache_server` (a start-up failure
    names the key: unreachable, another LMCache version, no shared memory here)."""
    if settings.embedded_store:
        return ChunkStore(layout, fingerprint, chunk_size, settings.store_config(ranks=world),
                          kv_rank=rank, stats=stats)
    from ..stores.server_tier import ServerUnavailable, UnsupportedServer
    from ..stores.server import ServerStore

    try:
        # The fingerprint names the rank: each rank registers groups of its own.
        return ServerStore(layout, fingerprint, chunk_size, url=settings.lmcache_server,
                           timeout_s=settings.lmcache_server_timeout_s,
                           cuda=device.type == "cuda", stats=stats)
    except (ServerUnavailable, UnsupportedServer) as e:
        raise SettingsError(f'gemma4-kv: kv_connector_extra_config["lmcache_server"] cannot '
                            f"be used: {e}; fix: start the README's `lmcache server` command "
                            "line (LMCache 0.5.6, on this host) or remove the key") from None


class ConnectorWorker:
    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.chunk_size = settings.chunk_size
        self.stats = Gemma4KVStats()
        self.store = self.server = self.lookups = None
        self.rank = 0
        self._layer_ready: dict[str, torch.cuda.Event] = {}  # this step's queued layers
        self._in_flight = None  # (QueuedLoads, [(LoadRequest, Hit, plan)]) of this step
        self._landing: list = []  # earlier steps' loads whose copies may still run
        self._forward_waits = True  # vLLM calls wait_for_layer_load before each layer

    # -- set-up -----------------------------------------------------------------------
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
        set_lmcache_log_level(self.settings.lmcache_log_level)
        self.layout = from_vllm(self.kv_cache_config, kv_caches)
        self.caches = {g.group_id: [kv_caches[n] for n in g.layers] for g in self.layout.groups}
        device = next(iter(kv_caches.values())).device
        self.rank = rank = get_tensor_model_parallel_rank()
        model = self.settings.model_id or self.vllm_config.model_config.model
        # The page interior depends on the attention backend and device (vLLM's CPU
        # backend stores K transposed): never mix objects across them.
        page_format = f"{self.kv_cache_config.kv_cache_layout}-{device.type}"
        engine = engine_identity(self.vllm_config, weights_id=self.settings.weights_id)
        layers, bad_layers = layer_identity(self.vllm_config,
                                            [n for g in self.layout.groups for n in g.layers])
        self.fingerprint = fingerprint(self.layout, model=f"{model}|{page_format}",
                                       chunk_size=self.chunk_size, tp_rank=rank,
                                       tp_size=world, engine=engine.digest, layers=layers)
        if engine.unsafe or bad_layers:
            # The scheduler half sees the same and never asks or saves; say it once here.
            logger.warning("gemma4-kv: KV of this engine cannot be keyed safely (%s): "
                           "nothing is stored or loaded", engine.unsafe or bad_layers)
        self.store = open_store(self.settings, self.layout, self.fingerprint, self.chunk_size,
                                world, rank, device, self.stats)
        self.transfer = Transfer(device, self.settings.num_programs)
        pool = StagingPool(self.settings.staging_mb << 20, device) if self.transfer.cuda \
            else None
        self.record = StatsFile(self.settings.stats_file, self.layout, rank)
        self.saver = Saver(self.store, self.layout, self.caches, self.transfer, pool,
                           self.chunk_size, self.stats, self.record)
        self._load_order = forward_order(self.layout)
        self._warm_up()
        self.lookups = LookupService(self.store, self.layout, self.chunk_size,
                                     self.settings.lookup_timeout_s, self.stats, self.record)
        engine_id = self.vllm_config.kv_transfer_config.engine_id
        self.server = LookupServer(
            socket_address(engine_id, engine_core_pid(self.vllm_config), rank),
            self.lookups.handle)
        self.record.layout_event(self.fingerprint)
        logger.info("gemma4-kv: %d groups, fingerprint %s, store %s on rank %d",
                    len(self.layout.groups), self.fingerprint,
                    self.settings.lmcache_server or f"{self.settings.cpu_gb / world:.2f} GiB",
                    rank)

    def _warm_up(self) -> None:
        """Compile the kernels now rather than in the first hit's TTFT (0.4 s measured
        on the H200): gather the null block into scratch objects and scatter the same
        bytes back, once with 1 and once with 8 moves (Triton specialises on some sizes)."""
        if not self.transfer.cuda:
            return
        try:
            for g in self.layout.groups:
                caches = self.caches[g.group_id]
                for n in (1, min(8, self.chunk_size // g.block_size)):
                    plan = [ChunkBlocks(g.group_id, 0, tuple(range(n)), (0,) * n)]
                    obj = torch.empty(g.chunk_shape(self.chunk_size), dtype=g.dtype,
                                      pin_memory=True)
                    trailer = torch.empty(4, dtype=torch.int64, pin_memory=True)
                    self.transfer.save(g, caches, [(obj, trailer, 0)], plan, None)
                    self.transfer.fence().synchronize()
                    self.transfer.load_by_layer({g.group_id: (g, caches, [obj], plan)},
                                                [(g.group_id, 0)]).done.synchronize()
            torch.cuda.synchronize()
        except Exception:  # a slower first hit is no reason to refuse to start
            logger.exception("gemma4-kv: kernel warm-up failed")

    # -- loads ------------------------------------------------------------------------
    def start_load_kv(self, meta: Gemma4KVMetadata) -> None:
        """Queue this step's loads; on CUDA they run layer by layer beside the forward.
        Every object was pinned and checked by the lookup: nothing here can fail but a
        bug, which is raised rather than leaving blocks unfilled."""
        self._finish_loads()
        t0 = time.perf_counter()
        items, loaded = defaultdict(list), []
        for load in meta.loads:
            hit = self.lookups.take(load.req_id)
            if hit is None or (hit.start, hit.hit) != (load.start, load.hit):
                raise RuntimeError(f"gemma4-kv: request {load.req_id} was offered a hit of "
                                   f"[{load.start}, {load.hit}) that rank {self.rank} did "
                                   f"not pin ({hit and (hit.start, hit.hit)})")
            plan = load_blocks(self.layout, load.start, load.hit, self.chunk_size,
                               load.block_ids)
            for cb in plan:
                items[cb.group_id].append((cb, hit.pinned.views[(load.hashes[cb.chunk],
                                                                 cb.group_id)]))
            loaded.append((load, hit, plan))
        if not items:
            self._loaded(loaded, 0.0)
            return
        loads = {gid: (self.layout.groups[gid], self.caches[gid], [o for _, o in its],
                       [cb for cb, _ in its]) for gid, its in items.items()}
        if not self.transfer.cuda:
            for args in loads.values():
                self.transfer.load(*args)
            self._loaded(loaded, time.perf_counter() - t0)
            return
        queued = self.transfer.load_by_layer(loads, [(g, p) for g, p, _ in self._load_order])
        self._in_flight = (queued, loaded)
        if self._forward_waits:
            self._layer_ready = dict(zip((n for _, _, n in self._load_order), queued.ready))
        else:
            torch.cuda.current_stream().wait_event(queued.done)

    def wait_for_layer_load(self, layer_name: str) -> None:
        event = self._layer_ready.pop(layer_name, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _finish_loads(self) -> None:
        """After the forward: later work (the drafter, the next step) is ordered after
        every load; the store lets go of the objects once the copies have run
        (`_release_landed`, never a wait on the host)."""
        self._release_landed()
        if self._in_flight is None:
            return
        queued, loaded = self._in_flight
        self._in_flight = None
        if self._layer_ready and len(self._layer_ready) == len(self._load_order):
            # This model's attention does not call wait_for_layer_load: from now on the
            # forward waits for all loads before it starts.
            logger.error("gemma4-kv: the forward waited for no layer load; loading "
                         "before the forward from now on")
            self._forward_waits = False
        self._layer_ready = {}
        torch.cuda.current_stream().wait_event(queued.done)
        self._landing.append((queued, loaded))

    def _release_landed(self, wait: bool = False) -> None:
        still = []
        for queued, loaded in self._landing:
            if wait or queued.done.query():
                self._loaded(loaded, queued.seconds())
            else:
                still.append((queued, loaded))
        self._landing = still

    def _loaded(self, loaded: list, seconds: float) -> None:
        for load, hit, plan in loaded:
            self.lookups.done(hit)
            for cb in plan:
                g = self.layout.groups[cb.group_id]
                self.stats.add("load_blocks", len(cb.block_ids))
                self.stats.add("load_bytes", len(cb.block_ids) * g.page_bytes * len(g.layers),
                               cb.group_id)
            self.record("load", load.req_id, load.start, load.hit, plan, seconds=seconds)
        if loaded:
            self.stats.add("load_seconds", seconds)

    # -- saves ------------------------------------------------------------------------
    def wait_for_save(self, meta: Gemma4KVMetadata) -> None:
        self._finish_loads()
        for save in meta.saves:
            self.saver.save(save)
        self.saver.commit_ready()
        for touch in meta.touches:
            self.saver.touch(touch)

    def get_finished(self) -> tuple[None, None]:
        self._release_landed()
        self.saver.commit_ready()
        return None, None

    def get_stats(self) -> Gemma4KVStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        if self.store is None:
            return
        self._finish_loads()
        self._release_landed(wait=True)
        self.saver.commit_ready(wait=True)
        if self.server:
            self.server.close()
        self.lookups.close()
        self.store.close()
        self.store = None
