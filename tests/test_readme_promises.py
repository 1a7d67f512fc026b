"""Behaviour the README promises, each through the real parts: the connector's
scheduler half on two real lookup ranks (tests/scheduler_half.py: vLLM's VllmConfig,
KVCacheManager, Request and block hasher; per rank a real LookupService and
EmbeddedStore behind a real lookup socket), and LMCache's real disk tier."""

from __future__ import annotations

import random

import pytest

from needs import require
from scheduler_half import CHUNK, SchedulerHalf

require("vllm")
pytestmark = pytest.mark.vllm

_rng = random.Random(25)
PROMPT = [_rng.randrange(3, 500) for _ in range(1100)]
HIT = 1024  # 4 full chunks of 256; the prompt's last token is computed by vLLM
NONE = [set(), set()]


@pytest.fixture(scope="module")
def half(tmp_path_factory):
    from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

    model = save_config(tiny_gemma4_config(window=100), tmp_path_factory.mktemp("model"))
    h = SchedulerHalf(model, ranks=2)
    yield h
    h.close()


def _request(half, rid: str, tokens, **sampling):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=1, **sampling), None,
                   block_hasher=half.block_hasher)


# -- "requests with skip_reading_prefix_cache ... (they are still stored)" ---------------

def test_a_request_that_skips_reading_cached_kv_is_still_stored(half):
    """vLLM's SamplingParams(skip_reading_prefix_cache=True): the connector offers no
    hit and pins nothing, even where the chunks are stored, but stores the chunks the
    request computes: a later request without the flag hits all 4 of them."""
    prompt = [t + 1 for t in PROMPT]  # keys of its own
    first = _request(half, "skip-1", prompt, skip_reading_prefix_cache=True)
    assert first.skip_reading_prefix_cache
    hit, meta = half.serve(first)
    assert hit == 0 and not meta.loads
    assert len(half.saved["skip-1"]) == HIT // CHUNK  # chunks 0-3 stored
    again = _request(half, "skip-2", prompt, skip_reading_prefix_cache=True)
    assert half.connector.get_num_new_matched_tokens(again, 0) == (0, False)
    assert half.pinned() == NONE  # asked nothing, pinned nothing
    half.connector.request_finished_all_groups(again, ((),) * len(half.layout.groups))
    hit, meta = half.serve(_request(half, "reads", prompt))
    assert hit == HIT and [(j.start, j.hit) for j in meta.loads] == [(0, HIT)]
    assert half.pinned() == NONE


# -- "returns True only once every rank has" ---------------------------------------------

def test_reset_cache_is_false_while_a_rank_fails_and_true_once_every_rank_resets(half):
    """A rank that does not answer (its lookup socket gone: a dead or hung worker) makes
    `reset_cache` False, which vLLM's `reset_prefix_cache` returns; with every rank
    answering it is True and the prompt stored before misses."""
    from gemma4_kv.lookup.channel import LookupServer

    prompt = [t + 2 for t in PROMPT]
    assert half.serve(half.request(prompt))[0] == 0
    assert half.serve(half.request(prompt))[0] == HIT
    address = half.servers[1].address
    half.servers[1].close()
    try:
        assert half.connector.reset_cache() is False
    finally:
        half.servers[1] = LookupServer(address, half.services[1].handle)
    assert half.connector.reset_cache() is True
    assert half.serve(half.request(prompt))[0] == 0  # new generation: nothing old hits
    assert half.pinned() == NONE


# -- "disk_gb ... GiB of the disk tier ..., LRU eviction" --------------------------------

def test_the_disk_tier_evicts_the_oldest_chunks_at_disk_gb(tmp_path):
    """40 chunks of 4 KiB (one full-attention group) written to a disk tier of 64 KiB,
    one request after the other, while the CPU tier holds them all: LMCache's L2
    eviction deletes the least recently stored files until the tier fits in
    `disk_gb`; the newest chunks stay on disk."""
    import torch

    from model_keys import chunk_hashes
    from gemma4_kv.keys.engine import fingerprint
    from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
    from gemma4_kv.stores.embedded import EmbeddedStore, StoreConfig
    from test_store import put, wait_for

    small = 32
    layout = KVLayout((KVGroup(0, AttentionKind.FULL, None, 32, 1, 32, 32, torch.bfloat16,
                               ("c",)),))
    cap = 64 << 10
    disk = tmp_path / "disk"
    disk.mkdir()
    s = EmbeddedStore(layout, fingerprint(layout, model="tiny", chunk_size=small), small,
                      StoreConfig(cpu_bytes=4 << 20, disk_path=str(disk),
                                  disk_gb=cap / (1 << 30)))
    try:
        gen = torch.Generator().manual_seed(3)
        chain = chunk_hashes(list(range(40 * small)), small)

        def on_disk():
            return {p.name.split("@")[3].removesuffix(".data"): p.stat().st_size
                    for p in disk.rglob("*") if p.is_file()}

        # Bounded waits: LMCache writes and evicts in background threads. Each chunk
        # lands before the next is written, so the tier's LRU order is the write order.
        for i in range(len(chain)):
            put(s, chain[:i + 1], gen, groups=(0,), first=i, req=f"r{i}")
            wait_for(lambda: chain[i].hex() in on_disk())
        wait_for(lambda: sum(on_disk().values()) <= cap, timeout=60)
        files = on_disk()
        assert 0 < len(files) < len(chain)
        kept = [i for i, h in enumerate(chain) if h.hex() in files]
        assert kept == list(range(len(chain) - len(kept), len(chain))), kept  # the newest
    finally:
        s.close()


# -- "KV per token (bf16, TP 1)" table and `gemma4-kv inspect` ---------------------------

def _kv_per_token_by_hand(shape: dict) -> int:
    """2 (K, V) x layers x KV heads x head dim x 2 bytes (bf16), summed over the layers
    that own KV (KV-shared layers read another layer's and are counted once, there).
    Gemma 4's pattern: every sixth layer (5, 11, ...) is full attention, with
    `num_global_key_value_heads` (else `num_key_value_heads`) heads of `global_head_dim`;
    the others slide with `num_key_value_heads` heads of `head_dim`."""
    owners = shape["num_hidden_layers"] - shape.get("num_kv_shared_layers", 0)
    full = sum(1 for i in range(owners) if i % 6 == 5)
    sliding = owners - full
    full_heads = shape.get("num_global_key_value_heads", shape["num_key_value_heads"])
    return (2 * sliding * shape["num_key_value_heads"] * shape["head_dim"] * 2
            + 2 * full * full_heads * shape["global_head_dim"] * 2)


@pytest.mark.parametrize("row, name, total", [
    ("31B", "gemma4-31b-like", 2 * 50 * 16 * 256 * 2 + 2 * 10 * 4 * 512 * 2),  # 901,120
    ("12B", "gemma4-12b-like", 2 * 40 * 8 * 256 * 2 + 2 * 8 * 2 * 512 * 2),  # 360,448
    ("E4B", "gemma4-e4b-like", 2 * 20 * 2 * 256 * 2 + 2 * 4 * 2 * 512 * 2),  # 57,344
])
def test_inspect_prints_the_kv_per_token_the_readme_table_shows(row, name, total, capsys):
    """The README's table row (KB per token, groups) against the bundled shape's numbers
    worked out by hand (above, and from its JSON) and against `gemma4-kv inspect`'s
    output."""
    import json
    import re
    from pathlib import Path

    from gemma4_kv.tools.cli import main

    root = Path(__file__).resolve().parents[1]
    shape = json.loads((root / "gemma4_kv/model_shapes" / f"{name}.json").read_text())
    assert _kv_per_token_by_hand(shape) == total
    readme = (root / "README.md").read_text()
    (kb, groups), = re.findall(rf"^\| {row}\b[^|]*\| (\d+) KB over (\d+) groups \|",
                               readme, flags=re.M)
    assert (int(kb), int(groups)) == (round(total / 1000), 6)
    assert main(["inspect", name]) == 0
    out = capsys.readouterr().out
    (n, printed), = re.findall(r"^(\d+) groups; ([\d,]+) bytes of KV per token", out,
                               flags=re.M)
    assert (int(n), int(printed.replace(",", ""))) == (6, total)


# -- "verify_checksums ... verify each object's checksum when it comes up from an L2 tier"

@pytest.mark.parametrize("verify", [True, False])
def test_verify_checksums_decides_whether_a_damaged_disk_object_is_offered(tmp_path, verify):
    """A disk object with 64 bytes flipped, brought up by a lookup: with the default
    (true) it is rejected and never offered; with `verify_checksums: false` nothing
    checks it and it is offered as it came (what turning it off gives up)."""
    import dataclasses

    import torch

    from gemma4_kv.config.settings import ConnectorSettings
    from gemma4_kv.stores.embedded import EmbeddedStore
    from test_store import (CHUNK as SCHUNK, FP, LAYOUT, disk_file, evict, prefetched, put,
                            stored_on_disk, wait_for)
    from gemma4_kv.stores.base import HIGH, LOW
    from model_keys import chunk_hashes

    extra = {"disk_path": str(tmp_path)} | ({} if verify else {"verify_checksums": False})
    config = dataclasses.replace(ConnectorSettings.from_extra_config(extra).store_config(),
                                 cpu_bytes=1 << 20)
    s = EmbeddedStore(LAYOUT, FP, SCHUNK, config)
    try:
        chain = chunk_hashes(list(range(3 * SCHUNK)), SCHUNK)
        put(s, chain, torch.Generator().manual_seed(7),
            ends=[(3 * SCHUNK, HIGH), (SCHUNK, LOW)])
        wait_for(lambda: stored_on_disk(tmp_path, 6))
        evict(s, chain)
        victim = disk_file(tmp_path, chain[1], 0)
        raw = bytearray(victim.read_bytes())
        mid = len(raw) // 2
        raw[mid:mid + 64] = bytes(b ^ 0xFF for b in raw[mid:mid + 64])
        victim.write_bytes(bytes(raw))
        p = prefetched(s, chain)
        assert (1 in s.resident(chain)[0]) is not verify
        assert p.rejected == (1 if verify else 0)
        s.finish_prefetch(p)
    finally:
        s.close()


# -- "disk_gb ... 0 = unbounded" ----------------------------------------------------------

def test_disk_gb_0_keeps_every_chunk_on_disk(tmp_path):
    """The disk tier of the `disk_gb` test above, with `disk_gb: 0`: all 40 chunks (160
    KiB, where 64 KiB made LMCache evict) stay on disk."""
    import torch

    from model_keys import chunk_hashes
    from gemma4_kv.config.settings import ConnectorSettings
    from gemma4_kv.keys.engine import fingerprint
    from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout
    from gemma4_kv.stores.embedded import EmbeddedStore
    from test_store import put, wait_for

    small = 32
    layout = KVLayout((KVGroup(0, AttentionKind.FULL, None, 32, 1, 32, 32, torch.bfloat16,
                               ("c",)),))
    disk = tmp_path / "disk"
    disk.mkdir()
    config = ConnectorSettings.from_extra_config(
        {"cpu_gb": 4 / 1024, "disk_path": str(disk), "disk_gb": 0}).store_config()
    s = EmbeddedStore(layout, fingerprint(layout, model="tiny", chunk_size=small), small,
                      config)
    try:
        gen = torch.Generator().manual_seed(3)
        chain = chunk_hashes(list(range(40 * small)), small)

        def on_disk():
            return {p.name.split("@")[3].removesuffix(".data")
                    for p in disk.rglob("*") if p.is_file()}

        for i in range(len(chain)):
            put(s, chain[:i + 1], gen, groups=(0,), first=i, req=f"r{i}")
            wait_for(lambda: chain[i].hex() in on_disk())
        assert sum(p.stat().st_size for p in disk.rglob("*") if p.is_file()) > 64 << 10
        assert on_disk() == {h.hex() for h in chain}
    finally:
        s.close()
