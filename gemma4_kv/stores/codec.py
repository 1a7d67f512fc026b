"""The stored form of an object in an L2 tier under `l2_codec` (no torch, no LMCache):
the frame every mode shares, and the lossless mode.

An object (its KV and integrity trailer, as bytes) is stored as one frame of a size
fixed by its layout (`frame_size`): LMCache 0.5.6's `fs_native` and `valkey` tiers load
a value only into a buffer of exactly the size it expects (a shorter file is an
"incomplete read", a shorter Valkey value a miss), so the frame cannot shrink with each
object. An object whose encoding does not fit its frame is not stored (`DoesNotFit`).

Frame (little-endian):

    offset  size  field
    0       4     magic b"G4KC"
    4       1     format version (2)
    5       1     codec id (1: lossless, 2: cachegen, whose payload `cachegen.py` defines)
    6       1     element width the bytes were shuffled by (2 for bf16, 4 for fp32)
    7       1     payload kind: 0 zstd of the shuffled bytes, 1 the object's bytes as
                  they are (when zstd would not make them smaller)
    8       8     raw length: bytes of the object
    16      8     payload length
    24      8     frame length
    32      16    BLAKE3, its first 16 bytes, of the frame's bytes except these 16
                  (header, payload and zero padding)
    48      ...   payload, then zeros up to the frame length

Lossless (codec 1): the raw bytes' first `width * (raw // width)` bytes are split into
`width` byte planes (plane j holds byte j of every element: the high byte of a bf16,
sign and exponent, repeats far more than the low one), the planes concatenated, the
`raw % width` tail bytes appended, and the whole compressed by `zstandard` (one frame,
its content size recorded); if that is not smaller than the object, the payload is the
object's bytes as they are (kind 1), so a frame of 1.0 holds any object. `decode` checks
magic, version, lengths and the checksum over what is stored before it decompresses
anything: a damaged frame is `Damaged`.
"""

from __future__ import annotations

import math
import struct

import blake3
import numpy as np

MAGIC = b"G4KC"
VERSION = 2
"""2: the checksum is BLAKE3 (1 had BLAKE2b)."""
LOSSLESS = 1
CACHEGEN = 2
MODES = {"lossless": LOSSLESS, "cachegen": CACHEGEN}
"""Codec modes that encode (`none` stores the object as it is, with no frame);
`cachegen`'s payload is defined in `cachegen.py`, its frame here."""
_HEAD = struct.Struct("<4sBBBBQQQ")
HEADER = _HEAD.size + 16
"""Bytes before the payload: the fields and the checksum."""
DEFAULT_LEVEL = 3
"""zstd level: its default; the level changes only how small a payload is, never how
it decodes, so it is not part of the format."""


class Damaged(ValueError):
    """A stored frame that is not one this codec wrote intact (checked before decoding)."""


class DoesNotFit(ValueError):
    """An object whose encoding is larger than its frame: it is not stored."""


def frame_size(raw_len: int, frame: float) -> int:
    """Bytes of the stored frame of an object of `raw_len` bytes: the header plus
    `frame` (a fraction in (0, 1]) of the object, rounded up."""
    if not 0 < frame <= 1:
        raise ValueError(f"frame must be in (0, 1], got {frame!r}")
    return HEADER + math.ceil(raw_len * frame)


def identity(mode: str, frame: float, bits: int = 4) -> str:
    """What the key fingerprint names of a codec: its mode, format version and every
    parameter that changes what a load returns or where it is stored (`lossless`: the
    frame size; `cachegen`: its anchor interval, scale block and bit budget, which fix
    its frame); "" for `none` (keys stay those of unencoded objects)."""
    if mode == "none":
        return ""
    if mode == "lossless":
        return f"{mode}-v{VERSION}-shuffle-zstd-frame{frame!r}"
    if mode == "cachegen":
        from .cachegen import ANCHOR, BLOCK

        return f"{mode}-v{VERSION}-anchor{ANCHOR}-block{BLOCK}-bits{bits}-stored"
    raise ValueError(f"unknown codec mode {mode!r}")


def shuffle(raw: np.ndarray, width: int) -> np.ndarray:
    """The byte planes of `raw` (uint8) by element width, then its tail bytes."""
    n = raw.size // width * width
    planes = raw[:n].reshape(-1, width).T.reshape(-1)
    return np.concatenate([planes, raw[n:]])


def unshuffle(planes: np.ndarray, width: int) -> np.ndarray:
    """Inverse of `shuffle` (into a fresh array)."""
    n = planes.size // width * width
    body = planes[:n].reshape(width, -1).T.reshape(-1)
    return np.concatenate([body, planes[n:]])


def _checksum(frame: memoryview) -> bytes:
    """BLAKE3, 128 bits: on one core about 7 times BLAKE2b's rate (6.4 against 0.95
    GB/s on the 2-core CI machine), where BLAKE2b took most of a GPU-coded frame's time
    (H200, bench_codec.py's profile). One thread: serde threads run side by side."""
    h = blake3.blake3()
    h.update(frame[:_HEAD.size])
    h.update(frame[HEADER:])
    return h.digest(16)


def write_frame(out, codec_id: int, width: int, kind: int, raw_len: int,
                payload: bytes) -> int:
    """Write a frame of codec `codec_id` holding `payload` into the writable bytes-like
    `out` (its whole length is the frame): header, payload, zero padding, checksum.
    Returns that length; raises `DoesNotFit` (nothing written) if it does not fit."""
    dst = memoryview(out).cast("B")
    check_fits(len(dst), len(payload), raw_len)
    dst[HEADER:HEADER + len(payload)] = payload
    return seal_frame(dst, codec_id, width, kind, raw_len, len(payload))


def check_fits(total: int, payload_len: int, raw_len: int) -> None:
    """Raise `DoesNotFit` unless a payload of `payload_len` bytes fits a frame of
    `total` (the object's `raw_len` bytes named in the message)."""
    if HEADER + payload_len > total:
        raise DoesNotFit(f"{raw_len} bytes encode to {payload_len}, the frame holds "
                         f"{total - HEADER}")


def seal_frame(out, codec_id: int, width: int, kind: int, raw_len: int,
               payload_len: int) -> int:
    """`write_frame` for a payload its coder already wrote at `out[HEADER:]` (no copy):
    the zero padding, the header and the checksum. Returns the frame's length."""
    dst = memoryview(out).cast("B")
    total = len(dst)
    check_fits(total, payload_len, raw_len)
    end = HEADER + payload_len
    dst[end:total] = bytes(total - end)
    _HEAD.pack_into(dst, 0, MAGIC, VERSION, codec_id, width, kind, raw_len,
                    payload_len, total)
    dst[_HEAD.size:HEADER] = _checksum(dst)
    return total


def read_frame(frame, codec_id: int, raw_len: int) -> tuple[int, int, memoryview]:
    """(width, kind, payload) of a stored frame of codec `codec_id` for an object of
    `raw_len` bytes, after checking magic, version, fields and the checksum over what
    is stored: anything else raises `Damaged`, before a byte of it is decoded."""
    src = memoryview(frame).cast("B")
    if len(src) < HEADER:
        raise Damaged(f"{len(src)} bytes: shorter than a frame header")
    magic, version, codec, width, kind, stored_len, payload_len, total = \
        _HEAD.unpack_from(src)
    if magic != MAGIC or version != VERSION or codec != codec_id:
        raise Damaged(f"not a frame of this codec (magic {magic!r}, version {version}, "
                      f"codec {codec})")
    if total != len(src) or HEADER + payload_len > total or stored_len != raw_len \
            or width not in (1, 2, 4, 8) or kind not in (0, 1):
        raise Damaged(f"fields do not add up (frame {total} of {len(src)} stored, "
                      f"payload {payload_len}, object {stored_len} of {raw_len} expected, "
                      f"width {width}, kind {kind})")
    if bytes(src[_HEAD.size:HEADER]) != _checksum(src):
        raise Damaged("checksum mismatch: the stored frame is damaged")
    return width, kind, src[HEADER:HEADER + payload_len]


def encode_into(raw, out, width: int, level: int = DEFAULT_LEVEL) -> int:
    """Encode the object `raw` (a bytes-like) losslessly into the writable bytes-like
    `out`, whose whole length is the frame; returns that length. Raises `DoesNotFit`
    (nothing written past the header) if the payload does not fit."""
    import zstandard

    src = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
    payload = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(
        shuffle(src, width).tobytes())
    kind = 0
    if len(payload) >= src.size:
        payload, kind = src.tobytes(), 1
    return write_frame(out, LOSSLESS, width, kind, src.size, payload)


def encode(raw, frame_len: int, width: int, level: int = DEFAULT_LEVEL) -> bytes:
    """`encode_into` a new frame of `frame_len` bytes."""
    out = bytearray(frame_len)
    encode_into(raw, out, width, level)
    return bytes(out)


def decode_into(frame, out) -> None:
    """Check the stored `frame` and decode it into the writable `out` (exactly the
    object's length). Raises `Damaged` before decompressing anything if the frame is
    not intact, or if it decodes to other than `len(out)` bytes."""
    import zstandard

    dst = memoryview(out).cast("B")
    raw_len = len(dst)
    width, kind, payload = read_frame(frame, LOSSLESS, raw_len)
    if kind == 1:
        if len(payload) != raw_len:
            raise Damaged(f"a stored-as-is payload of {len(payload)} bytes, not {raw_len}")
        dst[:] = payload
        return
    try:
        planes = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_len)
    except zstandard.ZstdError as e:  # checksummed yet undecodable: written wrong
        raise Damaged(f"payload does not decode ({e})") from None
    if len(planes) != raw_len:
        raise Damaged(f"payload decodes to {len(planes)} bytes, not {raw_len}")
    dst[:] = unshuffle(np.frombuffer(planes, dtype=np.uint8), width).tobytes()


def decode(frame, raw_len: int) -> bytes:
    """`decode_into` a new object of `raw_len` bytes."""
    out = bytearray(raw_len)
    decode_into(frame, out)
    return bytes(out)
