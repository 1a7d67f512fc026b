"""One namespace's registrations on the server (`Space`) and what is open in them
(`Lease`).

A space is unregistered once it is replaced (`ChunkStore.reset`) and nothing is open
in it: unregistering commits its open reservations unwritten (0.5.6 `_release_entry`),
and drops the read locks a load in flight reads under. So every lookup, pin and
reservation holds a `Lease` on its space from the first call it sends until the server
has let go of what it holds; the space alone counts them, under a lock of its own that
guards that count and nothing else, and is never held across a call to the server.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable


class Use(enum.Enum):
    """What a lease keeps open."""

    READ = "read"
    """Read locks: a lookup's, then the pin it hands them to."""
    WRITE = "write"
    """Reservations, until their commit is answered (an abandoned one: for good)."""


class Space:
    """One namespace's registrations: a model name and an instance id per group, and
    the count of leases open in them."""

    def __init__(self, namespace: str, names: dict[int, str], ids: dict[int, int]):
        self.namespace, self.names, self.ids = namespace, names, ids
        self._lock = threading.Lock()
        self._open = {Use.READ: 0, Use.WRITE: 0}
        self._retired = False
        self._idle_told = False

    @property
    def open_reads(self) -> int:
        """Lookups and pins holding the server's read locks in this space."""
        return self._open[Use.READ]

    @property
    def open_writes(self) -> int:
        """Reservations not committed (an abandoned one stays counted)."""
        return self._open[Use.WRITE]

    def lease(self, use: Use, on_idle: Callable[[Space], None]) -> Lease:
        """Count one more `use` open here, until the lease closes. `on_idle` runs (on the
        thread that closes the last lease, outside the lock) once the space is retired
        and nothing is open in it."""
        with self._lock:
            self._open[use] += 1
        return Lease(self, use, on_idle)

    def retire(self) -> bool:
        """Replaced by new registrations: whether nothing is open now (the caller then
        unregisters it; otherwise the last lease to close does)."""
        with self._lock:
            self._retired = True
            return self._idle_once()

    def end(self, use: Use) -> bool:
        """One `use` fewer (`Lease.close` only); whether the space just became idle."""
        with self._lock:
            self._open[use] -= 1
            return self._idle_once()

    def _idle_once(self) -> bool:
        if self._retired and not self._idle_told and not any(self._open.values()):
            self._idle_told = True
            return True
        return False


class Lease:
    """One read or write open in `space`, counted there until `close`, which its one
    owner at a time calls (the first close counts; later ones do nothing). As a context
    manager the block that sends the first call owns it: it is closed when the block
    ends, unless `keep` handed it on to what outlives the block (a lookup, a pin, a
    reservation)."""

    def __init__(self, space: Space, use: Use, on_idle: Callable[[Space], None]):
        self.space, self.use = space, use
        self._on_idle = on_idle
        self._open = True
        self._kept = False

    @property
    def open(self) -> bool:
        return self._open

    def keep(self) -> Lease:
        """Hand the lease on past the `with` block (its new owner closes it)."""
        self._kept = True
        return self

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        if self.space.end(self.use):
            self._on_idle(self.space)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        if not self._kept:
            self.close()
