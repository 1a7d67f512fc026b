"""Open the store a rank's configuration names: the embedded LMCache store, or the
store on a running `lmcache server`."""

from __future__ import annotations

from dataclasses import dataclass

from ..layout.groups import KVLayout
from .base import ChunkStore
from .embedded import EmbeddedStore, StoreConfig


@dataclass(frozen=True)
class ServerConfig:
    """A running `lmcache server` (engine-driven, shared-memory L1) on this host."""

    url: str
    timeout_s: float = 1.0


class StoreUnavailable(RuntimeError):
    """The configured store cannot be used (the message says why)."""


def open_store(config: StoreConfig | ServerConfig, layout: KVLayout, fingerprint: str,
               chunk_size: int, *, kv_rank: int = 0, cuda: bool = False,
               stats=None) -> ChunkStore:
    """The fingerprint names the rank: each rank keeps objects of its own."""
    if isinstance(config, StoreConfig):
        return EmbeddedStore(layout, fingerprint, chunk_size, config, kv_rank=kv_rank,
                             stats=stats)
    from .server import ServerStore
    from .server_shm import UnsupportedServer
    from .server_wire import ServerUnavailable

    try:
        return ServerStore(layout, fingerprint, chunk_size, url=config.url,
                           timeout_s=config.timeout_s, cuda=cuda, stats=stats)
    except (ServerUnavailable, UnsupportedServer) as e:
        raise StoreUnavailable(str(e)) from None
