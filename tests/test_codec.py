"""`l2_codec`: the stored frame (`stores/codec.py`) against its definition, written out
again here with numpy, struct, blake3 and zstandard (never the module's helpers); then
through LMCache's real tiers (`fs_native` in a tmp dir, a real Valkey server): loads
are bit-exact, a damaged frame is a miss with nothing loaded, the codec is in the key.

The compression ratios of the data below are printed (run with -s), not asserted."""

from __future__ import annotations

import blake3
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from gemma4_kv.config.settings import ConnectorSettings, SettingsError
from gemma4_kv.keys.engine import fingerprint
from gemma4_kv.stores import codec
from gemma4_kv.stores.config import StoreConfig
from gemma4_kv.stores.embedded import EmbeddedStore
from test_remote_tier import (CHUNK, LAYOUT, copied, drop_cpu_tier, lookup, needed, put,
                              reads_back, spec_for, wait_until, writes_ended)
from tier_servers import require_server, tier_server  # noqa: F401  (fixture)
from model_keys import chunk_hashes as _chunk_hashes


def chunk_hashes(n: int) -> list[bytes]:
    return _chunk_hashes(list(range(n * CHUNK)), CHUNK)


def kinds(n: int = 1 << 15) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    walk = torch.cumsum(torch.randn(n, generator=g) * 0.01, 0)
    return {
        "random bytes": torch.randint(0, 256, (2 * n,), dtype=torch.uint8, generator=g),
        "gaussian bf16": torch.randn(n, generator=g).to(torch.bfloat16),
        "smooth bf16": walk.to(torch.bfloat16),
        "gaussian fp32": torch.randn(n // 2, generator=g),
        "smooth fp32": walk[: n // 2].clone(),
    }


def raw_of(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def expected_frame(raw: bytes, width: int, frame_len: int) -> bytes:
    """The frame as the format defines it, built here from scratch."""
    a = np.frombuffer(raw, dtype=np.uint8)
    n = a.size // width * width
    planes = b"".join(a[j:n:width].tobytes() for j in range(width)) + a[n:].tobytes()
    payload = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(planes)
    kind = 0
    if len(payload) >= len(raw):  # not smaller: stored as it is
        payload, kind = raw, 1
    head = struct.pack("<4sBBBBQQQ", b"G4KC", 2, 1, width, kind, len(raw), len(payload),
                       frame_len)
    body = payload + bytes(frame_len - 48 - len(payload))
    return head + blake3.blake3(head + body).digest(16) + body


@pytest.mark.parametrize("name", list(kinds()))
def test_a_frame_is_its_definition_and_decodes_bit_exact(name):
    t = kinds()[name]
    raw, width = raw_of(t), t.element_size() if t.dtype != torch.uint8 else 2
    frame_len = codec.frame_size(len(raw), 1.0)  # holds any object
    got = codec.encode(raw, frame_len, width)
    assert got == expected_frame(raw, width, frame_len)
    assert codec.decode(got, len(raw)) == raw
    payload = struct.unpack_from("<Q", got, 16)[0]
    print(f"\n{name}: {len(raw)} bytes -> payload {payload} "
          f"({len(raw) / payload:.2f}x), stored as is: {got[7] == 1}")


def test_an_odd_length_object_keeps_its_tail():
    raw = bytes(range(7)) * 3  # 21 bytes: a tail of 1 after 2-byte elements
    frame = codec.encode(raw, 48 + 200, 2)
    assert frame == expected_frame(raw, 2, 48 + 200) and codec.decode(frame, 21) == raw


def test_frame_size_by_hand():
    assert codec.frame_size(1000, 1.0) == 48 + 1000
    assert codec.frame_size(1000, 0.9) == 48 + 900
    assert codec.frame_size(1001, 0.5) == 48 + 501  # rounded up
    for bad in (0, 1.01, -0.5):
        with pytest.raises(ValueError):
            codec.frame_size(1000, bad)


def test_an_object_that_does_not_fit_is_refused():
    raw = raw_of(kinds()["random bytes"])
    with pytest.raises(codec.DoesNotFit):
        codec.encode(raw, codec.frame_size(len(raw), 0.9), 2)
    smooth = raw_of(kinds()["smooth bf16"])  # control: compressible, it fits
    assert codec.decode(codec.encode(smooth, codec.frame_size(len(smooth), 0.9), 2),
                        len(smooth)) == smooth


def flipped(frame: bytes, at: int) -> bytes:
    b = bytearray(frame)
    b[at] ^= 0x10
    return bytes(b)


@pytest.mark.parametrize("at", [0, 5, 9, 20, 40, 48, 100, -1])
def test_a_damaged_frame_is_refused_before_decoding(at, monkeypatch):
    raw = raw_of(kinds()["smooth bf16"])
    frame = codec.encode(raw, codec.frame_size(len(raw), 0.9), 2)

    def no_decoding(*a, **k):
        raise AssertionError("decompression ran on a damaged frame")

    monkeypatch.setattr(zstandard, "ZstdDecompressor", no_decoding)
    with pytest.raises(codec.Damaged):
        codec.decode(flipped(frame, at), len(raw))
    with pytest.raises(codec.Damaged):
        codec.decode(frame[:-1], len(raw))  # truncated
    with pytest.raises(codec.Damaged):
        codec.decode(frame, len(raw) + 2)  # another object's size


def test_the_codec_is_in_the_fingerprint():
    base = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK)
    ids = {codec.identity(m, f, b) for m, f, b in
           [("none", 0.9, 4), ("lossless", 0.9, 4), ("lossless", 1.0, 4),
            ("lossless", 0.75, 4), ("cachegen", 0.9, 4), ("cachegen", 0.9, 3)]}
    names = {fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK, codec=i) for i in ids}
    assert len(ids) == len(names) == 6
    assert fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK, codec="") == base
    cfg = StoreConfig(l2_adapters=({"type": "mock", "max_size_gb": 1},), codec="lossless")
    assert cfg.codec_identity() == codec.identity("lossless", 0.9) != ""
    assert StoreConfig(codec="lossless").codec_identity() == ""  # no L2 tier: no codec
    assert all(s["serde"] == {"type": "gemma4_kv", "mode": "lossless", "frame": 0.9,
                              "bits": 4, "device": "auto", "frame_bytes": 5000}
               for s in StoreConfig(disk_path="/x", l2_adapters=cfg.l2_adapters,
                                    codec="lossless").adapter_specs(5000))


def test_settings(tmp_path):
    s = ConnectorSettings.from_extra_config({"disk_path": str(tmp_path), "l2_codec": "lossless",
                                             "l2_codec_frame": 0.75})
    assert (s.store_config().codec, s.store_config().codec_frame) == ("lossless", 0.75)
    assert ConnectorSettings().l2_codec == "none"
    for extra, says in [
            ({"l2_codec": "lossless"}, "there is none"),
            ({"l2_codec": "zstd", "disk_path": str(tmp_path)}, "none/lossless/cachegen"),
            ({"l2_codec_frame": 1.5}, "at most 1"), ({"l2_codec_frame": 0}, "> 0"),
            ({"l2_codec": "lossless", "l2_adapters": [
                {"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 1, "serde": {"type": "fp8"}}]}, "fp8"),
            ({"l2_codec": "lossless", "l2_adapters": [
                {"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 1, "serde": {"type": "aesgcm"}}]},
             "its own \"serde\""),
            ({"l2_adapters": [{"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 1,
                               "serde": {"type": "gemma4_kv"}}]}, "set \"l2_codec\""),
            ({"l2_codec": "lossless", "lmcache_server": "tcp://127.0.0.1:1"},
             "cannot be combined with lmcache_server")]:
        with pytest.raises(SettingsError, match=None) as e:
            ConnectorSettings.from_extra_config(extra)
        assert says in str(e.value), (extra, str(e.value))


# -- through LMCache's real tiers -------------------------------------------------------

def open_coded(spec: dict, mode: str = "lossless", frame: float = 1.0) -> EmbeddedStore:
    cfg = StoreConfig(cpu_bytes=4 << 20, l2_adapters=(spec,), codec=mode, codec_frame=frame)
    fp = fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK, codec=cfg.codec_identity())
    return EmbeddedStore(LAYOUT, fp, CHUNK, cfg)


def stored_and_evicted(store: EmbeddedStore, hashes, path: Path | None = None) -> dict:
    """Put every group of every chunk of `hashes` (2 objects a chunk), wait until the
    copies to L2 ended, then evict L1. With `path` (an `fs_native` directory) it also
    waits for the 2 * len(hashes) files that must land: LMCache's counts can read 0
    while its store thread holds keys it took off its queue (`writes_ended`)."""
    data = put(store, hashes, torch.Generator().manual_seed(1))
    writes_ended(store)
    if path is not None:
        wait_until(lambda: len(files(path)) == 2 * len(hashes)
                   and store.l2_writes_in_flight() == 0, "every object's file landed")
    drop_cpu_tier(store, hashes)
    return data


def layout_tensors(store: EmbeddedStore):
    """Per group, empty tensors of its object's layout in L1 (KV, trailer, padding)."""
    return [[torch.empty(s, dtype=d) for s, d in zip(lay.shapes, lay.dtypes)]
            for lay in store._layouts.values()]


def files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_fs_native_round_trip_is_bit_exact_and_the_files_are_frames(tmp_path):
    hashes = chunk_hashes(3)
    store = open_coded({"type": "fs_native", "base_path": str(tmp_path), "num_workers": 1})
    try:
        data = stored_and_evicted(store, hashes, tmp_path)
        stored = files(tmp_path)
        assert stored and all(p.read_bytes()[:4] == b"G4KC" for p in stored)
        # The groups' objects differ in size (8 KiB and 4 KiB of KV): every frame is
        # the header plus the largest object's bytes (KV, trailer, padding) at frame 1.0.
        largest = max(sum(t.numel() * t.element_size() for t in o)
                      for o in layout_tensors(store))
        assert {p.stat().st_size for p in stored} == {48 + largest}
        p = lookup(store, hashes)
        assert p.loaded == needed(hashes) and p.rejected == 0
        assert reads_back(store, hashes, data)
    finally:
        store.close()


def test_fs_native_damaged_frame_is_a_miss_and_nothing_is_loaded(tmp_path):
    hashes = chunk_hashes(3)
    store = open_coded({"type": "fs_native", "base_path": str(tmp_path), "num_workers": 1})
    try:
        stored_and_evicted(store, hashes, tmp_path)
        for f in files(tmp_path):  # one payload byte of every frame
            b = bytearray(f.read_bytes())
            b[60] ^= 0x01
            f.write_bytes(bytes(b))
        p = lookup(store, hashes)
        assert p.loaded == set() and store.resident(hashes) == {0: set(), 1: set()}
        assert store.pin(hashes, 0, len(hashes) * CHUNK) is None
    finally:
        store.close()


def test_objects_too_large_for_their_frame_are_not_stored(tmp_path):
    """Random KV bits do not compress: with a frame of half the object nothing reaches
    the tier, and a lookup misses (loads nothing)."""
    hashes = chunk_hashes(2)
    store = open_coded({"type": "fs_native", "base_path": str(tmp_path), "num_workers": 1},
                       frame=0.5)
    try:
        stored_and_evicted(store, hashes)
        assert files(tmp_path) == []
        assert lookup(store, hashes).loaded == set()
    finally:
        store.close()


def test_an_uncoded_store_cannot_read_coded_objects(tmp_path):
    """Keys differ by codec: a store without the codec on the same directory finds
    nothing the coded one wrote."""
    hashes = chunk_hashes(2)
    spec = {"type": "fs_native", "base_path": str(tmp_path), "num_workers": 1}
    coded = open_coded(spec)
    try:
        stored_and_evicted(coded, hashes, tmp_path)
    finally:
        coded.close()
    plain = EmbeddedStore(LAYOUT, fingerprint(LAYOUT, model="tiny", chunk_size=CHUNK), CHUNK,
                          StoreConfig(cpu_bytes=4 << 20, l2_adapters=(spec,)))
    try:
        assert lookup(plain, hashes).loaded == set()
    finally:
        plain.close()


def test_valkey_round_trip_and_damage(tier_server):  # noqa: F811
    hashes = chunk_hashes(3)
    store = open_coded(spec_for(tier_server))
    try:
        data = put(store, hashes, torch.Generator().manual_seed(1))
        keys = copied(store, tier_server, 6)
        assert all(tier_server.cli("GETRANGE", k, "0", "3").strip() == "G4KC" for k in keys)
        drop_cpu_tier(store, hashes)
        assert lookup(store, hashes).loaded == needed(hashes)
        assert reads_back(store, hashes, data)
        drop_cpu_tier(store, hashes)
        for k in keys:  # one payload byte of every frame
            tier_server.cli("SETRANGE", k, "60", "X")
        p = lookup(store, hashes)
        assert p.loaded == set() and store.resident(hashes) == {0: set(), 1: set()}
        assert store.pin(hashes, 0, len(hashes) * CHUNK) is None
    finally:
        store.close()
