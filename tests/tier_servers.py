"""Real Redis/Valkey servers for remote-tier tests: started on loopback, stopped, restarted.

A `TierServer` runs `valkey-server` (or `redis-server`, whichever is installed;
`scripts/install_servers.sh` installs one) on 127.0.0.1 with no persistence, in a
directory of its own, so each test starts from an empty keyspace. `stop` / `kill` /
`pause` and `start` again on the same port play "the server goes away mid-run and
comes back" against clients that were configured with that host and port.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from needs import skip_or_fail

HOST = "127.0.0.1"
SERVERS = ("valkey-server", "redis-server")
CLIENTS = {"valkey-server": "valkey-cli", "redis-server": "redis-cli"}
_LIVE: weakref.WeakSet = weakref.WeakSet()
ATTEMPTS = 5
"""Starts on new ports after a port collision before giving up."""


@atexit.register
def _kill_leftovers() -> None:
    """No server outlives the test process, whatever a test forgot."""
    for server in list(_LIVE):
        server.kill()


def server_binary() -> str | None:
    """The first server program on PATH (valkey preferred), or None."""
    return next((b for b in SERVERS if shutil.which(b)), None)


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ping(port: int, timeout: float = 0.5) -> bool:
    """True when a RESP server on `port` answers PING with PONG (inline command)."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


_MIN_IDLE = ("local m = -1 for _, k in ipairs(redis.call('KEYS', '*')) do "
             "local t = redis.call('OBJECT', 'IDLETIME', k) "
             "if m < 0 or t < m then m = t end end return m")


class TierServer:
    """One server process on a fixed loopback port; start/stop as often as a test needs."""

    def __init__(self, binary: str | None = None, port: int | None = None,
                 workdir: str | os.PathLike | None = None, args: tuple[str, ...] = ()):
        self.binary = binary or server_binary()
        if self.binary is None:
            raise RuntimeError("no valkey-server or redis-server on PATH "
                               "(run scripts/install_servers.sh)")
        self.cli_binary = CLIENTS.get(Path(self.binary).name, "redis-cli")
        self.host = HOST
        self.port = port or free_port()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="tier-server-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = tuple(args)  # more server options, e.g. ("--maxmemory", "4mb")
        self.proc: subprocess.Popen | None = None
        self._port_known = port is not None  # a port the caller gave is never changed

    # -- lifecycle --------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> TierServer:
        """Start on `self.port` and return once it answers PING. A port `free_port`
        chose that another process took before the server bound it: new port, again
        (at most ATTEMPTS times), until a start succeeded once (clients know it then)."""
        if self.running:
            return self
        for _ in range(ATTEMPTS):
            if self._launch(timeout):
                self._port_known = True
                return self
            if self._port_known:
                break
            self.port = free_port()
        raise RuntimeError(f"{self.binary}: port {self.port} taken: {self.log()[-2000:]}")

    def _launch(self, timeout: float) -> bool:
        """Whether the server came up; False if its port was taken."""
        log_path = self.workdir / "server.log"
        start = log_path.stat().st_size if log_path.exists() else 0
        log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--bind", HOST, "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
             "--protected-mode", "no", "--loglevel", "warning", *self.args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        _LIVE.add(self)
        deadline = time.monotonic() + timeout
        while not (self._ours_listening() and ping(self.port)):
            if self.proc.poll() is not None:
                text = self.log()[start:]
                if "ddress already in use" in text:
                    self.proc = None
                    return False
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}: "
                                   f"{text[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"{self.binary} did not answer PING on {self.port}")
            time.sleep(0.02)
        return True

    def _ours_listening(self) -> bool:
        """This process listens on the port (PING alone may reach another server)."""
        import psutil

        try:
            return any(c.laddr.port == self.port and c.status == psutil.CONN_LISTEN
                       for c in psutil.Process(self.proc.pid).net_connections("tcp"))
        except psutil.Error:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM); the keyspace is lost (no persistence)."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """Abrupt death (SIGKILL), as a crashed or OOM-killed server."""
        self._signal(signal.SIGKILL, 10.0)

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections stay open but nothing answers."""
        if self.running:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGCONT)

    def _signal(self, sig: int, timeout: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot exit
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        path = self.workdir / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- inspection -------------------------------------------------------------------
    def cli(self, *args: str) -> str:
        """Run the server's own command-line client against it; its stdout."""
        return subprocess.run([self.cli_binary, "-h", HOST, "-p", str(self.port), *args],
                              check=True, capture_output=True, text=True,
                              timeout=30).stdout

    def keys(self, pattern: str = "*") -> list[str]:
        """Every key name (SCAN, not KEYS), sorted."""
        return sorted(k for k in self.cli("--scan", "--pattern", pattern).splitlines() if k)

    def flush(self) -> None:
        self.cli("FLUSHALL")

    def clients(self) -> int:
        """Clients connected now, the command-line client that asks left out."""
        info = self.cli("INFO", "clients")
        (line,) = [x for x in info.splitlines() if x.startswith("connected_clients:")]
        return int(line.split(":")[1]) - 1

    def min_idle_s(self) -> int:
        """The least idle time of any key, in whole seconds of the server's LRU clock
        (OBJECT IDLETIME reads it without touching the key); -1 without keys."""
        return int(self.cli("EVAL", _MIN_IDLE, "0"))

    # -- LMCache L2 adapter spec ------------------------------------------------------
    def valkey_spec(self, **extra) -> dict:
        """LMCache's valkey-glide adapter (needs the `valkey-glide-sync` package)."""
        return {"type": "valkey", "startup_nodes": f"{self.host}:{self.port}", **extra}

    def __repr__(self) -> str:
        return f"TierServer({Path(self.binary).name}, {self.host}:{self.port})"


def require_server() -> str:
    """The server binary, or skip (outside CI) / fail (CI=true) when none is installed."""
    binary = server_binary()
    if binary is None:
        skip_or_fail("no valkey-server/redis-server: run scripts/install_servers.sh")
    return binary


@pytest.fixture
def tier_server(tmp_path) -> Iterator[TierServer]:
    """A fresh, empty server for one test, stopped afterwards."""
    server = TierServer(require_server(), workdir=tmp_path).start()
    try:
        yield server
    finally:
        server.kill()
