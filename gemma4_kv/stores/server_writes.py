"""Writes to a running `lmcache server`: objects reserved in its shared-memory L1,
filled by the client, then committed (or left to expire). A mixin of
`server_tier.MPServerTier`, on its connection state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .server_shm import UnsupportedServer
from .server_wire import Space

logger = logging.getLogger(__name__)


@dataclass
class Write:
    """Objects reserved in the server's L1: fill, then commit (or leave to expire)."""

    space: Space
    tokens: tuple[int, ...]
    request_id: str
    runs: list[tuple[int, int, int]]
    """(group, a, b) ranges with reserved slots (those to commit)."""
    objects: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(chunk index, group id) -> (KV view, trailer view) of its slot in the server's L1."""
    epoch: int


class ServerWrites:
    """`reserve`, `commit`, `abort` of `MPServerTier`."""

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
            self._later.submit(self._finish, [], [rid])
        else:
            self._use(self.epoch, 1)
        return Write(space, tokens, rid, reserved, objects, self.epoch)

    def _close_write(self, write: Write) -> None:
        """The write's views are done with (committed, aborted, or its server gone)."""
        if write.runs:
            write.runs = []
            self._use(write.epoch, -1)

    def commit(self, write: Write) -> bool:
        """Make the filled objects visible to every client of the server."""
        if not write.runs:
            return True
        if self._stale(write):
            self._close_write(write)
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
            self._close_write(write)
        # Answered commits are visible to every lookup from now on; the session's end
        # needs no waiting.
        self._later.submit(self._committed, space, write.request_id)
        return ok

    def _committed(self, space: Space, request_id: str) -> None:
        self._finish([], [request_id])
        self._settle(space)

    def abort(self, write: Write) -> None:
        """Leave the reservations uncommitted: the server drops them after its write TTL
        (0.5.6 has no abort call; unregistering or a reap would commit them)."""
        if write.runs:
            logger.warning("gemma4-kv: reserved objects left to expire on %s", self.url)
            self._close_write(write)  # still counted open: never unregistered
            if self._healthy:
                self._later.submit(self._finish, [], [write.request_id])
