"""`l2_codec: cachegen`: lossy, bounded compression of the KV an L2 tier holds, after
CacheGen (Liu et al., SIGCOMM 2024, arXiv 2310.07240) where it fits Gemma 4's objects.
Never the default; outputs may change (README, "What the codec changes").

An object is one group's KV of one chunk in LMCache's KV_2LTD layout, `[2, layers,
tokens, channels]` (channels = KV heads x head size: 256-dim sliding and 512-dim full
heads are separate groups, so each gets its own scales), then the integrity trailer.
Each of its `P = 2 x layers` planes `[tokens, channels]` is coded on its own:

- tokens in groups of `ANCHOR`; a group's first token is its anchor, quantized to int8
  with one float32 scale per plane and group (`s_a = max |x| / 127`);
- every other token of the group is coded as its change against the anchor as
  decoded (`d = x - â`: KV of nearby tokens differs less than it varies), quantized to
  `bits` (2-8) with one float32 scale per plane, group and `BLOCK` channels
  (`s_d = max |d| / q`, `q = 2**(bits-1) - 1`), stored as `code = round(d / s_d) + q`
  in `bits` bits, most significant bit first, packed across bytes;
- the scales, anchors and packed codes are compressed with zstd (`zstandard`, the
  entropy coder; stored as they are where zstd does not make them smaller).

Decoding: `â = fl32(q_a * s_a)`; `x̂ = fl32(â + fl32((code - q) * s_d))` for the other
tokens, rounded to the KV's dtype (nearest, ties to even). Bound, per element, before that
rounding: `|x̂ - x| <= s / 2 + 2**-22 * max(|x|, |x̂|)` (s: the element's scale; the second
term covers float32 rounding in the subtraction and the two operations). A zero scale (an
all-zero group) is stored as 1.0 and every code is then exact. KV holding inf or NaN is not
coded (the object is not stored in that tier).

The trailer's checksum covers the KV as written, so the object that comes back is
sealed again: the frame stores `key64 = checksum - sum(x)` (mod 2**64) of the original
object (`integrity`), and the decoder writes `[MAGIC, sum(x̂) + key64, KV bytes, 0]`.
A frame is checked (its BLAKE2b) before anything is decoded, and the decoded object is
verified against its trailer like every object from L2, so an object stored under
another key (another key64) is still a miss.

Payload (little-endian): `SUB` (key64 int64, planes, tokens, channels uint32, anchor
uint16, bits uint8, dtype code uint8, tail bytes uint32), then the body: zstd of (or,
kind 1, as they are) anchor scales f32 [P, G], anchors int8 [P, G, C], change scales
f32 [P, G, NB], packed codes of every non-anchor token [P, T - G, C] in that order
(G = ceil(T / ANCHOR), NB = ceil(C / BLOCK)).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from ..layout import integrity
from . import codec

ANCHOR = 16
"""Tokens per group; the first is the group's anchor."""
BLOCK = 64
"""Channels sharing one change scale (a quarter of a sliding 256-dim head)."""
DTYPES = {1: torch.bfloat16, 2: torch.float16, 3: torch.float32}
_CODES = {d: c for c, d in DTYPES.items()}
SUB = struct.Struct("<qIIIHBBI")
_TRAILER_BYTES = 8 * integrity.SEAL_SHAPE[0]


def parts(planes: int, tokens: int, channels: int, bits: int) -> tuple[int, int, int, int]:
    """Bytes of the body's four arrays: anchor scales, anchors, change scales, codes."""
    g = -(-tokens // ANCHOR)
    nb = -(-channels // BLOCK)
    return (4 * planes * g, planes * g * channels, 4 * planes * g * nb,
            math.ceil(planes * (tokens - g) * channels * bits / 8))


def frame_size(kv_shape, bits: int) -> int:
    """The frame of an object of this KV shape: it holds the body stored as it is,
    the most a payload takes, so every object of the shape fits."""
    p, t, c = _planes(kv_shape)
    return codec.HEADER + SUB.size + sum(parts(p, t, c, bits))


def _planes(kv_shape) -> tuple[int, int, int]:
    if len(kv_shape) != 4 or kv_shape[0] != 2:
        raise ValueError(f"cachegen codes KV_2LTD objects [2, layers, tokens, channels], "
                         f"not {tuple(kv_shape)}")
    return 2 * kv_shape[1], kv_shape[2], kv_shape[3]


def _pack(codes: np.ndarray, bits: int) -> bytes:
    b = np.unpackbits(codes.reshape(-1, 1), axis=1)[:, 8 - bits:]
    return np.packbits(b.reshape(-1)).tobytes()


def _unpack(data, n: int, bits: int) -> np.ndarray:
    b = np.unpackbits(np.frombuffer(data, dtype=np.uint8))[:n * bits].reshape(n, bits)
    return (b.astype(np.int32) << np.arange(bits - 1, -1, -1, dtype=np.int32)).sum(1)


def encode_into(raw, out, kv_shape, dtype: torch.dtype, bits: int,
                level: int = codec.DEFAULT_LEVEL) -> int:
    """Encode the sealed object `raw` (KV of `kv_shape` and `dtype`, its trailer, any
    padding) into the writable `out`, whose whole length is the frame. Raises
    `codec.DoesNotFit` if it does not fit, ValueError for an object that is not sealed
    or not KV_2LTD."""
    import zstandard

    if not 2 <= bits <= 8 or dtype not in _CODES:
        raise ValueError(f"cachegen: bits {bits} (2-8), dtype {dtype}")
    p, t, c = _planes(kv_shape)
    src = memoryview(raw).cast("B")
    kv_bytes = p * t * c * dtype.itemsize
    if len(src) < kv_bytes + _TRAILER_BYTES:
        raise ValueError(f"cachegen: {len(src)} bytes hold no KV of {kv_shape} + trailer")
    kv = torch.frombuffer(bytearray(src[:kv_bytes]), dtype=dtype)
    magic, check, nbytes, _ = struct.unpack_from("<qqqq", src, kv_bytes)
    if magic != integrity.MAGIC or nbytes != kv_bytes:
        raise ValueError("cachegen: the object is not sealed (no valid trailer)")
    key64 = _signed(check - int(integrity.weighted_sums(kv.view(1, -1))[0]))
    x = kv.float().view(p, t, c)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cachegen: the KV holds inf or NaN: stored by no lossy code")
    g = -(-t // ANCHOR)
    q = (1 << (bits - 1)) - 1
    anchors = x[:, ::ANCHOR, :]
    sa = anchors.abs().amax(dim=2) / 127
    sa = torch.where(sa > 0, sa, torch.ones_like(sa))
    qa = torch.round(anchors / sa[:, :, None]).clamp_(-127, 127)
    ahat = qa * sa[:, :, None]  # â, as the decoder computes it
    rows = torch.arange(t)
    other = rows % ANCHOR != 0
    d = x - ahat[:, rows // ANCHOR, :]
    d[:, ~other, :] = 0
    pad_t, pad_c = g * ANCHOR - t, -(-c // BLOCK) * BLOCK - c
    dp = torch.nn.functional.pad(d.abs(), (0, pad_c, 0, pad_t))
    sd = dp.view(p, g, ANCHOR, -1, BLOCK).amax(dim=(2, 4)) / q
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    scale = sd.repeat_interleave(ANCHOR, dim=1)[:, :t].repeat_interleave(BLOCK, dim=2)[:, :, :c]
    codes = (torch.round(d / scale).clamp_(-q, q) + q)[:, other, :]
    body = b"".join((sa.numpy().astype("<f4").tobytes(),
                     qa.to(torch.int8).numpy().tobytes(),
                     sd.numpy().astype("<f4").tobytes(),
                     _pack(codes.to(torch.uint8).numpy(), bits)))
    packed = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(body)
    kind = 0
    if len(packed) >= len(body):
        packed, kind = body, 1
    sub = SUB.pack(key64, p, t, c, ANCHOR, bits, _CODES[dtype], len(src) - kv_bytes)
    return codec.write_frame(out, codec.CACHEGEN, dtype.itemsize, kind, len(src),
                             sub + packed)


def decode_into(frame, out) -> None:
    """Check the stored `frame` and write the object it codes into `out` (exactly the
    object's length): the decoded KV, its trailer sealed again, zeros after it. Raises
    `codec.Damaged` for a frame that is not intact or does not add up."""
    import zstandard

    dst = memoryview(out).cast("B")
    width, kind, payload = codec.read_frame(frame, codec.CACHEGEN, len(dst))
    if len(payload) < SUB.size:
        raise codec.Damaged("cachegen: payload shorter than its header")
    key64, p, t, c, anchor, bits, code, tail = SUB.unpack_from(payload)
    dtype = DTYPES.get(code)
    if dtype is None or anchor != ANCHOR or not 2 <= bits <= 8 or width != dtype.itemsize \
            or p * t * c * width + tail != len(dst) or tail < _TRAILER_BYTES or t == 0:
        raise codec.Damaged(f"cachegen: fields do not add up ({p}x{t}x{c}, dtype code "
                            f"{code}, anchor {anchor}, bits {bits}, tail {tail})")
    sizes = parts(p, t, c, bits)
    body = payload[SUB.size:]
    if kind == 0:
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=sum(sizes))
        except zstandard.ZstdError as e:
            raise codec.Damaged(f"cachegen: payload does not decode ({e})") from None
    if len(body) != sum(sizes):
        raise codec.Damaged(f"cachegen: body of {len(body)} bytes, not {sum(sizes)}")
    g, nb, q = -(-t // ANCHOR), -(-c // BLOCK), (1 << (bits - 1)) - 1
    o = np.cumsum((0,) + sizes)
    sa = torch.from_numpy(np.frombuffer(body, "<f4", p * g, o[0]).copy()).view(p, g)
    qa = torch.from_numpy(np.frombuffer(body, np.int8, p * g * c, o[1]).copy())
    sd = torch.from_numpy(np.frombuffer(body, "<f4", p * g * nb, o[2]).copy()).view(p, g, nb)
    rows = torch.arange(t)
    other = rows % ANCHOR != 0
    n = p * int(other.sum()) * c
    codes = torch.from_numpy(_unpack(body[o[3]:o[4]], n, bits)).view(p, -1, c)
    ahat = qa.view(p, g, c).float() * sa[:, :, None]
    x = ahat[:, rows // ANCHOR, :].clone()
    scale = sd.repeat_interleave(ANCHOR, dim=1)[:, :t].repeat_interleave(BLOCK, dim=2)[:, :, :c]
    x[:, other, :] = x[:, other, :] + (codes - q).float() * scale[:, other, :]
    kv = x.to(dtype).contiguous()
    kv_bytes = p * t * c * width
    dst[:kv_bytes] = kv.view(torch.uint8).numpy().tobytes()
    check = _signed(int(integrity.weighted_sums(kv.view(1, -1))[0]) + key64)
    struct.pack_into("<qqqq", dst, kv_bytes, integrity.MAGIC, check, kv_bytes, 0)
    dst[kv_bytes + _TRAILER_BYTES:] = bytes(tail - _TRAILER_BYTES)


def _signed(v: int) -> int:
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)
