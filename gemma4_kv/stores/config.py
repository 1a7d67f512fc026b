"""What configures a store, and what the store it names can do: read by the settings and
the scheduler half, which hold no store (the scheduler runs in another process than the
stores), so this module imports neither torch nor LMCache.

`factory.open_store` opens the store a config names; each store's `capabilities` is its
config's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import StoreCapabilities

CODEC_SERDE = "gemma4_kv"
"""The serde type `lmcache_codec` registers with LMCache (named here, where neither
torch nor LMCache is imported)."""


@dataclass(frozen=True)
class StoreConfig:
    """Sizes and tiers of one rank's embedded store (LMCache in this process)."""

    cpu_bytes: int = 4 << 30
    disk_path: str | None = None
    disk_gb: float = 0.0
    l2_adapters: tuple[dict, ...] = ()
    """More LMCache L2 tiers, as `lmcache server --l2-adapter` JSON objects (checked by
    `lmcache.check_l2_adapter`)."""
    verify_checksums: bool = True
    codec: str = "none"
    """How objects are stored in every L2 tier (`codec.MODES`, or "none")."""
    codec_frame: float = 0.9
    """Fraction of an object's size its stored frame takes (`codec.frame_size`)."""
    codec_bits: int = 4
    """Bits per coded KV change under `cachegen` (`cachegen.py`)."""
    codec_device: str = "auto"
    """Where `cachegen` codes: "auto" (the engine's GPU where it has one) or "cpu"; the
    same bytes either way, so not part of the key."""

    def adapter_specs(self, frame_bytes: int = 0) -> list[dict]:
        """Every L2 tier: the disk tier first, then `l2_adapters`; each with the
        codec's serde unless `codec` is "none", every frame `frame_bytes` long (the
        store's largest object's, `lmcache_codec.frame_bytes`: LMCache 0.5.6 sizes the
        buffers of a batch of objects, which mixes groups, by its first object's
        layout)."""
        specs = [dict(s) for s in self.l2_adapters]
        if self.disk_path:
            disk = {"type": "fs_native", "base_path": self.disk_path, "num_workers": 4,
                    "max_capacity_gb": self.disk_gb}
            if self.disk_gb:
                disk["eviction"] = {"eviction_policy": "LRU"}
            specs.insert(0, disk)
        if self.codec != "none":
            for spec in specs:
                spec["serde"] = {"type": CODEC_SERDE, "mode": self.codec,
                                 "frame": self.codec_frame, "bits": self.codec_bits,
                                 "device": self.codec_device, "frame_bytes": frame_bytes}
        return specs

    def codec_identity(self) -> str:
        """What the key fingerprint names of the codec ("" for none, or no L2 tier)."""
        from .codec import identity

        return identity(self.codec, self.codec_frame, self.codec_bits) \
            if self.adapter_specs() else ""

    @property
    def capabilities(self) -> StoreCapabilities:
        return StoreCapabilities(slow_tier=bool(self.adapter_specs()), ranks_hit_ends=True,
                                 stores_generated=True,
                                 verifies_always=False)


@dataclass(frozen=True)
class ServerConfig:
    """A running `lmcache server` (engine-driven, shared-memory L1) on this host."""

    url: str
    timeout_s: float = 1.0
    """Seconds one call may wait for the server's answer before it counts as down."""
    retention_interval: int = 0
    """Tokens between stored sliding-window chunks (the scheduler's; 0: every chunk)."""
    read_ttl_s: float = 300.0
    """The server's read-lock lifetime (`--l1-read-ttl-seconds`): past it the server may
    evict a read-locked object and reuse its slot, so a pin is trusted only within it."""

    TIMEOUT_MAX_S = 1.5
    """Most `timeout_s`: below the scheduler's 2 s wait for a worker rank's lookup answer
    (`connector.scheduler.RANK_TIMEOUT_S`), so a lookup that finds the server gone still
    answers in time."""

    CAPABILITIES = StoreCapabilities(
        # Its LRU evicts: the class of an end means nothing to it. A hit ending among
        # generated tokens would need a window chain per generated chunk.
        slow_tier=True, ranks_hit_ends=False, stores_generated=False,
        # LMCache 0.5.6 makes a dead client's unfinished writes visible, and other
        # clients may write anything under our names.
        verifies_always=True)

    @property
    def capabilities(self) -> StoreCapabilities:
        return self.CAPABILITIES
