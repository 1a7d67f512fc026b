"""A checksum per stored object, written with it and verified before a hit is offered.

Objects that come up from a disk or remote tier may be corrupted, truncated, written
by another model or stored under another key. Each object therefore carries a small
trailer (LMCache's second tensor of the object, `SEAL_SHAPE` int64 words):
`[MAGIC, checksum, KV bytes, 0]`, where the checksum is

    sum_i  x_i * w_i  +  key64      (mod 2**64)

over the object's KV bytes read as unsigned 32-bit words `x_i`, with weights
`w_i = 2 * p(i) + 1`, p a fixed bijection on 30-bit integers (a multiply-xorshift
mix), and `key64` derived from the object's full key (fingerprint, chunk hash, group).
Each product is exact (below 2**63), and no two positions of an object (at most 2**30
words) share a weight. So damage changes the sum by the exact sum of its weighted
changes, which is 0 only if those cancel: a single changed word always fails, and so
does a swap of two different words ((x_j - x_i) * (w_i - w_j) is not 0 and below
2**63); other damage passes only if its weighted changes cancel, about 1 in 2**31 for
random damage. An object under another key fails through `key64`. It is plain integer
arithmetic in torch, so the GPU (at save time, in the staging buffer) and the CPU (at
verification, in pinned host memory) compute the same value bit for bit. This guards
against corruption, not against an attacker who can write the tier: keep tier
directories and servers private to the serving user.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import torch

MAGIC = 0x67346B7633  # "g4kv3"; objects sealed by an older format ("g4kv1", "g4kv2") fail
SEAL_SHAPE = (4,)
SEAL_DTYPE = torch.int64
MAX_WORDS = 1 << 30
"""Longest object (32-bit words, 4 GiB): beyond it p, and so the weights, would repeat."""
_SLAB = 1 << 17
"""Words per multiply-and-sum slab on the CPU: small enough that the widened words and
their products stay in cache instead of making extra passes over memory."""

_MASK = MAX_WORDS - 1
_weights: dict[str, torch.Tensor] = {}
_lock = threading.Lock()


def _mix30(i: torch.Tensor) -> torch.Tensor:
    """p: a bijection on [0, 2**30) (every step is one: adding a constant, x ^ (x >> k),
    and multiplying by an odd constant, each mod 2**30). Values stay below 2**62, so
    int64 holds every step exactly, on any device."""
    z = i.add(0x2B5D3A97).bitwise_and_(_MASK)  # then in place: up to 2**30 words of them
    z.bitwise_xor_(z >> 15).mul_(0x7FEB352D).bitwise_and_(_MASK)
    z.bitwise_xor_(z >> 13).mul_(0x846CA68B).bitwise_and_(_MASK)
    return z.bitwise_xor_(z >> 16)


def weights(num_words: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The first `num_words` weights on `device` (built there, grown and cached per device)."""
    if num_words > MAX_WORDS:
        raise ValueError(f"gemma4-kv: an object of {num_words} 32-bit words is over the "
                         "checksum's 2**30 words (4 GiB), where its weights would repeat; "
                         "use a smaller chunk_size")
    dev = torch.device(device)
    with _lock:
        w = _weights.get(str(dev))
        if w is None or w.numel() < num_words:
            n = min(MAX_WORDS, max(num_words, 2 * (w.numel() if w is not None else 0)))
            w = _weights[str(dev)] = _mix30(
                torch.arange(n, dtype=torch.int64, device=dev)).mul_(2).add_(1)
        return w[:num_words]


def key64(fingerprint: str, chunk_hash: bytes, group_id: int) -> int:
    """The key's contribution, as a signed int64 value."""
    d = hashlib.sha256(f"{fingerprint}|{group_id}|".encode() + chunk_hash).digest()
    return int.from_bytes(d[:8], "little", signed=True)


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    if (flat.numel() * flat.element_size()) % 8:
        raise ValueError("checksummed objects must be a multiple of 8 bytes")
    return flat.view(torch.uint8).view(torch.int32)


def weighted_sums(objects: torch.Tensor) -> torch.Tensor:
    """sum_i x_i * w_i (mod 2**64) of each object `objects[k]` (stacked on dim 0) as an
    [n] int64 tensor on their device, without host synchronisation. Slabs keep the
    widened words and products small: in cache on the CPU, at most 256 MiB on a GPU."""
    n = objects.shape[0]
    x = _words(objects).view(n, -1)
    w = weights(x.shape[1], x.device)
    slab = max(1, (_SLAB if x.device.type == "cpu" else 1 << 25) // n)
    total = torch.zeros(n, dtype=torch.int64, device=x.device)
    for i in range(0, x.shape[1], slab):
        total += (widen(x[:, i:i + slab]) * w[i:i + slab]).sum(dim=1)
    return total


def widen(words: torch.Tensor, masked: bool | None = None) -> torch.Tensor:
    """int32 words as their unsigned values in int64. On the CPU through a uint32 view
    (one pass over the words, where the mask takes two); on a GPU through a mask, which
    needs no unsigned kernels."""
    if masked if masked is not None else words.device.type != "cpu":
        return words.to(torch.int64) & 0xFFFFFFFF
    return words.view(torch.uint32).to(torch.int64)


def seal_many(kv: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """Trailers of `kv[k]` (objects stacked on dim 0, e.g. a staging buffer) under key
    values `keys`, as a [n, 4] int64 tensor on kv's device (queued, no sync)."""
    n = len(keys)
    out = torch.zeros((n, *SEAL_SHAPE), dtype=SEAL_DTYPE, device=kv.device)
    out[:, 0] = MAGIC
    out[:, 2] = kv[0].numel() * kv.element_size()
    key = torch.tensor(keys, dtype=torch.int64)
    out[:, 1] = weighted_sums(kv) + (key.pin_memory() if kv.is_cuda else key).to(
        kv.device, non_blocking=True)
    return out


def seal(kv: torch.Tensor, out: torch.Tensor, key: int) -> None:
    """Write the trailer of one object `kv` under key value `key` into `out`."""
    out.copy_(seal_many(kv.unsqueeze(0), [key])[0])


def verify(kv: torch.Tensor, trailer: torch.Tensor, key: int) -> bool:
    """Whether object `kv` with trailer `trailer` is intact and stored under `key`."""
    t = trailer.to("cpu").tolist()
    if t[0] != MAGIC or t[2] != kv.numel() * kv.element_size():
        return False
    s = (int(weighted_sums(kv.unsqueeze(0))[0]) + key + (1 << 63)) % (1 << 64) - (1 << 63)
    return s == t[1]


class Verification:
    """`verify` of several objects, started without waiting for it. On a GPU each object
    is copied to the device by DMA (no SMs) and summed there, on a stream of its own, so
    a host thread never reads the bytes; elsewhere the objects are verified on the host
    at once. With `keep`, the GPU copies stay (`copies`): a load can then read the very
    bytes that were verified, from device memory, instead of crossing PCIe again.
    `done` never waits; `result` waits if needed."""

    _streams: dict[str, torch.cuda.Stream] = {}
    _scratch: dict[str, torch.Tensor] = {}

    def __init__(self, objects: list[tuple[torch.Tensor, torch.Tensor, int]],
                 device: torch.device | str = "cpu", keep: bool = False):
        self.device = torch.device(device)
        self._event: Any = None  # a torch.cuda.Event once started on a GPU
        self._ok: Any = None  # its per-object answers (pinned host memory)
        self._result: list[bool] | None = None
        self.copies: list[torch.Tensor] | None = None
        """With `keep` on a GPU: each object's KV on the device, in the order given
        (complete once `done`)."""
        if self.device.type != "cuda" or not objects:
            self._result = [verify(kv, trailer, key) for kv, trailer, key in objects]
            return
        self._start(objects, keep)

    def _start(self, objects, keep: bool) -> None:
        dev = str(self.device)
        with _lock:
            stream = self._streams.setdefault(dev, torch.cuda.Stream(self.device))
            need = 0 if keep else max(kv.numel() * kv.element_size() for kv, _, _ in objects)
            scratch = self._scratch.get(dev)
            if need and (scratch is None or scratch.numel() < need):
                scratch = self._scratch[dev] = torch.empty(need, dtype=torch.uint8,
                                                           device=self.device)
        n = len(objects)
        with torch.cuda.stream(stream):
            if keep:
                self.copies = [torch.empty(kv.shape, dtype=kv.dtype, device=self.device)
                               for kv, _, _ in objects]
            sums = torch.empty(n, dtype=torch.int64, device=self.device)
            for i, (kv, _, _) in enumerate(objects):
                nbytes = kv.numel() * kv.element_size()
                if self.copies is not None:  # keep
                    buf = self.copies[i].view(-1).view(torch.uint8)
                else:
                    assert scratch is not None  # sized above for every object
                    buf = scratch[:nbytes]
                buf.copy_(kv.reshape(-1).view(torch.uint8), non_blocking=True)
                sums[i:i + 1] = weighted_sums(buf.view(1, -1))
            host = torch.stack([t.reshape(-1) for _, t, _ in objects]).pin_memory()
            trailers = host.to(self.device, non_blocking=True)
            meta = torch.tensor([[key, kv.numel() * kv.element_size()]
                                 for kv, _, key in objects], dtype=torch.int64).pin_memory()
            meta = meta.to(self.device, non_blocking=True)
            ok = (trailers[:, 0] == MAGIC) & (trailers[:, 2] == meta[:, 1]) \
                & (trailers[:, 1] == sums + meta[:, 0])  # int64 sums wrap: mod 2**64
            self._ok = torch.empty(n, dtype=torch.bool, pin_memory=True)
            self._ok.copy_(ok, non_blocking=True)
            self._event = stream.record_event()

    def done(self) -> bool:
        return self._result is not None or self._event.query()

    def result(self) -> list[bool]:
        """Per object (in the order given), whether it is intact and under its key."""
        if self._result is None:
            self._event.synchronize()
            self._result = self._ok.tolist()
        return self._result
