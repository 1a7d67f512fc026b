"""Do at start-up what the first saves and loads would otherwise pay in a request's
time: compile the Triton kernel for every way it is launched (saves staged through the
staging buffer and written straight to pinned memory, layer-by-layer loads), and build
the checksum weights for the largest object (`integrity.weights`) on the device and on
the host (saves straight to pinned memory are sealed, and objects from an L2 tier
verified, there).

Triton compiles a variant per launch signature (`kernels.launch.BlockCopy.signature`):
besides the group's geometry, whether each argument's address is 16-byte aligned. The
moves' chunk numbers sit 8 bytes per move after their block ids, so an odd and an even
number of moves make two signatures: both are warmed. Every signature warmed is
recorded (`DeviceStreams.launches`); a later launch of another one counts as a cold launch.
Off CUDA the same moves run through the torch mover, so the signatures of real saves
and loads can be checked against warm-up's there too.

The blocks moved are the null block's (block 0), which holds nothing of any request;
nothing reaches the store.
"""

from __future__ import annotations

import logging

import torch

from ..layout.plan import ChunkBlocks
from ..layout import integrity

logger = logging.getLogger(__name__)

MOVES = (1, 2)
"""Moves per launch warmed: an odd and an even number (see above)."""


def warm_up(transfer, layout, caches: dict, chunk_size: int, pool=None,
            moves=MOVES) -> None:
    try:
        with transfer.launches.warming():
            _warm_up(transfer, layout, caches, chunk_size, pool, moves)
    except Exception:  # a slower first hit is no reason to refuse to start
        logger.exception("gemma4-kv: kernel warm-up failed")


def _warm_up(transfer, layout, caches, chunk_size, pool, moves) -> None:
    cuda = transfer.cuda
    words = max(torch.Size(g.chunk_shape(chunk_size)).numel() * g.dtype.itemsize // 4
                for g in layout.groups)
    for device in {torch.device("cpu"), transfer.device}:
        integrity.weights(words, device)
    for g in layout.groups:
        obj = torch.empty(g.chunk_shape(chunk_size), dtype=g.dtype, pin_memory=cuda)
        trailer = torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE,
                              pin_memory=cuda)
        for n in moves:
            plan = [ChunkBlocks(g.group_id, 0, (0,) * n, (0,) * n)]
            for staging in ((pool, None) if pool is not None else (None,)):
                transfer.save(g, caches[g.group_id], [(obj, trailer, 0)], plan, staging)
                if cuda:
                    transfer.fence().synchronize()
            if cuda:
                transfer.load_by_layer({g.group_id: (g, caches[g.group_id], [obj], plan)},
                                       [(g.group_id, p) for p in range(len(g.layers))]
                                       ).done.synchronize()
            else:
                transfer.load(g, caches[g.group_id], [obj], plan)
    if cuda:
        torch.cuda.synchronize()
