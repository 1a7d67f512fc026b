"""Object trailers: the checksum is plain modular arithmetic (checked against a numpy
uint64 oracle, weights included), catches any changed word, any swap of two different
words and high-bit damage, binds the key, and is the same on CPU and GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gemma4_kv.layout import integrity
from paged import random_bits


M30 = np.uint64((1 << 30) - 1)


def weights_np(n: int) -> np.ndarray:
    """The weights as defined, in numpy uint64: w_i = 2 * p(i) + 1 with p the 30-bit mix
    (add, then two rounds of xorshift and multiply by an odd constant, each mod 2**30)."""
    z = (np.arange(n, dtype=np.uint64) + np.uint64(0x2B5D3A97)) & M30
    z = ((z ^ (z >> np.uint64(15))) * np.uint64(0x7FEB352D)) & M30
    z = ((z ^ (z >> np.uint64(13))) * np.uint64(0x846CA68B)) & M30
    z ^= z >> np.uint64(16)
    return np.uint64(2) * z + np.uint64(1)


def format2_weights_np(n: int) -> np.ndarray:
    """Format 2's weights: the top 31 bits of splitmix64 of the index, made odd (only
    2**30 values, so long objects repeat them)."""
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(33)) | np.uint64(1)


def _words_np(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().view(np.uint32).astype(np.uint64)


def oracle(t: torch.Tensor, key: int, weights=weights_np) -> int:
    """The definition, in numpy: unsigned 32-bit words times the weights (each below
    2**31, odd), summed mod 2**64."""
    x = _words_np(t)
    w = weights(x.size)
    assert (w < (1 << 31)).all() and (w & 1).all()
    with np.errstate(over="ignore"):
        s = int((x * w).sum(dtype=np.uint64))
    return (s + key) % (1 << 64)


def test_weights_are_the_defined_ones_and_distinct_beyond_the_largest_object():
    """A 31B sliding chunk object is [2, 10, 256, 4096] bf16: 10,485,760 words < 2**24."""
    n = 1 << 24
    w = integrity.weights(n).numpy()
    assert np.unique(w).size == n
    assert np.array_equal(w.view(np.uint64), weights_np(n))
    assert w.min() >= 1 and w.max() < (1 << 31) and (w & 1).all()
    with pytest.raises(ValueError, match="2\\*\\*30"):
        integrity.weights((1 << 30) + 1)


def test_a_swap_at_positions_that_format_2_weighted_alike_fails():
    """Format 2 gave some positions the same weight (61,611 in a 44 MiB object); two
    different words swapped there kept its checksum. The first such pair lies in the
    first 2**17 words."""
    old = format2_weights_np(1 << 17)
    order = np.argsort(old, kind="stable")
    same = np.flatnonzero(old[order][1:] == old[order][:-1])
    assert same.size, "no repeated format-2 weight in the first 2**17 words"
    i, j = sorted((int(order[same[0]]), int(order[same[0] + 1])))
    t = random_bits((j + 1,), torch.int32, generator=torch.Generator().manual_seed(5))
    t[i], t[j] = 7, 11
    swapped = t.clone()
    swapped[[i, j]] = swapped[[j, i]]
    key = integrity.key64("fp", b"s" * 32, 0)
    assert oracle(swapped, key, format2_weights_np) == oracle(t, key, format2_weights_np)
    assert not integrity.verify(swapped, _sealed(t, key), key)


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


def _sealed(t, key):
    trailer = torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE)
    integrity.seal(t, trailer, key)
    return trailer


def test_high_bit_damage_fails_every_time():
    """The cases a sum of 64-bit words mod 2**64 passed: bit 63 flipped in two words
    (every time), the sign of every 4th bf16 of a 4 KiB page, random top-byte damage
    (9 of 2,000 passed)."""
    gen = torch.Generator().manual_seed(3)
    t = random_bits((2, 2, 256, 64), torch.bfloat16, generator=gen)
    key = integrity.key64("fp", b"c" * 32, 0)
    trailer = _sealed(t, key)
    n64 = t.numel() // 4
    for _ in range(200):
        i, j = torch.randperm(n64, generator=gen)[:2].tolist()
        bad = t.clone()
        bad.view(-1).view(torch.int64)[[i, j]] ^= -(1 << 63)  # bit 63 of both
        assert not integrity.verify(bad, trailer, key)
    for page in range(0, t.numel() * 2, 4096):
        bad = t.clone()
        bf = bad.view(-1).view(torch.int16)
        lo = page // 2
        bf[lo:lo + 2048:4] ^= -(1 << 15)  # the sign bit of every 4th bf16 in the page
        assert not integrity.verify(bad, trailer, key)
    raw = t.view(-1).view(torch.uint8)
    for _ in range(2000):
        bad = raw.clone()
        k = int(torch.randint(1, 5, (1,), generator=gen))
        where = torch.randint(0, raw.numel() // 8, (k,), generator=gen) * 8 + 7
        bad[where] ^= torch.randint(1, 256, (k,), generator=gen, dtype=torch.uint8)
        assert not integrity.verify(bad.view(torch.bfloat16).view(t.shape), trailer, key)


def test_objects_sealed_with_an_older_format_fail():
    """Format 2 trailers (magic "g4kv2", its weights) and anything marked "g4kv1"."""
    t = random_bits((2, 64), torch.bfloat16, generator=torch.Generator().manual_seed(4))
    key = integrity.key64("fp", b"d" * 32, 1)
    trailer = _sealed(t, key)
    assert integrity.verify(t, trailer, key)
    s = (oracle(t, key, format2_weights_np) + (1 << 63)) % (1 << 64) - (1 << 63)
    format2 = torch.tensor([0x67346B7632, s, t.numel() * t.element_size(), 0])
    assert not integrity.verify(t, format2, key)
    for magic in (0x67346B7631, 0x67346B7632):
        old = trailer.clone()
        old[0] = magic
        assert not integrity.verify(t, old, key)


@pytest.mark.cuda
def test_gpu_and_cpu_checksums_are_equal():
    t = random_bits((6, 2, 10, 256, 512), torch.bfloat16,
                    generator=torch.Generator().manual_seed(2))
    keys = [integrity.key64("fp", bytes([i]) * 32, i) for i in range(6)]
    on_gpu = integrity.seal_many(t.cuda(), keys).cpu()
    for k, key in enumerate(keys):
        assert integrity.verify(t[k], on_gpu[k], key)


def test_both_widenings_give_the_unsigned_words():
    """The CPU's uint32 view and the GPU's mask widen int32 words alike (checked here on
    the CPU, where both run): by hand, -1 is 2**32 - 1 and INT32_MIN is 2**31."""
    words = torch.tensor([-1, 0, 5, -(1 << 31), (1 << 31) - 1], dtype=torch.int32)
    want = [(1 << 32) - 1, 0, 5, 1 << 31, (1 << 31) - 1]
    assert integrity.widen(words, masked=False).tolist() == want
    assert integrity.widen(words, masked=True).tolist() == want


def _objects(device_for_seal="cpu"):
    """Three sealed objects of two sizes; the second damaged in one bit afterwards, the
    third checked under another key: (objects as (kv, trailer, key), expected)."""
    gen = torch.Generator().manual_seed(31)
    out = []
    for i, n in enumerate((4096, 1536, 4096)):
        kv = torch.randint(-2**15, 2**15, (2, 3, n), dtype=torch.int16, generator=gen)
        kv = kv.view(torch.bfloat16)
        trailer = torch.empty(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE)
        integrity.seal(kv.to(device_for_seal), trailer, 1000 + i)
        out.append([kv, trailer, 1000 + i])
    out[1][0].view(torch.int16)[1, 2, 7] ^= 1
    out[2][2] = 7
    return [tuple(o) for o in out], [True, False, False]


def test_a_verification_on_the_host_agrees_with_verify():
    objects, expected = _objects()
    assert [integrity.verify(*o) for o in objects] == expected
    check = integrity.Verification(objects, "cpu")
    assert check.done() and check.result() == expected


@pytest.mark.cuda
def test_a_verification_on_the_gpu_agrees_with_verify_on_pinned_objects():
    """The objects sit in pinned host memory, as the server's registered L1 does: copied
    to the GPU by DMA and summed there, each verdict equals the host's."""
    objects, expected = _objects("cuda")
    pinned = [(kv.pin_memory(), t.pin_memory(), key) for kv, t, key in objects]
    check = integrity.Verification(pinned, torch.device("cuda"))
    assert check.result() == expected and check.done()


@pytest.mark.cuda
def test_a_kept_verification_leaves_the_verified_bytes_on_the_gpu():
    """`keep`: the copies a load then reads are bit for bit the objects, verdicts as
    without it (the damaged object's copy is its damaged bytes)."""
    objects, expected = _objects("cuda")
    pinned = [(kv.pin_memory(), t.pin_memory(), key) for kv, t, key in objects]
    check = integrity.Verification(pinned, torch.device("cuda"), keep=True)
    assert check.result() == expected
    assert [c.device.type for c in check.copies] == ["cuda"] * len(pinned)
    for (kv, _, _), copy in zip(pinned, check.copies):
        assert copy.shape == kv.shape and copy.dtype == kv.dtype
        assert torch.equal(copy.cpu().view(torch.uint8), kv.view(torch.uint8))
