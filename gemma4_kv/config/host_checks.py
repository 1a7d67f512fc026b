"""Start-up checks against this host: memory for `cpu_gb`, disk for `disk_gb`, a TCP
connect to each network tier. The worker runs them before anything is allocated (parsing
the settings, in `settings.py`, touches nothing: it also runs in the scheduler and the
API server). Errors are the settings' own: one line naming the key and the fix."""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket

from ..stores.lmcache import L2AdapterRejected, l2_adapter_endpoints
from .checks import error, redacted, show
from .settings import GiB, ConnectorSettings, server_endpoint

logger = logging.getLogger(__name__)


def memory_headroom(total: int) -> int:
    """Bytes left to everything else: 5% of the machine's memory, at least 1 GiB. The CPU
    tier is pinned (neither swapped nor reclaimed), and the OS, vLLM's other processes and
    its host-side buffers still need memory after it is taken."""
    return max(GiB, total // 20)


def cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this container may still take (cgroup v2 or v1 limit), when it has a limit:
    psutil sees the host's memory, the kernel kills at the cgroup's."""
    for limit_f, usage_f, stat_f, inactive in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "memory/memory.stat", "total_inactive_file")):
        try:
            with open(f"{root}/{limit_f}") as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            with open(f"{root}/{usage_f}") as f:
                used = int(f.read())
            with open(f"{root}/{stat_f}") as f:
                stat = dict(line.split() for line in f if len(line.split()) == 2)
            return int(raw) - used + int(stat.get(inactive, 0))  # page cache is reclaimable
        except (OSError, ValueError):
            continue
    return None


def memory_room() -> tuple[int, int]:
    """(available, total) bytes of memory for this process: psutil's view of the machine,
    capped by the container's cgroup limit if there is one."""
    import psutil

    vm = psutil.virtual_memory()
    available, total = vm.available, vm.total
    room = cgroup_room()
    if room is not None and room < available:
        available = max(room, 0)
    return available, total


def check_host_resources(settings: ConnectorSettings, ranks: int = 1) -> None:
    """Fail naming `cpu_gb` / `disk_gb` if the tiers cannot fit on this host, and create
    `disk_path` (mode 0700: stored KV reveals prompts) if it is missing.

    Call it before any rank allocates its store (e.g. every rank, then a TP barrier): the
    whole `cpu_gb` must fit in what is available now, minus `memory_headroom`.
    """
    if not settings.embedded_store:
        return  # the server's tiers live in its own process
    available, total = memory_room()
    need, spare = settings.cpu_gb * GiB, memory_headroom(total)
    if need > available - spare:
        most = max(available - spare, 0) / GiB
        per = f", split over {ranks} tensor-parallel ranks" if ranks > 1 else ""
        raise error('["cpu_gb"]', f"does not fit in this host's memory: {available / GiB:.1f} "
                     f"GiB available of {total / GiB:.1f} GiB, and {spare / GiB:.1f} GiB (5%, "
                     f"at least 1 GiB) stays for the rest", show(settings.cpu_gb),
                     f"set cpu_gb <= {math.floor(most * 10) / 10:g} (it is per engine{per}), "
                     "or free memory")
    if settings.disk_path:
        _check_disk(settings, settings.disk_path)


def _check_disk(settings: ConnectorSettings, path: str) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise error('["disk_path"]', f"cannot be created ({e.strerror})", show(path),
                     "create it yourself or pick a writable directory") from None
    usage = shutil.disk_usage(path)
    want = settings.disk_gb * GiB
    if want > usage.total:
        raise error('["disk_gb"]', f"is larger than the file system of disk_path ({path}: "
                     f"{usage.total / GiB:.1f} GiB in all)", show(settings.disk_gb),
                     f"set disk_gb <= {usage.free / GiB:.0f} (free now) or use a larger disk")
    if want > usage.free:
        # Not an error: the tier's own files from an earlier run sit in `used` too.
        logger.warning("gemma4-kv: disk_gb=%g but only %.1f GiB are free on %s: the disk may "
                       "fill before the tier evicts", settings.disk_gb, usage.free / GiB, path)
    elif not want and usage.free < usage.total // 10:
        logger.warning("gemma4-kv: the disk tier in %s is unbounded (disk_gb 0) and only "
                       "%.1f GiB (%.0f%%) are free: set disk_gb", path, usage.free / GiB,
                       100 * usage.free / usage.total)


def check_tiers_reachable(settings: ConnectorSettings, timeout_s: float = 1.0) -> None:
    """A TCP connect to each network tier in `l2_adapters` (valkey): an unreachable
    tier fails start-up naming it, instead of every lookup waiting on it later; likewise
    `lmcache_server` (its version and shared memory are checked when the store opens)."""
    if settings.lmcache_server:
        host, port = server_endpoint(settings.lmcache_server)
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except (OSError, OverflowError) as e:
            raise error('["lmcache_server"]', f"cannot be reached within {timeout_s:g} s "
                         f"({getattr(e, 'strerror', None) or e})",
                         show(settings.lmcache_server), "start it (the README's `lmcache "
                         "server` command line) or correct the URL") from None
    for i, spec in enumerate(settings.l2_adapters):
        try:
            endpoints, any_one = l2_adapter_endpoints(spec)
        except L2AdapterRejected as bad:
            raise error(f'["l2_adapters"][{i}]', bad.problem, show(redacted(spec)),
                         bad.fix) from None
        failures: list[str] = []
        for host, port in endpoints:
            try:
                socket.create_connection((host, port), timeout=timeout_s).close()
                if any_one:
                    failures = []
                    break
            except (OSError, OverflowError, TypeError) as e:
                failures.append(f"{host}:{port} ({getattr(e, 'strerror', None) or e})")
        if failures:
            raise error(f'["l2_adapters"][{i}]', f'(type "{spec["type"]}") cannot be reached '
                         f"within {timeout_s:g} s: " + ", ".join(failures),
                         show(redacted(spec)), "start that server, correct host/port, or "
                         "remove this adapter")
