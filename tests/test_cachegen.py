"""`l2_codec: cachegen` (stores/cachegen.py): the frame decoded here from its written
definition with numpy, struct and blake3 (never the module's helpers), the
module's decoding equal to it bit for bit and within the documented bound of the
original KV; frame sizes worked out by hand; then through LMCache's real `fs_native`
tier: loads within the bound and accepted by the integrity check (the trailer sealed
again), a damaged frame a miss. Compression ratios are printed (run with -s), not
asserted."""

from __future__ import annotations

import blake3
import struct

import numpy as np
import pytest
import torch

from gemma4_kv.keys.engine import fingerprint
from gemma4_kv.layout import integrity
from gemma4_kv.stores import cachegen, codec
from gemma4_kv.stores.base import HIGH
from gemma4_kv.stores.config import StoreConfig
from gemma4_kv.stores.embedded import EmbeddedStore
from test_remote_tier import CHUNK, LAYOUT, drop_cpu_tier, lookup, needed, wait_until, \
    writes_ended
from test_store import write
from model_keys import chunk_hashes

KEY = integrity.key64("fp", b"h" * 32, 1)


def sealed(shape, dtype, seed: int = 0, smooth: bool = True) -> tuple[torch.Tensor, bytes]:
    """A KV object of `shape` (KV_2LTD) and its bytes as an L1 object holds them: KV,
    the trailer under KEY, 64 bytes of padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if smooth:  # nearby tokens alike, as real KV is (random weights give less of it)
        x = torch.cumsum(x * 0.05, dim=2) + 0.01 * torch.randn(shape, generator=g)
    kv = x.to(dtype).contiguous()
    trailer = torch.zeros(4, dtype=torch.int64)
    integrity.seal(kv, trailer, KEY)
    return kv, kv.view(torch.uint8).numpy().tobytes() + trailer.numpy().tobytes() + bytes(64)


def oracle(frame: bytes, raw_len: int):
    """Decode a cachegen frame from the format's definition: (x̂ in float32, per-element
    scale, dtype code, key64)."""
    head = struct.Struct("<4sBBBBQQQ")
    magic, version, codec_id, width, kind, stored, plen, total = head.unpack_from(frame)
    assert (magic, version, codec_id, stored, total) == (b"G4KC", 2, 2, raw_len, len(frame))
    assert blake3.blake3(frame[:32] + frame[48:]).digest(16) == frame[32:48]
    payload = frame[48:48 + plen]
    key64, p, t, c, anchor, bits, dcode, tail = struct.unpack_from("<qIIIHBBI", payload)
    assert kind == 1  # the body as it is
    body = payload[28:]
    g, nb, q = -(-t // anchor), -(-c // 64), 2 ** (bits - 1) - 1
    o = 0
    sa = np.frombuffer(body, "<f4", p * g, o).reshape(p, g)
    o += 4 * p * g
    qa = np.frombuffer(body, np.int8, p * g * c, o).reshape(p, g, c)
    o += p * g * c
    sd = np.frombuffer(body, "<f4", p * g * nb, o).reshape(p, g, nb)
    o += 4 * p * g * nb
    others = [r for r in range(t) if r % anchor]
    n = p * len(others) * c
    packed = np.frombuffer(body, np.uint8, len(body) - o, o).astype(np.uint32)
    pos = np.arange(n, dtype=np.int64) * bits  # bit i*bits.. of the stream, MSB first
    window = (packed[pos // 8] << 16) | (np.append(packed, [0, 0])[pos // 8 + 1] << 8) \
        | np.append(packed, [0, 0])[pos // 8 + 2]
    codes = ((window >> (24 - bits - pos % 8)) & ((1 << bits) - 1)).reshape(p, -1, c)
    ahat = qa.astype(np.float32) * sa[:, :, None]
    x = np.empty((p, t, c), np.float32)
    scale = np.empty((p, t, c), np.float32)
    for r in range(t):
        x[:, r] = ahat[:, r // anchor]
        scale[:, r] = np.repeat(sa[:, r // anchor, None], c, 1)
    for j, r in enumerate(others):
        s = np.repeat(sd[:, r // anchor], 64, axis=1)[:, :c]
        x[:, r] = x[:, r] + (codes[:, j].astype(np.int64) - q).astype(np.float32) * s
        scale[:, r] = s
    return x, scale, dcode, key64


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (nearest, ties to even), as uint16 bit patterns."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoding_is_the_definitions_and_within_its_bound(bits, dtype):
    shape = (2, 3, 256, 96)  # 96 channels: the last scale block is partial
    kv, raw = sealed(shape, dtype, seed=bits)
    frame = bytearray(cachegen.frame_size(shape, bits))
    cachegen.encode_into(raw, frame, shape, dtype, bits)
    x, scale, dcode, key64 = oracle(bytes(frame), len(raw))
    back = bytearray(len(raw))
    cachegen.decode_into(bytes(frame), back)
    n = kv.numel() * kv.element_size()
    got = torch.frombuffer(back[:n], dtype=dtype)
    want = x.reshape(-1)
    if dtype == torch.bfloat16:
        assert dcode == 1
        assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), to_bf16_bits(want))
    else:
        assert dcode == 3 and np.array_equal(got.numpy(), want)
    # The bound, before the dtype's rounding: half a scale step, plus float32 rounding
    # (2**-22 of the larger magnitude; measured at most 0.32 * 2**-23 here).
    orig = kv.float().numpy().reshape(x.shape)
    err = np.abs(x - orig)
    assert (err <= scale / 2 + 2.0 ** -22 * np.maximum(np.abs(x), np.abs(orig))).all()
    # The trailer is sealed again under the original key; the padding is zeros.
    trailer = torch.frombuffer(back[n:n + 32], dtype=torch.int64)
    assert key64 == KEY and integrity.verify(got.view(kv.shape), trailer, KEY)
    assert not integrity.verify(got.view(kv.shape), trailer, KEY + 1)
    assert bytes(back[n + 32:]) == bytes(64)
    print(f"\n{dtype} bits {bits}: frame {len(frame) / len(raw):.3f} of the object, "
          f"payload {struct.unpack_from('<Q', frame, 16)[0] / len(raw):.3f}")


def test_device_choice():
    assert cachegen.device_for("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="auto or cpu"):
        cachegen.device_for("gpu")


def test_frame_sizes_by_hand():
    # [2, 3, 256, 128], bits 4: P = 6 planes, T = 256 tokens in G = 16 groups, C = 128
    # channels in NB = 2 blocks. Anchor scales 4*6*16 = 384, anchors 6*16*128 = 12288,
    # change scales 4*6*16*2 = 768, codes 6*240*128*4/8 = 92160: 105600, plus the
    # payload header (28) and the frame header (48): 105676 bytes, against 393216 of
    # bf16 KV (3.72 x fewer).
    assert cachegen.frame_size((2, 3, 256, 128), 4) == 105676
    # bits 3 with 100 channels (NB = 2): codes 6*240*100*3/8 = 54000, anchors 9600,
    # scales 384 + 768: 64752 + 76.
    assert cachegen.frame_size((2, 3, 256, 100), 3) == 64828


def test_damaged_unsealed_and_non_finite():
    shape = (2, 1, 32, 64)
    kv, raw = sealed(shape, torch.bfloat16)
    frame = bytearray(cachegen.frame_size(shape, 4))
    cachegen.encode_into(raw, frame, shape, torch.bfloat16, 4)
    out = bytearray(len(raw))
    for at in (5, 40, 60, len(frame) - 1):  # codec id, checksum, payload, padding
        bad = bytearray(frame)
        bad[at] ^= 0x01
        with pytest.raises(codec.Damaged):
            cachegen.decode_into(bytes(bad), out)
    with pytest.raises(codec.Damaged):  # a frame of another object's length
        cachegen.decode_into(bytes(frame), bytearray(len(raw) + 8))
    with pytest.raises(codec.Damaged):  # a lossless frame is not a cachegen one
        cachegen.decode_into(codec.encode(raw, codec.frame_size(len(raw), 1.0), 2), out)
    unsealed = bytearray(raw)
    unsealed[kv.numel() * 2] ^= 0xFF  # the trailer's magic
    with pytest.raises(ValueError, match="not sealed"):
        cachegen.encode_into(bytes(unsealed), frame, shape, torch.bfloat16, 4)
    nan = kv.clone()
    nan.view(-1)[7] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        cachegen.encode_into(nan.view(torch.uint8).numpy().tobytes() + raw[kv.numel() * 2:],
                             frame, shape, torch.bfloat16, 4)


# -- through LMCache's fs_native tier ---------------------------------------------------

def open_cachegen(path, bits: int = 4) -> EmbeddedStore:
    cfg = StoreConfig(cpu_bytes=4 << 20, codec="cachegen", codec_bits=bits,
                      l2_adapters=({"type": "fs_native", "base_path": str(path),
                                    "num_workers": 1},))
    fp = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK, codec=cfg.codec_identity())
    return EmbeddedStore(LAYOUT, fp, CHUNK, cfg)


def put_finite(store: EmbeddedStore, chain, seed: int) -> dict:
    """Every group of every chunk of `chain`, KV finite and smooth (cachegen codes no
    inf or NaN), sealed and committed as a save does."""
    g = torch.Generator().manual_seed(seed)
    res = store.reserve(write("r", chain, 0, [(0, 1)] * len(chain),
                              [(len(chain) * CHUNK, HIGH)]))
    data = {}
    for (h, gid), (kv, trailer, key) in res.objects.items():
        x = torch.cumsum(torch.randn(kv.shape, generator=g) * 0.05, dim=2)
        data[(h, gid)] = x.to(kv.dtype)
        kv.copy_(data[(h, gid)])
        integrity.seal(kv, trailer, key)
    store.commit(res)
    store.on_request_finished("r")
    return data


def files(path) -> list:
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_fs_native_loads_within_the_bound_and_damage_is_a_miss(tmp_path):
    hashes = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
    store = open_cachegen(tmp_path)
    try:
        data = put_finite(store, hashes, 1)
        writes_ended(store)
        wait_until(lambda: len(files(tmp_path)) == len(data)  # 5: chunk 0's sliding
                   # object is in no hit's window
                   and store.l2_writes_in_flight() == 0, "every object's file landed")
        sizes = {p.stat().st_size for p in files(tmp_path)}
        # One frame size per store, the largest object's. Group 0's [2, 2, 32, 32] bf16
        # (P 4, G 2, C 32, NB 1): anchor scales 4*4*2 = 32, anchors 4*2*32 = 256, change
        # scales 32, codes 4*30*32*4/8 = 1920; 2240 + 28 + 48 = 2316 (group 1's,
        # [2, 1, 32, 32], would take 1120 + 76 = 1196).
        assert sizes == {2316}
        drop_cpu_tier(store, hashes)
        p = lookup(store, hashes)
        assert p.loaded == set(data) == needed(hashes) and p.rejected == 0  # resealed
        pinned = store.pin(hashes, 0, len(hashes) * CHUNK)
        assert pinned is not None
        try:
            for k, v in pinned.views.items():
                x = data[k].float()
                # bits 4 (q = 7): |x̂ - x| <= s/2 with s <= max|d| / 7 and |d| <= 2 max|x|
                # + an anchor's step; bf16 rounding adds at most 2**-8 of |x̂|.
                bound = x.abs().max() * (2 / 7 / 2 * 1.01) + v.float().abs() * 2 ** -8
                assert ((v.float() - x).abs() <= bound).all(), k
                assert not torch.equal(v, data[k])  # lossy indeed
        finally:
            store.release(pinned)
        drop_cpu_tier(store, hashes)
        for f in files(tmp_path):  # one payload byte of every frame
            b = bytearray(f.read_bytes())
            b[60] ^= 0x01
            f.write_bytes(bytes(b))
        p = lookup(store, hashes)
        assert p.loaded == set() and store.pin(hashes, 0, len(hashes) * CHUNK) is None
    finally:
        store.close()
