"""The connector's settings: every `kv_connector_extra_config` key, with defaults."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .store import StoreConfig


@dataclass(frozen=True)
class ConnectorSettings:
    chunk_size: int = 256
    """Tokens per stored chunk (LMCache's default); a multiple of every group's block size."""
    cpu_gb: float = 4.0
    """Size of the embedded LMCache CPU tier (pinned when CUDA is present)."""
    disk_path: str | None = None
    """Directory of an optional LMCache local-disk tier (fs_native) behind the CPU tier."""
    disk_gb: float = 0.0
    """Disk tier capacity with LRU eviction; 0 = unbounded."""
    l2_adapters: tuple = ()
    """More LMCache L2 tiers behind the CPU tier: a list of `lmcache server --l2-adapter`
    JSON objects (Redis/Valkey `resp`, `fs_native` on a shared mount, `p2p`, ...)."""
    num_programs: int = 32
    """Programs (SM budget) of the Triton kernel that loads straight from pinned host
    memory beside the forward (H200: 51 GB/s from 32 programs on, the same as with 132);
    saves gather with the full grid for a few ms, then copy by DMA."""
    model_id: str | None = None
    """Overrides the model name in the key fingerprint (default: vLLM's model path)."""
    stats_file: str | None = None
    """If set, the worker appends one JSON line per load and save (tests, demo)."""

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        s = cls(**extra)
        if s.chunk_size <= 0 or s.cpu_gb <= 0 or s.num_programs <= 0:
            raise ValueError(f"chunk_size, cpu_gb and num_programs must be positive: {s}")
        return s

    def store_config(self) -> StoreConfig:
        return StoreConfig(cpu_bytes=int(self.cpu_gb * (1 << 30)), disk_path=self.disk_path,
                           disk_gb=self.disk_gb, l2_adapters=tuple(self.l2_adapters))
