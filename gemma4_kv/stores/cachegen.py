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
- the scales, anchors and packed codes are stored as they are (`STORED`): no entropy
  coder, because a frame's size is fixed by its shape.

Encoding and decoding are plain torch ops on the object's bytes moved to a device
(`device_for`: the engine's GPU where it has one, else the CPU); both devices write
the same bytes (tests/test_cachegen_cuda.py).

Decoding: `â = fl32(q_a * s_a)`; `x̂ = fl32(â + fl32((code - q) * s_d))` for the other
tokens, rounded to the KV's dtype (nearest, ties to even). Bound, per element, before that
rounding: `|x̂ - x| <= s / 2 + 2**-22 * max(|x|, |x̂|)` (s: the element's scale; the second
term covers float32 rounding in the subtraction and the two operations). A zero scale (an
all-zero group) is stored as 1.0 and every code is then exact. KV holding inf or NaN is not
coded (the object is not stored in that tier).

The trailer's checksum covers the KV as written, so the object that comes back is
sealed again: the frame stores `key64 = checksum - sum(x)` (mod 2**64) of the original
object (`integrity`), and the decoder writes `[MAGIC, sum(x̂) + key64, KV bytes, 0]`.
A frame is checked (its BLAKE3) before anything is decoded, and the decoded object is
verified against its trailer like every object from L2, so an object stored under
another key (another key64) is still a miss.

Payload (little-endian): `SUB` (key64 int64, planes, tokens, channels uint32, anchor
uint16, bits uint8, dtype code uint8, tail bytes uint32), then the body (payload
kind 1, `STORED`): anchor scales f32 [P, G], anchors int8 [P, G, C], change scales
f32 [P, G, NB], packed codes of every non-anchor token [P, T - G, C] in that order
(G = ceil(T / ANCHOR), NB = ceil(C / BLOCK)).
"""

from __future__ import annotations

import math
import struct

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
CPU = torch.device("cpu")
STORED = 1
"""The frame's payload kind: the body as it is. A frame's size is fixed by its shape
(LMCache's tiers load values of one size), so an entropy coder could not shrink what
is stored or sent; it only cost time."""
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


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, each below 2**bits) -> their bits, most significant first, packed
    across bytes, the last byte padded with zero bits (numpy's `packbits` order), in
    integer ops of the codes' device. Each 8 codes make `bits` whole bytes."""
    n = codes.numel()
    if bits == 8:
        return codes.reshape(-1)
    if 8 % bits == 0:  # whole codes a byte (2 and 4 bits): fewer, narrower passes
        per = 8 // bits
        c = torch.nn.functional.pad(codes.reshape(-1), (0, -n % per)).view(-1, per)
        shifts = torch.arange(per - 1, -1, -1, dtype=torch.uint8, device=codes.device) * bits
        return (c << shifts).sum(dim=1, dtype=torch.uint8)
    c = torch.nn.functional.pad(codes.reshape(-1), (0, -n % 8)).view(-1, 8).to(torch.int64)
    shifts = torch.arange(7, -1, -1, device=codes.device) * bits
    word = (c << shifts).sum(dim=1, keepdim=True)  # 8 * bits <= 56 bits: exact in int64
    out = (word >> (torch.arange(bits - 1, -1, -1, device=codes.device) * 8)) & 0xFF
    return out.to(torch.uint8).view(-1)[:-(-n * bits // 8)]


def _unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of `_pack`: the first `n` codes (int64) of `packed` (uint8)."""
    if bits == 8:
        return packed[:n].to(torch.int64)
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per - 1, -1, -1, dtype=torch.uint8, device=packed.device) * bits
        codes = (packed[:-(-n // per), None] >> shifts) & ((1 << bits) - 1)
        return codes.view(-1)[:n].to(torch.int64)
    need = -(-n // 8) * bits
    b = torch.nn.functional.pad(packed[:need], (0, need - min(need, packed.numel())))
    b = b.view(-1, bits).to(torch.int64)
    word = (b << (torch.arange(bits - 1, -1, -1, device=b.device) * 8)).sum(dim=1, keepdim=True)
    codes = (word >> (torch.arange(7, -1, -1, device=b.device) * bits)) & ((1 << bits) - 1)
    return codes.view(-1)[:n]


def encode_tensors(x: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """The body's four arrays (as uint8 tensors on x's device, in body order) of the
    planes `x` ([P, T, C] float32, finite). Plain torch ops, each rounded as IEEE float32
    on any device (a division, a product and a difference are separate ops, never fused),
    so a GPU writes the same bytes as the CPU."""
    p, t, c = x.shape
    g, nb, q = -(-t // ANCHOR), -(-c // BLOCK), (1 << (bits - 1)) - 1
    xp = torch.nn.functional.pad(x, (0, nb * BLOCK - c, 0, g * ANCHOR - t))
    xp = xp.view(p, g, ANCHOR, nb, BLOCK)
    anchors = xp[:, :, 0]  # [P, G, NB, BLOCK]
    # Divisors as tensors of the device: CUDA divides by a host scalar as a product
    # with its reciprocal, which rounds differently from the CPU's (and IEEE's) quotient.
    sa = anchors.abs().amax(dim=(2, 3)) / torch.full((), 127.0, device=x.device)
    sa = torch.where(sa > 0, sa, torch.ones_like(sa))
    qa = torch.round(anchors / sa[:, :, None, None]).clamp_(-127, 127)
    ahat = qa * sa[:, :, None, None]  # â, as the decoder computes it
    d = xp - ahat[:, :, None]
    d[:, :, 0] = 0  # anchors are not changes
    d[:, g - 1, t - (g - 1) * ANCHOR:] = 0  # nor are the padding rows of the last group
    sd = d.abs().amax(dim=(2, 4)) / torch.full((), float(q), device=x.device)  # [P, G, NB]
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    codes = torch.round(d[:, :, 1:] / sd[:, :, None, :, None]).clamp_(-q, q).add_(q)
    codes = codes.to(torch.uint8).reshape(p, g * (ANCHOR - 1), nb * BLOCK)[:, :t - g, :c]
    return [sa.contiguous().view(torch.uint8).view(-1),
            qa.to(torch.int8).reshape(p, g, nb * BLOCK)[:, :, :c].contiguous().view(
                torch.uint8).view(-1),
            sd.contiguous().view(torch.uint8).view(-1),
            _pack(codes.contiguous(), bits)]


def decode_tensors(body: torch.Tensor, p: int, t: int, c: int, bits: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The KV ([P, T, C] of `dtype`, on body's device) that `body` (uint8, the four
    arrays, `parts` long) codes: `â = fl32(q_a * s_a)`, `x̂ = fl32(â + fl32((code - q) *
    s_d))`, each op separate, then rounded to `dtype` (nearest, ties to even)."""
    g, nb, q = -(-t // ANCHOR), -(-c // BLOCK), (1 << (bits - 1)) - 1
    o = [0]
    for size in parts(p, t, c, bits):
        o.append(o[-1] + size)
    sa = body[o[0]:o[1]].clone().view(torch.float32).view(p, g)  # clones: aligned
    qa = body[o[1]:o[2]].view(torch.int8).view(p, g, c)
    sd = body[o[2]:o[3]].clone().view(torch.float32).view(p, g, nb)
    codes = _unpack(body[o[3]:o[4]], p * (t - g) * c, bits).view(p, t - g, c)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, g * (ANCHOR - 1) - (t - g)))
    ahat = qa.float() * sa[:, :, None]  # [P, G, C]
    scale = sd[:, :, :, None].expand(p, g, nb, BLOCK).reshape(p, g, nb * BLOCK)[:, :, :c]
    change = (codes.view(p, g, ANCHOR - 1, c) - q).float() * scale[:, :, None]
    rows = torch.cat((ahat[:, :, None], ahat[:, :, None] + change), dim=2)
    return rows.reshape(p, g * ANCHOR, c)[:, :t].to(dtype).contiguous()


def device_for(choice: str) -> torch.device:
    """Where a serde codes: "cpu", or "auto" (this thread's CUDA device where there is
    one; the frames are the same bytes either way)."""
    if choice == "auto" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if choice not in ("auto", "cpu"):
        raise ValueError(f"cachegen: device {choice!r} (auto or cpu)")
    return CPU


def encode_into(raw, out, kv_shape, dtype: torch.dtype, bits: int,
                device: torch.device = CPU) -> int:
    """Encode the sealed object `raw` (KV of `kv_shape` and `dtype`, its trailer, any
    padding) into the writable `out`, whose whole length is the frame, coding on
    `device`. Raises `codec.DoesNotFit` if it does not fit, ValueError for an object
    that is not sealed, not KV_2LTD or not finite."""
    if not 2 <= bits <= 8 or dtype not in _CODES:
        raise ValueError(f"cachegen: bits {bits} (2-8), dtype {dtype}")
    p, t, c = _planes(kv_shape)
    src = memoryview(raw).cast("B")
    kv_bytes = p * t * c * dtype.itemsize
    if len(src) < kv_bytes + _TRAILER_BYTES:
        raise ValueError(f"cachegen: {len(src)} bytes hold no KV of {kv_shape} + trailer")
    magic, check, nbytes, _ = struct.unpack_from("<qqqq", src, kv_bytes)
    if magic != integrity.MAGIC or nbytes != kv_bytes:
        raise ValueError("cachegen: the object is not sealed (no valid trailer)")
    kv = _bytes(src, kv_bytes).to(device).view(dtype)
    x = kv.float().view(p, t, c)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cachegen: the KV holds inf or NaN: stored by no lossy code")
    arrays = encode_tensors(x, bits)
    key64 = _signed(check - int(integrity.weighted_sums(kv.view(1, -1))[0]))
    dst = memoryview(out).cast("B")
    size = SUB.size + sum(parts(p, t, c, bits))
    codec.check_fits(len(dst), size, len(src))  # before anything is written
    SUB.pack_into(dst, codec.HEADER, key64, p, t, c, ANCHOR, bits, _CODES[dtype],
                  len(src) - kv_bytes)
    start = codec.HEADER + SUB.size
    torch.frombuffer(dst, dtype=torch.uint8, count=size - SUB.size, offset=start).copy_(
        torch.cat(arrays))  # straight into the frame
    return codec.seal_frame(dst, codec.CACHEGEN, dtype.itemsize, STORED, len(src), size)


def decode_into(frame, out, device: torch.device = CPU) -> None:
    """Check the stored `frame` and write the object it codes into `out` (exactly the
    object's length), decoding on `device`: the decoded KV, its trailer sealed again,
    zeros after it. Raises `codec.Damaged` for a frame that is not intact or does not
    add up."""
    dst = memoryview(out).cast("B")
    width, kind, payload = codec.read_frame(frame, codec.CACHEGEN, len(dst))
    if len(payload) < SUB.size:
        raise codec.Damaged("cachegen: payload shorter than its header")
    key64, p, t, c, anchor, bits, code, tail = SUB.unpack_from(payload)
    dtype = DTYPES.get(code)
    if dtype is None or anchor != ANCHOR or not 2 <= bits <= 8 or width != dtype.itemsize \
            or p * t * c * width + tail != len(dst) or tail < _TRAILER_BYTES or t == 0 \
            or kind != STORED:
        raise codec.Damaged(f"cachegen: fields do not add up ({p}x{t}x{c}, dtype code "
                            f"{code}, anchor {anchor}, bits {bits}, tail {tail}, kind {kind})")
    size = sum(parts(p, t, c, bits))
    if len(payload) - SUB.size != size:
        raise codec.Damaged(f"cachegen: body of {len(payload) - SUB.size} bytes, not {size}")
    body = _bytes(payload[SUB.size:], size)
    kv = decode_tensors(body.to(device), p, t, c, bits, dtype).view(1, -1)
    check = _signed(int(integrity.weighted_sums(kv)[0]) + key64)
    kv_bytes = p * t * c * width
    torch.frombuffer(dst, dtype=torch.uint8, count=kv_bytes).copy_(kv.view(torch.uint8)[0])
    struct.pack_into("<qqqq", dst, kv_bytes, integrity.MAGIC, check, kv_bytes, 0)
    dst[kv_bytes + _TRAILER_BYTES:] = bytes(tail - _TRAILER_BYTES)


def _bytes(buf: memoryview, count: int) -> torch.Tensor:
    """The first `count` bytes of `buf` as a uint8 tensor: a view, or a copy where the
    buffer is read-only (torch views only writable memory; nothing here writes it)."""
    if buf.readonly:
        buf = memoryview(bytearray(buf[:count]))
    return torch.frombuffer(buf, dtype=torch.uint8, count=count)


def _signed(v: int) -> int:
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)
