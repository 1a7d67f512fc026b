"""Where the lookup sockets live: a private directory per user, one socket per worker
rank named after the engine-core process, and the lock file that keeps a second server
off a live engine's socket.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import re
import stat
import tempfile

_ENGINE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SUN_PATH_MAX = 107  # bytes of a Unix socket path (sun_path is 108 with the NUL)


# -- where the socket lives ---------------------------------------------------------------
def socket_dir() -> str:
    """This user's private directory for lookup sockets, created 0700 if missing.

    The first of `$XDG_RUNTIME_DIR/gemma4-kv`, `$HOME/.cache/gemma4-kv` (each only where
    its parent is ours and not writable by others, so nobody else can have made it) and
    `{tempdir}/gemma4-kv-{uid}` that is ours with mode 0700, or can be made so. A missing
    `~/.cache` is made 0700 where the home directory is ours and not writable by others:
    containers and services often have neither a runtime dir nor `~/.cache`, and tmp is
    shared. An existing directory that others could enter or that is not plainly ours
    is never tightened or used (someone else may have put files in it): the next one is
    taken, so another user who creates `/tmp/gemma4-kv-<uid>` first cannot stop the
    engine while one of the others can be ours."""
    uid = os.getuid()
    problems = []
    for path in _candidates(uid):
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # a umask may have taken owner bits away
        except FileExistsError:
            pass
        except OSError as e:
            problems.append(f"{path}: {e.strerror}")
            continue
        try:
            check_private_dir(path)
            return path
        except RuntimeError as e:
            problems.append(str(e))
    raise RuntimeError("gemma4-kv: no private directory for the lookup sockets: "
                       + "; ".join(problems))


def _candidates(uid: int):
    """Socket directories to try, in order; `~/.cache` is made only once it is reached.
    Relative paths (an empty HOME, say) would name a directory under the cwd: skipped."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and _owned_dir(runtime, uid, 0o022):
        yield os.path.join(runtime, "gemma4-kv")
    home = os.path.expanduser("~")
    if os.path.isabs(home):
        cache = os.path.join(home, ".cache")
        if not os.path.lexists(cache) and _owned_dir(home, uid, 0o022):
            try:
                os.mkdir(cache, 0o700)
                os.chmod(cache, 0o700)
            except OSError:
                pass  # made meanwhile, or a read-only home: the check below decides
        if _owned_dir(cache, uid, 0o022):
            yield os.path.join(cache, "gemma4-kv")
    yield os.path.join(tempfile.gettempdir(), f"gemma4-kv-{uid}")


def _owned_dir(path: str, uid: int, forbidden: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & forbidden


def check_private_dir(path: str) -> None:
    """Raise unless `path` is a real directory (not a symlink), ours, mode 0700."""
    st = os.lstat(path)
    problem = (
        "is a symlink" if stat.S_ISLNK(st.st_mode)
        else "is not a directory" if not stat.S_ISDIR(st.st_mode)
        else f"belongs to uid {st.st_uid}, not {os.getuid()}" if st.st_uid != os.getuid()
        else f"has mode {stat.S_IMODE(st.st_mode):04o}, group/other may use it"
        if st.st_mode & 0o077 else None)
    if problem:
        raise RuntimeError(f"gemma4-kv: refusing lookup socket directory {path}: it {problem}; "
                           "remove it (it is re-created private) or make it ours with mode 0700")


def socket_address(engine_id: str, engine_pid: int, rank: int) -> str:
    """`ipc://` address of a worker rank's lookup socket, unique per engine process
    (two engines given the same engine_id still get different sockets)."""
    if not _ENGINE_ID.fullmatch(engine_id):
        raise ValueError(f"gemma4-kv: engine_id {engine_id!r} cannot name a socket file "
                         "(letters, digits, '.', '_', '-' only)")
    path = os.path.join(socket_dir(), f"{engine_id}-{engine_pid}-r{rank}.sock")
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ValueError(f"gemma4-kv: lookup socket path {path} is longer than "
                         f"{_SUN_PATH_MAX} bytes; use a shorter engine_id or TMPDIR")
    return f"ipc://{path}"


def engine_core_pid(vllm_config) -> int:
    """PID of vLLM's engine-core process (where the scheduler half runs), seen from a
    worker. The uni and external_launcher executors run the worker inside the engine
    core; the mp executor starts each worker as a multiprocessing child (fork or spawn)
    of the engine core. Ray workers may sit on other hosts, out of reach of IPC."""
    pc = vllm_config.parallel_config
    backend = pc.distributed_executor_backend
    if backend is None and pc.world_size_across_dp == 1:
        backend = "uni"  # what ParallelConfig.__post_init__ resolves it to
    if isinstance(backend, type):
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        backend = ("ray" if getattr(backend, "uses_ray", False)
                   else "mp" if issubclass(backend, MultiprocExecutor)
                   else "uni" if issubclass(backend, UniProcExecutor) else backend)
    if backend == "ray":
        raise RuntimeError("gemma4-kv does not support the ray executor: its lookups use "
                           "local IPC sockets, which workers on other hosts cannot reach")
    if backend in ("uni", "external_launcher"):
        return os.getpid()
    if backend == "mp":
        if pc.nnodes_within_dp > 1:
            raise RuntimeError("gemma4-kv does not support one engine spread over several "
                               f"nodes (nnodes_within_dp={pc.nnodes_within_dp}): lookups "
                               "use local IPC sockets")
        parent = multiprocessing.parent_process()
        if parent is None or parent.pid is None:
            raise RuntimeError("gemma4-kv: mp executor, but this worker was not started "
                               "by multiprocessing; cannot tell the engine-core PID")
        return parent.pid
    raise RuntimeError(f"gemma4-kv: cannot tell the engine-core process for "
                       f"distributed_executor_backend {backend!r} (supported: uni, mp, "
                       "external_launcher, or subclasses of their executors)")


def ipc_path(address: str) -> str:
    if not address.startswith("ipc://"):
        raise ValueError(f"gemma4-kv: lookup address {address!r} is not ipc://")
    return address[len("ipc://"):]


def take_lock(lock_path: str, sock_path: str) -> int:
    """fd holding an exclusive flock on `lock_path`, or a clear error if a live server
    holds it. A closing server unlinks the file it locked, so retry until the locked
    file is the one on disk (else two servers could each lock a different file)."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"gemma4-kv: lookup socket {sock_path} is served by another "
                               f"live engine (it holds {lock_path}); not taking it over") from None
        try:
            st = os.stat(lock_path, follow_symlinks=False)
            here = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
