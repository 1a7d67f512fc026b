"""Open the store a rank's configuration names: the embedded LMCache store, or the
store on a running `lmcache server`."""

from __future__ import annotations

from ..layout.groups import KVLayout
from .base import ChunkStore
from .config import ServerConfig, StoreConfig
from .embedded import EmbeddedStore
from .stats import Stats


class StoreUnavailable(RuntimeError):
    """The configured store cannot be used (the message says why)."""


def open_store(config: StoreConfig | ServerConfig, layout: KVLayout, fingerprint: str,
               chunk_size: int, *, kv_rank: int = 0, device=None,
               stats: Stats | None = None) -> ChunkStore:
    """The fingerprint names the rank: each rank keeps objects of its own. `device` is
    where the rank's KV lives (a server store verifies objects there)."""
    import torch

    device = torch.device(device or "cpu")
    if isinstance(config, StoreConfig):
        return EmbeddedStore(layout, fingerprint, chunk_size, config, kv_rank=kv_rank,
                             stats=stats)
    from .server import ServerStore, ServerUnavailable, UnsupportedServer

    try:
        return ServerStore(layout, fingerprint, chunk_size, url=config.url,
                           timeout_s=config.timeout_s, cuda=device.type == "cuda",
                           stats=stats, retention_interval=config.retention_interval,
                           read_ttl_s=config.read_ttl_s, device=device)
    except (ServerUnavailable, UnsupportedServer) as e:
        raise StoreUnavailable(str(e)) from None
