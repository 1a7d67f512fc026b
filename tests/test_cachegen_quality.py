"""benchmarks/cachegen_quality.py's measurement on a small random-weight model (no
training), a few seconds on CPU: its bookkeeping, not the codec's quality.

- the `exact` row (the prefix's KV put back into a cache built like the coded rows')
  gives the reference's logits exactly (the same KV in the cache gives the same logits),
  so 0 % perplexity change and 100 % agreement;
- a row per bits value, float32 and bfloat16;
- the bytes: objects (KV + trailer) and frames worked out by hand from the format in
  stores/cachegen.py's docstring, and the ratios the rows report equal to them."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import cachegen_quality as cq  # noqa: E402

PREFIX, CONT, WINDOWS = 256, 32, 2


def frame_by_hand(planes: int, tokens: int, channels: int, bits: int) -> int:
    """Header 48 + SUB 28 + anchor scales 4PG + anchors PGC + change scales 4PG*NB +
    codes ceil(P (T - G) C bits / 8), G = ceil(T / 16), NB = ceil(C / 64)."""
    g, nb = math.ceil(tokens / 16), math.ceil(channels / 64)
    return 48 + 28 + 4 * planes * g + planes * g * channels + 4 * planes * g * nb \
        + math.ceil(planes * (tokens - g) * channels * bits / 8)


@pytest.fixture(scope="module")
def result():
    torch.set_num_threads(2)
    cfg = cq.make_config()
    model = cq.make_model(cfg, seed=0)
    _, held, _ = cq.split_corpus()
    rows = cq.windows(held, PREFIX + CONT, WINDOWS)
    assert rows.shape == (WINDOWS, PREFIX + CONT) and (rows[:, 0] == cq.BOS).all()
    return cfg, cq.measure(model, cfg, rows, PREFIX)


def test_exact_row_is_the_reference(result):
    _, res = result
    exact = res["rows"]["exact"]
    assert res["checks"]["exact_vs_reference_max_abs_logit"] == 0.0
    assert exact["perplexity_change_pct"] == 0.0
    assert exact["top1_agreement_pct"] == 100.0 and exact["first_token_agreement_pct"] == 100.0
    assert exact["positions"] == WINDOWS * CONT and exact["windows"] == WINDOWS
    # The cached run is the uncached forward over prefix + continuation, up to rounding.
    assert res["checks"]["exact_vs_full_forward_max_abs_logit"] < 1e-3


def test_a_row_per_bits_and_dtype(result):
    _, res = result
    rows = res["rows"]
    assert set(rows) == {"exact", "bf16"} | {f"cachegen-{b}" for b in cq.BITS} \
        | {f"bf16+cachegen-{b}" for b in cq.BITS}
    assert set(cq.BITS) == {8, 6, 4, 3, 2}
    for b in cq.BITS:
        assert rows[f"cachegen-{b}"]["bits"] == b and rows[f"cachegen-{b}"]["kv_dtype"] == "float32"
        assert rows[f"bf16+cachegen-{b}"]["kv_dtype"] == "bfloat16"
    for r in rows.values():
        assert r["positions"] == WINDOWS * CONT and math.isfinite(r["perplexity"])
        assert 0 <= r["top1_agreement_pct"] <= 100


@pytest.mark.parametrize("dtype,prefix", [(torch.float32, ""), (torch.bfloat16, "bf16+")])
def test_bytes_are_the_frames_worked_out_by_hand(result, dtype, prefix):
    cfg, res = result
    width = dtype.itemsize
    # This model: 6 layers with KV of their own (8 minus 2 KV-shared): 5 sliding (2 KV
    # heads x 32 = 64 channels) in one object per chunk, 1 full (2 x 64 = 128) in another.
    assert cq.groups(cfg) == {"sliding_attention": [0, 1, 2, 3, 4], "full_attention": [5]}
    objects = [(2 * 5, PREFIX, 64), (2 * 1, PREFIX, 128)]  # (planes, tokens, channels)
    raw = WINDOWS * sum(p * t * c * width + 32 for p, t, c in objects)
    for b in cq.BITS:
        row = res["rows"][f"{prefix}cachegen-{b}"]
        frame = WINDOWS * sum(frame_by_hand(p, t, c, b) for p, t, c in objects)
        assert row["raw_bytes"] == raw and row["frame_bytes"] == frame
        assert row["raw_over_frame"] == raw / frame
        assert row["stored_bytes"] <= frame
        assert row["stored_bytes"] == row["payload_bytes"] + WINDOWS * len(objects) * 48
    # One case in numbers: bf16, 4 bits, the sliding object [2, 5, 256, 64]:
    # 640 + 10240 + 640 + 76800 + 76 = 88396 bytes for 327680 + 32.
    assert frame_by_hand(10, 256, 64, 4) == 88396
