"""Worker half of the connector: owns the store and moves the bytes.

`register_kv_caches` builds the layout from the real tensors and opens the store
and the lookup service; `start_load_kv` fills the blocks of this step's hits before
the forward; `wait_for_save` stores the chunks completed this step (on CUDA the copy
to host overlaps the next steps; objects are committed once their copy has landed).
"""

from __future__ import annotations

import json
import logging
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


class ConnectorWorker:
    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.chunk_size = settings.chunk_size
        self.store: ChunkStore | None = None
        self.server: LookupServer | None = None
        self._lock = threading.Lock()  # the lookup thread and the model thread share the store
        self._pinned: dict[str, list] = {}  # req id -> chunk keys pinned by its lookup
        self._pending: list[tuple] = []  # (event, hashes to commit, keep-alive)
        self._load_errors: set[int] = set()

    # -- set-up -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.layout = from_vllm(self.kv_cache_config, kv_caches)
        self.caches = {g.group_id: [kv_caches[n] for n in g.layers] for g in self.layout.groups}
        device = next(iter(kv_caches.values())).device
        rank = get_tensor_model_parallel_rank()
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
        self._warm_up()
        engine_id = self.vllm_config.kv_transfer_config.engine_id
        self.server = LookupServer(socket_path(engine_id, rank),
                                   {"lookup": self.lookup, "release": self.release})
        if self.settings.stats_file:
            with open(self.settings.stats_file, "a") as f:
                f.write(json.dumps({"event": "layout", "fingerprint": self.fingerprint,
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
        bytes back, once with 1 and once with 8 moves (Triton specialises on sizes)."""
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
                    self.transfer.load(g, caches, [obj], plan)
            torch.cuda.synchronize()
        except Exception:  # a slower first hit is no reason to refuse to start
            logger.exception("gemma4-kv: kernel warm-up failed")

    # -- lookup service (called from the scheduler through `LookupServer`) -------------
    def lookup(self, req_id: str, hashes: list[bytes], start: int) -> int:
        """Largest hit every group can serve; its objects stay pinned until loaded."""
        t0 = time.perf_counter()
        hit = self._lookup(req_id, hashes, start)
        self._record("lookup", req_id, start, hit, [], t0)
        return hit

    def _lookup(self, req_id: str, hashes: list[bytes], start: int) -> int:
        with self._lock:
            self._release_locked(req_id)
            present = self.store.present(hashes)
            hit = max_servable_hit(self.layout, self.chunk_size, len(hashes),
                                   lambda g, c: c in present[g], start)
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
        for load in meta.loads:
            try:
                self._load(load)
            finally:
                self.release(load.req_id)

    def _load(self, load: LoadRequest) -> None:
        t0 = time.perf_counter()
        plan = load_blocks(self.layout, load.start, load.hit, self.chunk_size, load.block_ids)
        keys = [(load.hashes[cb.chunk], cb.group_id) for cb in plan]
        with self._lock:
            objects = self.store.read(keys) if self._pinned.get(load.req_id) else None
        if objects is None:
            # Pins lost or objects incompatible: these blocks hold no KV; vLLM recomputes
            # or fails the request, per its kv_load_failure_policy.
            logger.warning("gemma4-kv: load of %s failed", load.req_id)
            self._load_errors.update(b for cb in plan for b in cb.block_ids)
            return
        by_group = defaultdict(list)
        for cb, obj in zip(plan, objects):
            by_group[cb.group_id].append((cb, obj))
        for gid, items in by_group.items():
            group = self.layout.groups[gid]
            self.transfer.load(group, self.caches[gid], [o for _, o in items],
                               [cb for cb, _ in items])
        if self.transfer.cuda:
            torch.cuda.current_stream().synchronize()  # objects are unpinned right after
        self._record("load", load.req_id, load.start, load.hit, plan, t0)

    # -- saves ------------------------------------------------------------------------
    def wait_for_save(self, meta: Gemma4KVMetadata) -> None:
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
        self._commit_ready(wait=True)
        if self.server:
            self.server.close()
        if self.store:
            self.store.close()

    # -- statistics -------------------------------------------------------------------
    def _record(self, event: str, req_id: str, start: int, end: int, plan, t0: float) -> None:
        if not self.settings.stats_file:
            return
        per_group = defaultdict(lambda: [0, 0])
        for cb in plan:
            g = self.layout.groups[cb.group_id]
            per_group[cb.group_id][0] += len(cb.block_ids)
            per_group[cb.group_id][1] += len(cb.block_ids) * g.page_bytes * len(g.layers)
        line = {"event": event, "req_id": req_id, "start": start, "end": end,
                "seconds": time.perf_counter() - t0,
                "groups": {gid: {"blocks": b, "bytes": n} for gid, (b, n) in per_group.items()}}
        with open(self.settings.stats_file, "a") as f:
            f.write(json.dumps(line) + "\n")
