"""Worker half of the connector: owns the store and moves the bytes.

`register_kv_caches` builds the layout from the real tensors and opens the store
and the lookup service; `start_load_kv` fills the blocks of this step's hits before
the forward; `wait_for_save` stores the chunks completed this step (on CUDA the copy
to host overlaps the next steps; objects are committed once their copy has landed).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import defaultdict

import torch

from .keys import fingerprint
from .layout import from_vllm
from .lookup import LookupServer, socket_path
from .metadata import Gemma4KVMetadata, LoadRequest, SaveRequest
from .plan import ChunkBlocks, hit_chunks, load_blocks, max_servable_hit, save_blocks
from .settings import ConnectorSettings
from .store import ChunkStore
from .transfer import Transfer

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


class ConnectorWorker:
    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.chunk_size = settings.chunk_size
        self.store: ChunkStore | None = None
        self.rank = 0
        self.server: LookupServer | None = None
        self._lock = threading.Lock()  # the lookup thread and the model thread share the store
        self._pinned: dict[str, list] = {}  # req id -> chunk keys pinned by its lookup
        self._pending: list[tuple] = []  # (event, hashes to commit, keep-alive)
        self._load_errors: set[int] = set()
        self._layer_ready: dict[str, torch.cuda.Event] = {}  # this step's queued layers
        self._in_flight = None  # (QueuedLoads, [(LoadRequest, plan)]) of this step
        self._forward_waits = True  # vLLM calls wait_for_layer_load before each layer

    # -- set-up -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.layout = from_vllm(self.kv_cache_config, kv_caches)
        self.caches = {g.group_id: [kv_caches[n] for n in g.layers] for g in self.layout.groups}
        device = next(iter(kv_caches.values())).device
        self.rank = rank = get_tensor_model_parallel_rank()
        world = self.vllm_config.parallel_config.tensor_parallel_size
        model = self.settings.model_id or self.vllm_config.model_config.model
        # The page interior depends on the attention backend and device (vLLM's CPU
        # backend stores K transposed): never mix objects across them.
        page_format = f"{self.kv_cache_config.kv_cache_layout}-{device.type}"
        self.fingerprint = fingerprint(self.layout, model=f"{model}|{page_format}",
                                       chunk_size=self.chunk_size, tp_rank=rank, tp_size=world)
        self.store = ChunkStore(self.layout, self.fingerprint, self.chunk_size,
                                self.settings.store_config(), kv_rank=rank)
        self.transfer = Transfer(device, self.settings.num_programs)
        self._load_order = forward_order(self.layout)
        self._warm_up()
        engine_id = self.vllm_config.kv_transfer_config.engine_id
        self.server = LookupServer(socket_path(engine_id, rank),
                                   {"lookup": self.lookup, "release": self.release})
        if self.settings.stats_file:
            with open(self.settings.stats_file, "a") as f:
                f.write(json.dumps({"event": "layout", "rank": rank,
                                    "fingerprint": self.fingerprint,
                                    "groups": [dict(kind=g.kind.value, window=g.window,
                                                    block_size=g.block_size,
                                                    layers=list(g.layers),
                                                    aliases=[a for a, _ in g.aliases])
                                               for g in self.layout.groups]}) + "\n")
        logger.info("gemma4-kv: %d groups, fingerprint %s, store %.1f GiB",
                    len(self.layout.groups), self.fingerprint, self.settings.cpu_gb)

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
                    self.transfer.save(g, caches, [obj], plan)
                    self.transfer.fence().synchronize()
                    self.transfer.load_by_layer({g.group_id: (g, caches, [obj], plan)},
                                                [(g.group_id, 0)]).done.synchronize()
            torch.cuda.synchronize()
        except Exception:  # a slower first hit is no reason to refuse to start
            logger.exception("gemma4-kv: kernel warm-up failed")

    # -- lookup service (called from the scheduler through `LookupServer`) -------------
    def lookup(self, req_id: str, hashes: list[bytes], start: int, limit: int) -> int:
        """Largest hit (at most `limit` tokens) every group can serve; its objects stay
        pinned until loaded."""
        t0 = time.perf_counter()
        hit = self._lookup(req_id, hashes, start, limit)
        self._record("lookup", req_id, start, hit, [], t0)
        return hit

    def _lookup(self, req_id: str, hashes: list[bytes], start: int, limit: int) -> int:
        with self._lock:
            self._release_locked(req_id)
            present = self.store.present(hashes)
            hit = max_servable_hit(self.layout, self.chunk_size, len(hashes),
                                   lambda g, c: c in present[g], start, limit)
            if hit <= start:
                return 0
            keys = [(hashes[c], g) for g, c in hit_chunks(self.layout, start, hit,
                                                          self.chunk_size)]
            if not self.store.lock(keys):
                return 0
            self._pinned[req_id] = keys
            return hit

    def release(self, req_id: str) -> None:
        with self._lock:
            self._release_locked(req_id)

    def _release_locked(self, req_id: str) -> None:
        keys = self._pinned.pop(req_id, None)
        if keys:
            self.store.release(keys)

    # -- loads ------------------------------------------------------------------------
    def start_load_kv(self, meta: Gemma4KVMetadata) -> None:
        """Queue this step's loads; on CUDA they run layer by layer beside the forward."""
        self._finish_loads()
        t0 = time.perf_counter()
        items, loaded = defaultdict(list), []
        for load in meta.loads:
            plan = self._read(load, items)
            if plan is not None:
                loaded.append((load, plan))
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

    def _read(self, load: LoadRequest, items: dict) -> list | None:
        """The pinned objects of one hit, added to `items[group id]` as (blocks, object)."""
        plan = load_blocks(self.layout, load.start, load.hit, self.chunk_size, load.block_ids)
        keys = [(load.hashes[cb.chunk], cb.group_id) for cb in plan]
        with self._lock:
            objects = self.store.read(keys) if self._pinned.get(load.req_id) else None
        if objects is None:
            # Pins lost or objects incompatible: these blocks hold no KV; vLLM recomputes
            # or fails the request, per its kv_load_failure_policy.
            logger.warning("gemma4-kv: load of %s failed", load.req_id)
            self._load_errors.update(b for cb in plan for b in cb.block_ids)
            self.release(load.req_id)
            return None
        for cb, obj in zip(plan, objects):
            items[cb.group_id].append((cb, obj))
        return plan

    def wait_for_layer_load(self, layer_name: str) -> None:
        event = self._layer_ready.pop(layer_name, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _finish_loads(self) -> None:
        """After the forward: later work (the drafter, the next step) is ordered after
        every load, and the store may let go of the objects."""
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
        self._loaded(loaded, queued.seconds())

    def _loaded(self, loaded: list, seconds: float) -> None:
        for load, plan in loaded:
            self.release(load.req_id)
            self._record("load", load.req_id, load.start, load.hit, plan, seconds=seconds)

    # -- saves ------------------------------------------------------------------------
    def wait_for_save(self, meta: Gemma4KVMetadata) -> None:
        self._finish_loads()
        for save in meta.saves:
            self._save(save)
        self._commit_ready()

    def _save(self, save: SaveRequest) -> None:
        t0 = time.perf_counter()
        per_group = defaultdict(list)
        reserved, planned = [], []
        with self._lock:
            for i, h in enumerate(save.hashes):
                blocks = save_blocks(self.layout, save.first_chunk + i, self.chunk_size,
                                     save.block_ids)
                if blocks is None:
                    continue  # a sliding block left the window before the chunk completed
                objects = self.store.reserve(h)
                if not objects:
                    continue  # stored already, or no room
                reserved.append(h)
                for cb in blocks:
                    if cb.group_id in objects:
                        per_group[cb.group_id].append((cb, objects[cb.group_id]))
                        planned.append(cb)
        if not reserved:
            return
        keep = []
        for gid, items in per_group.items():
            keep += self.transfer.save(self.layout.groups[gid], self.caches[gid],
                                       [o for _, o in items], [cb for cb, _ in items])
        self._pending.append((self.transfer.fence(), reserved, keep))
        self._record("save", save.req_id, save.first_chunk * self.chunk_size,
                     (save.first_chunk + len(save.hashes)) * self.chunk_size, planned, t0)

    def _commit_ready(self, wait: bool = False) -> None:
        still = []
        for event, hashes, keep in self._pending:
            if event is None or wait or event.query():
                if event is not None:
                    event.synchronize()
                with self._lock:
                    for h in hashes:
                        self.store.commit(h)
            else:
                still.append((event, hashes, keep))
        self._pending = still

    def get_finished(self) -> tuple[None, None]:
        self._commit_ready()
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._finish_loads()
        self._commit_ready(wait=True)
        if self.server:
            self.server.close()
        if self.store:
            self.store.close()

    # -- statistics -------------------------------------------------------------------
    def _record(self, event: str, req_id: str, start: int, end: int, plan, t0: float = 0.0,
                seconds: float | None = None) -> None:
        if not self.settings.stats_file:
            return
        per_group = defaultdict(lambda: [0, 0])
        for cb in plan:
            g = self.layout.groups[cb.group_id]
            per_group[cb.group_id][0] += len(cb.block_ids)
            per_group[cb.group_id][1] += len(cb.block_ids) * g.page_bytes * len(g.layers)
        line = {"event": event, "rank": self.rank, "req_id": req_id, "start": start, "end": end,
                "seconds": time.perf_counter() - t0 if seconds is None else seconds,
                "groups": {gid: {"blocks": b, "bytes": n} for gid, (b, n) in per_group.items()}}
        with open(self.settings.stats_file, "a") as f:
            f.write(json.dumps(line) + "\n")
