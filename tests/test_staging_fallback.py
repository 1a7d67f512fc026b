"""Saves past `staging_mb` write pinned memory directly (README, `staging_mb`). The
fallback lives in `DeviceStreams.save`'s CUDA branch (a CPU save never stages: the torch
mover copies straight into the store's objects), so on the CPU only its decision is
tested: the ring answers "no room" (None) for a save larger than the whole buffer,
without raising and without handing out or holding any of its memory. The save
itself is tested on a GPU (marked `cuda`)."""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.layout.groups import AttentionKind, KVGroup
from gemma4_kv.layout.plan import ChunkBlocks
from gemma4_kv.layout import integrity
from gemma4_kv.transfer.staging import StagingPool
from paged import bits, make_paged


def test_a_save_larger_than_the_staging_buffer_gets_no_region_and_takes_nothing():
    pool = StagingPool(4096, torch.device("cpu"))
    assert pool.take(4097) is None  # DeviceStreams.save then writes pinned memory directly
    whole = pool.take(4096)  # nothing was held for the refused save
    assert whole is not None and whole.numel() == 4096
    assert pool.take(1) is None


CHUNK = 64
GROUP = KVGroup(0, AttentionKind.FULL, None, 32, 2, 128, 128, torch.bfloat16, ("a", "b"))


@pytest.mark.cuda
def test_a_save_past_the_staging_buffer_writes_pinned_memory_directly_bit_exact():
    """Three chunks (3 x 128 KiB) through a 64 KiB staging buffer: no region fits, the
    kernel writes the pinned objects itself and their trailers are left to the host
    (`host_seals`); the bytes equal those of the same save staged through a buffer
    large enough (the staged path: no host seals)."""
    from gemma4_kv.transfer.streams import DeviceStreams

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)
    caches = make_paged(len(GROUP.layers), 16, GROUP.num_kv_heads, GROUP.block_size,
                        GROUP.head_size, GROUP.dtype, "LBNHC", dev, 1, gen)
    per_chunk = CHUNK // GROUP.block_size
    plan = [ChunkBlocks(0, c, tuple(range(per_chunk)),
                        tuple(range(1 + c * per_chunk, 1 + (c + 1) * per_chunk)))
            for c in range(3)]
    transfer = DeviceStreams(dev, 32)

    def save(pool):
        objs = [(torch.empty(GROUP.chunk_shape(CHUNK), dtype=GROUP.dtype, pin_memory=True),
                 torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE,
                             pin_memory=True), 11 + i) for i in range(len(plan))]
        _, host_seals = transfer.save(GROUP, caches, objs, plan, pool)
        transfer.fence().synchronize()
        for kv, trailer, key in host_seals:
            integrity.seal(kv, trailer, key)
        assert all(integrity.verify(kv, t, key) for kv, t, key in objs)
        return objs, host_seals

    small = StagingPool(64 << 10, dev)
    direct, host_seals = save(small)
    assert len(host_seals) == len(plan)  # the fallback: every trailer sealed on the host
    assert small.take(64 << 10) is not None  # the refused save held none of the buffer
    staged, staged_seals = save(StagingPool(1 << 20, dev))
    assert staged_seals == []
    for (a, _, _), (b, _, _) in zip(direct, staged):
        assert torch.equal(bits(a), bits(b))
