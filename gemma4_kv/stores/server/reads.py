"""Reads from a running `lmcache server`: lookups, the read locks a hit keeps, and views
of the held objects in the server's shared-memory L1.

A lookup locks, per group it asks, the leading run of chunks of one chain the server
holds (0.5.6 applies the full-attention rule to every registration); `keep` holds the
locks a hit needs and frees the rest, `read` maps the held objects. Everything that
hands locks and sessions back goes through the connection's `later`, so neither the
lookup thread nor the model thread waits for the server's answers.

Each lookup holds a `Lease` on its space, handed to the pin it becomes (`keep`) and
closed once the server has let go of its locks. `ServerReads` alone owns the retrieves
its pins share (`_prepared`), under a lock of its own held for that dict only, never
across a call: `read` runs on the lookup thread (one per store), `release`'s work on
the connection's `later` thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..lmcache import Pending
from .connection import ServerConnection, ServerUnavailable, runs
from .space import Lease, Space, Use

logger = logging.getLogger(__name__)


@dataclass
class ServerLookup:
    """A lookup in flight: per group asked, a server session whose leading run of
    `hashes` gets locked."""

    lease: Lease | None
    """Its read in `space`, until `keep` hands it to the pin or `forget` closes it."""
    space: Space
    hashes: tuple[bytes, ...]
    tokens: tuple[int, ...]
    rids: dict[int, str]
    acks: dict[int, Pending[None]]
    epoch: int
    polls: dict[int, Pending[int | None]] = field(default_factory=dict)
    found: dict[int, int] = field(default_factory=dict)
    """Group id -> leading chunks held (and read-locked), once answered."""
    sent: float = field(default_factory=time.monotonic)
    """When the lookup was sent: the server takes its read locks later, so their TTL
    runs out no earlier than `sent` + the TTL."""
    asked: float = field(default_factory=time.monotonic)
    """When the calls now unanswered were sent."""
    @property
    def open(self) -> bool:
        """Still holding its lease (neither kept nor forgotten)."""
        return self.lease is not None

    def take_lease(self) -> Lease | None:
        lease, self.lease = self.lease, None
        return lease

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
class ReadLocks:
    """Read locks a lookup holds on the server: what `read` may map, until `release`."""

    lease: Lease
    """Its read in `space`, closed once the server has let go of its locks."""
    space: Space
    tokens: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    """(chunk index, group id) in the caller's order."""
    sessions: dict[int, str]
    runs: dict[int, list[tuple[int, int]]]
    epoch: int
    locked_at: float
    """When the lookup that took these locks was sent (`ServerLookup.sent`)."""
    read_runs: set[tuple[int, int, int]] = field(default_factory=set)
    spent: set[tuple[int, int, int]] = field(default_factory=set)
    """Runs whose locks the server already gave up (a failed retrieve)."""
    open: bool = True
    """Not released yet."""
    freeing: list = field(default_factory=list)
    """Frees `keep` sent in these sessions, answered before `release` ends them."""


class ServerReads:
    """Lookups, pins and reads of one client on its connection."""

    def __init__(self, conn: ServerConnection):
        self.conn = conn
        self._lock = threading.Lock()
        self._prepared: dict[tuple, _Prepared] = {}  # under _lock
        conn.on_new_server.append(self._forget_prepared)  # its reads went with it

    def _forget_prepared(self) -> None:
        with self._lock:
            self._prepared.clear()

    # -- lookup -----------------------------------------------------------------------
    def start_lookup(self, hashes: Sequence[bytes], groups: Iterable[int] | None = None
                     ) -> ServerLookup:
        """Ask `groups` (default: all) for the leading run of `hashes` they hold, without
        waiting (the server may bring chunks up from its L2 tiers first)."""
        conn = self.conn
        conn.check()
        tokens = conn.tokens(hashes)
        rids = {g: conn.new_rid() for g in (conn.space.names if groups is None else groups)}
        sent = time.monotonic()
        with conn.lease(Use.READ) as lease:
            space = lease.space
            acks = {g: conn.wire.lookup(conn.key(space, g, tokens, 0, len(hashes),
                                                 rids[g], None)) for g in rids}
            return ServerLookup(lease.keep(), space, tuple(hashes), tokens, rids, acks,
                                conn.epoch, sent=sent)

    def forget(self, lk: ServerLookup) -> None:
        """A lookup given up unfinished (no answer, or the server down): its locks, if
        any, expire with the server's read-lock TTL."""
        lease = lk.take_lease()
        if lease is not None:
            lease.close()

    def poll_lookup(self, lk: ServerLookup) -> bool:
        """Whether every group has answered (`lk.found`); never waits. A call unanswered
        for `timeout_s` marks the server down (ServerUnavailable); a server still reading
        its L2 answers "not yet" in time and is left to finish."""
        conn = self.conn
        conn.check()
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
                lk.polls[g] = conn.wire.lookup_status(rid)
                sent = True
            elif poll.query():
                r = poll.result(0)
                del lk.polls[g]
                if r is not None:
                    lk.found[g] = r
        if lk.done:
            return True
        now = time.monotonic()
        if sent:
            lk.asked = now
        elif now - lk.asked > conn.timeout_s and not (
                any(f.query() for f in lk.acks.values())
                or any(f.query() for f in lk.polls.values())):
            conn.waited_out_once()
            conn.mark_down(f"no answer to a lookup within {conn.timeout_s} s")
        return False

    def wait_lookup(self, lk: ServerLookup) -> None:
        """Wait for `lk` up to the timeout (ServerUnavailable after it)."""
        deadline = time.monotonic() + self.conn.timeout_s
        while not self.poll_lookup(lk):
            self.conn.check()
            if time.monotonic() > deadline:
                self.conn.waited_out_once()
                raise ServerUnavailable(f"{self.conn.url}: lookup not done within "
                                        f"{self.conn.timeout_s} s")
            time.sleep(0.0005)

    def _free(self, space: Space, tokens, gid: int, rid: str, indices: Iterable[int]) -> list:
        conn = self.conn
        return [conn.wire.free_lookup_locks(conn.key(space, gid, tokens, a, b, rid, None))
                for a, b in runs(indices)]

    def keep(self, lk: ServerLookup, chunks: Sequence[tuple[int, int]]) -> ReadLocks | None:
        """Hold the locks of these (chunk index, group id) objects of a finished lookup
        and free all others; None (nothing held) if any of them was not found. The frees
        are sent, not waited for (`later`): nothing here needs their answers."""
        want: dict[int, set[int]] = defaultdict(set)
        for c, g in chunks:
            want[g].add(c)
        lease = lk.take_lease()
        if lease is None:
            raise ValueError("keep() of a lookup already kept or forgotten")
        if self.conn.stale(lk):  # its server is gone, and its locks with it
            lease.close()
            return None
        ok = bool(chunks) and all(max(cs) < lk.found.get(g, 0) for g, cs in want.items())
        if not ok:
            want.clear()
        ended: list[Pending[Any]] = []  # `free_lookup_locks` calls (`_free`)
        freeing: list[Pending[Any]] = []
        sent = False
        try:
            for g, hit in lk.found.items():
                frees = self._free(lk.space, lk.tokens, g, lk.rids[g], set(range(hit)) - want[g])
                (freeing if want[g] else ended).extend(frees)
            sent = True
        finally:
            self.conn.later.submit(self._kept, ended,
                                   [rid for g, rid in lk.rids.items() if not want[g]],
                                   None if ok and sent else lease)
        if not ok:
            return None
        self.conn.l1.use(lk.epoch, 1)
        return ReadLocks(lease, lk.space, lk.tokens, tuple(chunks), {g: lk.rids[g] for g in want},
                   {g: runs(cs) for g, cs in want.items()}, lk.epoch, lk.sent,
                   freeing=freeing)

    def drop(self, lk: ServerLookup) -> None:
        """Free every lock of a finished lookup (nothing kept)."""
        self.keep(lk, ())

    def _kept(self, frees: list, rids: list[str], lease: Lease | None) -> None:
        """`keep`'s answers: the sessions of groups the pin does not use end once their
        frees are answered; the lease of a lookup that pinned nothing closes then."""
        try:
            self.conn.finish(frees, rids)
        finally:
            if lease is not None:
                lease.close()

    def lock(self, hashes: Sequence[bytes],
             chunks: Sequence[tuple[int, int]]) -> ReadLocks | None:
        """Pin these (chunk index, group id) objects of the chain `hashes`; all or none."""
        if not chunks:
            return None
        lk = self.start_lookup(hashes[:max(c for c, _ in chunks) + 1], {g for _, g in chunks})
        try:
            self.wait_lookup(lk)
        except BaseException:
            self.forget(lk)
            raise
        return self.keep(lk, chunks)

    # -- read -------------------------------------------------------------------------
    def read(self, pin: ReadLocks) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(KV, trailer) views of the pinned objects in the server's L1, in `pin.chunks`
        order (valid until `release`), or None if the server no longer has them all.
        Lookup thread only: a run another pin prepared is shared, the others are
        prepared here, with no lock held while the server answers."""
        conn = self.conn
        conn.check()
        runs_ = [(g, a, b) for g, rs in pin.runs.items() for a, b in rs]
        if conn.stale(pin) or any(r in pin.spent for r in runs_):
            return None
        space = pin.space
        with self._lock:
            todo = [r for r in runs_ if r not in pin.read_runs and not self._share(pin, r)]
        keys = {r: conn.key(space, r[0], pin.tokens, r[1], r[2], pin.sessions[r[0]])
                for r in todo}
        futures = {r: conn.wire.prepare_retrieve(keys[r], space.ids[r[0]]) for r in todo}
        prepared, spent = {}, []
        try:
            for (g, a, b), f in futures.items():
                reply = conn.call(f, "prepare_retrieve")
                objects = conn.views(reply.slots, g) if reply.success else None
                if objects is None or len(objects) != b - a:
                    # Either way the server let go of this run's locks: a failed prepare
                    # releases what it found (0.5.6), a bad shape is handed back here.
                    if reply.success:
                        conn.call(conn.wire.commit_retrieve(keys[(g, a, b)], space.ids[g]),
                                  "commit_retrieve")
                    spent.append((g, a, b))
                    continue
                prepared[(g, a, b)] = objects
        finally:  # what the server prepared is handed back by `release`, even now
            with self._lock:
                for (g, a, b), objects in prepared.items():
                    self._prepared[(space.ids[g], pin.tokens, a, b)] = _Prepared(objects)
                    pin.read_runs.add((g, a, b))
                pin.spent.update(spent)
        if spent:
            return None
        with self._lock:
            got = {}
            for g, a, b in runs_:
                shared = self._prepared.get((space.ids[g], pin.tokens, a, b))
                if shared is None:  # another server answers now: its reads went
                    return None
                got.update({(a + i, g): o for i, o in enumerate(shared.objects)})
        return [got[c] for c in pin.chunks]

    def _share(self, pin: ReadLocks, run: tuple[int, int, int]) -> bool:
        """Read `run` through the retrieve another pin prepared, if one did (under
        `_lock`)."""
        g, a, b = run
        shared = self._prepared.get((pin.space.ids[g], pin.tokens, a, b))
        if shared is None:
            return False
        shared.users += 1
        pin.read_runs.add(run)
        return True

    def release(self, pin: ReadLocks) -> None:
        """Give the pinned objects back (a run several pins share is handed back on the
        server when its last user lets go) on `later`'s thread: the caller (the model
        thread, after a load) neither waits for the server nor for the lock a read in
        flight on the lookup thread holds."""
        if pin.open:
            pin.open = False
            self.conn.later.submit(self._released, pin)

    def _released(self, pin: ReadLocks) -> None:
        try:
            futures, rids = self._release(pin)
            if rids and self.conn.healthy:
                self.conn.finish(futures, rids)
        finally:
            pin.lease.close()
            self.conn.l1.use(pin.epoch, -1)

    def _release(self, pin: ReadLocks) -> tuple[list, list[str]]:
        """Send what gives the pin's locks back: (the calls to wait for, the sessions to
        end after them). What to send is decided under `_lock`, sent after it."""
        conn = self.conn
        space, commits, frees = pin.space, [], []
        with self._lock:
            if conn.stale(pin):
                pin.read_runs.clear()
                return [], []
            for g, runs_ in pin.runs.items():
                for a, b in runs_:
                    if (g, a, b) in pin.spent:
                        continue
                    ident = (space.ids[g], pin.tokens, a, b)
                    shared = self._prepared.get(ident) if (g, a, b) in pin.read_runs \
                        else None
                    if shared is not None:
                        shared.users -= 1
                        if not shared.users:  # the server's pending read frees one lock set
                            del self._prepared[ident]
                            commits.append((g, a, b))
                            continue
                    # Not read, or read through another pin's retrieve: this pin's own
                    # lookup locks go back as they came.
                    frees.append((g, a, b))
            pin.read_runs.clear()
            pin.spent.update((g, a, b) for g, rs in pin.runs.items() for a, b in rs)
        futures = list(pin.freeing)
        futures += [conn.wire.commit_retrieve(
            conn.key(space, g, pin.tokens, a, b, pin.sessions[g]), space.ids[g])
            for g, a, b in commits]
        for g, a, b in frees:
            futures += self._free(space, pin.tokens, g, pin.sessions[g], range(a, b))
        return futures, list(pin.sessions.values())

    def close(self) -> None:
        self._forget_prepared()
