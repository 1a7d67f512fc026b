"""The server's L1 in this process: its shared-memory segment (/dev/shm) mapped here, so
the client copies objects in and out itself, page-locked and known to CUDA when the
kernels read and write it through UVA.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import Counter

import torch

from ...layout.groups import KVGroup
from ...layout import integrity

SEAL_BYTES = 8 * integrity.SEAL_SHAPE[0]


class UnsupportedServer(RuntimeError):
    """The server cannot serve this client (no shared-memory L1, another host, another
    LMCache wire format, ...)."""


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


class SharedL1:
    """The mapped segment of the server process now running (`map` again when another
    one runs); views of objects in it; and who still points into a dead server's
    segment (`use`), which is unmapped once nobody does. Thread-safe."""

    def __init__(self, url: str, *, prefault: bool = True, cuda_register: bool = False):
        self.url = url
        self._lock = threading.RLock()
        self._users: Counter[int] = Counter()
        """Epoch -> pins and reservations whose views point into that epoch's segment."""
        self._prefault, self._cuda_register = prefault, cuda_register
        self._maps: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
        """Epoch -> its mapping. A dead server's stays until `unmap` (its views may still
        be read by a load in flight: closing an mmap does not wait for torch views)."""
        self.pool: torch.Tensor | None = None
        self._ino: int | None = None
        self.size = 0
        self.epoch = 0
        """Server processes seen (a new L1 segment): a lock, read or reservation of an
        earlier one is gone with it, and is never handed back to its successor (which
        would not answer calls naming instances it does not know)."""

    def map(self, name: str, size: int) -> bool:
        """Map segment `name`; whether it is another one than before (a new server).
        The mapping (populated: tens of ms per GB) is made without the lock, which
        guards only which mappings this object holds."""
        path = f"/dev/shm/{name.lstrip('/')}"
        try:
            ino = os.stat(path).st_ino
        except FileNotFoundError:
            raise UnsupportedServer(f"{self.url}'s L1 {path} is not on this host") from None
        with self._lock:
            if ino == self._ino:
                return False
        mm, pool = self._open(path, size)
        with self._lock:
            if ino == self._ino:  # another thread mapped it meanwhile: ours goes
                self._close(mm, pool)
                return False
            another = self._ino is not None
            if another:  # another server process: its reads went too
                self.epoch += 1
            self._maps[self.epoch] = (mm, pool)
            self.pool, self._ino, self.size = pool, ino, size
        self._unmap_idle()
        return another

    def use(self, epoch: int, n: int) -> None:
        """`n` more (or, negative, fewer) views of `epoch`'s segment are in use."""
        with self._lock:
            self._users[epoch] += n
        if n < 0:
            self._unmap_idle()

    def _unmap_idle(self) -> None:
        """Unmap dead servers' segments nothing points into any more: a restart must not
        keep the old L1's pages (MAP_POPULATE: all of them) for the life of the engine."""
        with self._lock:
            for epoch in self.old_epochs():
                if self._users[epoch] <= 0:
                    self._users.pop(epoch, None)
                    self.unmap(epoch)

    def _open(self, path: str, size: int) -> tuple[mmap.mmap, torch.Tensor]:
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
        return mm, pool

    def views(self, group: KVGroup, chunk_size: int, slots: list[dict], slot_count: int
              ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(KV, trailer) views of reserved or retrieved slots, or None if the server's
        objects are not what this client registered or lie outside its L1 segment."""
        shape = group.chunk_shape(chunk_size)
        kv_bytes = 2 * len(group.layers) * chunk_size * group.num_kv_heads \
            * group.head_size * group.dtype.itemsize
        want = [2, len(group.layers), slot_count, group.num_kv_heads * group.head_size]
        out = []
        for s in slots:
            offset, length = s.get("offset"), s.get("length")
            if list(s.get("shape", ())) != want \
                    or s.get("dtype") != str(group.dtype).removeprefix("torch.") \
                    or not isinstance(offset, int) or not isinstance(length, int) \
                    or offset < 0 or offset % 8 or length < kv_bytes + SEAL_BYTES \
                    or self.pool is None or offset + kv_bytes + SEAL_BYTES > self.size:
                # A slot outside the segment would be a view of other memory (or no
                # view at all): whatever the server meant, nothing is read or written.
                return None
            raw = self.pool[offset:offset + kv_bytes + SEAL_BYTES]
            out.append((raw[:kv_bytes].view(group.dtype).view(shape),
                        raw[kv_bytes:].view(integrity.SEAL_DTYPE)))
        return out

    def old_epochs(self) -> list[int]:
        """Epochs of dead servers whose segments are still mapped here."""
        return [e for e in self._maps if e != self.epoch]

    def unmap(self, epoch: int) -> None:
        """Give back the mapping of `epoch` (its pages, held by nobody else once the dead
        server's segment is unlinked). The caller guarantees no view of it is in use."""
        entry = self._maps.pop(epoch, None)
        if entry is None:
            return
        if epoch == self.epoch:
            self.pool = None
        self._close(*entry)

    def _close(self, mm: mmap.mmap, pool: torch.Tensor) -> None:
        if self._cuda_register:
            torch.cuda.cudart().cudaHostUnregister(pool.data_ptr())
        del pool
        try:
            mm.close()
        except BufferError:  # exported elsewhere: the mapping goes with its last user
            pass

    def close(self) -> None:
        with self._lock:
            for epoch in list(self._maps):
                self.unmap(epoch)
            self.pool = None
