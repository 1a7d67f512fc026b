"""`gemma4-kv server` as a user runs it: a real `lmcache server` child with the flags
the `lmcache_server` tier needs and the ones given after `--`, the URL it prints used
by the connector's own `ServerStore` (a store and a bit-exact read back through it), and
SIGTERM or SIGINT stopping the server with nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path


from needs import require, skip_or_fail

require("lmcache")
psutil = require("psutil")

from lmcache_servers import ENV, free_port  # noqa: E402

START_S = 120.0  # bound on the server coming up (it takes ~10 s on the 2-core machine)
STOP_S = 60.0  # bound on it going away (--stop-timeout 20, then SIGKILL)
PASSED = ["--l1-write-ttl-seconds", "20", "--max-workers", "1"]


class CliServer:
    """`gemma4-kv server` on free ports (others, up to 3 times, if it could not bind)."""

    def __init__(self, tmp: Path):
        for attempt in range(3):
            try:
                return self._start(tmp, attempt)
            except _PortTaken:
                continue
        raise AssertionError("no free ports in 3 tries")

    def _start(self, tmp: Path, attempt: int):
        self.port, self.http = free_port(), free_port()
        self.shm = f"g4kvcli{uuid.uuid4().hex[:10]}"
        self.out_path = tmp / f"{self.shm}-{attempt}.out"
        self.out = open(self.out_path, "wb")
        tests = os.path.dirname(os.path.abspath(__file__))
        env = dict(ENV, PYTHONPATH=os.pathsep.join(
            [str(Path(tests).parent), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gemma4_kv.tools.cli", "server", "--port", str(self.port),
             "--http-port", str(self.http), "--l1-size-gb", "0.25", "--shm-name", self.shm,
             "--stop-timeout", "20", "--", *PASSED],
            env=env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_S
        while "engines:" not in self.text():
            if self.proc.poll() is not None:
                text = self.text()
                if "requires the full lmcache installation" in text:
                    skip_or_fail("`lmcache server` lacks its server dependencies")
                if "address already in use" in text.lower() and attempt < 2:
                    self.out.close()
                    raise _PortTaken()
                raise AssertionError(f"gemma4-kv server exited:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no URL in {START_S} s:\n{self.text()[-3000:]}")
            time.sleep(0.3)
        m = re.search(r"lmcache server \(pid (\d+)\) at (\S+),", self.text())
        self.child, self.url = int(m.group(1)), m.group(2)

    def text(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stop(self, sig) -> tuple[int, bool]:
        """(exit status, whether the L1 segment is still in /dev/shm) after `sig`."""
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout=STOP_S)
            return rc, Path(f"/dev/shm/lmcache_l1_pool_{self.shm}").exists()
        finally:
            self.kill()

    def kill(self) -> None:
        """Whatever is left (a failed test): the command's group and the server's."""
        for pid in (self.proc.pid, getattr(self, "child", None)):
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait(timeout=10)
        self.out.close()
        Path(f"/dev/shm/lmcache_l1_pool_{self.shm}").unlink(missing_ok=True)


class _PortTaken(Exception):
    pass


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_the_printed_url_serves_a_store_and_sigterm_stops_it(tmp_path):
    from model_keys import chunk_hashes
    from test_mp_server import CHUNK, lookup, open_store, put, read_back, tokens_of

    s = CliServer(tmp_path)
    try:
        assert s.url == f"tcp://127.0.0.1:{s.port}"
        assert f'{{"lmcache_server": "{s.url}"}}' in s.text()  # the config to paste
        argv = psutil.Process(s.child).cmdline()
        assert argv[argv.index("server"):][-len(PASSED):] == PASSED  # passed through
        for flag in ("--supported-transfer-mode", "--chunk-size", "--l2-prefetch-policy"):
            assert flag in argv  # what the client needs (server_argv)
        writer = open_store(s.url)
        try:
            put(writer, 1, 3)
        finally:
            writer.close()
        reader = open_store(s.url)
        try:
            present, pinned, exact = read_back(reader, 1, 3)
            # negative control: a prompt never stored
            missed = lookup(reader, chunk_hashes(tokens_of(7, 3), CHUNK), keep=False)
        finally:
            reader.close()
        assert present == {0: [1, 2], 1: [0, 1, 2], 2: [0, 1, 2]} and pinned and exact
        assert not any(missed.values()), missed
    except BaseException:
        s.kill()
        raise
    assert Path(f"/dev/shm/lmcache_l1_pool_{s.shm}").exists()
    assert s.stop(signal.SIGTERM) == (0, False)  # stopped on request, its L1 removed
    assert gone(s.child)


def test_sigint_stops_the_server_and_leaves_no_orphan(tmp_path):
    s = CliServer(tmp_path)
    group = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == s.child]
    assert s.child in group
    t = time.monotonic()
    assert s.stop(signal.SIGINT) == (0, False)
    print(f"stopped in {time.monotonic() - t:.1f} s")
    assert all(gone(pid) for pid in group)
    assert not any(_pgid(p.pid) == s.child and not gone(p.pid) for p in psutil.process_iter())


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_the_readme_shows_the_command_it_runs():
    """The README's long form (its details note) is what `--print-command` prints for
    the README's short form, flag for flag."""
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    note = readme[readme.index("<details><summary>The <code>lmcache server</code>"):]
    start = note.index("```bash\n") + 8
    block = note[start:note.index("\n```", start)]
    shown = shlex.split(" ".join(l.rstrip("\\") for l in block.splitlines()
                                 if not l.strip().startswith("[")))
    printed = subprocess.run(
        [sys.executable, "-m", "gemma4_kv.tools.cli", "server", "--print-command",
         "--l1-size-gb", "64", "--port", "5555"], capture_output=True, text=True,
        timeout=120, check=True).stdout
    argv = shlex.split(printed)
    assert "lmcache" in " ".join(argv[:argv.index("server")])
    assert _flags(shown[shown.index("server"):]) == _flags(argv[argv.index("server"):])


def _flags(argv: list[str]) -> dict:
    """{flag: value or True} of a command line."""
    out, i = {}, 1
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]], i = argv[i + 1], i + 2
        else:
            out[argv[i]], i = True, i + 1
    return out
