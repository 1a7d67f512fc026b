"""The server's L1 as our GPU kernels use it (`MPServerTier(cuda_register=True)`): a
/dev/shm mapping registered with cudaHostRegister, written by the gather kernel (saves
without staging room) and read layer by layer by the load kernel through UVA, as pinned
memory. No server process is needed: the mapping is made the way `SharedL1.map`
makes it."""

from __future__ import annotations

import mmap
import os
import uuid

import pytest
import torch

from gemma4_kv.layout.groups import AttentionKind, KVGroup
from gemma4_kv.transfer.mover import BlockMoves, gather, scatter_by_layer
from gemma4_kv.stores.server.shm import cuda_host_register
from paged import bits, make_paged

pytestmark = pytest.mark.cuda


def test_registered_shared_memory_is_pinned_for_the_kernels():
    group = KVGroup(0, AttentionKind.SLIDING, 1024, 16, 2, 256, 256, torch.bfloat16,
                    tuple(f"l{i}" for i in range(4)))
    gen = torch.Generator().manual_seed(0)
    caches = make_paged(4, 20, 2, 16, 256, torch.bfloat16, "LBNHC", "cuda", 1, gen)
    shape = group.chunk_shape(64)
    nbytes = 3 * torch.Size(shape).numel() * 2
    path = f"/dev/shm/g4kv-cuda-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
        os.unlink(path)
    pool = torch.frombuffer(mm, dtype=torch.uint8)
    cuda_host_register(pool, path)
    try:
        per = nbytes // 3
        objects = [pool[i * per:(i + 1) * per].view(torch.bfloat16).view(shape)
                   for i in range(3)]
        assert all(o.is_pinned() for o in objects)  # DeviceStreams checks it before UVA loads
        moves = BlockMoves(torch.tensor([3, 5, 7, 9, 11], device="cuda"),
                           torch.tensor([0, 0, 1, 2, 2], device="cuda"),
                           torch.tensor([0, 3, 1, 2, 0], device="cuda"))
        reference = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
        gather(group, caches, reference, moves)
        gather(group, caches, objects, moves)  # the kernel writes host memory directly
        torch.cuda.synchronize()
        for o, r in zip(objects, reference):
            assert torch.equal(bits(o), bits(r.cpu()))
        targets = [torch.zeros_like(c) for c in caches]
        load = scatter_by_layer(group, targets, objects, moves, num_programs=8)
        for layer in range(len(caches)):
            load(layer)
        torch.cuda.synchronize()
        for t, c in zip(targets, caches):
            for b in (3, 5, 7, 9, 11):
                assert torch.equal(bits(t[b]), bits(c[b]))
    finally:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(pool.data_ptr())
