"""Identity of the weights vLLM loads: a hash of the bytes of the files it loads.

A stat signature (size, mtime) is kept by `cp -p`, `rsync -a`, tar and images built with
fixed mtimes, so two checkpoints could share KV. Contents cannot be kept by a rewrite.

- Which files: those vLLM's loader reads for the load format (`loaded_files`, vLLM's
  own selection rules), so trainer state beside a checkpoint (`optimizer.pt`,
  `training_args.bin`) is neither read nor keyed.
- Once per file version and host: digests are cached per (device, inode, ctime, size),
  and the kernel updates ctime on every write, so a file rewritten by any means is
  hashed again and an untouched one is not. The process that hashes holds a file lock
  beside the cache; every other rank and engine of the host waits for it (at most
  `LOCK_WAIT_S`), then reads the cache.
- Trusted only where it is ours: the cache maps a stat stamp to a digest, so whoever
  could write it could make one checkpoint's identity name another's KV, and whoever
  held its lock could stall the engine. Its directory must be ours, mode 0700 and not a
  symlink; the cache and lock files ours, not group/world writable, regular, opened
  without following symlinks. Otherwise, or without an absolute home, the digests are
  computed without the cache (with a warning that names the path and the fix).
- In the background (`start`): from vLLM's first call that carries the config; the
  worker waits for the result only when it makes its fingerprint (`take`).
- Never fatal: a file that cannot be read or keeps changing makes the result name the
  file and the `weights_id` fix; the engine then stores and loads nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time

from .weight_files import FIX, WeightsError, loaded_files

# Under vLLM's logger: vLLM configures only its own, so the progress of a hash shows in
# the engine's log.
logger = logging.getLogger(f"vllm.{__name__}")

CACHE_VERSION = 1
HASH_THREADS = 8
"""Files hashed at once, at most one per CPU this process may use: hashlib releases the
GIL, and sha256 scaled linearly to 8 threads on the H200 host (1.2 GB/s each)."""
LOCK_WAIT_S = 60.0
"""How long a start waits for another process of the host to hash the weights before
it hashes them itself (and leaves the cache to that process). Hashing 60 GB took about
7 s on the H200 host; a lock held longer is stuck or hostile, and a bounded wait costs
CPU, never correctness."""
_LOCK_POLL_S = 0.05
_started_lock = threading.Lock()
_hashing_lock = threading.Lock()
_CACHE_FILE = "weight-digests.json"
_LOCK_FILE = "weight-digests.lock"



def cache_dir() -> tuple[str | None, str | None]:
    """(the digest cache's directory, None), or (None, why there is none): the first
    set of `$GEMMA4_KV_CACHE_DIR`, `$XDG_CACHE_HOME/gemma4-kv`, `~/.cache/gemma4-kv`.
    Never a relative path: with HOME unset and no passwd entry `~` stays `~`, and the
    cache would land under the working directory, where anyone who can write there
    could feed it."""
    fix = "set GEMMA4_KV_CACHE_DIR to an absolute directory of yours (mode 0700)"
    env = os.environ.get("GEMMA4_KV_CACHE_DIR")
    if env:
        return ((env, None) if os.path.isabs(env) else
                (None, f"GEMMA4_KV_CACHE_DIR={env!r} is not an absolute path; {fix}"))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # a relative one is invalid (XDG base directory spec)
        return os.path.join(xdg, "gemma4-kv"), None
    home = os.path.expanduser("~")
    if os.path.isabs(home):
        return os.path.join(home, ".cache", "gemma4-kv"), None
    return None, f"no absolute home directory or XDG_CACHE_HOME; {fix}"


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
        """(signature, None), or (None, why the weights cannot be named). Waits for the
        hash itself; for another process's hash at most `LOCK_WAIT_S`."""
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
    with _locked_cache() as (dir_fd, where, owner):
        cache = _read_cache(dir_fd, where) if dir_fd is not None else {}
        stamps = {}
        for f in files:
            real = os.path.realpath(f)
            stamps[real] = _stamp(real)
        todo = [r for r, stamp in stamps.items()
                if cache.get(r) is None or cache[r][0] != stamp]
        if todo:
            for real, entry in _hash_all(todo, stamps, where if owner else None).items():
                cache[real] = entry
            if owner:  # the lock's holder alone writes the cache
                _write_cache(dir_fd, where, cache)
        return [(os.path.basename(f), cache[os.path.realpath(f)][1]) for f in files]


def _stamp(real: str) -> list[int]:
    try:
        st = os.stat(real)
    except OSError as e:
        raise WeightsError(f"cannot read weight file {real} ({e.strerror}); {FIX}") from None
    return [st.st_dev, st.st_ino, st.st_ctime_ns, st.st_size]


def _hash_all(todo: list[str], stamps: dict, where: str | None) -> dict[str, list]:
    """Hash the files on `HASH_THREADS` threads, logging progress per file; `where`
    the cache directory the digests go to (None: not cached)."""
    total = sum(stamps[r][3] for r in todo)
    threads = min(HASH_THREADS, len(todo), len(os.sched_getaffinity(0)))
    logger.info("gemma4-kv: hashing %d weight file(s), %.1f GB, on %d thread(s) for the "
                "key fingerprint (%s)", len(todo), total / 1e9, threads,
                f"once per file version; cached in {where}" if where else "not cached")
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
    `touch`, `chmod`, new hard link or write), at most three times. Opened without
    blocking and read only if regular: a FIFO named like a shard would stall forever."""
    for _ in range(3):
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with open(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise WeightsError(f"weight file {real} is not a regular file; {FIX}")
                digest = hashlib.file_digest(fh, "sha256").hexdigest()
        except OSError as e:
            raise WeightsError(f"cannot read weight file {real} ({e.strerror}); "
                               f"{FIX}") from None
        now = _stamp(real)
        if now == stamp:
            return [stamp, digest]
        stamp = now
    raise WeightsError(f"weight file {real} kept changing while it was hashed; {FIX}")


# -- the cache and its lock: trusted only where they are ours ---------------------------

def _refusal(st: os.stat_result, kind: str) -> str | None:
    """Why a "directory" or "file" (opened with O_NOFOLLOW, then fstat'ed) cannot be
    trusted, or None: it must be ours; a directory 0700 (nobody else adds, swaps or
    reads entries), a file regular and not group/world writable."""
    uid = os.getuid()
    if kind == "directory":
        wrong_type, forbidden, may = not stat.S_ISDIR(st.st_mode), 0o077, "use"
    else:
        wrong_type, forbidden, may = not stat.S_ISREG(st.st_mode), 0o022, "write"
    return (f"it is not a {'directory' if kind == 'directory' else 'regular file'}"
            if wrong_type
            else f"it belongs to uid {st.st_uid}, not {uid}" if st.st_uid != uid
            else f"it has mode {stat.S_IMODE(st.st_mode):04o}, group/other may {may} it"
            if st.st_mode & forbidden else None)


def _distrust(path: str, problem: str, fix: str) -> None:
    logger.warning("gemma4-kv: not trusting the weight-digest cache's %s: %s; the weights "
                   "are hashed without it (nothing cached) until you %s", path, problem, fix)


def _open_checked(path: str, flags: int, kind: str, dir_fd: int | None = None,
                  missing_ok: bool = False, tighten: bool = False) -> int | None:
    """fd of `path` (with `dir_fd`: its base name in that directory), opened without
    following a symlink or blocking on a FIFO and checked on the fd itself
    (`_refusal`), so nothing can be swapped in between; None, with a warning naming
    the path and the fix, if refused. `tighten`: we just made it, so set mode 0700."""
    fix = (f"remove {path} (it is re-created private) or make it yours with mode 0700"
           if kind == "directory" else f"remove {path} (it is re-created yours)")
    name = path if dir_fd is None else os.path.basename(path)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        if not missing_ok:
            _distrust(path, "it does not exist", f"make {path}")
        return None
    except OSError as e:
        link = e.errno == errno.ELOOP or os.path.islink(path)
        _distrust(path, "it is a symlink" if link else e.strerror or str(e), fix)
        return None
    st = os.fstat(fd)
    if tighten and st.st_uid == os.getuid():
        with contextlib.suppress(OSError):  # a umask may have taken owner bits away
            os.fchmod(fd, 0o700)
            st = os.fstat(fd)
    problem = _refusal(st, kind)
    if problem:
        os.close(fd)
        _distrust(path, problem, fix)
        return None
    return fd


def _open_cache_dir() -> tuple[int, str] | None:
    """(fd, path) of the private cache directory, made 0700 if missing; None, with a
    warning, if there is none or it is not plainly ours (never tightened: someone else
    may have put files in it)."""
    where, why = cache_dir()
    if where is None:
        logger.warning("gemma4-kv: weight digests are not cached: %s", why)
        return None
    made = False
    try:
        os.makedirs(os.path.dirname(where), mode=0o700, exist_ok=True)
        os.mkdir(where, 0o700)
        made = True
    except FileExistsError:
        pass
    except OSError as e:  # a read-only home: each start hashes on its own
        logger.warning("gemma4-kv: weight digests are not cached: cannot make %s (%s); "
                       "set GEMMA4_KV_CACHE_DIR to an absolute directory of yours (mode "
                       "0700)", where, e.strerror)
        return None
    fd = _open_checked(where, os.O_RDONLY | os.O_DIRECTORY, "directory", tighten=made)
    return None if fd is None else (fd, where)


@contextlib.contextmanager
def _locked_cache():
    """(directory fd, its path, whether we hold the host's lock) for one round of
    read, hash, write; (None, None, False) without a usable cache. This process's lock,
    then the host's, a file lock beside the cache, each waited for until one deadline
    `LOCK_WAIT_S` away; past it the round goes on without the lock: it reads the cache,
    hashes what is missing and writes nothing (the lock's holder owns the cache)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    with contextlib.ExitStack() as stack:
        in_process = _hashing_lock.acquire(timeout=LOCK_WAIT_S)
        if in_process:
            stack.callback(_hashing_lock.release)
        opened = _open_cache_dir()
        if opened is None:
            yield None, None, False
            return
        dir_fd, where = opened
        stack.callback(os.close, dir_fd)
        lock_path = os.path.join(where, _LOCK_FILE)
        if not in_process:
            logger.warning("gemma4-kv: another thread of this process has hashed weights "
                           "for over %.0f s: hashing these without the lock %s (nothing "
                           "cached)", LOCK_WAIT_S, lock_path)
            yield dir_fd, where, False
            return
        lock_fd = _open_checked(lock_path, os.O_RDWR | os.O_CREAT, "file", dir_fd)
        if lock_fd is None:
            yield dir_fd, where, False
            return
        stack.callback(os.close, lock_fd)  # closing releases the lock
        yield dir_fd, where, _flock_until(lock_fd, lock_path, deadline)


def _flock_until(fd: int, path: str, deadline: float) -> bool:
    """Take the host's lock, polling without blocking until `deadline`: a process that
    holds it forever (stuck, or not one of ours) delays a start, never stops it."""
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:  # a file system without flock: each start on its own
            logger.warning("gemma4-kv: cannot lock %s (%s): hashing the weights without "
                           "it (nothing cached)", path, e.strerror)
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            logger.warning("gemma4-kv: %s is still locked after %.0f s: hashing the "
                           "weights here without it (nothing cached by this process); if "
                           "no engine of yours is hashing them, end the process that holds "
                           "it (`fuser %s` names it)", path, LOCK_WAIT_S, path)
            return False
        if not waiting:
            waiting = True
            logger.info("gemma4-kv: waiting for another process of this host to hash the "
                        "weights (%s)", path)
        time.sleep(min(_LOCK_POLL_S, left))


def _valid_entry(entry) -> bool:
    """[stamp: 4 ints, sha256 hex digest]: anything else is ignored, never trusted."""
    return (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
            and len(entry[0]) == 4 and all(type(x) is int for x in entry[0])
            and isinstance(entry[1], str) and len(entry[1]) == 64
            and all(c in "0123456789abcdef" for c in entry[1]))


def _read_cache(dir_fd: int, where: str) -> dict:
    """The cached entries, if the cache file passes `_open_checked`; else none."""
    fd = _open_checked(os.path.join(where, _CACHE_FILE), os.O_RDONLY, "file", dir_fd,
                       missing_ok=True)
    if fd is None:
        return {}
    try:
        with os.fdopen(fd) as f:
            data = json.load(f)
        if data.get("version") == CACHE_VERSION and isinstance(data.get("files"), dict):
            return {k: v for k, v in data["files"].items() if _valid_entry(v)}
    except (OSError, ValueError, AttributeError):
        pass
    return {}


def _write_cache(dir_fd: int, where: str, files: dict) -> None:
    """Atomically (a concurrent engine reads the old or the new file, never half), into
    a new file of ours (O_EXCL, 0600) renamed over the old one inside the directory."""
    path = os.path.join(where, _CACHE_FILE)
    tmp = f".weight-digests-{os.getpid()}-{os.urandom(6).hex()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "files": files}, f)
            os.replace(tmp, _CACHE_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
    except OSError as e:  # a full or read-only file system: hashed again at the next start
        logger.warning("gemma4-kv: cannot cache weight digests in %s: %s", path, e)
