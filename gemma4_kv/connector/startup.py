"""The line each worker rank logs once at start-up (`ConnectorWorker.register_kv_caches`),
in vLLM's own log: where the KV goes (tiers, sizes, URLs), the fingerprint's short id,
what the role lets through, and what is handed on to LMCache."""

from __future__ import annotations

import logging

from ..config.checks import redacted
from ..config.settings import ConnectorSettings

startup_log = logging.getLogger("vllm.gemma4_kv.connector.worker")
"""A `vllm.` logger: vLLM's handler prints it in the worker's log, as it does its own
lines (a plain `gemma4_kv` logger has no handler in vLLM's processes)."""


def startup_line(settings: ConnectorSettings, layout, fingerprint: str, rank: int, world: int,
                 role: str, enabled: bool = True) -> str:
    """One line per rank at start-up: where the KV goes (tiers, sizes, URLs), the
    fingerprint's short id, the role, and what is handed on to LMCache."""
    if settings.lmcache_server:
        tiers = f"lmcache server {settings.lmcache_server} (its L1 and L2 tiers)"
    else:
        parts = [f"cpu {settings.cpu_gb / world:.2f} GiB"]
        if settings.disk_path:
            size = f"{settings.disk_gb / world:.2f} GiB" if settings.disk_gb else "unbounded"
            parts.append(f"disk {settings.disk_path} {size}")
        parts += [f"l2 {_where(spec)}" for spec in settings.l2_adapters]
        tiers = " > ".join(parts)
    kinds = sorted({g.kind.value for g in layout.groups})
    short = fingerprint.rsplit("-", 1)[-1][:12]
    does = {"kv_producer": "stores only", "kv_consumer": "loads only"}.get(role,
                                                                          "loads and stores")
    if not enabled:
        does = "stores and loads nothing (KV cannot be keyed safely)"
    return (f"gemma4-kv: rank {rank}/{world}: tiers {tiers}; fingerprint {short}; "
            f"{len(layout.groups)} KV groups ({'/'.join(kinds)}), chunk "
            f"{settings.chunk_size} tokens; {role}: {does}; to LMCache: "
            f"{len(settings.l2_adapters)} l2_adapters, log level {settings.lmcache_log_level}")


def _where(spec: dict) -> str:
    """An `l2_adapters` entry as `type address` (secrets never shown)."""
    spec = redacted(spec)
    for key in ("url", "startup_nodes", "base_path", "host", "address", "path"):
        if spec.get(key):
            where = spec[key]
            if key == "host" and spec.get("port"):
                where = f"{where}:{spec['port']}"
            return f"{spec.get('type', '?')} {where}"
    return str(spec.get("type", "?"))
