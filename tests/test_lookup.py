"""Lookup channel between the scheduler and the worker ranks, over real ZMQ IPC sockets
and, where it matters, real other processes (a foreign sender, another uid, a killed
server)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

import lookup_peer
from gemma4_kv.lookup import messages
from gemma4_kv.lookup.channel import LookupClient, LookupServer
from gemma4_kv.lookup.sockets import engine_core_pid, socket_address, socket_dir

PEER = str(Path(__file__).with_name("lookup_peer.py"))
LOOKUP = messages.Lookup("req-1", [b"\x01" * 32], 0, 256)
RID = (1 << 40).to_bytes(8, "big")
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture
def rundir(monkeypatch):
    """A fresh XDG_RUNTIME_DIR (short, so socket paths fit; 0755 so another uid can
    reach our directory and be stopped by it rather than by this one)."""
    base = tempfile.mkdtemp(prefix="g4kv-", dir="/tmp")
    os.chmod(base, 0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def wait_until(cond, what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def peer_send(address: str, frames: list[bytes], kind: str = "dealer", wait_ms: int = 1000,
              **popen) -> str:
    out = subprocess.run([sys.executable, PEER, "send", address, kind, str(wait_ms),
                          *(f.hex() for f in frames)], capture_output=True, text=True,
                         timeout=60, **popen)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def start_peer_server(address: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, PEER, "serve", address], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def pinned(n: int) -> messages.LookupReply:
    return messages.LookupReply(pinned=n, candidates=[n])


# -- requests and replies -----------------------------------------------------------------
def test_every_rank_answers_and_ranks_work_in_parallel(rundir):
    rank1_asked = threading.Event()

    def handler(rank):
        def handle(msg):
            if rank == 1:
                rank1_asked.set()
            # rank 0 answers only once rank 1 has its request: both were in flight at once
            elif not rank1_asked.wait(10):
                raise RuntimeError("rank 1 was not asked while rank 0 was busy")
            return pinned(msg.limit + rank)
        return handle

    addresses = [socket_address("par", os.getpid(), r) for r in range(2)]
    servers = [LookupServer(a, handler(r)) for r, a in enumerate(addresses)]
    client = LookupClient(addresses)
    try:
        assert client.ask_all(LOOKUP) == [pinned(256), pinned(257)]
    finally:
        client.close()
        for s in servers:
            s.close()


def test_a_failing_or_silent_rank_is_a_miss_and_the_client_recovers(rundir):
    mode = {"how": "ok"}

    def handle(msg):
        if mode["how"] == "raise":
            raise RuntimeError("store closed")
        if mode["how"] == "wrong type":
            return 7
        return messages.Done(ok=True)

    good = LookupServer(socket_address("f", os.getpid(), 0), handle)
    silent = socket_address("f", os.getpid(), 1)  # nobody serves this rank yet
    client = LookupClient([good.address, silent], timeout_ms=300)
    late = None
    try:
        assert client.ask_all(messages.Release("r")) is None
        late = LookupServer(silent, handle)
        client.timeout_ms = 20_000
        assert client.ask_all(messages.Release("r")) == [messages.Done(ok=True)] * 2
        for how in ("raise", "wrong type"):
            mode["how"] = how
            assert client.ask_all(messages.Release("r")) is None
        mode["how"] = "ok"
        assert client.ask_all(messages.Reset()) == [messages.Done(ok=True)] * 2
    finally:
        client.close()
        good.close()
        if late is not None:
            late.close()


def test_two_unanswered_lookups_pause_lookups_for_10_s_and_one_pauses_nothing(
        rundir, monkeypatch):
    """README: "A worker rank that does not answer within 2 s is that request's miss;
    two in a row pause lookups for 10 s." The scheduler's own RankLookups with the
    scheduler's constants, against a rank nobody serves; the pause is read on a clock
    the test moves (the client's 2 s wait stays real)."""
    from gemma4_kv.connector import scheduler
    from gemma4_kv.connector.metrics import Gemma4KVStats
    from gemma4_kv.lookup import ranks

    # The README's numbers, by hand.
    assert (scheduler.RANK_TIMEOUT_S, scheduler.RANKS_DOWN_AFTER,
            scheduler.RANK_BACKOFF_S) == (2.0, 2, 10.0)
    now = [1000.0]
    monkeypatch.setattr(ranks, "time", SimpleNamespace(monotonic=lambda: now[0]))
    stats = Gemma4KVStats()
    rl = ranks.RankLookups([socket_address("p", os.getpid(), 0)], stats,
                           timeout_s=scheduler.RANK_TIMEOUT_S,
                           down_after=scheduler.RANKS_DOWN_AFTER,
                           backoff_s=scheduler.RANK_BACKOFF_S)
    try:
        assert rl.client.timeout_ms == 2000
        assert rl.lookup(LOOKUP) == (0, 0, None)  # a miss
        assert not rl.paused()  # one unanswered lookup pauses nothing
        assert rl.client.waited_out == 1
        assert rl.lookup(LOOKUP) == (0, 0, None)
        assert rl.client.waited_out == 2
        assert rl.paused()
        now[0] += 9.99
        assert rl.paused()
        now[0] += 0.02
        assert not rl.paused()
        assert stats.data["lookups_unanswered"] == 2
    finally:
        rl.client.close()


def test_telling_a_silent_rank_does_not_wait_and_it_is_handled_in_order(rundir):
    holding, busy, seen = threading.Event(), threading.Event(), []

    def handle(msg):
        seen.append(type(msg).__name__)
        if len(seen) == 1:
            holding.set()
            busy.wait(30)  # the first message holds the rank up
        return messages.Done(ok=True)

    server = LookupServer(socket_address("tell", os.getpid(), 0), handle)
    client = LookupClient([server.address], timeout_ms=200)
    try:
        assert client.ask_all(messages.Release("a")) is None  # the rank is silent
        assert holding.wait(30) and client.waited_out == 1
        client.tell_all(messages.Release("a"))
        # tell_all is back while the rank still holds the first message: it did not wait
        # for its reply (the rank has not handled it yet) nor out the timeout (a count).
        assert seen == ["Release"] and client.waited_out == 1
        busy.set()
        client.timeout_ms = 20_000
        assert client.ask_all(messages.Reset()) == [messages.Done(ok=True)]
        assert seen == ["Release", "Release", "Reset"] and client.waited_out == 1
    finally:
        client.close()
        server.close()


def test_a_late_reply_is_never_the_answer_to_the_next_request(rundir):
    release_first = threading.Event()
    calls = []

    def handle(msg):
        calls.append(msg.limit)
        if len(calls) == 1:
            release_first.wait(30)  # slow once: the client gives up on this request
        return pinned(msg.limit)

    server = LookupServer(socket_address("late", os.getpid(), 0), handle)
    client = LookupClient([server.address], timeout_ms=200)
    try:
        assert client.ask_all(messages.Lookup("a", [], 0, 111)) is None
        release_first.set()  # its reply (111) now arrives before the next one's
        client.timeout_ms = 20_000
        assert client.ask_all(messages.Lookup("b", [], 0, 222)) == [pinned(222)]
        assert calls == [111, 222]
    finally:
        client.close()
        server.close()


# -- what a foreign sender can do ---------------------------------------------------------
class RunsShell:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_pickle_used_below_runs_code_when_unpickled(tmp_path):
    """Control: the payload the next test sends is live."""
    marker = tmp_path / "ran"
    payload = pickle.dumps(RunsShell(marker))
    subprocess.run([sys.executable, "-c", "import pickle, sys; "
                    "pickle.loads(sys.stdin.buffer.read())"], input=payload, check=True)
    assert marker.exists()


FOREIGN = {
    "pickle on a REQ socket": ("req", lambda p, v: [p]),
    "pickle alone": ("dealer", lambda p, v: [p]),
    "pickle after a request id": ("dealer", lambda p, v: [RID, p]),
    "msgpack, not our type": ("dealer", lambda p, v: [RID, msgspec.msgpack.encode(
        {"type": "Exec", "cmd": "touch"})]),
    "one of our replies, not a request": ("dealer", lambda p, v: [RID, msgspec.msgpack.encode(
        messages.Done(ok=True))]),
    "a Lookup with a wrong field type": ("dealer", lambda p, v: [RID, msgspec.msgpack.encode(
        {"type": "Lookup", "req_id": 1, "hashes": [], "start": 0, "limit": 1})]),
    "garbage bytes": ("dealer", lambda p, v: [RID, b"\xc1\xff\x00garbage"]),
    "empty frame": ("dealer", lambda p, v: [b""]),
    "a valid request with an extra frame": ("dealer", lambda p, v: [RID, v, b"x"]),
    "a valid request with a short id": ("dealer", lambda p, v: [b"id", v]),
    "a valid request without an id": ("dealer", lambda p, v: [v]),
}


@pytest.mark.parametrize("case", FOREIGN)
def test_a_foreign_message_runs_nothing_gets_no_answer_and_serving_goes_on(
        rundir, tmp_path, case, caplog):
    marker = tmp_path / "ran"
    seen = []
    server = LookupServer(socket_address("x", os.getpid(), 0),
                          lambda msg: seen.append(msg) or messages.Done(ok=True))
    client = LookupClient([server.address], timeout_ms=20_000)
    kind, frames = FOREIGN[case]
    try:
        sent = frames(pickle.dumps(RunsShell(marker)), msgspec.msgpack.encode(LOOKUP))
        assert peer_send(server.address, sent, kind) == "silent"
        wait_until(lambda: server.dropped == 1, "the server dropped the message")
        assert not marker.exists() and seen == []
        assert "not a lookup request" in caplog.text
        assert client.ask_all(LOOKUP) == [messages.Done(ok=True)]
        assert seen == [LOOKUP]
        # and the same peer, speaking our protocol, is answered: it was the message
        assert peer_send(server.address, [RID, msgspec.msgpack.encode(LOOKUP)]) == "answered"
    finally:
        client.close()
        server.close()


def test_dropped_messages_are_all_counted_and_warned_of_once_per_interval(
        rundir, caplog, monkeypatch):
    from gemma4_kv.lookup import channel

    # An interval no run outlasts (set before the server reads it): the five drops fall
    # within it however slowly the peers start (the default 10 s made this depend on
    # the machine's speed).
    monkeypatch.setattr(channel, "WARN_EVERY_S", 1e9)
    server = LookupServer(socket_address("w", os.getpid(), 0),
                          lambda msg: messages.Done(ok=True))
    warned = lambda: [r.getMessage() for r in caplog.records  # noqa: E731
                      if "not a lookup request" in r.getMessage()]
    try:
        for n in range(1, 6):
            assert peer_send(server.address, [RID, b"\xc1garbage"], wait_ms=100) == "silent"
            wait_until(lambda: server.dropped == n, f"message {n} dropped")
        assert len(warned()) == 1  # within WARN_EVERY_S of the first
        monkeypatch.setattr(channel, "WARN_EVERY_S", 0.0)
        assert peer_send(server.address, [RID, b"\xc1garbage"], wait_ms=100) == "silent"
        wait_until(lambda: server.dropped == 6, "message 6 dropped")
        assert len(warned()) == 2 and "4 more since the last warning" in warned()[1]
    finally:
        server.close()


def test_a_message_over_the_size_cap_is_refused_and_serving_goes_on(rundir):
    import zmq

    from gemma4_kv.lookup.channel import MAX_MESSAGE_BYTES

    seen = []
    server = LookupServer(socket_address("m", os.getpid(), 0),
                          lambda msg: seen.append(msg) or messages.Done(ok=True))
    client = LookupClient([server.address], timeout_ms=20_000)
    ctx = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    try:
        assert server._sock.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
        assert [s.getsockopt(zmq.MAXMSGSIZE) for s in client._socks] == [MAX_MESSAGE_BYTES]
        big.connect(server.address)
        big.send_multipart([RID, b"\x00" * (MAX_MESSAGE_BYTES + 1)])
        assert client.ask_all(LOOKUP) == [messages.Done(ok=True)]
        assert seen == [LOOKUP]
    finally:
        big.close()
        ctx.term()
        client.close()
        server.close()


# -- who can reach the socket -------------------------------------------------------------
def mode_of(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_directory_and_socket_are_private_even_under_umask_0(rundir):
    old = os.umask(0)
    try:
        server = LookupServer(socket_address("u", os.getpid(), 0),
                              lambda msg: messages.Done(ok=True))
    finally:
        os.umask(old)
    try:
        assert os.path.dirname(server.path) == os.path.join(rundir, "gemma4-kv")
        assert mode_of(os.path.dirname(server.path)) == 0o700
        assert mode_of(server.path) == 0o600
        assert mode_of(server.path + ".lock") == 0o600
    finally:
        server.close()
    assert not os.path.exists(server.path) and not os.path.exists(server.path + ".lock")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_another_uid_gets_no_answer(rundir):
    address = socket_address("o", 4244, 0)
    path = address[len("ipc://"):]
    # The server runs in another process, so this one has no ZMQ threads when it forks.
    server = start_peer_server(address)
    frames = [RID, msgspec.msgpack.encode(LOOKUP)]

    def as_nobody() -> str:
        here, there = multiprocessing.get_context("fork").Pipe()
        child = multiprocessing.get_context("fork").Process(
            target=lookup_peer.send_as, args=(there, 65534, address, frames))
        child.start()
        child.join(60)
        assert child.exitcode == 0 and here.poll()
        return here.recv()

    folder = os.path.dirname(path)
    try:
        assert as_nobody() == "silent"
        os.chmod(path, 0o777)  # the directory alone keeps it out
        assert as_nobody() == "silent"
        os.chmod(path, 0o600)
        os.chmod(folder, 0o755)  # the socket's mode alone keeps it out
        assert as_nobody() == "silent"
        os.chmod(path, 0o777)  # control: with both open, that uid is answered
        assert as_nobody() == "answered"
    finally:
        os.chmod(folder, 0o700)
        server.kill()
        server.wait()


def test_socket_dir_prefers_runtime_dir_then_home_cache_then_a_per_uid_temp_dir(
        rundir, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert socket_dir() == os.path.join(rundir, "gemma4-kv")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert socket_dir() == str(home / ".cache" / "gemma4-kv")
    os.chmod(home / ".cache", 0o777)  # a parent others may write is not used
    assert socket_dir() == str(tmp_path / f"gemma4-kv-{os.getuid()}")
    os.chmod(home / ".cache", 0o755)
    monkeypatch.setenv("HOME", "/nonexistent/home")
    assert socket_dir() == str(tmp_path / f"gemma4-kv-{os.getuid()}")
    os.chmod(rundir, 0o777)  # neither is a runtime dir others may write
    monkeypatch.setenv("XDG_RUNTIME_DIR", rundir)
    assert socket_dir() == str(tmp_path / f"gemma4-kv-{os.getuid()}")
    os.chmod(rundir, 0o755)
    for made in ("gemma4-kv", f"gemma4-kv-{os.getuid()}"):
        assert stat.S_IMODE(os.stat(os.path.join(rundir if made == "gemma4-kv" else tmp_path,
                                                 made)).st_mode) == 0o700


@pytest.mark.parametrize("home_mode", [0o700, 0o755])
def test_a_home_without_cache_gets_a_private_one_when_tmp_is_taken(
        tmp_path, monkeypatch, home_mode):
    """Containers and services often have no XDG_RUNTIME_DIR and no ~/.cache: another
    user's /tmp/gemma4-kv-<uid> (here one of the wrong mode, which any user can make)
    must not stop the engine while our own home can hold a private directory."""
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, home_mode)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    taken = tmp_path / f"gemma4-kv-{os.getuid()}"
    taken.mkdir()
    os.chmod(taken, 0o755)
    assert socket_dir() == str(home / ".cache" / "gemma4-kv")
    for made in (home / ".cache", home / ".cache" / "gemma4-kv"):
        st = os.lstat(made)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.getuid()
    assert stat.S_IMODE(os.stat(taken).st_mode) == 0o755  # not tightened


def test_no_cache_dir_is_made_in_a_home_others_may_write(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    os.chmod(home, 0o777)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert socket_dir() == str(tmp_path / f"gemma4-kv-{os.getuid()}")
    assert not (home / ".cache").exists()


def make_unsafe(path: str, bad: str, elsewhere: Path) -> None:
    if bad == "symlink":
        os.mkdir(elsewhere, 0o700)
        os.symlink(elsewhere, path)
    elif bad == "file":
        Path(path).write_text("")
    else:
        os.mkdir(path)
        os.chmod(path, 0o750 if bad == "group or other" else 0o700)
        if bad == "other owner":
            if os.geteuid() != 0:
                pytest.skip("needs root to give a directory to another uid")
            os.chown(path, 65534, 65534)


UNSAFE = ["symlink", "file", "group or other", "other owner"]
REASON = {"symlink": "is a symlink", "file": "is not a directory",
          "group or other": "has mode 0750", "other owner": "belongs to uid 65534"}


@pytest.mark.parametrize("bad", UNSAFE)
def test_an_unsafe_socket_dir_is_skipped_untouched_for_the_next_private_one(
        rundir, tmp_path, monkeypatch, bad):
    """What someone else may have made (another user pre-creating /tmp/gemma4-kv-<uid>
    to stop our engine, say) is neither tightened nor used, and stops nothing."""
    monkeypatch.setenv("HOME", "/nonexistent/home")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    taken = os.path.join(rundir, "gemma4-kv")
    make_unsafe(taken, bad, tmp_path / "elsewhere")
    before = os.lstat(taken)
    fallback = str(tmp_path / f"gemma4-kv-{os.getuid()}")
    assert socket_dir() == fallback
    assert socket_address("e", 1, 0) == f"ipc://{fallback}/e-1-r0.sock"
    after = os.lstat(taken)
    assert (after.st_mode, after.st_uid, after.st_ino) == (
        before.st_mode, before.st_uid, before.st_ino)


@pytest.mark.parametrize("bad", UNSAFE)
def test_when_every_socket_dir_is_unsafe_the_error_names_each_and_the_fix(
        rundir, tmp_path, monkeypatch, bad):
    monkeypatch.setenv("HOME", "/nonexistent/home")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    make_unsafe(os.path.join(rundir, "gemma4-kv"), bad, tmp_path / "elsewhere")
    per_uid = str(tmp_path / f"gemma4-kv-{os.getuid()}")
    os.mkdir(per_uid, 0o755)
    os.chmod(per_uid, 0o755)  # as another user's pre-made one would be
    with pytest.raises(RuntimeError) as err:
        socket_address("e", 1, 0)
    text = str(err.value)
    assert REASON[bad] in text and f"{rundir}/gemma4-kv" in text
    assert f"{per_uid}: it has mode 0755" in text and "remove it" in text
    assert stat.S_IMODE(os.stat(per_uid).st_mode) == 0o755  # not tightened


def test_engine_ids_that_cannot_name_a_file_are_refused(rundir):
    for bad in ("../../etc/x", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(ValueError):
            socket_address(bad, 1, 0)
    assert socket_address("3f2a-uuid_dp1", 42, 3).endswith("/gemma4-kv/3f2a-uuid_dp1-42-r3.sock")


# -- one server per socket ----------------------------------------------------------------
def test_a_second_server_cannot_take_a_live_engines_socket(rundir):
    address = socket_address("dup", 4242, 0)
    path = address[len("ipc://"):]
    first = start_peer_server(address)  # another engine process
    client = LookupClient([address], timeout_ms=20_000)
    try:
        with pytest.raises(RuntimeError, match=f"{path} is served by another live engine"):
            LookupServer(address, lambda msg: messages.Done(ok=False))
        assert client.ask_all(LOOKUP) == [messages.Done(ok=True)]  # still the first one
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
        assert not os.path.exists(path) and not os.path.exists(path + ".lock")
        with LookupServer(address, lambda msg: messages.Done(ok=False)) as second:
            assert client.ask_all(LOOKUP) == [messages.Done(ok=False)]
            second.close()  # idempotent
        assert not os.path.exists(path) and not os.path.exists(path + ".lock")
    finally:
        client.close()
        first.kill()
        first.wait()


def test_a_dead_engines_socket_is_replaced(rundir):
    address = socket_address("dead", 4243, 0)
    path = address[len("ipc://"):]
    first = start_peer_server(address)
    first.kill()  # no clean-up: the files stay, the lock goes with the process
    first.wait()
    assert os.path.exists(path) and os.path.exists(path + ".lock")
    with LookupServer(address, lambda msg: messages.Done(ok=True)) as server:
        client = LookupClient([server.address], timeout_ms=20_000)
        try:
            assert client.ask_all(LOOKUP) == [messages.Done(ok=True)]
        finally:
            client.close()


# -- the engine-core PID seen from a worker -----------------------------------------------
def test_engine_core_pid_in_process_executors(monkeypatch):
    from vllm.config import ParallelConfig

    # Building an external_launcher ParallelConfig sets VLLM_ENABLE_V1_MULTIPROCESSING=0
    # in os.environ: undone after this test (monkeypatch), or every later engine this
    # pytest process starts would run in-process (tests/conftest.py fails a test that
    # leaves it changed).
    monkeypatch.setenv(MP_ENV, os.environ.get(MP_ENV, "1"))

    def pid(**kw):
        return engine_core_pid(SimpleNamespace(parallel_config=ParallelConfig(**kw)))

    # vLLM resolves None to "uni" for one process: the worker is the engine core
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert pid() == pid(distributed_executor_backend="uni") == os.getpid()
    assert pid(distributed_executor_backend="external_launcher") == os.getpid()
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    assert pid(distributed_executor_backend=UniProcExecutor) == os.getpid()
    # and to "mp" for two: workers are children of the engine core; this process is not one
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    for kw in ({"tensor_parallel_size": 2}, {"distributed_executor_backend": MultiprocExecutor}):
        with pytest.raises(RuntimeError, match="not started by multiprocessing"):
            pid(**kw)
    ray = SimpleNamespace(parallel_config=SimpleNamespace(
        distributed_executor_backend="ray", world_size=2, world_size_across_dp=2))
    with pytest.raises(RuntimeError, match="ray executor"):
        engine_core_pid(ray)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_engine_core_pid_of_an_mp_worker_is_its_parent(method):
    ctx = multiprocessing.get_context(method)
    here, there = ctx.Pipe()
    child = ctx.Process(target=lookup_peer.report_engine_core_pid, args=(there, "mp"))
    child.start()
    try:
        assert here.poll(60)
        assert here.recv() == os.getpid() != child.pid
    finally:
        child.join(30)
