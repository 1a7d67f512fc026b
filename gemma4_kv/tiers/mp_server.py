"""gemma4-kv chunk objects in a running `lmcache server` (engine-driven mode, shared-memory L1).

Several engines on one host then share the server's L1 and its L2 tiers while keeping
gemma4-kv's keys, object shapes and window-aware loads. LMCache 0.5.6's engine-driven
protocol (`lmcache/v1/multiprocess/modules/engine_driven_transfer.py`) takes one object
layout per registration and forms keys itself from token ids, so:

- each KV cache group registers as an instance of its own, under the model name
  `<fingerprint>.g<group>`, with that group's KV_2LTD shape;
- our 32-byte chunk hashes travel as the "tokens" of their chunk (8 big-endian uint32
  words, zero padded to the server's chunk size). The server's rolling blake3 over them
  depends on our hash chain only, so a key still names one exact prefix (our hashes
  already cover tokens, salt and everything before);
- the client copies the bytes itself, into the server's L1 mapped from /dev/shm.

The server answers a lookup with the number of leading chunks it holds (full-attention
rule, for every registration in 0.5.6); `present` therefore reports prefixes. Loads stay
window-aware: `lock` keeps the read locks of the chunks a hit needs and frees the others.
A call that gets no answer within `timeout_s` raises `ServerUnavailable` (0.5.6 sends no
reply when a handler raises, so a dead server and a refused call look alike).
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
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..layout import KVLayout

logger = logging.getLogger(__name__)

HASH_BYTES = 32
"""Length of gemma4-kv's chunk hashes (sha256): 8 uint32 "tokens"."""


class ServerUnavailable(ConnectionError):
    """The server did not answer in time: dead, restarting, or it refused the call."""


class UnsupportedServer(RuntimeError):
    """The server cannot serve this client (no shared-memory L1, another host, ...)."""


def server_argv(lmcache: str, *, port: int, shm_name: str, l1_gb: float, http_port: int,
                host: str = "localhost", write_ttl_s: int = 30, workers: int = 2) -> list[str]:
    """Command line of a server this client can use.

    The write TTL must stay below the reap timeout (120 s): 0.5.6 commits a dead client's
    unfinished reservations when it reaps the client (`_release_entry` -> `finish_write`),
    unless they expired first.
    """
    return [lmcache, "server", "--supported-transfer-mode", "engine_driven",
            "--shm-name", shm_name, "--no-l1-use-lazy", "--l1-size-gb", str(l1_gb),
            "--eviction-policy", "LRU", "--host", host, "--port", str(port),
            "--http-port", str(http_port), "--l1-write-ttl-seconds", str(write_ttl_s),
            "--max-workers", str(workers), "--disable-observability"]


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
class _Prepared:
    """A retrieve prepared on the server for one (group, range); shared by pins of it."""

    views: list[torch.Tensor]
    users: int = 1


@dataclass
class Pin:
    """Read locks a lookup took on the server: what `read` may map, until `release`."""

    tokens: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    """(chunk index, group id) in the caller's order."""
    sessions: dict[int, str]
    """Group id -> request id of the lookup that locked its chunks."""
    runs: dict[int, list[tuple[int, int]]]
    read_runs: set[tuple[int, int, int]] = field(default_factory=set)
    """(group, a, b) runs mapped by `read`."""
    spent: set[tuple[int, int, int]] = field(default_factory=set)
    """Runs whose locks the server already gave up (a failed retrieve)."""


@dataclass
class Write:
    """Objects reserved in the server's L1 for chunks [first, end): fill, then commit."""

    tokens: tuple[int, ...]
    first: int
    end: int
    request_id: str
    groups: tuple[int, ...]
    """Groups with reserved slots (those to commit)."""
    objects: dict[tuple[int, int], torch.Tensor]
    """(chunk index, group id) -> view of its slot in the server's L1."""


class MPServerTier:
    """KV_2LTD objects per (chunk, group) in a running LMCache MP server."""

    def __init__(self, url: str, layout: KVLayout, fingerprint: str, chunk_size: int, *,
                 timeout_s: float = 5.0, ping_interval_s: float = 20.0, prefault: bool = True):
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.url, self.layout, self.chunk_size = url, layout, chunk_size
        self.timeout_s = timeout_s
        self._prefault = prefault
        self._client = RequestClientFactory.create(url)
        self._healthy = True
        self._state = threading.RLock()
        self._names = {g.group_id: f"{fingerprint}.g{g.group_id}" for g in layout.groups}
        if any("@" in n for n in self._names.values()):
            raise ValueError("LMCache model names must not contain '@'")
        base = int.from_bytes(os.urandom(5), "big") << 8  # ids are global to the server
        self._ids = {g.group_id: base + g.group_id for g in layout.groups}
        self._shapes = {g.group_id: (tuple(g.chunk_shape(chunk_size)), g.dtype)
                        for g in layout.groups}
        self._prepared: dict[tuple, _Prepared] = {}
        self._open_writes = 0
        self._maps: list[tuple[mmap.mmap, torch.Tensor]] = []  # old ones kept: views may live
        self._pool: torch.Tensor | None = None
        self._pool_ino: int | None = None
        if not self._call(self._client.ping(None), "ping"):
            raise ServerUnavailable(f"{url}: ping refused")
        self.server_chunk = int(self._call(self._client.get_chunk_size(), "get_chunk_size"))
        if self.server_chunk * 4 < HASH_BYTES:
            raise UnsupportedServer(f"server chunk size {self.server_chunk} holds no "
                                    f"{HASH_BYTES}-byte hash")
        try:
            self._register()
            self._probe_wire()
        except Exception:
            self._client.close()
            raise
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(ping_interval_s,),
                                           name="gemma4kv-mp-ping", daemon=True)
        self._heartbeat.start()

    # -- connection -------------------------------------------------------------------
    def _call(self, future, what: str):
        """The answer of one RPC within the timeout, or ServerUnavailable."""
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            self._healthy = False
            raise ServerUnavailable(f"{self.url}: no answer to {what} within "
                                    f"{self.timeout_s} s") from None

    def _check(self) -> None:
        if not self._healthy:
            raise ServerUnavailable(f"{self.url} is not answering (waiting for a ping)")

    def _register(self) -> None:
        """Register every group (idempotent on the server) and map its L1."""
        from lmcache.v1.multiprocess.custom_types import RegisterEngineDrivenContextPayload

        futures = {}
        for g in self.layout.groups:
            futures[g.group_id] = self._client.register_kv_cache_engine_driven_context(
                RegisterEngineDrivenContextPayload(
                    instance_id=self._ids[g.group_id], model_name=self._names[g.group_id],
                    world_size=1, block_size=g.block_size, num_layers=len(g.layers),
                    hidden_dim_size=g.num_kv_heads * g.head_size,
                    dtype_str=str(g.dtype).removeprefix("torch."), use_mla=False,
                    num_physical_slots=self.chunk_size))
        pools = {(r.shm_name, r.pool_size) for r in
                 (self._call(f, "register") for f in futures.values())}
        (name, size), = pools
        if not name or size <= 0:
            raise UnsupportedServer(
                f"{self.url} has no shared-memory L1: start it with --supported-transfer-mode "
                "engine_driven --shm-name NAME --no-l1-use-lazy and a /dev/shm larger than L1")
        self._map(name, size)
        for iid in self._ids.values():
            self._call(self._client.ping(iid), "ping")  # ping-proven: reaped after 120 s

    def _probe_wire(self) -> None:
        """A keyed call that does nothing (an empty range): a server of another wire
        format (0.5.7 sends `token_bytes`) cannot decode the key and never answers,
        while registration and pings still work."""
        g = next(iter(self._names))
        try:
            self._call(self._client.free_lookup_locks(
                self._key(g, self._tokens([bytes(HASH_BYTES)]), 0, 0, self._rid(), None), 1),
                "free_lookup_locks")
        except ServerUnavailable:
            for iid in self._ids.values():  # nothing was reserved: safe to unregister
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
        self._maps.append((mm, pool))
        self._pool, self._pool_ino = pool, ino

    def _beat(self, interval: float) -> None:
        """Keep the registrations alive; after an outage register again (a restarted
        server knows none of them and has a new L1 segment)."""
        while not self._stop.wait(interval if self._healthy else min(interval, 1.0)):
            was = self._healthy
            try:
                for iid in self._ids.values():
                    self._client.ping(iid).result(timeout=self.timeout_s)
                if not was:
                    self._register()
                    self._probe_wire()  # it may have come back as another version
                    logger.info("gemma4-kv: %s answers again", self.url)
                self._healthy = True
            except Exception as e:  # noqa: BLE001 - any failure means "not now"
                if was:
                    logger.warning("gemma4-kv: %s not answering: %s", self.url, e)
                self._healthy = False

    @property
    def healthy(self) -> bool:
        return self._healthy

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

    def _key(self, gid: int, tokens: tuple[int, ...], a: int, b: int, request_id: str,
             worker: int | None = 0):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        s = self.server_chunk
        return IPCCacheServerKey(model_name=self._names[gid], world_size=1, worker_id=worker,
                                 token_ids=tokens, start=a * s, end=b * s,
                                 request_id=request_id, num_kv_readers=1)

    @staticmethod
    def _rid() -> str:
        return f"g4kv-{uuid.uuid4().hex}"

    # -- lookup -----------------------------------------------------------------------
    def _lookup(self, tokens: tuple[int, ...], n: int, groups: Collection[int]) -> dict:
        """Per group: (request id, leading chunks held and now read-locked)."""
        rids = {g: self._rid() for g in groups}
        acks = [self._client.lookup(self._key(g, tokens, 0, n, rids[g], None), 1)
                for g in groups]
        for f in acks:
            self._call(f, "lookup")
        hits: dict[int, int] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(hits) < len(rids):
            polls = {g: self._client.query_prefetch_status(rids[g]) for g in rids
                     if g not in hits}
            for g, f in polls.items():
                r = self._call(f, "query_prefetch_status")
                if r is not None:
                    hits[g] = int(r)
            if len(hits) < len(rids):
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"{self.url}: prefetch not done within "
                                            f"{self.timeout_s} s")
                time.sleep(0.001)
        return {g: (rids[g], hits[g]) for g in rids}

    def _free(self, tokens, gid: int, rid: str, indices: Iterable[int]) -> list:
        return [self._client.free_lookup_locks(self._key(gid, tokens, a, b, rid, None), 1)
                for a, b in _runs(indices)]

    def _finish(self, futures: Iterable, rids: Iterable[str]) -> None:
        """Wait for `futures`, then end the sessions. Not both at once: the server runs
        them on several threads (commits on another pool), and a call that lands after
        its session ended recreates an empty one (a free then releases nothing)."""
        for f in list(futures):
            self._call(f, "free/commit")
        for f in [self._client.end_session(r) for r in rids]:
            self._call(f, "end_session")

    def present(self, hashes: Sequence[bytes]) -> dict[int, set[int]]:
        """Per group id, the chunk indices the server holds (its leading run in 0.5.6)."""
        self._check()
        if not hashes:
            return {g.group_id: set() for g in self.layout.groups}
        tokens = self._tokens(hashes)
        found = self._lookup(tokens, len(hashes), list(self._names))
        self._finish((f for g, (rid, hit) in found.items()
                      for f in self._free(tokens, g, rid, range(hit))),
                     (rid for rid, _ in found.values()))
        return {g: set(range(hit)) for g, (_, hit) in found.items()}

    def pin(self, hashes: Sequence[bytes],
            choose: Callable[[dict[int, set[int]]], Sequence[tuple[int, int]] | None]
            ) -> Pin | None:
        """One lookup per group; `choose(present)` names the (chunk, group) objects to keep
        pinned (or None); every other lock is freed at once."""
        self._check()
        tokens = self._tokens(hashes)
        found = self._lookup(tokens, len(hashes), list(self._names))
        chosen = choose({g: set(range(hit)) for g, (_, hit) in found.items()})
        want: dict[int, set[int]] = defaultdict(set)
        for c, g in chosen or ():
            want[g].add(c)
        ok = chosen is not None and all(max(cs) < found[g][1] for g, cs in want.items())
        if not ok:
            want.clear()
        frees = [f for g, (rid, hit) in found.items()
                 for f in self._free(tokens, g, rid, set(range(hit)) - want[g])]
        idle = [rid for g, (rid, _) in found.items() if not want[g]]
        self._finish(frees, idle)
        if not ok:
            return None
        return Pin(tokens=tokens, chunks=tuple(chosen), sessions={g: found[g][0] for g in want},
                   runs={g: _runs(cs) for g, cs in want.items()})

    def lock(self, hashes: Sequence[bytes], chunks: Sequence[tuple[int, int]]) -> Pin | None:
        """Pin these (chunk index, group id) objects of the prefix `hashes`; all or none."""
        if not chunks:
            return None
        n = max(c for c, _ in chunks) + 1
        return self.pin(hashes[:n], lambda present: chunks)

    # -- read -------------------------------------------------------------------------
    def _views(self, slots: list[dict], gid: int) -> list[torch.Tensor] | None:
        shape, dtype = self._shapes[gid]
        out = []
        for s in slots:
            if tuple(s["shape"]) != shape or s["dtype"] != str(dtype).removeprefix("torch."):
                logger.warning("gemma4-kv: server object of group %d is %s %s, expected %s "
                               "%s: treated as a miss", gid, s["shape"], s["dtype"], shape,
                               dtype)
                return None
            raw = self._pool[s["offset"]:s["offset"] + s["length"]]
            out.append(raw.view(dtype).view(shape))
        return out

    def read(self, pin: Pin) -> list[torch.Tensor] | None:
        """Views of the pinned objects in the server's L1, in `pin.chunks` order (valid
        until `release`), or None if the server no longer has them all."""
        self._check()
        runs = [(g, a, b) for g, rs in pin.runs.items() for a, b in rs]
        if any(r in pin.spent for r in runs):
            return None
        with self._state:  # one reader at a time: pending reads are shared, see `_Prepared`
            todo = []
            for g, a, b in runs:
                shared = self._prepared.get((g, pin.tokens, a, b))
                if (g, a, b) in pin.read_runs:
                    continue
                if shared is not None:
                    shared.users += 1
                    pin.read_runs.add((g, a, b))
                else:
                    todo.append((g, a, b))
            keys = {r: self._key(r[0], pin.tokens, r[1], r[2], pin.sessions[r[0]])
                    for r in todo}
            futures = {r: self._client.prepare_retrieve(keys[r], self._ids[r[0]])
                       for r in todo}
            ok = True
            for (g, a, b), f in futures.items():
                reply = self._call(f, "prepare_retrieve")
                views = self._views(reply.context.get("slots", []), g) if reply.success \
                    else None
                if views is None or len(views) != b - a:
                    # Either way the server let go of this run's locks: a failed prepare
                    # releases what it found (0.5.6), a bad shape is handed back here.
                    if reply.success:
                        self._call(self._client.commit_retrieve(keys[(g, a, b)],
                                                                self._ids[g]), "commit_retrieve")
                    pin.spent.add((g, a, b))
                    ok = False
                    continue
                self._prepared[(g, pin.tokens, a, b)] = _Prepared(views)
                pin.read_runs.add((g, a, b))
            if not ok:
                return None
            got: dict[tuple[int, int], torch.Tensor] = {}
            for g, a, b in runs:
                views = self._prepared[(g, pin.tokens, a, b)].views
                got.update({(a + i, g): v for i, v in enumerate(views)})
        return [got[c] for c in pin.chunks]

    def release(self, pin: Pin) -> None:
        """Give the pinned objects back (each run once; a run several pins share is handed
        back on the server when its last user lets go)."""
        futures = []
        with self._state:
            for g, runs in pin.runs.items():
                rid = pin.sessions[g]
                for a, b in runs:
                    ident = (g, pin.tokens, a, b)
                    if (g, a, b) in pin.spent:
                        continue
                    if (g, a, b) in pin.read_runs:
                        shared = self._prepared[ident]
                        shared.users -= 1
                        if not shared.users:  # the server's pending read frees one lock set
                            del self._prepared[ident]
                            futures.append(self._client.commit_retrieve(
                                self._key(g, pin.tokens, a, b, rid), self._ids[g]))
                            continue
                    futures += self._free(pin.tokens, g, rid, range(a, b))
        pin.read_runs.clear()
        if self._healthy:
            self._finish(futures, pin.sessions.values())

    # -- write ------------------------------------------------------------------------
    def reserve(self, hashes: Sequence[bytes], first: int = 0) -> Write:
        """Slots for chunks [first, len(hashes)) of every group not stored yet (chunks
        the server already holds, or has no room for, get none)."""
        self._check()
        tokens, end, rid = self._tokens(hashes), len(hashes), self._rid()
        futures = {g: self._client.prepare_store(self._key(g, tokens, first, end, rid),
                                                 self._ids[g]) for g in self._names}
        objects: dict[tuple[int, int], torch.Tensor] = {}
        groups = []
        for g, f in futures.items():
            ctx = self._call(f, "prepare_store").context
            slots, idx = ctx.get("slots") or [], ctx.get("chunk_indices") or []
            if not slots:
                continue
            groups.append(g)
            views = self._views(slots, g)
            if views is None:
                raise UnsupportedServer(f"server reserved objects of another shape for "
                                        f"group {g}")
            objects.update({(first + i, g): v for i, v in zip(idx, views)})
        with self._state:
            self._open_writes += bool(groups)
        return Write(tokens, first, end, rid, tuple(groups), objects)

    def commit(self, write: Write) -> bool:
        """Make the filled objects visible to every client of the server."""
        futures = [self._client.commit_store(self._key(g, write.tokens, write.first,
                                                       write.end, write.request_id),
                                             self._ids[g], b"") for g in write.groups]
        ok = all([self._call(f, "commit_store") for f in futures])
        self._finish([], [write.request_id])
        with self._state:
            self._open_writes -= bool(write.groups)
        return ok

    def abort(self, write: Write) -> None:
        """Leave the reservations uncommitted: the server drops them after its write TTL.
        (0.5.6 has no abort call.)"""
        if write.groups:
            logger.warning("gemma4-kv: %d reserved objects left to expire on %s",
                           len(write.objects), self.url)
        self._call(self._client.end_session(write.request_id), "end_session")

    # -- misc -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop pinging and unregister, unless reservations are still open: unregistering
        would commit them unwritten (0.5.6 `_release_entry`); they expire instead."""
        self._stop.set()
        self._heartbeat.join(timeout=self.timeout_s)
        if self._healthy and not self._open_writes:
            try:
                for f in [self._client.unregister_kv_cache_engine_driven_context(i)
                          for i in self._ids.values()]:
                    self._call(f, "unregister")
            except ServerUnavailable:
                pass
        self._client.close()
        self._pool = None
        with self._state:
            self._prepared.clear()
        for mm, _ in self._maps:
            try:
                mm.close()
            except BufferError:  # a caller still holds views; the mapping goes with them
                pass
        self._maps.clear()

