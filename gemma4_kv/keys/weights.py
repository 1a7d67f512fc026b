"""Identity of the weights vLLM loads: a hash of the weight files' bytes.

A stat signature (size, mtime) is kept by `cp -p`, `rsync -a`, tar and images built with
fixed mtimes, so two checkpoints could share KV. Contents cannot be kept by a rewrite.
Hashing is paid once per file version: digests are cached per (device, inode, ctime,
size), and the kernel updates ctime on every write, so a file rewritten by any means is
hashed again and an untouched one is not (a restart reads the cache only).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.index.json")
CACHE_VERSION = 1
_lock = threading.Lock()


def cache_path() -> str:
    """Where file digests are cached: `$GEMMA4_KV_CACHE_DIR` or ~/.cache/gemma4-kv."""
    base = os.environ.get("GEMMA4_KV_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "gemma4-kv")
    return os.path.join(base, "weight-digests.json")


def weights_dir(model_config, load_config) -> str | None:
    """The directory vLLM loads the weights from: a local path, or the Hugging Face
    snapshot in vLLM's `download_dir` (its default cache when unset). None if the
    snapshot is not on this machine yet."""
    path = getattr(model_config, "model_weights", "") or model_config.model
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, revision=model_config.revision,
                                 cache_dir=getattr(load_config, "download_dir", None),
                                 local_files_only=True)
    except Exception:  # noqa: BLE001 - not downloaded: vLLM will fetch it
        return None


def weights_signature(model_config, load_config) -> str:
    """"dummy" for vLLM's random weights (seeded with a constant); else the digest of
    the weight files' names and contents (copies of one checkpoint agree, wherever they
    are); "unresolved:..." if the files are not on this machine."""
    if str(getattr(load_config, "load_format", "auto")) == "dummy":
        return "dummy"
    path = weights_dir(model_config, load_config)
    if path is None:
        return f"unresolved:{model_config.model}@{model_config.revision}"
    files = sorted({f for pat in WEIGHT_FILES for f in glob.glob(os.path.join(path, pat))})
    h = hashlib.sha256(b"gemma4-kv:weights:1\n")
    for name, digest in file_digests(files):
        h.update(f"{name}\0{digest}\n".encode())
    return f"content:{len(files)}:{h.hexdigest()}"


def file_digests(files: list[str]) -> list[tuple[str, str]]:
    """(base name, sha256 of the bytes) of each file, from the cache where the file's
    (device, inode, ctime, size) is unchanged."""
    with _lock:
        cache = _read_cache()
        out, changed = [], False
        for f in files:
            real = os.path.realpath(f)
            st = os.stat(real)
            stamp = [st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size]
            entry = cache.get(real)
            if entry is None or entry[0] != stamp:
                t0 = time.monotonic()
                with open(real, "rb") as fh:
                    digest = hashlib.file_digest(fh, "sha256").hexdigest()
                if os.stat(real).st_ctime_ns != st.st_ctime_ns:
                    raise RuntimeError(f"gemma4-kv: weight file {real} changed while it was "
                                       "hashed; start the engine once it is written")
                logger.info("gemma4-kv: hashed weight file %s (%.1f GB) in %.1f s",
                            os.path.basename(real), st.st_size / 1e9, time.monotonic() - t0)
                entry = cache[real] = [stamp, digest]
                changed = True
            out.append((os.path.basename(f), entry[1]))
        if changed:
            _write_cache(cache)
    return out


def _read_cache() -> dict:
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        if data.get("version") == CACHE_VERSION and isinstance(data.get("files"), dict):
            return data["files"]
    except (OSError, ValueError):
        pass
    return {}


def _write_cache(files: dict) -> None:
    """Atomically (a concurrent engine reads the old or the new file, never half)."""
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".weight-digests-")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "files": files}, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: hashed again at the next start
        logger.warning("gemma4-kv: cannot cache weight digests in %s: %s", path, e)
