"""The worker's start-up line (connector/startup.py) for each kind of store: the tiers
and their per-rank sizes, addresses (secrets never shown), the fingerprint's short id,
the role. Through a real server's log: tests/test_e2e_serve.py."""

from __future__ import annotations

import torch

from gemma4_kv.config.settings import ConnectorSettings
from gemma4_kv.connector.startup import startup_line
from gemma4_kv.layout.groups import AttentionKind, KVGroup, KVLayout

LAYOUT = KVLayout((
    KVGroup(0, AttentionKind.SLIDING, 128, 16, 2, 16, 16, torch.bfloat16, ("a", "b")),
    KVGroup(1, AttentionKind.FULL, None, 32, 1, 32, 32, torch.float16, ("c",)),
))
FP = "gemma4kv-v3-tp1of2-0123456789abcdef01234567"


def line(extra: dict, role: str = "kv_both", enabled: bool = True) -> str:
    return startup_line(ConnectorSettings.from_extra_config(extra), LAYOUT, FP, 1, 2, role,
                        enabled)


def test_embedded_tiers_per_rank_with_their_addresses(tmp_path):
    valkey = {"type": "valkey", "startup_nodes": "redis.local:6379", "password": "hunter2"}
    text = line({"cpu_gb": 8, "disk_path": str(tmp_path), "disk_gb": 100,
                 "l2_adapters": [valkey]})
    assert text.startswith("gemma4-kv: rank 1/2: tiers cpu 4.00 GiB > disk "
                           f"{tmp_path} 50.00 GiB > l2 valkey redis.local:6379; ")
    assert "fingerprint 0123456789ab;" in text
    assert "2 KV groups (full/sliding), chunk 256 tokens; kv_both: loads and stores;" in text
    assert "1 l2_adapters, log level WARNING" in text
    assert "hunter2" not in text and "\n" not in text


def test_server_tier_role_and_a_rank_that_stores_nothing():
    text = line({"lmcache_server": "tcp://127.0.0.1:5555"}, role="kv_consumer")
    assert "tiers lmcache server tcp://127.0.0.1:5555 (its L1 and L2 tiers);" in text
    assert "kv_consumer: loads only;" in text
    assert "stores and loads nothing" in line({}, enabled=False)
    assert "tiers cpu 2.00 GiB;" in line({})  # the default 4 GiB over 2 ranks
