"""Identity of the weights vLLM loads: a hash of the bytes of the files it loads.

A stat signature (size, mtime) is kept by `cp -p`, `rsync -a`, tar and images built with
fixed mtimes, so two checkpoints could share KV. Contents cannot be kept by a rewrite.

- Which files: those vLLM's loader reads for the load format (`loaded_files`, vLLM's
  own selection rules), so trainer state beside a checkpoint (`optimizer.pt`,
  `training_args.bin`) is neither read nor keyed.
- Once per file version and host: digests are cached per (device, inode, ctime, size),
  and the kernel updates ctime on every write, so a file rewritten by any means is
  hashed again and an untouched one is not. The process that hashes holds a file lock
  beside the cache; every other rank and engine of the host waits for it, then reads
  the cache.
- In the background (`start`): from vLLM's first call that carries the config; the
  worker waits for the result only when it makes its fingerprint (`take`).
- Never fatal: a file that cannot be read or keeps changing makes the result name the
  file and the `weights_id` fix; the engine then stores and loads nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import tempfile
import threading
import time

# Under vLLM's logger: vLLM configures only its own, so the progress of a hash shows in
# the engine's log.
logger = logging.getLogger(f"vllm.{__name__}")

CACHE_VERSION = 1
HASH_THREADS = 8
"""Files hashed at once, at most one per CPU this process may use: hashlib releases the
GIL, and sha256 scaled linearly to 8 threads on the H200 host (1.2 GB/s each)."""
FIX = 'set kv_connector_extra_config["weights_id"] to name the checkpoint'
_DEFAULT_LOADER = ("auto", "hf", "safetensors", "fastsafetensors", "instanttensor",
                   "mistral", "pt", "npcache")
_started_lock = threading.Lock()
_hashing_lock = threading.Lock()


class WeightsError(Exception):
    """The weights cannot be named; the message says which file and the fix."""


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


def loaded_files(model_config, load_config) -> list[str]:
    """The weight files vLLM's loader reads for this model and load format, sorted."""
    fmt = str(getattr(load_config, "load_format", "auto")).lower()
    folder = weights_dir(model_config, load_config)
    if folder is None:
        raise WeightsError(f"the weights of {model_config.model!r} (revision "
                           f"{model_config.revision}) are not on this machine; {FIX}")
    if fmt in _DEFAULT_LOADER:
        fall_back_to_pt, overrides = _model_load_rules(model_config)
        files = _default_loader_files(folder, fmt, fall_back_to_pt, overrides)
    elif fmt == "sharded_state":  # vLLM's ShardedStateLoader: every rank's shards
        files = glob.glob(os.path.join(folder, "*.safetensors"))
    else:
        raise WeightsError(f"load_format {fmt!r}: gemma4-kv cannot tell which files vLLM "
                           f"loads; {FIX}")
    if not files:
        raise WeightsError(f"no weight file that load_format {fmt!r} reads in {folder}; "
                           f"{FIX}")
    return sorted(files)


def _model_load_rules(model_config) -> tuple[bool, list[str] | None]:
    """The model class's say in which files load (`fall_back_to_pt_during_load`,
    `allow_patterns_overrides`, as vLLM's DefaultModelLoader reads them)."""
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    except Exception as e:  # noqa: BLE001 - reported as the reason nothing is cached
        raise WeightsError(f"cannot resolve the model class of {model_config.model!r} "
                           f"({e}); {FIX}") from None
    return (getattr(cls, "fall_back_to_pt_during_load", True),
            getattr(cls, "allow_patterns_overrides", None))


def _default_loader_files(folder: str, load_format: str, fall_back_to_pt: bool,
                          overrides: list[str] | None) -> list[str]:
    """`DefaultModelLoader._prepare_weights` (vLLM 0.32) on a local folder, through
    vLLM's public filters: the first pattern with files wins, safetensors are filtered
    by their index, other formats lose the trainer's files."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME
    from vllm.model_executor.model_loader.weight_utils import (
        filter_duplicate_safetensors_files, filter_files_not_needed_for_inference)
    from vllm.transformers_utils.repo_utils import list_filtered_repo_files

    index_file = SAFE_WEIGHTS_INDEX_NAME
    use_safetensors = False
    if load_format == "auto":
        load_format = ("mistral" if list_filtered_repo_files(
            folder, allow_patterns=["consolidated*.safetensors"]) else "hf")
    if load_format == "hf":
        patterns = ["*.safetensors", "*.bin"]
    elif load_format in ("safetensors", "fastsafetensors", "instanttensor"):
        use_safetensors, patterns = True, ["*.safetensors"]
    elif load_format == "mistral":
        use_safetensors, patterns = True, ["consolidated*.safetensors"]
        index_file = "consolidated.safetensors.index.json"
    elif load_format == "pt":
        patterns = ["*.pt"]
    else:  # npcache
        patterns = ["*.bin"]
    if fall_back_to_pt and not use_safetensors:
        patterns += ["*.pt"]
    if overrides is not None:
        patterns = overrides
    files: list[str] = []
    for pattern in patterns:
        files += glob.glob(os.path.join(folder, pattern))
        if files:
            use_safetensors = use_safetensors or pattern.endswith(".safetensors")
            break
    if not use_safetensors:
        return filter_files_not_needed_for_inference(files)
    if overrides is not None:
        return files
    try:
        return filter_duplicate_safetensors_files(files, folder, index_file)
    except (OSError, ValueError, KeyError) as e:
        raise WeightsError(f"cannot read {os.path.join(folder, index_file)} ({e}); "
                           f"{FIX}") from None


def weights_signature(model_config, load_config) -> str:
    """"dummy" for vLLM's random weights (seeded with a constant); else the digest of
    the loaded weight files' names and contents (copies of one checkpoint agree,
    wherever they are). Raises WeightsError."""
    if str(getattr(load_config, "load_format", "auto")) == "dummy":
        return "dummy"
    files = loaded_files(model_config, load_config)
    h = hashlib.sha256(b"gemma4-kv:weights:1\n")
    for name, digest in file_digests(files):
        h.update(f"{name}\0{digest}\n".encode())
    return f"content:{len(files)}:{h.hexdigest()}"


# -- in the background ---------------------------------------------------------------

class WeightsDigest:
    """`weights_signature`, computed in a thread of its own."""

    def __init__(self, model_config, load_config):
        self._done = threading.Event()
        self._signature: str | None = None
        self._unsafe: str | None = None
        threading.Thread(target=self._run, args=(model_config, load_config),
                         name="gemma4-kv-weights", daemon=True).start()

    def _run(self, model_config, load_config) -> None:
        try:
            self._signature = weights_signature(model_config, load_config)
        except WeightsError as e:
            self._unsafe = str(e)
        except Exception as e:  # noqa: BLE001 - never fatal: the engine only caches nothing
            self._unsafe = f"cannot hash the weights of {model_config.model!r} ({e!r}); {FIX}"
        finally:
            self._done.set()

    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def result(self) -> tuple[str | None, str | None]:
        """(signature, None), or (None, why the weights cannot be named)."""
        self._done.wait()
        return self._signature, self._unsafe


_started: dict[tuple, WeightsDigest] = {}


def _key(model_config, load_config) -> tuple:
    return (model_config.model, getattr(model_config, "model_weights", ""),
            model_config.revision, str(getattr(load_config, "load_format", "auto")),
            getattr(load_config, "download_dir", None))


def start(model_config, load_config) -> WeightsDigest:
    """Start hashing (or join the running digest of the same weights)."""
    key = _key(model_config, load_config)
    with _started_lock:
        digest = _started.get(key)
        if digest is None or not digest.running:  # a finished one may be stale by now
            digest = _started[key] = WeightsDigest(model_config, load_config)
        return digest


def take(model_config, load_config) -> WeightsDigest:
    """The digest the engine's `start` began for these weights (every engine calls
    `start` as its connector is made), or one started now."""
    with _started_lock:
        digest = _started.pop(_key(model_config, load_config), None)
    return digest if digest is not None else WeightsDigest(model_config, load_config)


# -- the digests ------------------------------------------------------------------------

def file_digests(files: list[str]) -> list[tuple[str, str]]:
    """(base name, sha256 of the bytes) of each file, from the cache where the file's
    (device, inode, ctime, size) is unchanged. Raises WeightsError."""
    with _lock_hashing():
        cache = _read_cache()
        stamps = {}
        for f in files:
            real = os.path.realpath(f)
            stamps[real] = _stamp(real)
        todo = [r for r, stamp in stamps.items()
                if cache.get(r) is None or cache[r][0] != stamp]
        if todo:
            for real, entry in _hash_all(todo, stamps).items():
                cache[real] = entry
            _write_cache(cache)
        return [(os.path.basename(f), cache[os.path.realpath(f)][1]) for f in files]


def _stamp(real: str) -> list[int]:
    try:
        st = os.stat(real)
    except OSError as e:
        raise WeightsError(f"cannot read weight file {real} ({e.strerror}); {FIX}") from None
    return [st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size]


def _hash_all(todo: list[str], stamps: dict) -> dict[str, list]:
    """Hash the files on `HASH_THREADS` threads, logging progress per file."""
    total = sum(stamps[r][3] for r in todo)
    threads = min(HASH_THREADS, len(todo), len(os.sched_getaffinity(0)))
    logger.info("gemma4-kv: hashing %d weight file(s), %.1f GB, on %d thread(s) for the "
                "key fingerprint (once per file version; cached in %s)", len(todo),
                total / 1e9, threads, cache_path())
    t0, done, out = time.monotonic(), 0, {}
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        jobs = {pool.submit(_hash_one, r, stamps[r]): r for r in todo}
        try:
            for job in concurrent.futures.as_completed(jobs):
                real = jobs[job]
                out[real] = job.result()
                done += out[real][0][3]
                logger.info("gemma4-kv: hashed %s: %d/%d files, %.1f/%.1f GB, %.1f s",
                            os.path.basename(real), len(out), len(todo), done / 1e9,
                            total / 1e9, time.monotonic() - t0)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    return out


def _hash_one(real: str, stamp: list[int]) -> list:
    """[stamp, sha256]: read again while the file's stamp moves under the read (a
    `touch`, `chmod`, new hard link or write), at most three times."""
    for _ in range(3):
        try:
            with open(real, "rb") as fh:
                digest = hashlib.file_digest(fh, "sha256").hexdigest()
        except OSError as e:
            raise WeightsError(f"cannot read weight file {real} ({e.strerror}); "
                               f"{FIX}") from None
        now = _stamp(real)
        if now == stamp:
            return [stamp, digest]
        stamp = now
    raise WeightsError(f"weight file {real} kept changing while it was hashed; {FIX}")


@contextlib.contextmanager
def _lock_hashing():
    """This process's lock, then the host's: a file lock beside the cache that every
    process hashing weights takes (without a writable cache directory, none)."""
    with _hashing_lock:
        path = os.path.join(os.path.dirname(cache_path()), "weight-digests.lock")
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # a read-only home: each process hashes on its own
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("gemma4-kv: waiting for another process of this host to hash "
                            "the weights (%s)", path)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock



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
