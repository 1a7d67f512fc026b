"""Measured rates that outlive an engine: one small JSON file per user and host, so a new
engine's first lookup is judged by what the engines before it measured (`wait.Rates`).

Entries are keyed by a sha256 of what the rate depends on: a tier's throughput by the
tier (its adapter specs or server URL: the hash keeps a password in a spec out of the
file) and the engine's fingerprint; a prefill rate by the fingerprint. The file lives
in the lookup sockets' private directory (`sockets.socket_dir`: ours, 0700) and is
read only if it is a regular file of our uid that group and others cannot write, opened
with O_NOFOLLOW; anything else (another uid's file, a symlink, bad JSON, absurd values)
reads as no entries. Writes replace the file whole (a private temporary file, then
rename): engines that write at once lose one update, never the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
import time

from .sockets import check_private_dir, socket_dir

logger = logging.getLogger(__name__)

MAX_BYTES = 256 << 10
"""A larger file is not ours to parse."""
MAX_ENTRIES = 512
"""Entries kept, the most recently written first."""
LIMITS = {"tier": (1e3, 1e13), "prefill": (1e-9, 60.0)}
"""Plausible values: bytes/s of a tier, seconds per prefilled token."""


def entry_key(kind: str, *parts: str) -> str:
    """The key of a rate of `kind` ("tier" or "prefill") over what it depends on."""
    h = hashlib.sha256(f"gemma4-kv:rate:1:{kind}".encode())
    for p in parts:
        h.update(b"\0" + p.encode())
    return f"{kind}:{h.hexdigest()[:32]}"


ENV = "GEMMA4_KV_RATES_FILE"
"""Another path for the file (its directory must be private too), or `off`: none."""


def default_path() -> str | None:
    """`$GEMMA4_KV_RATES_FILE`, else `rates.json` in this user's private directory; None
    if it is `off` or there is no private directory."""
    chosen = os.environ.get(ENV, "")
    if chosen:
        return None if chosen == "off" else chosen
    try:
        return os.path.join(socket_dir(), "rates.json")
    except (RuntimeError, OSError):
        return None


class RateFile:
    """The rates file at `path` (its directory must be private to us)."""

    def __init__(self, path: str):
        self.path = path

    def read(self) -> dict[str, float]:
        """{key: value} of plausible entries; {} if the file is missing or not trusted."""
        return {k: e["value"] for k, e in self._load().items()}

    def _load(self) -> dict[str, dict]:
        """{key: {"value", "at"}} of plausible entries (see `read`)."""
        try:
            check_private_dir(os.path.dirname(self.path) or ".")
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, RuntimeError):
            return {}
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                    or st.st_mode & 0o022 or st.st_size > MAX_BYTES):
                logger.warning("gemma4-kv: ignoring %s: not a regular file of uid %d that "
                               "only it can write", self.path, os.getuid())
                return {}
            raw = os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw)
            entries = doc["entries"] if doc.get("version") == 1 else {}
        except (ValueError, TypeError, KeyError, AttributeError):
            return {}
        out = {}
        for key, e in entries.items() if isinstance(entries, dict) else ():
            value = e.get("value") if isinstance(e, dict) else None
            at = e.get("at") if isinstance(e, dict) else None
            lo, hi = LIMITS.get(str(key).split(":")[0], (math.inf, 0))
            if isinstance(value, (int, float)) and lo <= value <= hi:
                out[key] = {"value": float(value),
                            "at": float(at) if isinstance(at, (int, float)) else 0.0}
        return out

    def update(self, values: dict[str, float]) -> bool:
        """Merge `values` into the file; whether it was written."""
        try:
            check_private_dir(os.path.dirname(self.path) or ".")
        except (OSError, RuntimeError):
            return False
        now = time.time()
        entries = self._load()
        entries.update({k: {"value": float(v), "at": now} for k, v in values.items()})
        keep = sorted(entries.items(), key=lambda kv: -kv[1]["at"])[:MAX_ENTRIES]
        data = json.dumps({"version": 1, "entries": dict(keep)}).encode()
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            return True
        except OSError as e:
            logger.debug("gemma4-kv: cannot write %s: %s", self.path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
