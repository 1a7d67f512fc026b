"""The wire protocol of a running `lmcache server` (LMCache 0.5.6, engine-driven mode,
shared-memory L1), as gemma4-kv uses it: chunk objects per KV cache group.

0.5.6's engine-driven protocol (`lmcache/v1/multiprocess/modules/engine_driven_transfer.py`)
takes one object layout per registration and forms keys itself from token ids, so:

- each KV cache group registers as an instance of its own, under the model name
  `<namespace>.g<group>`; its objects are the group's KV_2LTD bytes followed by the
  integrity trailer (`integrity.py`): the registration asks for a few token slots more
  than a chunk (`object_slots`), and the client reads the bytes as (KV, trailer);
- our 32-byte chunk hashes travel as the "tokens" of their chunk (8 big-endian uint32
  words, zero padded to the server's chunk size; `--chunk-size 8` sends no padding).
  The server's rolling blake3 over them depends on our hash chain only, so a key
  names one exact prefix; every call sends the hashes from chunk 0;
- the client copies the bytes itself, into the server's L1 mapped from /dev/shm.

A lookup locks, per group, the leading run of chunks the server holds (0.5.6 applies
the full-attention rule to every registration); `keep` holds the locks a hit needs and
frees the rest, `read` maps the held objects. A call with no answer within `timeout_s`
raises `ServerUnavailable` and marks the server down (0.5.6 sends no reply when a
handler raises, so a dead server and a refused call look alike); calls then fail at
once until the heartbeat gets answers again and registers anew.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from . import integrity
from ..layout.groups import KVGroup, KVLayout

logger = logging.getLogger(__name__)

HASH_BYTES = 32
"""Length of gemma4-kv's chunk hashes (sha256): 8 uint32 "tokens"."""
SEAL_BYTES = 8 * integrity.SEAL_SHAPE[0]


class ServerUnavailable(ConnectionError):
    """The server did not answer in time: dead, restarting, or it refused the call."""


class UnsupportedServer(RuntimeError):
    """The server cannot serve this client (no shared-memory L1, another host, another
    LMCache wire format, ...)."""


def server_argv(lmcache: str, *, port: int, shm_name: str, l1_gb: float, http_port: int,
                host: str = "localhost", chunk_size: int = 8, write_ttl_s: int = 30,
                workers: int = 2, l2_adapters: Sequence[str] = ()) -> list[str]:
    """Command line of a server this client can use (the README shows the same).

    The write TTL must stay below the reap timeout (120 s): 0.5.6 commits a dead client's
    unfinished reservations when it reaps the client (`_release_entry` -> `finish_write`),
    unless they expired first. `--l2-prefetch-policy retain` keeps objects brought up from
    L2 in L1 after their first read.
    """
    argv = [lmcache, "server", "--supported-transfer-mode", "engine_driven",
            "--shm-name", shm_name, "--no-l1-use-lazy", "--l1-size-gb", str(l1_gb),
            "--chunk-size", str(chunk_size), "--eviction-policy", "LRU",
            "--host", host, "--port", str(port), "--http-port", str(http_port),
            "--l1-write-ttl-seconds", str(write_ttl_s), "--max-workers", str(workers),
            "--l2-prefetch-policy", "retain", "--disable-observability"]
    for spec in l2_adapters:
        argv += ["--l2-adapter", spec]
    return argv


def object_slots(group: KVGroup, chunk_size: int) -> int:
    """Token slots registered per object: the chunk, plus enough for the trailer."""
    row = 2 * len(group.layers) * group.num_kv_heads * group.head_size * group.dtype.itemsize
    return chunk_size + -(-SEAL_BYTES // row)


def cuda_host_register(pool: torch.Tensor, what: str = "the server's L1") -> None:
    """Page-lock a mapping of the server's L1 and make it known to CUDA: our Triton
    loads and direct saves read and write host memory through UVA (pinned memory), and
    torch then sees its views as pinned. Seen on an H200 (torch 2.11, 2026-12-01): a
    registered /dev/shm mapping reported pinned, written by the gather kernel and read
    by the layer-wise loads bit for bit (tests/test_mp_server_cuda.py). The connector
    on a GPU with a server has NOT run yet."""
    rc = torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), 0)
    if int(rc) != 0:
        raise UnsupportedServer(f"cudaHostRegister of {what} ({pool.numel()} bytes) failed "
                                f"({rc}): raise the locked-memory limit (ulimit -l)")


def _runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted indices as half-open runs [a, b)."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [(a, b) for a, b in out]


@dataclass
class _Space:
    """One namespace's registrations: a model name and an instance id per group."""

    namespace: str
    names: dict[int, str]
    ids: dict[int, int]
    open_writes: int = 0


@dataclass
class Lookup:
    """A lookup in flight: per group, a server session whose leading run gets locked."""

    space: _Space
    tokens: tuple[int, ...]
    n: int
    rids: dict[int, str]
    acks: dict[int, object]
    epoch: int
    polls: dict[int, object] = field(default_factory=dict)
    found: dict[int, int] = field(default_factory=dict)
    """Group id -> leading chunks held (and read-locked), once answered."""
    started: float = field(default_factory=time.monotonic)
    asked: float = field(default_factory=time.monotonic)
    """When the calls now unanswered were sent."""

    @property
    def done(self) -> bool:
        return len(self.found) == len(self.rids)


@dataclass
class _Prepared:
    """A retrieve prepared on the server for one (group, range); shared by pins of it
    (the server keys pending reads by instance and key, not by request id)."""

    objects: list[tuple[torch.Tensor, torch.Tensor]]
    users: int = 1


@dataclass
class Pin:
    """Read locks a lookup holds on the server: what `read` may map, until `release`."""

    space: _Space
    tokens: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    """(chunk index, group id) in the caller's order."""
    sessions: dict[int, str]
    runs: dict[int, list[tuple[int, int]]]
    epoch: int
    read_runs: set[tuple[int, int, int]] = field(default_factory=set)
    spent: set[tuple[int, int, int]] = field(default_factory=set)
    """Runs whose locks the server already gave up (a failed retrieve)."""


@dataclass
class Write:
    """Objects reserved in the server's L1: fill, then commit (or leave to expire)."""

    space: _Space
    tokens: tuple[int, ...]
    request_id: str
    runs: list[tuple[int, int, int]]
    """(group, a, b) ranges with reserved slots (those to commit)."""
    objects: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(chunk index, group id) -> (KV view, trailer view) of its slot in the server's L1."""
    epoch: int


class MPServerTier:
    """KV_2LTD objects + trailers per (chunk, group) in a running LMCache MP server."""

    def __init__(self, url: str, layout: KVLayout, namespace: str, chunk_size: int, *,
                 timeout_s: float = 1.0, ping_interval_s: float = 20.0,
                 prefault: bool = True, cuda_register: bool = False):
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.url, self.layout, self.chunk_size = url, layout, chunk_size
        self.timeout_s = timeout_s
        self._prefault, self._cuda_register = prefault, cuda_register
        self._client = RequestClientFactory.create(url)
        self._healthy = True
        self._state = threading.RLock()
        self._groups = {g.group_id: g for g in layout.groups}
        self._slots = {gid: object_slots(g, chunk_size) for gid, g in self._groups.items()}
        self._kv_bytes = {gid: 2 * len(g.layers) * chunk_size * g.num_kv_heads * g.head_size
                          * g.dtype.itemsize for gid, g in self._groups.items()}
        self._prepared: dict[tuple, _Prepared] = {}
        self._maps: list[tuple[mmap.mmap, torch.Tensor]] = []  # old ones kept: views may live
        self._pool: torch.Tensor | None = None
        self._pool_ino: int | None = None
        self.pool_size = 0
        self.epoch = 0
        """Server processes seen (a new L1 segment): a lock, read or reservation of an
        earlier one is gone with it, and is never handed back to its successor (which
        would not answer calls naming instances it does not know)."""
        self._space = self._new_space(namespace)
        try:
            if not self._call(self._client.ping(None), "ping"):
                raise ServerUnavailable(f"{url}: ping refused")
            self.server_chunk = int(self._call(self._client.get_chunk_size(),
                                               "get_chunk_size"))
            if self.server_chunk * 4 < HASH_BYTES:
                raise UnsupportedServer(f"server chunk size {self.server_chunk} holds no "
                                        f"{HASH_BYTES}-byte hash: start it with --chunk-size 8")
            self._register(self._space)
            self._probe_wire()
        except Exception:
            self._client.close()
            raise
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(ping_interval_s,),
                                           name="gemma4kv-mp-ping", daemon=True)
        self._heartbeat.start()

    # -- connection -------------------------------------------------------------------
    def _call(self, future, what: str, *, probing: bool = False):
        """The answer of one RPC within the timeout, or ServerUnavailable. Gives up at
        once when another thread has found the server down (unless `probing`)."""
        deadline = time.monotonic() + self.timeout_s
        while not future.wait(0.02):
            if not self._healthy and not probing:
                raise ServerUnavailable(f"{self.url} is not answering")
            if time.monotonic() > deadline:
                if self._healthy:
                    logger.warning("gemma4-kv: %s gave no answer to %s within %g s",
                                   self.url, what, self.timeout_s)
                self._healthy = False
                raise ServerUnavailable(f"{self.url}: no answer to {what} within "
                                        f"{self.timeout_s} s")
        return future.result(0)

    def _check(self) -> None:
        if not self._healthy:
            raise ServerUnavailable(f"{self.url} is not answering (waiting for a ping)")

    def _new_space(self, namespace: str) -> _Space:
        names = {gid: f"{namespace}.g{gid}" for gid in self._groups}
        if any("@" in n or "/" in n for n in names.values()):
            raise ValueError("LMCache model names must not contain '@' or '/'")
        base = int.from_bytes(os.urandom(5), "big") << 8  # ids are global to the server
        return _Space(namespace, names, {gid: base + gid for gid in self._groups})

    def _register(self, space: _Space, probing: bool = False) -> None:
        """Register every group of `space` (idempotent on the server), map its L1."""
        from lmcache.v1.multiprocess.custom_types import RegisterEngineDrivenContextPayload

        futures = []
        for gid, g in self._groups.items():
            futures.append(self._client.register_kv_cache_engine_driven_context(
                RegisterEngineDrivenContextPayload(
                    instance_id=space.ids[gid], model_name=space.names[gid],
                    world_size=1, block_size=g.block_size, num_layers=len(g.layers),
                    hidden_dim_size=g.num_kv_heads * g.head_size,
                    dtype_str=str(g.dtype).removeprefix("torch."), use_mla=False,
                    num_physical_slots=self._slots[gid])))
        pools = {(r.shm_name, r.pool_size) for r in
                 (self._call(f, "register", probing=probing) for f in futures)}
        (name, size), = pools
        if not name or size <= 0:
            raise UnsupportedServer(
                f"{self.url} has no shared-memory L1: start it with --supported-transfer-mode "
                "engine_driven --shm-name NAME --no-l1-use-lazy and a /dev/shm larger than L1")
        self._map(name, size)
        for iid in space.ids.values():  # ping-proven: reaped after 120 s of silence, not 3600
            self._call(self._client.ping(iid), "ping", probing=probing)

    def _probe_wire(self, probing: bool = False) -> None:
        """A keyed call that does nothing (an empty range): a server of another wire
        format (0.5.7 sends `token_bytes`) cannot decode the key and never answers,
        while registration and pings still work."""
        space = self._space
        g = next(iter(space.names))
        try:
            self._call(self._client.free_lookup_locks(
                self._key(space, g, self._tokens([bytes(HASH_BYTES)]), 0, 0, self._rid(),
                          None), 1), "free_lookup_locks", probing=probing)
        except ServerUnavailable:
            for iid in space.ids.values():  # nothing was reserved: safe to unregister
                self._client.unregister_kv_cache_engine_driven_context(iid)
            raise UnsupportedServer(
                f"{self.url} does not decode LMCache 0.5.6 keys (IPCCacheServerKey.token_ids):"
                " client and server LMCache versions must match") from None

    def _map(self, name: str, size: int) -> None:
        path = f"/dev/shm/{name.lstrip('/')}"
        try:
            ino = os.stat(path).st_ino
        except FileNotFoundError:
            raise UnsupportedServer(f"{self.url}'s L1 {path} is not on this host") from None
        if ino == self._pool_ino:
            return
        fd = os.open(path, os.O_RDWR)
        # Without MAP_POPULATE every first touch of a 4 KiB page faults in this process:
        # it made copies into the L1 8x slower (measured, CPU); populating costs about
        # 70 ms per 512 MiB at start-up instead.
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if self._prefault else 0)
        try:
            mm = mmap.mmap(fd, size, flags=flags)
        finally:
            os.close(fd)
        pool = torch.frombuffer(mm, dtype=torch.uint8)
        if self._cuda_register:
            cuda_host_register(pool, path)
        with self._state:
            self._maps.append((mm, pool))
            if self._pool_ino is not None:  # another server process: its reads went too
                self.epoch += 1
                self._prepared.clear()
            self._pool, self._pool_ino, self.pool_size = pool, ino, size

    def _beat(self, interval: float) -> None:
        """Keep the registrations alive; after an outage register again (a restarted
        server knows none of them and has a new L1 segment)."""
        while not self._stop.wait(interval if self._healthy else min(interval, 1.0)):
            was = self._healthy
            space = self._space
            # While it is down, one ping a second: calls to a dead server queue up in
            # the client (ZMQ) and are all delivered when one comes back.
            ids = list(space.ids.values()) if was else list(space.ids.values())[:1]
            try:
                for iid in ids:
                    self._call(self._client.ping(iid), "ping", probing=True)
                if not was:
                    self._register(space, probing=True)
                    self._probe_wire(probing=True)  # it may have come back as another version
                    logger.warning("gemma4-kv: %s answers again", self.url)
                self._healthy = True
            except Exception as e:  # noqa: BLE001 - any failure means "not now"
                if was:
                    logger.warning("gemma4-kv: %s not answering: %s", self.url, e)
                self._healthy = False

    @property
    def healthy(self) -> bool:
        return self._healthy

    def rename(self, namespace: str) -> None:
        """Use new registrations under `namespace` from now on (`ChunkStore.reset`); the
        old ones are unregistered unless reservations are open in them (unregistering
        would commit those unwritten: they expire, the reaper takes the rest)."""
        old, new = self._space, self._new_space(namespace)
        self._space = new
        try:
            self._check()
            self._register(new)
        except Exception as e:
            self._healthy = False  # the heartbeat registers `new` once the server answers
            raise ServerUnavailable(f"{self.url}: cannot register {namespace}: {e}") from e
        if not old.open_writes:
            for f in [self._client.unregister_kv_cache_engine_driven_context(i)
                      for i in old.ids.values()]:
                self._call(f, "unregister")

    # -- keys -------------------------------------------------------------------------
    def _tokens(self, hashes: Sequence[bytes]) -> tuple[int, ...]:
        pad = (0,) * (self.server_chunk - HASH_BYTES // 4)
        out: list[int] = []
        for h in hashes:
            if len(h) != HASH_BYTES:
                raise ValueError(f"chunk hashes must be {HASH_BYTES} bytes, got {len(h)}")
            out += struct.unpack(">8I", h)
            out += pad
        return tuple(out)

    def _key(self, space: _Space, gid: int, tokens: tuple[int, ...], a: int, b: int,
             request_id: str, worker: int | None = 0):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        s = self.server_chunk
        return IPCCacheServerKey(model_name=space.names[gid], world_size=1, worker_id=worker,
                                 token_ids=tokens, start=a * s, end=b * s,
                                 request_id=request_id, num_kv_readers=1)

    @staticmethod
    def _rid() -> str:
        return f"g4kv-{uuid.uuid4().hex}"

    # -- lookup -----------------------------------------------------------------------
    def start_lookup(self, hashes: Sequence[bytes]) -> Lookup:
        """Ask every group for the leading run of `hashes` it holds, without waiting
        (the server may bring chunks up from its L2 tiers first)."""
        self._check()
        space, tokens = self._space, self._tokens(hashes)
        rids = {g: self._rid() for g in space.names}
        acks = {g: self._client.lookup(self._key(space, g, tokens, 0, len(hashes), rids[g],
                                                 None), 1) for g in rids}
        return Lookup(space, tokens, len(hashes), rids, acks, self.epoch)

    def poll_lookup(self, lk: Lookup) -> bool:
        """Whether every group has answered (`lk.found`); never waits. A call unanswered
        for `timeout_s` marks the server down (ServerUnavailable); a server still reading
        its L2 answers "not yet" in time and is left to finish."""
        self._check()
        sent = False
        for g, rid in lk.rids.items():
            if g in lk.found:
                continue
            ack = lk.acks.get(g)
            if ack is not None:
                if not ack.query():
                    continue
                ack.result(0)
                del lk.acks[g]
            poll = lk.polls.get(g)
            if poll is None:
                lk.polls[g] = self._client.query_prefetch_status(rid)
                sent = True
            elif poll.query():
                r = poll.result(0)
                del lk.polls[g]
                if r is not None:
                    lk.found[g] = int(r)
        if lk.done:
            return True
        now = time.monotonic()
        if sent:
            lk.asked = now
        elif now - lk.asked > self.timeout_s and not any(
                f.query() for f in (*lk.acks.values(), *lk.polls.values())):
            if self._healthy:
                logger.warning("gemma4-kv: %s gave no answer to a lookup within %g s",
                               self.url, self.timeout_s)
            self._healthy = False
            raise ServerUnavailable(f"{self.url}: no answer to a lookup within "
                                    f"{self.timeout_s} s")
        return False

    def wait_lookup(self, lk: Lookup) -> None:
        """Wait for `lk` up to the timeout (ServerUnavailable after it)."""
        deadline = time.monotonic() + self.timeout_s
        while not self.poll_lookup(lk):
            self._check()
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"{self.url}: lookup not done within "
                                        f"{self.timeout_s} s")
            time.sleep(0.0005)

    def _free(self, space: _Space, tokens, gid: int, rid: str, indices: Iterable[int]) -> list:
        return [self._client.free_lookup_locks(self._key(space, gid, tokens, a, b, rid, None), 1)
                for a, b in _runs(indices)]

    def _finish(self, futures: Iterable, rids: Iterable[str]) -> None:
        """Wait for `futures`, then end the sessions. Not both at once: the server runs
        them on several threads, and a call that lands after its session ended recreates
        an empty one (a free then releases nothing)."""
        for f in list(futures):
            self._call(f, "free/commit")
        for f in [self._client.end_session(r) for r in rids]:
            self._call(f, "end_session")

    def keep(self, lk: Lookup, chunks: Sequence[tuple[int, int]] | None) -> Pin | None:
        """Hold the locks of these (chunk index, group id) objects of a finished lookup
        and free all others; None (nothing held) if any of them was not found."""
        want: dict[int, set[int]] = defaultdict(set)
        for c, g in chunks or ():
            want[g].add(c)
        if lk.epoch != self.epoch:
            return None
        ok = bool(chunks) and all(max(cs) < lk.found.get(g, 0) for g, cs in want.items())
        if not ok:
            want.clear()
        frees = [f for g, hit in lk.found.items()
                 for f in self._free(lk.space, lk.tokens, g, lk.rids[g],
                                     set(range(hit)) - want[g])]
        self._finish(frees, [rid for g, rid in lk.rids.items() if not want[g]])
        if not ok:
            return None
        return Pin(lk.space, lk.tokens, tuple(chunks), {g: lk.rids[g] for g in want},
                   {g: _runs(cs) for g, cs in want.items()}, lk.epoch)

    def present(self, hashes: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices the server holds (its leading run in 0.5.6)."""
        if not hashes:
            return {g: set() for g in self._groups}
        lk = self.start_lookup(hashes)
        self.wait_lookup(lk)
        self.keep(lk, None)
        return {g: set(range(n)) for g, n in lk.found.items()}

    def lock(self, hashes: Sequence[bytes], chunks: Sequence[tuple[int, int]]) -> Pin | None:
        """Pin these (chunk index, group id) objects of the prefix `hashes`; all or none."""
        if not chunks:
            return None
        lk = self.start_lookup(hashes[:max(c for c, _ in chunks) + 1])
        self.wait_lookup(lk)
        return self.keep(lk, chunks)

    # -- read -------------------------------------------------------------------------
    def _objects(self, slots: list[dict], gid: int) -> list | None:
        """(KV, trailer) views of reserved or retrieved slots, or None if the server's
        objects are not what this client registered."""
        g = self._groups[gid]
        shape, kv_bytes = g.chunk_shape(self.chunk_size), self._kv_bytes[gid]
        want = [2, len(g.layers), self._slots[gid], g.num_kv_heads * g.head_size]
        out = []
        for s in slots:
            if list(s["shape"]) != want or s["dtype"] != str(g.dtype).removeprefix("torch.") \
                    or s["offset"] % 8 or s["length"] < kv_bytes + SEAL_BYTES:
                logger.warning("gemma4-kv: server object of group %d is %s %s, expected %s "
                               "%s: treated as a miss", gid, s["shape"], s["dtype"], want,
                               g.dtype)
                return None
            raw = self._pool[s["offset"]:s["offset"] + kv_bytes + SEAL_BYTES]
            out.append((raw[:kv_bytes].view(g.dtype).view(shape),
                        raw[kv_bytes:].view(integrity.SEAL_DTYPE)))
        return out

    def read(self, pin: Pin) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(KV, trailer) views of the pinned objects in the server's L1, in `pin.chunks`
        order (valid until `release`), or None if the server no longer has them all."""
        self._check()
        runs = [(g, a, b) for g, rs in pin.runs.items() for a, b in rs]
        if pin.epoch != self.epoch or any(r in pin.spent for r in runs):
            return None
        space = pin.space
        with self._state:  # one reader at a time: pending reads are shared (`_Prepared`)
            todo = []
            for g, a, b in runs:
                if (g, a, b) in pin.read_runs:
                    continue
                shared = self._prepared.get((space.ids[g], pin.tokens, a, b))
                if shared is not None:
                    shared.users += 1
                    pin.read_runs.add((g, a, b))
                else:
                    todo.append((g, a, b))
            keys = {r: self._key(space, r[0], pin.tokens, r[1], r[2], pin.sessions[r[0]])
                    for r in todo}
            futures = {r: self._client.prepare_retrieve(keys[r], space.ids[r[0]])
                       for r in todo}
            ok = True
            for (g, a, b), f in futures.items():
                reply = self._call(f, "prepare_retrieve")
                objects = self._objects(reply.context.get("slots", []), g) \
                    if reply.success else None
                if objects is None or len(objects) != b - a:
                    # Either way the server let go of this run's locks: a failed prepare
                    # releases what it found (0.5.6), a bad shape is handed back here.
                    if reply.success:
                        self._call(self._client.commit_retrieve(keys[(g, a, b)],
                                                                space.ids[g]), "commit_retrieve")
                    pin.spent.add((g, a, b))
                    ok = False
                    continue
                self._prepared[(space.ids[g], pin.tokens, a, b)] = _Prepared(objects)
                pin.read_runs.add((g, a, b))
            if not ok:
                return None
            got = {}
            for g, a, b in runs:
                objects = self._prepared[(space.ids[g], pin.tokens, a, b)].objects
                got.update({(a + i, g): o for i, o in enumerate(objects)})
        return [got[c] for c in pin.chunks]

    def release(self, pin: Pin) -> None:
        """Give the pinned objects back (a run several pins share is handed back on the
        server when its last user lets go)."""
        futures, space = [], pin.space
        with self._state:
            if self._stale(pin):
                pin.read_runs.clear()
                return
            for g, runs in pin.runs.items():
                rid = pin.sessions[g]
                for a, b in runs:
                    if (g, a, b) in pin.spent:
                        continue
                    if (g, a, b) in pin.read_runs:
                        ident = (space.ids[g], pin.tokens, a, b)
                        shared = self._prepared[ident]  # same epoch: still there
                        shared.users -= 1
                        if not shared.users:  # the server's pending read frees one lock set
                            del self._prepared[ident]
                            futures.append(self._client.commit_retrieve(
                                self._key(space, g, pin.tokens, a, b, rid), space.ids[g]))
                            continue
                    # Not read, or read through another pin's retrieve: this pin's own
                    # lookup locks go back as they came.
                    futures += self._free(space, pin.tokens, g, rid, range(a, b))
            pin.read_runs.clear()
            pin.spent.update((g, a, b) for g, rs in pin.runs.items() for a, b in rs)
        if self._healthy:
            self._finish(futures, pin.sessions.values())

    def _stale(self, thing) -> bool:
        """Made on a server process that is gone (its state went with it)."""
        return thing.epoch != self.epoch

    # -- write ------------------------------------------------------------------------
    def reserve(self, hashes: Sequence[bytes], runs: dict[int, list[tuple[int, int]]]
                ) -> Write:
        """Slots for chunks [a, b) of group g for each (a, b) in runs[g], keyed by the
        prefix `hashes` (from chunk 0 to at least the last b). Chunks the server already
        holds, or has no room for, get none."""
        self._check()
        space, rid = self._space, self._rid()
        end = max((b for rs in runs.values() for _, b in rs), default=0)
        tokens = self._tokens(hashes[:end])  # one session: the same tokens in every call
        futures = {(g, a, b): self._client.prepare_store(
            self._key(space, g, tokens, a, b, rid), space.ids[g])
            for g, rs in runs.items() for a, b in rs}
        objects, reserved = {}, []
        with self._state:  # counted until committed: never unregistered while open
            space.open_writes += 1
        try:
            for (g, a, b), f in futures.items():
                ctx = self._call(f, "prepare_store").context
                slots, idx = ctx.get("slots") or [], ctx.get("chunk_indices") or []
                if not slots:
                    continue
                reserved.append((g, a, b))
                views = self._objects(slots, g)
                if views is None:
                    raise UnsupportedServer(f"server reserved objects of another shape for "
                                            f"group {g}")
                objects.update({(a + i, g): v for i, v in zip(idx, views)})
        except BaseException:
            if not reserved:
                with self._state:
                    space.open_writes -= 1
            raise
        if not reserved:
            with self._state:
                space.open_writes -= 1
            self._call(self._client.end_session(rid), "end_session")
        return Write(space, tokens, rid, reserved, objects, self.epoch)

    def commit(self, write: Write) -> bool:
        """Make the filled objects visible to every client of the server."""
        if not write.runs:
            return True
        if self._stale(write):
            write.runs = []
            return False
        space = write.space
        try:
            futures = [self._client.commit_store(self._key(space, g, write.tokens, a, b,
                                                           write.request_id), space.ids[g], b"")
                       for g, a, b in write.runs]
            ok = all([self._call(f, "commit_store") for f in futures])
            with self._state:  # answered: nothing of it is open on the server any more
                space.open_writes -= 1
        finally:
            write.runs = []
        self._finish([], [write.request_id])
        return ok

    def abort(self, write: Write) -> None:
        """Leave the reservations uncommitted: the server drops them after its write TTL
        (0.5.6 has no abort call; unregistering or a reap would commit them)."""
        if write.runs:
            logger.warning("gemma4-kv: reserved objects left to expire on %s", self.url)
            write.runs = []  # still counted open: this registration is never unregistered
            if self._healthy:
                self._call(self._client.end_session(write.request_id), "end_session")

    # -- misc -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop pinging and unregister, unless reservations are still open: unregistering
        would commit them unwritten (0.5.6 `_release_entry`); they expire instead."""
        self._stop.set()
        self._heartbeat.join(timeout=self.timeout_s + 1)
        space = self._space
        if self._healthy and not space.open_writes:
            try:
                for f in [self._client.unregister_kv_cache_engine_driven_context(i)
                          for i in space.ids.values()]:
                    self._call(f, "unregister")
            except ServerUnavailable:
                pass
        self._client.close()
        with self._state:
            self._prepared.clear()
            self._pool = None
            for mm, pool in self._maps:
                if self._cuda_register:
                    torch.cuda.cudart().cudaHostUnregister(pool.data_ptr())
                try:
                    mm.close()
                except BufferError:  # a caller still holds views; the mapping goes with them
                    pass
            self._maps.clear()
