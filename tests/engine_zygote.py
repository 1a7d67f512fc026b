"""Test engines forked from one process that has already imported torch, vLLM and this
package (CPU test runs): a tiny engine otherwise spends about 8 s of its 18 s of CPU
importing them, and a test run starts some 40 engines on 2 cores.

The zygote is single-threaded (a select loop; SIGCHLD arrives through a pipe), so a fork
copies no lock another thread holds. A child starts a session of its own (killed by its
process group, as a Popen one is), takes its environment, working directory, stdout and
stderr from the request, reseeds `random`, runs the harness's `main` and exits; the
zygote reports its exit status on the request's connection.

A child inherits what the zygote's imports read from the environment, so `Zygote.spawn`
forks only for an environment that differs from the zygote's in variables read later
(`READ_LATER`); any other engine is started as a process of its own (`subprocess.Popen`).

Run as `python -P engine_zygote.py SOCKET` (by `Zygote`)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ("torch", "vllm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
           "gemma4_kv.tools.harness", "gemma4_kv.connector")
"""What the zygote imports (not LMCache: the connector sets LMCACHE_LOG_LEVEL before
LMCache's first import)."""
READ_LATER = {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
              "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOG_STATS_INTERVAL"}
"""Variables that may differ between a forked engine and the zygote: vLLM reads them when
it starts an engine or a worker; so does this package its GEMMA4_KV_* ones (and the
tests theirs), and LMCache, which the zygote does not import, its LMCACHE_* ones."""
SPAWN_AFRESH = "G4KV_SPAWN_AFRESH"
"""Set to 1 in an engine's environment: the engine is started as a process of its own and
never starts the zygote. For engines with modules of their own on their path (a stand-in
package): a zygote started from such an environment would hand them to every engine
forked after, and spawn every other one afresh."""


def _read_later(key: str) -> bool:
    return key in READ_LATER or key.startswith(("GEMMA4_KV_", "G4KV_", "LMCACHE_",
                                                "PYTEST_"))


def _differs(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not _read_later(k)}


# -- the test's side ----------------------------------------------------------------------
class Forked:
    """A forked engine, as much of `subprocess.Popen` as `e2e_common.Harness` uses."""

    def __init__(self, conn: socket.socket, args):
        self._conn, self.args = conn, args
        self._buf = b""
        self.pid = json.loads(self._line(None))["pid"]
        self.returncode = None

    def _line(self, timeout):
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return None
            data = self._conn.recv(4096)
            if not data:  # the zygote is gone: the exit status is unknown
                return json.dumps({"rc": -1})
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def poll(self):
        return self.wait(0, raise_timeout=False)

    def wait(self, timeout=None, raise_timeout=True):
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                if raise_timeout:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                return None
            self.returncode = json.loads(line)["rc"]
            self._conn.close()
        return self.returncode


class Zygote:
    """The zygote process of this test run (started on first use, from the environment of
    the first engine less its `READ_LATER` variables)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        self._env = None
        self._dir = None
        self.forked = self.spawned = 0
        self.why: set[str] = set()  # variables that kept an engine from being forked

    def spawn(self, cmd, env, stdout, stderr):
        """Start the harness command `cmd` ([python, -P, -m, gemma4_kv.tools.harness,
        spec, out]) in `env`: forked where it can be, else as a process of its own."""
        forked = self._fork(cmd, env, stdout, stderr)
        if forked is not None:
            self.forked += 1
            return forked
        self.spawned += 1
        return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr,
                                start_new_session=True)

    def _fork(self, cmd, env, stdout, stderr):
        import torch

        if torch.cuda.is_available():  # no fork after CUDA-aware imports; GPU runs are few
            return None
        if env.get(SPAWN_AFRESH) == "1":
            return None
        if cmd[1:4] != ["-P", "-m", "gemma4_kv.tools.harness"] or not self._up(env):
            return None
        differs = _differs(self._env, env)
        if differs:
            self.why.update(differs)
            return None
        request = {"argv": cmd[4:], "env": env, "cwd": os.getcwd(),
                   "stdout": stdout.name, "stderr": stderr.name}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            return Forked(conn, cmd)
        except OSError:
            conn.close()
            return None

    def _up(self, env) -> bool:
        with self._lock:
            if self._proc is None:
                self._env = {k: v for k, v in env.items() if not _read_later(k)}
                self._dir = tempfile.mkdtemp(prefix="g4kv-zygote-")  # mode 0700
                self._path = os.path.join(self._dir, "sock")
                self._log = open(os.path.join(self._dir, "log"), "wb")
                self._proc = subprocess.Popen(
                    [sys.executable, "-P", os.path.abspath(__file__), self._path],
                    env=self._env, stdout=self._log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 300
            while not os.path.exists(self._path):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
            return self._proc.poll() is None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            if self._dir is not None:
                self._log.close()
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


ZYGOTE = Zygote()


# -- the zygote ---------------------------------------------------------------------------
def _child(req: dict, keep_open: list, fds: tuple) -> None:
    """In the forked child: become the harness of `req`; never returns."""
    rc = 1
    try:
        for s in keep_open:
            s.close()
        signal.set_wakeup_fd(-1)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import random

        random.seed()
        sys.argv = ["gemma4_kv.tools.harness", *req["argv"]]
        from gemma4_kv.tools import harness

        harness.main(req["argv"])  # exits
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the child's stderr
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    parent = os.getppid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # appears once it accepts
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        if listener in ready:
            conn, _ = listener.accept()
            conn.settimeout(10)
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            try:
                req = json.loads(data)
            except ValueError:
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _child(req, [listener, conn, *children.values()], (wake_r, wake_w))
            children[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)})
                                 .encode() + b"\n")
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
