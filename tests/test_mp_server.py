"""The lmcache-server tier against a real `lmcache server` process (engine-driven, SHM L1).

Clients run in separate OS processes; the server's own status page is the oracle for
locks and sessions left behind.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from gemma4_kv.keys import chunk_hashes, fingerprint
from gemma4_kv.layout import AttentionKind, KVGroup, KVLayout
from gemma4_kv.tiers.mp_server import MPServerTier, ServerUnavailable, server_argv
from paged import bits, random_bits

CHUNK = 256  # the server's default chunk size; our objects hold as many tokens
LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 512, 16, 2, 16, 16, torch.bfloat16, ("a", "b")),
    KVGroup(1, AttentionKind.SLIDING, 1024, 32, 1, 64, 64, torch.bfloat16, ("c",)),
    KVGroup(2, AttentionKind.FULL, None, 32, 1, 32, 32, torch.float16, ("d", "e", "f")),
))
FP = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK)
ENV = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false")


def _lmcache_bin() -> str | None:
    here = Path(sys.executable).with_name("lmcache")
    return str(here) if here.exists() else shutil.which("lmcache")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `lmcache server` process on free ports with its own L1 segment."""

    def __init__(self, port: int | None = None, shm: str | None = None):
        exe = _lmcache_bin()
        if exe is None:
            pytest.skip("the lmcache CLI is not installed")
        self.port, self.http = port or _free_port(), _free_port()
        self.shm = shm or f"g4kvtest{uuid.uuid4().hex[:10]}"
        self.url = f"tcp://localhost:{self.port}"
        self.log = open(f"/tmp/{self.shm}-{self.port}.log", "w+")
        argv = server_argv(exe, port=self.port, shm_name=self.shm, l1_gb=0.25,
                           http_port=self.http)
        self.proc = subprocess.Popen(argv, env=ENV, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self._up():
            if self.proc.poll() is not None:
                self.log.seek(0)
                text = self.log.read()
                if "requires the full lmcache installation" in text:
                    pytest.skip("`lmcache server` lacks its server dependencies (httpx, "
                                "uvicorn, blake3) in this environment")
                raise RuntimeError(f"lmcache server exited:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("lmcache server did not come up in 120 s")
            time.sleep(0.5)

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
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        Path(f"/dev/shm/lmcache_l1_pool_{self.shm}").unlink(missing_ok=True)
        self.log.close()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def tokens_of(seed: int, chunks: int) -> list[int]:
    return torch.randint(0, 1 << 20, (chunks * CHUNK,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def payload(key: tuple[int, int], like: torch.Tensor, seed: int) -> torch.Tensor:
    """The bytes of object (chunk, group): a function of the seed, so another process can
    regenerate what was written."""
    gen = torch.Generator().manual_seed(seed * 1000 + key[0] * 10 + key[1])
    return random_bits(like.shape, like.dtype, generator=gen)


# -- client processes -------------------------------------------------------------------
def _writer(url: str, seed: int, chunks: int, out) -> None:
    tier = MPServerTier(url, LAYOUT, FP, CHUNK)
    write = tier.reserve(chunk_hashes(tokens_of(seed, chunks), CHUNK))
    for key, view in write.objects.items():
        view.copy_(payload(key, view, seed))
    out.put((sorted(write.objects), tier.commit(write)))
    tier.close()


def _reader(url: str, seed: int, chunks: int, wanted, out) -> None:
    tier = MPServerTier(url, LAYOUT, FP, CHUNK)
    hashes = chunk_hashes(tokens_of(seed, chunks), CHUNK)
    present = tier.present(hashes)
    pin = tier.lock(hashes, wanted)
    views = tier.read(pin) if pin else None
    exact = views is not None and all(
        torch.equal(bits(v), bits(payload(key, v, seed))) for key, v in zip(wanted, views))
    if pin:
        tier.release(pin)
    out.put(({g: sorted(c) for g, c in present.items()}, pin is not None, exact))
    tier.close()


def run_client(target, *args):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, out))
    p.start()
    try:
        result = out.get(timeout=120)
    finally:
        p.join(timeout=60)
    assert p.exitcode == 0
    return result


# -- tests ------------------------------------------------------------------------------
def test_one_process_stores_another_reads_bit_exact(server):
    written, ok = run_client(_writer, server.url, 1, 3)
    assert ok and written == [(c, g) for c in range(3) for g in range(3)]
    # A window-aware hit of 3 chunks: the sliding groups need only their last chunks.
    wanted = [(2, 0), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)]
    present, pinned, exact = run_client(_reader, server.url, 1, 3, wanted)
    assert present == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    assert pinned and exact
    assert server.locks() == (0, 0, 0)  # every lock and session given back


def test_pins_only_what_the_hit_needs(server):
    run_client(_writer, server.url, 2, 4)
    tier = MPServerTier(server.url, LAYOUT, FP, CHUNK)
    try:
        hashes = chunk_hashes(tokens_of(2, 4), CHUNK)
        wanted = [(3, 0), (2, 1), (3, 1)] + [(c, 2) for c in range(4)]
        pin = tier.lock(hashes, wanted)
        assert pin is not None
        assert server.locks()[0] == len(wanted)  # the lookup locked 12, kept 7
        assert tier.read(pin) is not None
        tier.release(pin)
        assert server.locks() == (0, 0, 0)
        assert tier.lock(hashes + chunk_hashes(tokens_of(9, 1), CHUNK), [(4, 2)]) is None
        assert server.locks() == (0, 0, 0)
    finally:
        tier.close()


def test_two_pins_of_one_range_share_the_servers_read(server):
    """The server keys pending reads by (instance, key) without the request id; two pins
    of the same range must not lose each other's locks."""
    run_client(_writer, server.url, 3, 2)
    tier = MPServerTier(server.url, LAYOUT, FP, CHUNK)
    try:
        hashes = chunk_hashes(tokens_of(3, 2), CHUNK)
        wanted = [(0, 2), (1, 2)]
        a, b = tier.lock(hashes, wanted), tier.lock(hashes, wanted)
        va, vb = tier.read(a), tier.read(b)
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(va, vb))
        assert server.locks()[0] == 2  # objects read-locked (twice each)
        tier.release(a)
        assert server.locks()[0] == 2  # b still holds them
        tier.release(b)
        assert server.locks() == (0, 0, 0)
    finally:
        tier.close()


def test_presence_is_a_prefix_on_lmcache_056(server):
    """0.5.6 counts leading chunks for every registration: chunks stored after a gap are
    not reported (a window-aware hit past an evicted early chunk is impossible)."""
    tier = MPServerTier(server.url, LAYOUT, FP, CHUNK)
    try:
        hashes = chunk_hashes(tokens_of(4, 3), CHUNK)
        write = tier.reserve(hashes, first=1)  # chunks 1 and 2 only
        assert sorted(write.objects) == [(c, g) for c in (1, 2) for g in range(3)]
        for key, view in write.objects.items():
            view.copy_(payload(key, view, 4))
        assert tier.commit(write)
        assert tier.present(hashes) == {0: set(), 1: set(), 2: set()}
        assert tier.lock(hashes, [(2, 0)]) is None
        assert server.locks() == (0, 0, 0)
    finally:
        tier.close()


def test_other_fingerprint_never_hits(server):
    run_client(_writer, server.url, 5, 1)
    other = MPServerTier(server.url, LAYOUT, fingerprint(LAYOUT, model="other",
                                                         chunk_size=CHUNK), CHUNK)
    try:
        assert other.present(chunk_hashes(tokens_of(5, 1), CHUNK)) == {0: set(), 1: set(),
                                                                        2: set()}
    finally:
        other.close()


def test_killed_server_fails_fast_and_a_restarted_one_is_used_again():
    s = Server()
    tier = None
    try:
        tier = MPServerTier(s.url, LAYOUT, FP, CHUNK, timeout_s=1.0, ping_interval_s=0.5)
        hashes = chunk_hashes(tokens_of(7, 2), CHUNK)
        s.kill()
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable):
            tier.present(hashes)
        with pytest.raises(ServerUnavailable):
            tier.reserve(hashes)
        assert time.monotonic() - t0 < 10  # bounded: one timeout, then refused at once
        assert not tier.healthy
        s.stop()
        s = Server(port=s.port, shm=s.shm)  # new process, new L1 segment, no registrations
        deadline = time.monotonic() + 30
        while not tier.healthy and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tier.healthy
        write = tier.reserve(hashes)
        for key, view in write.objects.items():
            view.copy_(payload(key, view, 7))
        assert tier.commit(write)
        written, _, exact = run_client(_reader, s.url, 7, 2, [(1, 0), (1, 1), (0, 2), (1, 2)])
        assert written == {0: [0, 1], 1: [0, 1], 2: [0, 1]} and exact
    finally:
        if tier is not None:
            tier.close()
        s.stop()


def test_zz_unfilled_reservations_are_never_committed_by_close(server):
    """0.5.6 commits an instance's open reservations when it is unregistered; `close`
    must not unregister while one is open. (Runs last: the reservation stays write-locked
    on the module's server until its TTL.)"""
    tier = MPServerTier(server.url, LAYOUT, FP, CHUNK)
    hashes = chunk_hashes(tokens_of(6, 1), CHUNK)
    assert tier.reserve(hashes).objects
    tier.close()
    probe = MPServerTier(server.url, LAYOUT, FP, CHUNK)
    try:
        assert probe.present(hashes) == {0: set(), 1: set(), 2: set()}
    finally:
        probe.close()


@pytest.mark.skipif(not os.environ.get("G4KV_LMCACHE_OTHER"),
                    reason="set G4KV_LMCACHE_OTHER to an unpacked LMCache wheel of another "
                           "wire format (0.5.7rc2) to run")
def test_a_server_of_another_wire_format_is_refused_at_connect():
    """0.5.7 renamed IPCCacheServerKey.token_ids to token_bytes: registration and pings
    still work, every keyed call goes unanswered. The client must say so at once."""
    from gemma4_kv.tiers.mp_server import UnsupportedServer

    port, http, shm = _free_port(), _free_port(), f"g4kvother{uuid.uuid4().hex[:8]}"
    env = dict(ENV, PYTHONPATH=os.environ["G4KV_LMCACHE_OTHER"])
    argv = server_argv(sys.executable, port=port, shm_name=shm, l1_gb=0.25, http_port=http)
    argv[1:2] = ["-m", "lmcache.cli.main", "server"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/status", timeout=5)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.5)
        with pytest.raises(UnsupportedServer, match="versions must match"):
            MPServerTier(f"tcp://localhost:{port}", LAYOUT, FP, CHUNK, timeout_s=2.0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        Path(f"/dev/shm/lmcache_l1_pool_{shm}").unlink(missing_ok=True)
