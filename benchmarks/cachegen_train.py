"""The trained model of benchmarks/cachegen_quality.py: Gemma 4's architecture at two
sizes, byte-level, trained on CPython's documentation text (`pydoc_data.topics`, which
ships with Python), on the CPU or a GPU.

- `small` (the CPU default): `tiny_gemma4_config` with 8 layers (5 sliding : 1 full,
  the last two KV-shared like the E-variants), head sizes 32:64 (as 256:512), 2 KV
  heads, hidden 128, window 128: 1.35 M parameters, 800 steps of 8 x 640 tokens in
  float32 (about 11 minutes on 2 CPU cores).
- `medium` (the GPU default): 14 layers, the last two KV-shared, so that the 12 with KV
  of their own are 10 sliding and 2 full (layers 5 and 11); head sizes 128:256, 2 KV
  heads (objects of 256 and 512 channels), hidden 512, window 256: about 35 M
  parameters. Trained in bfloat16 autocast (float32 weights and optimizer) on a GPU.

The corpus is small (about 0.43 M training bytes), so a 35 M model overfits it long
before a GPU's minutes run out: `medium` adds dropout on both residual branches,
weight decay 0.1, and keeps the weights of the step with the lowest loss on
validation topics (every 20th sorted key, kept out of training; the held-out topics
that the codec is measured on are never looked at while training).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from gemma4_kv.tools.harness import tiny_gemma4_config

PAD, EOS, BOS = 0, 1, 2  # tiny_gemma4_config's pad / eos / bos ids
OFFSET = 3  # byte b is token b + 3
VOCAB = 256 + OFFSET

SIZES = {
    "small": dict(
        model=dict(layers=8, kv_shared=2, window=128, head_dim=32, global_head_dim=64,
                   hidden=128, kv_heads=2),
        steps=800, seq=640, batch=8, lr=3e-3, weight_decay=0.01, dropout=0.0,
        eval_every=0, prefix=512, cont=128),
    "medium": dict(
        model=dict(layers=14, kv_shared=2, window=256, head_dim=128, global_head_dim=256,
                   hidden=512, kv_heads=2),
        steps=1000, seq=1280, batch=16, lr=1e-3, weight_decay=0.1, dropout=0.2,
        eval_every=50, prefix=1024, cont=128),
}
"""Per size: the model (`tiny_gemma4_config`'s arguments) and its training recipe
(`eval_every` 0: no validation split, the final weights are kept)."""
MODEL = SIZES["small"]["model"]

ASSUMED_TFLOPS = {"cuda": 50.0, "cpu": 0.04}
"""Sustained TFLOP/s assumed for the time estimate printed before training: eager
transformers at hidden 512 is bound by its many small element-wise kernels (norms,
rope, casts) as much as by its matmuls, so a fraction of an H100's bf16 peak. A guess,
checked by the `achieved_tflops` the result records."""


def make_config(size: str = "small"):
    cfg = tiny_gemma4_config(vocab=VOCAB, **SIZES[size]["model"])
    cfg._attn_implementation = "sdpa"
    return cfg


def make_model(cfg, seed: int, device: str | torch.device = "cpu"):
    import transformers

    torch.manual_seed(seed)
    return transformers.Gemma4ForCausalLM(cfg).float().to(device).eval()


def add_dropout(model, p: float) -> None:
    """Dropout on each decoder layer's attention and MLP branch, after its output norm,
    before it joins the residual stream (transformers' Gemma 4 has none); active only
    in training mode, so measurement is unchanged."""
    def drop(module, args, out):
        return torch.nn.functional.dropout(out, p, module.training)

    for layer in model.model.layers:
        layer.post_attention_layernorm.register_forward_hook(drop)
        layer.post_feedforward_layernorm.register_forward_hook(drop)


# ---------------------------------------------------------------- data

def _stream(keys: list[str]) -> torch.Tensor:
    """Each topic's UTF-8 bytes as tokens, then EOS."""
    from pydoc_data.topics import topics

    ids = []
    for k in keys:
        ids.extend(b + OFFSET for b in topics[k].encode("utf-8"))
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long)


def _keys() -> tuple[list[str], list[str], list[str]]:
    """Sorted topic keys: (held out: every 10th from the 6th; validation: every 20th
    from the 1st; the rest)."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    held = [k for i, k in enumerate(keys) if i % 10 == 5]
    val = [k for i, k in enumerate(keys) if i % 20 == 0]
    return held, val, [k for k in keys if k not in held and k not in val]


def split_corpus(validation: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Token streams (train, held out) and the held-out keys; with `validation` the
    validation topics are left out of train (`validation_stream`)."""
    held, val, rest = _keys()
    train = rest if validation else sorted(rest + val)
    return _stream(train), _stream(held), held


def validation_stream() -> torch.Tensor:
    return _stream(_keys()[1])


def windows(stream: torch.Tensor, length: int, n: int) -> torch.Tensor:
    """`n` non-overlapping windows of `length` tokens: BOS, then length - 1 tokens."""
    step = length - 1
    n = min(n, len(stream) // step)
    rows = [torch.cat([torch.tensor([BOS]), stream[i * step:(i + 1) * step]]) for i in range(n)]
    return torch.stack(rows)


# ---------------------------------------------------------------- training

def train_flops(model, batch: int, seq: int) -> float:
    """FLOPs of one training step: 6 per weight of every linear layer (the tied output
    head included) and token, plus attention's 12 S^2 d per sequence and layer (QK^T and
    PV, forward and backward; d = query heads x head size of the layer; the sliding
    layers' masked scores counted too, as sdpa with a mask computes them)."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear += model.model.embed_tokens.weight.numel()  # the tied lm head
    attn = sum(layer.self_attn.q_proj.out_features for layer in model.model.layers)
    return 6.0 * linear * batch * seq + 12.0 * batch * seq * seq * attn


def train(model, data: torch.Tensor, *, steps: int, seq: int, batch: int, lr: float,
          seed: int, weight_decay: float = 0.01, amp: str = "fp32",
          val: torch.Tensor | None = None, eval_every: int = 0,
          max_seconds: float | None = None, log_every: int = 25) -> dict:
    """AdamW, warm-up then cosine. With `val` and `eval_every`, the validation loss is
    taken every `eval_every` steps and at the end, and the best weights are kept.
    `max_seconds` stops early (the schedule is then cut short; recorded)."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95),
                            weight_decay=weight_decay,
                            **({"fused": True} if device.type == "cuda" else {}))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if amp == "bf16"
                else contextlib.nullcontext())
    curve, val_curve, best = [], [], (math.inf, -1, None)
    stopped = None
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        x = torch.stack([torch.cat([torch.tensor([BOS]), data[s:s + seq - 1]]) for s in starts])
        x = x.to(device, non_blocking=True)
        with autocast:
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        last = step == steps - 1 or (max_seconds is not None
                                     and time.perf_counter() - t0 > max_seconds)
        if step % log_every == 0 or last:
            curve.append((step, round(loss.item(), 4), round(time.perf_counter() - t0, 1)))
            print(f"  step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        if val is not None and eval_every and ((step + 1) % eval_every == 0 or last):
            v = mean_loss(model, val)
            model.train()
            val_curve.append((step, round(v, 4)))
            print(f"  step {step:4d} validation loss {v:.4f}", flush=True)
            if v < best[0]:
                best = (v, step, {k: t.detach().clone() for k, t in model.state_dict().items()})
        if last:
            stopped = step + 1 if step < steps - 1 else None
            break
    model.eval()
    out = {"steps": steps, "seq": seq, "batch": batch, "lr": lr, "weight_decay": weight_decay,
           "amp": amp, "curve": curve, "seconds": round(time.perf_counter() - t0, 1),
           "final_loss": curve[-1][1]}
    if stopped is not None:
        out["stopped_at_step"] = stopped  # by max_seconds
    if val_curve:
        model.load_state_dict(best[2])
        out.update(validation_curve=val_curve, kept_step=best[1], validation_loss=best[0])
    return out


@torch.no_grad()
def mean_loss(model, rows: torch.Tensor) -> float:
    """Mean next-token loss (nats) over `rows`, float32, in batches of 4."""
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for x in rows.split(4):
        x = x.to(device)
        out = model(input_ids=x, labels=x, use_cache=False)
        k = x[:, 1:].numel()
        total, n = total + float(out.loss) * k, n + k
    model.train(was)
    return total / n
