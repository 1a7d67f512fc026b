"""A real `lmcache server` process for tests (the command line the README shows):
free ports (started again on new ones if another process took one first), its own
shared-memory L1, its HTTP status page as the oracle. No `lmcache`
CLI or server dependencies: a skip, a failure in CI (tests/needs.py)."""

from __future__ import annotations

import json
import os
import importlib.util
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from gemma4_kv.stores.server import server_argv
from needs import skip_or_fail

ENV = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false")


def lmcache_bin() -> list[str] | None:
    """How to run the `lmcache` CLI: the venv's script, one on PATH, or its module (an
    install by --target, as on the GPU machine, has no script on PATH)."""
    here = Path(sys.executable).with_name("lmcache")
    exe = str(here) if here.exists() else shutil.which("lmcache")
    if exe is not None:
        return [exe]
    if importlib.util.find_spec("lmcache") is not None:
        return [sys.executable, "-m", "lmcache.cli.main"]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BIND_FAILED = "ddress already in use"
"""What the server logs when a port it was given is taken (ZMQ and uvicorn alike)."""
ATTEMPTS = 5
"""Starts tried with new ports after a collision before giving up."""


class PortTaken(RuntimeError):
    """The server could not bind a port: another process took it after `free_port`."""


class Server:
    """One `lmcache server` process on free ports with its own L1 segment.

    `free_port` only finds ports free *now*; another process may bind one before the
    server does. A server that exits because a port is taken is started again on new
    ports (at most ATTEMPTS times); one that answers is checked to be this process
    (it listens on both ports), never another server that holds the port."""

    def __init__(self, l1_gb: float = 0.25, log_dir: str = "/tmp",
                 l2_adapters: tuple[dict, ...] = (), **argv):
        self.exe = lmcache_bin()
        if self.exe is None:
            skip_or_fail("the lmcache CLI is not installed")
        self.shm = f"g4kvtest{uuid.uuid4().hex[:10]}"
        self.l1_gb, self.log_dir = l1_gb, log_dir
        self.argv = {"l2_adapters": tuple(json.dumps(a) for a in l2_adapters), **argv}
        """More `server_argv` keywords: `--l2-adapter` JSON specs (e.g.
        `TierServer.valkey_spec()`; none by default), `read_ttl_s`, ..."""
        self.port = None
        self._start()

    def _start(self, keep_port: bool = False) -> None:
        """Start a server process; `keep_port` (a restart: clients know the URL) picks
        only a new HTTP port after a collision."""
        for attempt in range(ATTEMPTS):
            if not keep_port or self.port is None:
                self.port = free_port()
                self.url = f"tcp://127.0.0.1:{self.port}"
            self.http = free_port()
            try:
                self._launch()
                return
            except PortTaken as e:
                if keep_port and f":{self.port}" in str(e):
                    raise RuntimeError(f"port {self.port} of the restarted server is "
                                       f"taken:\n{e}") from None
                last = e
        raise RuntimeError(f"lmcache server: ports taken in {ATTEMPTS} attempts:\n{last}")

    def _launch(self) -> None:
        self.log = open(Path(self.log_dir) / f"{self.shm}-{self.port}.log", "a+")
        start = self.log.tell()
        argv = self.exe + server_argv("lmcache", port=self.port, shm_name=self.shm,
                                      l1_gb=self.l1_gb, http_port=self.http,
                                      host="127.0.0.1", **self.argv)[1:]
        self.proc = subprocess.Popen(argv, env=ENV, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while not self._up():
            if self.proc.poll() is not None:
                self.log.seek(start)
                text = self.log.read()
                self.log.close()
                Path(f"/dev/shm/lmcache_l1_pool_{self.shm}").unlink(missing_ok=True)
                if "requires the full lmcache installation" in text:
                    skip_or_fail("`lmcache server` lacks its server dependencies (httpx, "
                                 "uvicorn, blake3) in this environment")
                if BIND_FAILED in text:
                    raise PortTaken("\n".join(line for line in text.splitlines()
                                               if BIND_FAILED in line))
                raise RuntimeError(f"lmcache server exited:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("lmcache server did not come up in 120 s")
            time.sleep(0.3)

    def _up(self) -> bool:
        """It answers on its HTTP port, and the process listening on both ports is ours."""
        if not self._listening():
            return False
        try:
            self.status()
            return True
        except OSError:
            return False

    def _listening(self) -> bool:
        import psutil

        try:
            proc = psutil.Process(self.proc.pid)
            ports = {c.laddr.port for p in [proc, *proc.children(recursive=True)]
                     for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            return False
        return {self.port, self.http} <= ports

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/status", timeout=5) as r:
            return json.load(r)

    def locks(self) -> tuple[int, int, int]:
        """(read-locked objects, write-locked objects, open sessions) on the server."""
        s = self.status()
        l1 = s["storage_manager"]["l1_manager"]
        return l1["read_locked_count"], l1["write_locked_count"], s["active_sessions"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        """Another server process on the same port and segment name."""
        self.stop()
        self._start(keep_port=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        Path(f"/dev/shm/lmcache_l1_pool_{self.shm}").unlink(missing_ok=True)
        self.log.close()
