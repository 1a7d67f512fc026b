"""A real `lmcache server` process for tests (the command line the README shows):
free ports, its own shared-memory L1, its HTTP status page as the oracle. No `lmcache`
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


class Server:
    """One `lmcache server` process on free ports with its own L1 segment."""

    def __init__(self, l1_gb: float = 0.25, log_dir: str = "/tmp",
                 l2_adapters: tuple[dict, ...] = ()):
        self.exe = lmcache_bin()
        if self.exe is None:
            skip_or_fail("the lmcache CLI is not installed")
        self.port = free_port()
        self.shm = f"g4kvtest{uuid.uuid4().hex[:10]}"
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.l1_gb, self.log_dir = l1_gb, log_dir
        self.l2_adapters = tuple(json.dumps(a) for a in l2_adapters)
        """`--l2-adapter` JSON specs (e.g. `TierServer.valkey_spec()`); none by default."""
        self._start()

    def _start(self) -> None:
        self.http = free_port()
        self.log = open(Path(self.log_dir) / f"{self.shm}-{self.port}.log", "a+")
        argv = self.exe + server_argv("lmcache", port=self.port, shm_name=self.shm,
                                      l1_gb=self.l1_gb, http_port=self.http,
                                      host="127.0.0.1", l2_adapters=self.l2_adapters)[1:]
        self.proc = subprocess.Popen(argv, env=ENV, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while not self._up():
            if self.proc.poll() is not None:
                self.log.seek(0)
                text = self.log.read()
                if "requires the full lmcache installation" in text:
                    skip_or_fail("`lmcache server` lacks its server dependencies (httpx, "
                                 "uvicorn, blake3) in this environment")
                raise RuntimeError(f"lmcache server exited:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("lmcache server did not come up in 120 s")
            time.sleep(0.3)

    def _up(self) -> bool:
        try:
            self.status()
            return True
        except OSError:
            return False

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
        self._start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        Path(f"/dev/shm/lmcache_l1_pool_{self.shm}").unlink(missing_ok=True)
        self.log.close()
