"""The start-up warm-up covers the launch signature of every real save and load
(issue 24: the first rounds after start were slower than later ones), counted, not
timed: `cold_launches` counts launches of a signature warm-up did not make. Off CUDA
the torch mover copies, and the signatures are those the kernel would be launched
with; tests/test_e2e_tier.py checks the same through a real engine."""

from __future__ import annotations

import pytest
import torch

from needs import require

require("vllm")

from gemma4_kv.connector.metrics import Gemma4KVStats  # noqa: E402
from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout  # noqa: E402
from gemma4_kv.layout.plan import ChunkBlocks  # noqa: E402
from gemma4_kv.layout import integrity  # noqa: E402
from gemma4_kv.transfer.streams import DeviceStreams  # noqa: E402
from gemma4_kv.transfer.warmup import warm_up  # noqa: E402
from paged import make_paged  # noqa: E402

CHUNK = 64
LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 48, 16, 4, 64, 64, torch.bfloat16, ("a", "b", "c")),
    KVGroup(1, AttentionKind.FULL, None, 32, 2, 128, 128, torch.bfloat16, ("d",)),
))


def saves_and_loads(transfer, caches, chunks_per_save=(1, 2, 3, 5)):
    """Saves of whole chunks (an odd and an even number of blocks per launch) and the
    loads of what they stored, of both groups."""
    for g in LAYOUT.groups:
        per_chunk = CHUNK // g.block_size
        for chunks in chunks_per_save:
            plan = [ChunkBlocks(g.group_id, c, tuple(range(per_chunk)),
                                tuple(range(1 + c * per_chunk, 1 + (c + 1) * per_chunk)))
                    for c in range(chunks)]
            objs = [(torch.empty(g.chunk_shape(CHUNK), dtype=g.dtype),
                     torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE), 7)
                    for _ in plan]
            transfer.save(g, caches[g.group_id], objs, plan, None)
            transfer.load(g, caches[g.group_id], [o for o, _, _ in objs], plan)


@pytest.fixture
def caches():
    gen = torch.Generator().manual_seed(0)
    return {g.group_id: make_paged(len(g.layers), 40, g.num_kv_heads, g.block_size,
                                   g.head_size, g.dtype, "LBHNC", "cpu", 1, gen)
            for g in LAYOUT.groups}


def test_after_the_warm_up_no_launch_is_cold(caches):
    stats = Gemma4KVStats()
    transfer = DeviceStreams(torch.device("cpu"), 32, stats)
    warm_up(transfer, LAYOUT, caches, CHUNK)
    # gather and scatter of each group, for an odd and an even number of moves
    assert len(transfer.launches.covered) == 2 * 2 * len(LAYOUT.groups)
    saves_and_loads(transfer, caches)
    assert stats.data.get("cold_launches", 0) == 0


def test_a_shape_the_warm_up_skips_is_counted(caches):
    """Negative control: warmed with odd numbers of moves only, every launch of an even
    number (saves of whole chunks of a group with 2 or 4 blocks per chunk) is cold."""
    stats = Gemma4KVStats()
    transfer = DeviceStreams(torch.device("cpu"), 32, stats)
    warm_up(transfer, LAYOUT, caches, CHUNK, moves=(1,))
    saves_and_loads(transfer, caches, chunks_per_save=(1,))
    # group 0: 4 blocks per chunk, group 1: 2; a save and a load each
    assert stats.data["cold_launches"] == 4
