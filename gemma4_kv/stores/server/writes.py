"""Writes to a running `lmcache server`: objects reserved in its shared-memory L1,
filled by the client, then committed (or left to expire).

A write holds a `Lease` on its space from its reservation until the server has
answered its commit and ended its session: unregistering the space before would commit
its objects unwritten. An abandoned write's lease is never closed, for that reason.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .connection import ServerConnection, ServerUnavailable
from .space import Lease, Space, Use

logger = logging.getLogger(__name__)


class BadSlots(ServerUnavailable):
    """The server answered a reservation with slots this client cannot use (another
    shape, outside its L1): that write stores nothing; the server stays in use."""


@dataclass
class Write:
    """Objects reserved in the server's L1 under one chain: fill, then commit (or leave
    to expire)."""

    lease: Lease
    """Its write in `space`: closed once its commit and session end are answered."""
    space: Space
    tokens: tuple[int, ...]
    request_id: str
    runs: list[tuple[int, int, int]]
    """(group, a, b) ranges with reserved slots (those to commit)."""
    objects: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(chunk index, group id) -> (KV view, trailer view) of its slot in the server's L1."""
    epoch: int


class ServerWrites:
    """`reserve`, `commit`, `abort` of one client on its connection."""

    def __init__(self, conn: ServerConnection):
        self.conn = conn

    def reserve(self, hashes: Sequence[bytes], runs: dict[int, list[tuple[int, int]]]
                ) -> Write:
        """Slots for chunks [a, b) of group g for each (a, b) in runs[g], keyed by the
        chain `hashes` (from chunk 0 to at least the last b). Chunks the server already
        holds, or has no room for, get none."""
        conn = self.conn
        conn.check()
        rid = conn.new_rid()
        end = max((b for rs in runs.values() for _, b in rs), default=0)
        tokens = conn.tokens(hashes[:end])  # one session: the same tokens in every call
        objects, reserved, bad = {}, [], None
        epoch = conn.epoch
        with conn.lease(Use.WRITE) as lease:  # kept once anything is reserved
            space = lease.space
            futures = {(g, a, b): conn.wire.prepare_store(
                conn.key(space, g, tokens, a, b, rid), space.ids[g])
                for g, rs in runs.items() for a, b in rs}
            for (g, a, b), f in futures.items():
                reply = conn.call(f, "prepare_store")
                slots, idx = reply.slots, reply.chunk_indices
                if not slots:
                    continue
                reserved.append((g, a, b))
                lease.keep()  # open on the server: never unregistered until committed
                views = conn.views(slots, g)
                if views is None or len(idx) != len(views) \
                        or any(not isinstance(i, int) or not 0 <= i < b - a for i in idx):
                    bad = g
                    continue
                objects.update({(a + i, g): v for i, v in zip(idx, views)})
        write = Write(lease, space, tokens, rid, reserved, objects, epoch)
        if not reserved:
            conn.later.submit(conn.finish, [], [rid])
            return write
        conn.l1.use(epoch, 1)
        if bad is not None:
            # Slots of another shape, or outside the server's L1: nothing is written
            # into them, and what was reserved is left to expire unseen.
            self.abort(write)
            raise BadSlots(f"{conn.url} reserved unusable slots for group {bad}")
        return write

    def _close_write(self, write: Write) -> None:
        """The write's views are done with (committed, aborted, or its server gone)."""
        if write.runs:
            write.runs = []
            self.conn.l1.use(write.epoch, -1)

    def commit(self, write: Write) -> bool:
        """Make the filled objects visible to every client of the server."""
        conn = self.conn
        if not write.runs:
            return True
        if conn.stale(write):
            self._close_write(write)
            return False
        space = write.space
        try:
            futures = [conn.wire.commit_store(conn.key(space, g, write.tokens, a, b,
                                                       write.request_id), space.ids[g])
                       for g, a, b in write.runs]
            ok = all([conn.call(f, "commit_store") for f in futures])
        finally:
            self._close_write(write)
        # Answered commits are visible to every lookup from now on; the session's end
        # needs no waiting.
        conn.later.submit(self._committed, write.lease, write.request_id)
        return ok

    def _committed(self, lease: Lease, request_id: str) -> None:
        """The commit was answered: nothing of the write stays open on the server once
        its session ends."""
        try:
            self.conn.finish([], [request_id])
        finally:
            lease.close()

    def abort(self, write: Write) -> None:
        """Leave the reservations uncommitted: the server drops them after its write TTL
        (0.5.6 has no abort call; unregistering or a reap would commit them)."""
        if write.runs:
            logger.warning("gemma4-kv: reserved objects left to expire on %s", self.conn.url)
            self._close_write(write)  # its lease stays open: never unregistered
            if self.conn.healthy:
                self.conn.later.submit(self.conn.finish, [], [write.request_id])
