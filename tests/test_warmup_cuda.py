"""The start-up warm-up leaves nothing to compile for the first real saves and loads
(issue: the first rounds after start were slower than later ones). Counted, not timed:
the Triton kernel's compiled variants and the checksum weights built, before and after
saves staged through the staging buffer, saves straight to pinned memory and
layer-by-layer loads of several sizes, on two groups of different geometry; the
connector's own counter of launches warm-up did not cover (`cold_launches`) agrees."""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.connector.metrics import Gemma4KVStats
from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
from gemma4_kv.layout.plan import ChunkBlocks
from gemma4_kv.layout import integrity
from gemma4_kv.transfer.staging import StagingPool
from gemma4_kv.transfer.streams import DeviceStreams
from gemma4_kv.transfer.warmup import warm_up
from paged import make_paged

pytestmark = pytest.mark.cuda

CHUNK = 64
LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 48, 16, 4, 64, 64, torch.bfloat16, ("a", "b", "c")),
    KVGroup(1, AttentionKind.FULL, None, 32, 2, 128, 128, torch.bfloat16, ("d",)),
))


def compiled() -> int:
    """Variants of the block-copy kernel compiled so far, on every device."""
    from gemma4_kv.kernels.copy_blocks import copy_blocks_kernel

    return sum(len(cache[0]) for cache in copy_blocks_kernel.device_caches.values())


def test_after_the_warm_up_real_saves_and_loads_compile_nothing():
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    caches = {g.group_id: make_paged(len(g.layers), 40, g.num_kv_heads, g.block_size,
                                     g.head_size, g.dtype, "LBNHC", dev, 1, gen)
              for g in LAYOUT.groups}
    stats = Gemma4KVStats()
    transfer, pool = DeviceStreams(dev, 32, stats), StagingPool(16 << 20, dev)
    warm_up(transfer, LAYOUT, caches, CHUNK, pool)
    variants, weights = compiled(), integrity._weights[str(dev)].numel()
    assert variants > 0
    for g in LAYOUT.groups:
        per_chunk = CHUNK // g.block_size
        for chunks in (1, 3, 5):
            plan = [ChunkBlocks(g.group_id, c, tuple(range(per_chunk)),
                                tuple(range(1 + c * per_chunk, 1 + (c + 1) * per_chunk)))
                    for c in range(chunks)]
            objs = [(torch.empty(g.chunk_shape(CHUNK), dtype=g.dtype, pin_memory=True),
                     torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE,
                                 pin_memory=True), 7) for _ in plan]
            for staging in (pool, None):
                _, host_seals = transfer.save(g, caches[g.group_id], objs, plan, staging)
                transfer.fence().synchronize()
                for kv, trailer, key in host_seals:
                    integrity.seal(kv, trailer, key)
                assert all(integrity.verify(kv, t, key) for kv, t, key in objs)
            order = [(g.group_id, p) for p in range(len(g.layers))]
            transfer.load_by_layer({g.group_id: (g, caches[g.group_id], [o for o, _, _ in objs],
                                                 plan)}, order).done.synchronize()
    assert compiled() == variants
    assert stats.data.get("cold_launches", 0) == 0  # the counter agrees with Triton
    assert integrity._weights[str(dev)].numel() == weights
