"""Object trailers: the checksum is plain modular arithmetic (checked against a numpy
uint64 oracle), catches any changed word, binds the key, and is the same on CPU and GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemma4_kv.stores import integrity
from paged import random_bits


def oracle(t: torch.Tensor, key: int) -> int:
    x = t.contiguous().reshape(-1).view(torch.uint8).numpy().view(np.uint64)
    w = integrity.weights(x.size).numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        s = int((x * w).sum(dtype=np.uint64))
    return (s + key) % (1 << 64)


@pytest.mark.parametrize("shape,dtype", [((2, 3, 64, 32), torch.bfloat16),
                                         ((2, 1, 512, 48), torch.float32),
                                         ((3, 1 << 17), torch.float8_e4m3fn)])
def test_checksum_matches_the_uint64_oracle(shape, dtype):
    t = random_bits(shape, dtype, generator=torch.Generator().manual_seed(0))
    key = integrity.key64("fp", b"h" * 32, 3)
    trailer = torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE)
    integrity.seal(t, trailer, key)
    assert trailer[0] == integrity.MAGIC and trailer[2] == t.numel() * t.element_size()
    assert int(trailer[1]) % (1 << 64) == oracle(t, key)
    assert integrity.verify(t, trailer, key)


def test_any_changed_word_a_truncation_or_another_key_fails():
    gen = torch.Generator().manual_seed(1)
    t = random_bits((2, 2, 256, 64), torch.bfloat16, generator=gen)
    key = integrity.key64("fp", b"a" * 32, 0)
    trailer = torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE)
    integrity.seal(t, trailer, key)
    words = t.view(-1).view(torch.int64)
    for i in torch.randint(0, words.numel(), (50,), generator=gen).tolist():
        bad = t.clone()
        bad.view(-1).view(torch.int64)[i] ^= 1 << int(torch.randint(0, 63, (1,)))
        assert not integrity.verify(bad, trailer, key)
    swapped = t.clone().view(-1).view(torch.int64)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert not integrity.verify(swapped.view(torch.bfloat16).view(t.shape), trailer, key)
    assert not integrity.verify(t[:, :, :128], trailer, key)
    assert not integrity.verify(t, trailer, integrity.key64("fp", b"b" * 32, 0))
    assert not integrity.verify(t, trailer, integrity.key64("other", b"a" * 32, 0))
    assert not integrity.verify(t, trailer, integrity.key64("fp", b"a" * 32, 1))
    zeros = torch.zeros_like(trailer)
    assert not integrity.verify(t, zeros, key)


@pytest.mark.cuda
def test_gpu_and_cpu_checksums_are_equal():
    t = random_bits((6, 2, 10, 256, 512), torch.bfloat16,
                    generator=torch.Generator().manual_seed(2))
    keys = [integrity.key64("fp", bytes([i]) * 32, i) for i in range(6)]
    on_gpu = integrity.seal_many(t.cuda(), keys).cpu()
    for k, key in enumerate(keys):
        assert integrity.verify(t[k], on_gpu[k], key)
