"""What the scheduler half tells the worker half each step (pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadRequest:
    """Fill tokens [start, hit) of a request from stored chunks 0 .. hit / chunk_size - 1."""

    req_id: str
    start: int
    hit: int
    hashes: list[bytes]
    block_ids: tuple[list[int], ...]


@dataclass
class SaveRequest:
    """Store chunks `first_chunk ..` of a request (their tokens are computed this step):
    chunk `first_chunk + i` has hash `hashes[i]` and is stored for `groups[i]` (every
    full-attention group; sliding groups only where a hit can end)."""

    req_id: str
    first_chunk: int
    hashes: list[bytes]
    groups: list[tuple[int, ...]]
    block_ids: tuple[list[int], ...]
    prefix: list[bytes] = field(default_factory=list)
    """Hashes of chunks 0 .. first_chunk - 1, for stores that key a chunk by its whole
    prefix (`lmcache_server`); empty otherwise."""


@dataclass
class TouchRequest:
    """A finished request's stored chunks (chunk order), to mark as used (head most recent)."""

    hashes: list[bytes]
    groups: list[tuple[int, ...]]


@dataclass
class Gemma4KVMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)
    touches: list[TouchRequest] = field(default_factory=list)
