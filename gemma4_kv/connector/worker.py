"""Worker half of the connector: wiring. `register_kv_caches` has the rank's parts built
(`build.build_worker`: the store, the data movement `transfer.Loads` and
`transfer.Saves`, the lookup service) and puts the lookup service behind its private
socket; each step's jobs then go to them.
"""

from __future__ import annotations

import logging

import torch

from ..config.settings import ConnectorSettings
from ..lookup import messages
from ..lookup.channel import LookupServer
from ..lookup.service import LookupService
from ..lookup.sockets import engine_core_pid, socket_address
from ..stores.base import ChunkStore
from ..stores.events import TierEvents
from ..transfer.loads import Loads
from ..transfer.saves import Saves
from ..transfer.step_timer import StepTimer
from .build import build_worker
from .events import attach, take_reports
from .metadata import Gemma4KVMetadata
from .metrics import Gemma4KVStats
from .startup import startup_line, startup_log

logger = logging.getLogger(__name__)


class ConnectorWorker:
    store: ChunkStore | None
    """Set by `register_kv_caches`; None again once shut down."""
    lookups: LookupService
    loads: Loads
    saves: Saves
    steps: StepTimer | None
    """None until `register_kv_caches` (vLLM may run a step before it: profiling)."""
    server: LookupServer | None
    events: TierEvents | None

    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.chunk_size = settings.chunk_size
        self.stats = Gemma4KVStats()
        self.store = self.server = self.steps = self.events = None
        self.rank = 0
        self.enabled = True
        """False when this rank cannot key its KV safely: it stores and serves nothing."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        parts = build_worker(self.vllm_config, self.kv_cache_config, self.settings, kv_caches,
                             self.stats)
        self.layout, self.rank, self.fingerprint = parts.layout, parts.rank, parts.fingerprint.name
        self.store, self.lookups, self.steps = parts.store, parts.lookups, parts.steps
        self.loads, self.saves = parts.loads, parts.saves
        self.events = attach(self.vllm_config, self.store)  # None: KV events off
        if parts.fingerprint.unsafe:
            # The scheduler half sees the engine's configuration reasons and never asks
            # or saves; what only a worker sees (its weights, its layers' scales) it
            # enforces itself: every lookup misses and no save is made.
            self.enabled = False
            logger.warning("gemma4-kv: KV of this engine cannot be keyed safely (%s): "
                           "nothing is stored or loaded", parts.fingerprint.unsafe)
        engine_id = self.vllm_config.kv_transfer_config.engine_id
        self.server = LookupServer(
            socket_address(engine_id, engine_core_pid(self.vllm_config), self.rank),
            self.lookups.handle if self.enabled else _nothing_cached,
            self.lookups.advance if self.enabled else None)
        world = self.vllm_config.parallel_config.tensor_parallel_size
        startup_log.info("%s", startup_line(self.settings, self.layout, self.fingerprint,
                                            self.rank, world,
                                            self.vllm_config.kv_transfer_config.kv_role,
                                            self.enabled))

    # -- each step --------------------------------------------------------------------
    def step_started(self) -> None:
        if self.steps is not None:
            self.steps.start()

    def start_load_kv(self, meta: Gemma4KVMetadata) -> None:
        self.loads.start(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.loads.wait_for_layer(layer_name)

    def wait_for_save(self, meta: Gemma4KVMetadata) -> None:
        if self.steps is not None:
            self.steps.stop(meta.num_tokens)
        self.loads.end_of_forward()
        for save in meta.saves if self.enabled else ():
            self.saves.submit(save)
        for finished in meta.finished:
            self.saves.finish(finished)
        self.saves.poll()

    def get_finished(self) -> tuple[None, None]:
        self.loads.poll()
        self.saves.poll()
        return None, None

    def take_events(self):
        """The store's reports since the last step, for vLLM's KV events."""
        return take_reports(self.events, self.rank)

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
