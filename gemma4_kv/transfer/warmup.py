"""Do at start-up what the first saves and loads would otherwise pay in a request's
time: compile the Triton kernel for every way it is launched (saves staged through the
staging buffer and written straight to pinned memory, layer-by-layer loads), once with
1 and once with 8 moves per group (Triton specialises on some sizes), and build the
checksum weights for the largest object (`integrity.weights`). The blocks moved are
the null block's, which holds nothing of any request; nothing reaches the store.
"""

from __future__ import annotations

import logging

import torch

from ..layout.plan import ChunkBlocks
from ..layout import integrity

logger = logging.getLogger(__name__)


def warm_up(transfer, layout, caches: dict, chunk_size: int, pool=None) -> None:
    if not transfer.cuda:
        return
    try:
        words = max(torch.Size(g.chunk_shape(chunk_size)).numel() * g.dtype.itemsize // 4
                    for g in layout.groups)
        integrity.weights(words, transfer.device)
        for g in layout.groups:
            for n in (1, min(8, chunk_size // g.block_size)):
                plan = [ChunkBlocks(g.group_id, 0, tuple(range(n)), (0,) * n)]
                obj = torch.empty(g.chunk_shape(chunk_size), dtype=g.dtype, pin_memory=True)
                trailer = torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE,
                                      pin_memory=True)
                for staging in ((pool, None) if pool is not None else (None,)):
                    transfer.save(g, caches[g.group_id], [(obj, trailer, 0)], plan, staging)
                    transfer.fence().synchronize()
                transfer.load_by_layer({g.group_id: (g, caches[g.group_id], [obj], plan)},
                                       [(g.group_id, 0)]).done.synchronize()
        torch.cuda.synchronize()
    except Exception:  # a slower first hit is no reason to refuse to start
        logger.exception("gemma4-kv: kernel warm-up failed")
