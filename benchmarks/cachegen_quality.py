"""Quality of `l2_codec: cachegen` (gemma4_kv/stores/cachegen.py) on TRAINED weights,
on the CPU or a GPU.

A model of Gemma 4's architecture (benchmarks/cachegen_train.py: `small`, 1.35 M
parameters, the CPU default; `medium`, about 35 M, head sizes 128:256, the GPU default)
with a byte-level vocabulary is trained on CPython's own documentation text
(`pydoc_data.topics.topics`, standard library), every 10th topic (sorted keys) held
out. Then, on held-out windows of P + C tokens: the prefix's KV is computed, cut into
the objects an L2 tier would hold (KV_2LTD `[2, layers of the group, 256 tokens,
kv_heads x head_dim]`, one per attention group and 256-token chunk, sealed with the
integrity trailer), each object is encoded and decoded by the module's real
`cachegen.encode_into` / `cachegen.decode_into` on the measuring device (the decoded
trailer verified like an L2 load), the decoded KV is put back into transformers' Gemma 4
cache (sliding layers keep their last window - 1 tokens, KV-shared layers read their
source layer's), and the continuation is run teacher-forced with that cache against the
reference: the same continuation on the cache the prefix run itself left (the `exact`
row rebuilds the cache from the same KV the way the other rows do, so its 0 % / 100 %
checks that rebuilding):

- perplexity of the continuation (C - 1 targets per window), relative change in %;
- top-1 agreement: argmax of the logits equal at each of the C continuation positions;
- first-token agreement: position 0, the token right after the cached prefix;
- bytes: the objects (KV + 32-byte trailer) vs their frames (`cachegen.frame_size`,
  what an L2 slot takes; the body is stored as it is, so header + payload, the frame's
  length field at offset 16, is the frame), in all and per group.

Rows: exact float32 KV; float32 KV through cachegen at 8/6/4/3/2 bits; bfloat16 KV
without codec (cast and back: the reference for bf16 rows); bfloat16 KV through
cachegen; bfloat16 KV with a bit budget per group (`s4f6`: sliding objects at 4 bits,
full-attention objects at 6; the codec takes one `bits` per object, so a row just
encodes each group's objects with its own). The same is measured with the same
architecture's random (untrained) weights. Measurement is in float32 (TF32 off).

    PYTHONPATH=. python benchmarks/cachegen_quality.py [--device cpu|cuda] [--size small|medium]

writes benchmarks/results/cachegen_quality_{cpu|gpu}_<date>.json (the size in the name
where it is not the device's default) and prints a markdown table. The checkpoint goes
to /tmp (outside git); `--load` reuses one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch
from cachegen_train import (ASSUMED_TFLOPS, BOS, SIZES, VOCAB, add_dropout, make_config,
                            make_model, mean_loss, split_corpus, train, train_flops,
                            validation_stream, windows)

from gemma4_kv.layout import integrity
from gemma4_kv.stores import cachegen, codec

__all__ = ["BOS", "make_config", "make_model", "split_corpus", "windows", "measure", "groups"]
CHUNK = 256  # tokens per stored object, as LMCache's chunk
BITS = (8, 6, 4, 3, 2)
GROUP_BITS = ((4, 6), (4, 8), (3, 6), (5, 8))
"""Per-group budgets (sliding bits, full-attention bits) of the extra bf16 rows."""
TARGETS = {"raw_over_frame": 3.5, "perplexity_change_pct": 1.0, "top1_agreement_pct": 99.0}
"""Issue 34's targets for `cachegen`: >= 3.5 x fewer bytes, perplexity within +1 %,
top-1 agreement >= 99 %."""
KEY = integrity.key64("cachegen_quality", b"q" * 32, 1)
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- KV through the codec

def own_layers(cfg) -> list[int]:
    """Layers with KV of their own (the KV-shared ones read another layer's)."""
    return list(range(cfg.num_hidden_layers - (cfg.num_kv_shared_layers or 0)))


def groups(cfg) -> dict[str, list[int]]:
    """Layers per attention group, as the store's objects hold them."""
    out: dict[str, list[int]] = {}
    for i in own_layers(cfg):
        out.setdefault(cfg.layer_types[i], []).append(i)
    return out


def sealed_object(kv: torch.Tensor) -> bytes:
    """An L1 object's bytes: the KV, then its trailer sealed under KEY (on kv's device)."""
    trailer = torch.zeros(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE, device=kv.device)
    integrity.seal(kv, trailer, KEY)
    return kv.contiguous().view(torch.uint8).cpu().numpy().tobytes() \
        + trailer.cpu().numpy().tobytes()


def roundtrip(kv: torch.Tensor, bits: int) -> tuple[torch.Tensor, dict]:
    """Encode and decode one KV_2LTD object with cachegen on kv's device; (decoded KV on
    that device, its bytes)."""
    raw = sealed_object(kv)
    frame = bytearray(cachegen.frame_size(kv.shape, bits))
    cachegen.encode_into(raw, frame, kv.shape, kv.dtype, bits, kv.device)
    payload = struct.unpack_from("<Q", frame, 16)[0]
    back = bytearray(len(raw))
    cachegen.decode_into(bytes(frame), back, kv.device)
    n = kv.numel() * kv.element_size()
    got = torch.frombuffer(back[:n], dtype=kv.dtype).view(kv.shape).to(kv.device)
    trailer = torch.frombuffer(back[n:n + 32], dtype=torch.int64).clone()
    if not integrity.verify(got, trailer, KEY):
        raise AssertionError("the decoded object fails its integrity check")
    return got, {"raw": len(raw), "frame": len(frame), "stored": codec.HEADER + payload,
                 "payload": payload}


def to_objects(kv: dict[int, tuple[torch.Tensor, torch.Tensor]], layers: list[int],
               start: int, end: int) -> torch.Tensor:
    """KV_2LTD `[2, len(layers), end - start, kv_heads * head_dim]` of one chunk."""
    def plane(t):  # [1, heads, tokens, dim] -> [tokens, heads * dim]
        t = t[0, :, start:end, :]
        return t.permute(1, 0, 2).reshape(end - start, -1)
    return torch.stack([torch.stack([plane(kv[i][j]) for i in layers]) for j in (0, 1)])


def from_objects(obj: torch.Tensor, kv_heads: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of to_objects: per layer (K, V) `[1, heads, tokens, dim]`."""
    t = obj.shape[2]
    def unplane(p):
        return p.reshape(t, kv_heads, -1).permute(1, 0, 2).unsqueeze(0)
    return [(unplane(obj[0, l]), unplane(obj[1, l])) for l in range(obj.shape[1])]


def coded_kv(cfg, kv, dtype: torch.dtype, bits: int | dict[str, int] | None, stats: dict):
    """The prefix's KV as a load would give it: cast to `dtype`, through cachegen at
    `bits` (one budget, or one per group; None: no codec), back to float32 for the
    model. Adds the bytes and squared errors to `stats`, in all and per group."""
    out = {i: [[], []] for i in kv}
    tokens = kv[next(iter(kv))][0].shape[2]
    for group, layers in groups(cfg).items():
        b = bits[group] if isinstance(bits, dict) else bits
        for start in range(0, tokens, CHUNK):
            end = min(start + CHUNK, tokens)
            obj = to_objects(kv, layers, start, end).to(dtype).contiguous()
            if b is not None:
                dec, sizes = roundtrip(obj, b)
                diff = (dec.float() - obj.float())
                sizes.update(err_sq=float((diff ** 2).sum()), ref_sq=float((obj.float() ** 2).sum()))
                for acc in (stats, stats.setdefault("groups", {}).setdefault(group, {})):
                    for k, v in sizes.items():
                        acc[k] = acc.get(k, 0) + v
                obj = dec
            for i, (k, v) in zip(layers, from_objects(obj.float(), cfg.num_key_value_heads)):
                out[i][0].append(k)
                out[i][1].append(v)
    return {i: (torch.cat(k, dim=2), torch.cat(v, dim=2)) for i, (k, v) in out.items()}


def cache_of(cfg, kv):
    """transformers' Gemma 4 cache holding `kv` as the prefix run would have left it
    (sliding layers: their last window - 1 tokens; no layers for KV-shared ones)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    for i, (k, v) in kv.items():
        cache.update(k.clone(), v.clone(), i)
    return cache


# ---------------------------------------------------------------- measurement

SETTINGS = [("exact", torch.float32, None)] + [(f"cachegen-{b}", torch.float32, b) for b in BITS] \
    + [("bf16", torch.bfloat16, None)] + [(f"bf16+cachegen-{b}", torch.bfloat16, b) for b in BITS]
GROUP_SETTINGS = [(f"bf16+cachegen-s{s}f{f}", torch.bfloat16,
                   {"sliding_attention": s, "full_attention": f}) for s, f in GROUP_BITS]


def _row(dtype, bits, a: dict, base: float) -> dict:
    ppl = math.exp(a["nll"] / a["targets"])
    row = {"kv_dtype": str(dtype).removeprefix("torch."), "bits": bits,
           "perplexity": ppl, "perplexity_change_pct": 100 * (ppl / base - 1),
           "top1_agreement_pct": 100 * a["agree"] / a["positions"],
           "first_token_agreement_pct": 100 * a["first"] / a["windows"],
           "positions": a["positions"], "windows": a["windows"]}
    b = a["bytes"]
    if b:
        row.update(raw_bytes=b["raw"], frame_bytes=b["frame"], stored_bytes=b["stored"],
                   payload_bytes=b["payload"], raw_over_frame=b["raw"] / b["frame"],
                   raw_over_stored=b["raw"] / b["stored"],
                   kv_rel_rms_error=math.sqrt(b["err_sq"] / b["ref_sq"]),
                   by_group={g: {"bits": bits[g] if isinstance(bits, dict) else bits,
                                 "raw_bytes": s["raw"], "frame_bytes": s["frame"],
                                 "raw_over_frame": s["raw"] / s["frame"],
                                 "kv_rel_rms_error": math.sqrt(s["err_sq"] / s["ref_sq"])}
                             for g, s in b["groups"].items()})
        row["meets_targets"] = None if dtype != torch.bfloat16 else (  # bf16: vLLM's KV
            row["raw_over_frame"] >= TARGETS["raw_over_frame"]
            and row["perplexity_change_pct"] <= TARGETS["perplexity_change_pct"]
            and row["top1_agreement_pct"] >= TARGETS["top1_agreement_pct"])
    return row


@torch.no_grad()
def measure(model, cfg, rows: torch.Tensor, prefix: int, settings=SETTINGS) -> dict:
    """Every setting's numbers over the windows `rows` ([n, prefix + C]), on the
    model's device."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    acc = {name: {"nll": 0.0, "targets": 0, "agree": 0, "positions": 0, "first": 0,
                  "windows": 0, "bytes": {}} for name, _, _ in settings}
    checks = {"exact_vs_full_forward_max_abs_logit": 0.0,
              "exact_vs_reference_max_abs_logit": 0.0}
    nll_ref, n_ref = 0.0, 0
    shape_acc: dict = {}
    for x in rows:
        x = x.unsqueeze(0).to(device)
        pre, cont = x[:, :prefix], x[:, prefix:]
        # The reference: the continuation on the cache the prefix run itself left.
        own = DynamicCache(config=cfg)
        model(input_ids=pre, past_key_values=own, use_cache=True)
        ref = model(input_ids=cont, past_key_values=own, use_cache=True).logits[0].float()
        lp = torch.log_softmax(ref[:-1], dim=-1)
        nll_ref -= float(lp.gather(1, cont[0, 1:, None]).sum())
        n_ref += cont.shape[1] - 1
        whole = model(input_ids=x, use_cache=False).logits[0, prefix:].float()
        checks["exact_vs_full_forward_max_abs_logit"] = max(
            checks["exact_vs_full_forward_max_abs_logit"], float((whole - ref).abs().max()))
        full = DynamicCache()  # no config: every layer keeps every prefix token
        model(input_ids=pre, past_key_values=full, use_cache=True)
        kv = {i: (full.layers[i].keys, full.layers[i].values) for i in own_layers(cfg)}
        structure(cfg, kv, shape_acc)
        for name, dtype, bits in settings:
            if dtype == torch.float32 and bits is None:
                use = kv  # the prefix's KV as it is, in a cache built like the others
            else:
                use = coded_kv(cfg, kv, dtype, bits, acc[name]["bytes"])
            logits = model(input_ids=cont, past_key_values=cache_of(cfg, use),
                           use_cache=True).logits[0].float()
            if bits is None and dtype == torch.float32:
                checks["exact_vs_reference_max_abs_logit"] = max(
                    checks["exact_vs_reference_max_abs_logit"], float((logits - ref).abs().max()))
            a = acc[name]
            lp = torch.log_softmax(logits[:-1], dim=-1)
            tgt = cont[0, 1:]
            a["nll"] -= float(lp.gather(1, tgt[:, None]).sum())
            a["targets"] += len(tgt)
            top = logits.argmax(-1) == ref.argmax(-1)
            a["agree"] += int(top.sum())
            a["positions"] += len(top)
            a["first"] += int(top[0])
            a["windows"] += 1
    base = math.exp(nll_ref / n_ref)
    out = {name: _row(dtype, bits, acc[name], base) for name, dtype, bits in settings}
    kv_structure = {g: {"anchor_delta_over_value_rms": math.sqrt(a["anchor"] / a["value"]),
                        "adjacent_delta_over_value_rms": math.sqrt(a["adjacent"] / a["value"])}
                    for g, a in shape_acc.items()}
    return {"reference_perplexity": base, "rows": out, "kv_structure": kv_structure,
            "checks": checks}


def structure(cfg, kv, acc: dict) -> None:
    """How alike nearby tokens' KV is, per group (what the anchor-delta coding relies
    on): sums of squares of x, of x minus its group's anchor (non-anchor tokens, groups
    of ANCHOR from each chunk's start) and of x minus the previous token."""
    tokens = kv[next(iter(kv))][0].shape[2]
    for group, layers in groups(cfg).items():
        a = acc.setdefault(group, {"value": 0.0, "anchor": 0.0, "adjacent": 0.0})
        for start in range(0, tokens, CHUNK):
            x = to_objects(kv, layers, start, min(start + CHUNK, tokens)).float()
            rows = torch.arange(x.shape[2], device=x.device)
            other = rows % cachegen.ANCHOR != 0
            anchor = x[:, :, rows - rows % cachegen.ANCHOR]
            a["value"] += float((x[:, :, other] ** 2).sum())
            a["anchor"] += float(((x - anchor)[:, :, other] ** 2).sum())
            a["adjacent"] += float(((x[:, :, 1:] - x[:, :, :-1])[:, :, other[1:]] ** 2).sum())


def table(title: str, result: dict) -> str:
    lines = [f"**{title}**", "",
             "| setting | KV dtype | ppl | ppl change | top-1 agree | first token | "
             "raw/frame | sliding, full raw/frame | KV rel. RMS err | targets (bf16) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["rows"].items():
        if "raw_bytes" in r:
            per = ", ".join(f"{g['raw_over_frame']:.2f}x" for g in r["by_group"].values())
            by = (f"{r['raw_over_frame']:.2f}x | {per} | {r['kv_rel_rms_error']:.2e} | "
                  f"{ {True: 'met', False: 'no', None: '-'}[r['meets_targets']]}")
        else:
            by = "- | - | - | -"
        lines.append(f"| {name} | {r['kv_dtype']} | {r['perplexity']:.4f} | "
                     f"{r['perplexity_change_pct']:+.3f} % | {r['top1_agreement_pct']:.2f} % | "
                     f"{r['first_token_agreement_pct']:.1f} % | {by} |")
    return "\n".join(lines)


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def parse(argv) -> argparse.Namespace:
    """Options; those left out take the size's recipe (cachegen_train.SIZES)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=tuple(SIZES), default=None,
                    help="model and recipe (default: small on cpu, medium on cuda)")
    ap.add_argument("--amp", choices=("bf16", "fp32"), default=None,
                    help="training precision (default: bf16 autocast on cuda, fp32 on cpu)")
    for name, kind, what in (("steps", int, "training steps"),
                             ("seq", int, "training sequence length"),
                             ("batch", int, "training batch"), ("lr", float, "peak lr"),
                             ("weight-decay", float, "AdamW weight decay"),
                             ("dropout", float, "residual-branch dropout in training"),
                             ("eval-every", int, "validation every N steps (0: none)"),
                             ("prefix", int, "P: cached prefix tokens"),
                             ("cont", int, "C: continuation tokens")):
        ap.add_argument(f"--{name}", type=kind, default=None, help=f"{what} (size's default)")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows (at most)")
    ap.add_argument("--val-windows", type=int, default=32, help="validation windows (at most)")
    ap.add_argument("--max-train-s", type=float, default=None,
                    help="stop training after this many seconds (default: 240 on cuda)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ckpt", default=None, help="default /tmp/cachegen_quality/SIZE.pt")
    ap.add_argument("--load", action="store_true", help="reuse --ckpt instead of training")
    ap.add_argument("--out", default=None, help="the JSON file, or a folder for it")
    args = ap.parse_args(argv)
    args.size = args.size or ("medium" if args.device == "cuda" else "small")
    for k, v in SIZES[args.size].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.amp = args.amp or ("bf16" if args.device == "cuda" else "fp32")
    if args.max_train_s is None and args.device == "cuda":
        args.max_train_s = 240.0
    args.ckpt = args.ckpt or f"/tmp/cachegen_quality/{args.size}.pt"
    return args


def out_path(args, date: str) -> Path:
    """cachegen_quality_{cpu|gpu}_<date>.json, the size named where it is not the
    device's default; `--out` a file, or a folder to put it in."""
    dev = "gpu" if args.device == "cuda" else "cpu"
    default = "medium" if args.device == "cuda" else "small"
    name = f"cachegen_quality_{'' if args.size == default else args.size + '_'}{dev}_{date}.json"
    if args.out is None:
        return ROOT / "benchmarks/results" / name
    out = Path(args.out)
    return out / name if out.is_dir() or args.out.endswith("/") else out


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # measurement in true float32
    device = torch.device(args.device)
    t_start = time.perf_counter()
    date = datetime.date.today().isoformat()
    cfg = make_config(args.size)
    validate = args.eval_every > 0
    train_stream, held_stream, held_keys = split_corpus(validation=validate)
    rows = windows(held_stream, args.prefix + args.cont, args.windows)
    val = windows(validation_stream(), args.seq, args.val_windows) if validate else None
    print(f"corpus: {len(train_stream)} train tokens, {len(held_stream)} held-out tokens "
          f"({len(held_keys)} topics), {len(rows)} windows of {args.prefix}+{args.cont}"
          + (f", {len(val)} validation windows of {args.seq}" if validate else ""))

    model = make_model(cfg, args.seed, device)
    params = sum(p.numel() for p in model.parameters())
    flops = train_flops(model, args.batch, args.seq)
    if args.load:
        state = torch.load(args.ckpt, map_location=device)
        model.load_state_dict(state["model"])
        training = state["training"]
        print(f"loaded {args.ckpt}")
    else:
        guess = flops * args.steps / (ASSUMED_TFLOPS[args.device] * 1e12)
        print(f"training {params} parameters for {args.steps} steps of {args.batch} x "
              f"{args.seq} ({args.amp}): {flops / 1e12:.2f} TFLOP a step, "
              f"{flops * args.steps / 1e15:.2f} PFLOP; about {guess:.0f} s at an assumed "
              f"{ASSUMED_TFLOPS[args.device]} TFLOP/s", flush=True)
        if args.dropout:
            add_dropout(model, args.dropout)
        training = train(model, train_stream, steps=args.steps, seq=args.seq, batch=args.batch,
                         lr=args.lr, seed=args.seed, weight_decay=args.weight_decay,
                         amp=args.amp, val=val, eval_every=args.eval_every,
                         max_seconds=args.max_train_s)
        done = training.get("stopped_at_step", args.steps)
        training.update(dropout=args.dropout, flops_per_step=flops,
                        achieved_tflops=flops * done / training["seconds"] / 1e12)
        Path(args.ckpt).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "training": training}, args.ckpt)
    training["heldout_loss"] = mean_loss(model, rows)
    print(f"held-out loss {training['heldout_loss']:.4f} nats/byte", flush=True)

    settings = SETTINGS + GROUP_SETTINGS
    t0 = time.perf_counter()
    trained = measure(model, cfg, rows, args.prefix, settings)
    t_trained = time.perf_counter() - t0
    rnd = make_model(cfg, args.seed + 1, device)
    rnd_loss = mean_loss(rnd, rows)
    t0 = time.perf_counter()
    random_ = measure(rnd, cfg, rows, args.prefix, settings)
    t_random = time.perf_counter() - t0

    import transformers
    result = {
        "what": "cachegen quality: prefix KV replaced by its decoded form, continuation vs exact",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "threads": args.threads, "date": date, "size": args.size,
        "command": "PYTHONPATH=. python benchmarks/cachegen_quality.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0],
                     "cuda": torch.version.cuda if device.type == "cuda" else None},
        "model": {**SIZES[args.size]["model"], "vocab": VOCAB, "layer_types": cfg.layer_types,
                  "parameters": params, "groups": groups(cfg)},
        "codec": {"anchor": cachegen.ANCHOR, "block": cachegen.BLOCK, "chunk": CHUNK,
                  "device": args.device, "payload_kind": cachegen.STORED,
                  "objects": "one per attention group per 256-token chunk, KV_2LTD "
                             "[2, layers of the group, tokens, kv_heads*head_dim] + trailer"},
        "targets": TARGETS,
        "data": {"corpus": "pydoc_data.topics.topics", "heldout_topics": held_keys,
                 "train_tokens": len(train_stream), "heldout_tokens": len(held_stream),
                 "validation_windows": len(val) if validate else 0,
                 "prefix": args.prefix, "continuation": args.cont, "windows": len(rows)},
        "training": training,
        "trained": {**trained, "seconds": round(t_trained, 1)},
        "random": {**random_, "heldout_loss": rnd_loss, "seconds": round(t_random, 1)},
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }
    out = out_path(args, date)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print()
    print(table(f"trained weights ({args.size}, {training['steps']} steps, held-out loss "
                f"{training['heldout_loss']:.3f} nats/byte, {result['device']})", trained))
    print()
    print(table(f"random weights (held-out loss {rnd_loss:.3f} nats/byte)", random_))
    print(f"\nnearby tokens' KV (rms of the change / rms of the value): trained "
          f"{trained['kv_structure']}, random {random_['kv_structure']}")
    print(f"\nchecks: trained {trained['checks']}, random {random_['checks']}")
    print(f"wrote {out} ({result['wall_seconds']} s)")
    return result


if __name__ == "__main__":
    main()
