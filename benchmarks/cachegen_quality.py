"""Quality of `l2_codec: cachegen` (gemma4_kv/stores/cachegen.py) on TRAINED weights, CPU.

A small model of Gemma 4's architecture (`tiny_gemma4_config`: sliding and full layers
5:1, head sizes 32:64 like 256:512, two KV-shared layers like the E-variants, window
128) with a byte-level vocabulary is trained for a few minutes on CPython's own
documentation text (`pydoc_data.topics.topics`, standard library), every 10th topic
(sorted keys) held out. Then, on held-out windows of P + C tokens: the prefix's KV is
computed, cut into the objects an L2 tier would hold (KV_2LTD `[2, layers of the group,
256 tokens, kv_heads x head_dim]`, one per attention group and 256-token chunk, sealed
with the integrity trailer), each object is encoded and decoded by the module's real
`cachegen.encode_into` / `cachegen.decode_into` (the decoded trailer verified like an
L2 load), the decoded KV is put back into transformers' Gemma 4 cache (sliding layers
keep their last window - 1 tokens, KV-shared layers read their source layer's), and the
continuation is run teacher-forced with that cache against the reference: the same
continuation on the cache the prefix run itself left (the `exact` row rebuilds the cache
from the same KV the way the other rows do, so its 0 % / 100 % checks that rebuilding):

- perplexity of the continuation (C - 1 targets per window), relative change in %;
- top-1 agreement: argmax of the logits equal at each of the C continuation positions;
- first-token agreement: position 0, the token right after the cached prefix;
- bytes: the objects (KV + 32-byte trailer) vs their frames (`cachegen.frame_size`,
  what an L2 slot takes) and vs header + actual payload (the frame's length field at
  offset 16: SUB header + zstd body).

Rows: exact float32 KV; float32 KV through cachegen at 8/6/4/3/2 bits; bfloat16 KV
without codec (cast and back: the reference for bf16 rows); bfloat16 KV through
cachegen. The same is measured with the same architecture's random (untrained) weights.

    PYTHONPATH=. python benchmarks/cachegen_quality.py

writes benchmarks/results/cachegen_quality_cpu_<date>.json and prints a markdown table.
The checkpoint goes to /tmp (outside git); `--load` reuses one.
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

from gemma4_kv.layout import integrity
from gemma4_kv.stores import cachegen, codec
from gemma4_kv.tools.harness import tiny_gemma4_config

PAD, EOS, BOS = 0, 1, 2  # tiny_gemma4_config's pad / eos / bos ids
OFFSET = 3  # byte b is token b + 3
VOCAB = 256 + OFFSET
CHUNK = 256  # tokens per stored object, as LMCache's chunk
BITS = (8, 6, 4, 3, 2)
KEY = integrity.key64("cachegen_quality", b"q" * 32, 1)
ROOT = Path(__file__).resolve().parents[1]

MODEL = dict(layers=8, kv_shared=2, window=128, head_dim=32, global_head_dim=64,
             hidden=128, kv_heads=2)


def make_config(**model):
    cfg = tiny_gemma4_config(vocab=VOCAB, **{**MODEL, **model})
    cfg._attn_implementation = "sdpa"
    return cfg


def make_model(cfg, seed: int):
    import transformers

    torch.manual_seed(seed)
    return transformers.Gemma4ForCausalLM(cfg).float().eval()


# ---------------------------------------------------------------- data

def split_corpus() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Token streams (train, held out) of pydoc_data's topics: every 10th sorted key
    held out; each topic is its UTF-8 bytes then EOS."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    held = [k for i, k in enumerate(keys) if i % 10 == 5]

    def stream(ks):
        ids = []
        for k in ks:
            ids.extend(b + OFFSET for b in topics[k].encode("utf-8"))
            ids.append(EOS)
        return torch.tensor(ids, dtype=torch.long)

    return stream([k for k in keys if k not in held]), stream(held), held


def windows(stream: torch.Tensor, length: int, n: int) -> torch.Tensor:
    """`n` non-overlapping windows of `length` tokens: BOS, then length - 1 tokens."""
    step = length - 1
    n = min(n, len(stream) // step)
    rows = [torch.cat([torch.tensor([BOS]), stream[i * step:(i + 1) * step]]) for i in range(n)]
    return torch.stack(rows)


# ---------------------------------------------------------------- training

def train(model, data: torch.Tensor, *, steps: int, seq: int, batch: int, lr: float,
          seed: int, log_every: int = 25) -> dict:
    g = torch.Generator().manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    curve, t0 = [], time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        x = torch.stack([torch.cat([torch.tensor([BOS]), data[s:s + seq - 1]]) for s in starts])
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps - 1:
            curve.append((step, round(loss.item(), 4), round(time.perf_counter() - t0, 1)))
            print(f"  step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    model.eval()
    return {"steps": steps, "seq": seq, "batch": batch, "lr": lr, "curve": curve,
            "seconds": round(time.perf_counter() - t0, 1), "final_loss": curve[-1][1]}


@torch.no_grad()
def mean_loss(model, rows: torch.Tensor) -> float:
    total, n = 0.0, 0
    for x in rows.split(4):
        out = model(input_ids=x, labels=x, use_cache=False)
        k = x[:, 1:].numel()
        total, n = total + float(out.loss) * k, n + k
    return total / n


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
    """An L1 object's bytes: the KV, then its trailer sealed under KEY."""
    trailer = torch.zeros(integrity.SEAL_SHAPE, dtype=integrity.SEAL_DTYPE)
    integrity.seal(kv, trailer, KEY)
    return kv.contiguous().view(torch.uint8).numpy().tobytes() + trailer.numpy().tobytes()


def roundtrip(kv: torch.Tensor, bits: int) -> tuple[torch.Tensor, dict]:
    """Encode and decode one KV_2LTD object with cachegen; (decoded KV, its bytes)."""
    raw = sealed_object(kv)
    frame = bytearray(cachegen.frame_size(kv.shape, bits))
    cachegen.encode_into(raw, frame, kv.shape, kv.dtype, bits)
    payload = struct.unpack_from("<Q", frame, 16)[0]
    back = bytearray(len(raw))
    cachegen.decode_into(bytes(frame), back)
    n = kv.numel() * kv.element_size()
    got = torch.frombuffer(back[:n], dtype=kv.dtype).view(kv.shape).clone()
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


def coded_kv(cfg, kv, dtype: torch.dtype, bits: int | None, stats: dict):
    """The prefix's KV as a load would give it: cast to `dtype`, through cachegen at
    `bits` (None: no codec), back to float32 for the model."""
    out = {i: [[], []] for i in kv}
    tokens = kv[next(iter(kv))][0].shape[2]
    for layers in groups(cfg).values():
        for start in range(0, tokens, CHUNK):
            end = min(start + CHUNK, tokens)
            obj = to_objects(kv, layers, start, end).to(dtype).contiguous()
            if bits is not None:
                dec, b = roundtrip(obj, bits)
                for k in b:
                    stats[k] = stats.get(k, 0) + b[k]
                diff = (dec.float() - obj.float())
                stats["err_sq"] = stats.get("err_sq", 0.0) + float((diff ** 2).sum())
                stats["ref_sq"] = stats.get("ref_sq", 0.0) + float((obj.float() ** 2).sum())
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


@torch.no_grad()
def measure(model, cfg, rows: torch.Tensor, prefix: int, settings=SETTINGS) -> dict:
    """Every setting's numbers over the windows `rows` ([n, prefix + C])."""
    from transformers import DynamicCache

    acc = {name: {"nll": 0.0, "targets": 0, "agree": 0, "positions": 0, "first": 0,
                  "windows": 0, "bytes": {}} for name, _, _ in settings}
    checks = {"exact_vs_full_forward_max_abs_logit": 0.0,
              "exact_vs_reference_max_abs_logit": 0.0}
    nll_ref, n_ref = 0.0, 0
    shape_acc: dict = {}
    for x in rows:
        x = x.unsqueeze(0)
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
    out = {}
    for name, dtype, bits in settings:
        a = acc[name]
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
                       kv_rel_rms_error=math.sqrt(b["err_sq"] / b["ref_sq"]))
        out[name] = row
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
            rows = torch.arange(x.shape[2])
            other = rows % cachegen.ANCHOR != 0
            anchor = x[:, :, rows - rows % cachegen.ANCHOR]
            a["value"] += float((x[:, :, other] ** 2).sum())
            a["anchor"] += float(((x - anchor)[:, :, other] ** 2).sum())
            a["adjacent"] += float(((x[:, :, 1:] - x[:, :, :-1])[:, :, other[1:]] ** 2).sum())


def table(title: str, result: dict) -> str:
    lines = [f"**{title}**", "",
             "| setting | KV dtype | ppl | ppl change | top-1 agree | first token | "
             "raw/frame | raw/stored | KV rel. RMS err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in result["rows"].items():
        by = (f"{r['raw_over_frame']:.2f}x | {r['raw_over_stored']:.2f}x | "
              f"{r['kv_rel_rms_error']:.2e}") if "raw_bytes" in r else "- | - | -"
        lines.append(f"| {name} | {r['kv_dtype']} | {r['perplexity']:.4f} | "
                     f"{r['perplexity_change_pct']:+.3f} % | {r['top1_agreement_pct']:.2f} % | "
                     f"{r['first_token_agreement_pct']:.1f} % | {by} |")
    return "\n".join(lines)


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seq", type=int, default=640, help="training sequence length")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prefix", type=int, default=512, help="P: cached prefix tokens")
    ap.add_argument("--cont", type=int, default=128, help="C: continuation tokens")
    ap.add_argument("--windows", type=int, default=64, help="held-out windows (at most)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ckpt", default="/tmp/cachegen_quality/model.pt")
    ap.add_argument("--load", action="store_true", help="reuse --ckpt instead of training")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    date = datetime.date.today().isoformat()
    cfg = make_config()
    train_stream, held_stream, held_keys = split_corpus()
    rows = windows(held_stream, args.prefix + args.cont, args.windows)
    print(f"corpus: {len(train_stream)} train tokens, {len(held_stream)} held-out tokens "
          f"({len(held_keys)} topics), {len(rows)} windows of {args.prefix}+{args.cont}")

    model = make_model(cfg, args.seed)
    params = sum(p.numel() for p in model.parameters())
    if args.load:
        state = torch.load(args.ckpt)
        model.load_state_dict(state["model"])
        training = state["training"]
        print(f"loaded {args.ckpt}")
    else:
        print(f"training {params} parameters for {args.steps} steps")
        training = train(model, train_stream, steps=args.steps, seq=args.seq, batch=args.batch,
                         lr=args.lr, seed=args.seed)
        Path(args.ckpt).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "training": training}, args.ckpt)
    training["heldout_loss"] = mean_loss(model, rows)
    print(f"held-out loss {training['heldout_loss']:.4f} nats/byte")

    t0 = time.perf_counter()
    trained = measure(model, cfg, rows, args.prefix)
    t_trained = time.perf_counter() - t0
    rnd = make_model(cfg, args.seed + 1)
    rnd_loss = mean_loss(rnd, rows)
    t0 = time.perf_counter()
    random_ = measure(rnd, cfg, rows, args.prefix)
    t_random = time.perf_counter() - t0

    import transformers
    result = {
        "what": "cachegen quality: prefix KV replaced by its decoded form, continuation vs exact",
        "device": "CPU", "threads": args.threads, "date": date,
        "command": "PYTHONPATH=. python benchmarks/cachegen_quality.py "
                   + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": git_commit(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "model": {**MODEL, "vocab": VOCAB, "layer_types": cfg.layer_types,
                  "parameters": params, "groups": groups(cfg)},
        "codec": {"anchor": cachegen.ANCHOR, "block": cachegen.BLOCK, "chunk": CHUNK,
                  "objects": "one per attention group per 256-token chunk, KV_2LTD "
                             "[2, layers of the group, tokens, kv_heads*head_dim] + trailer"},
        "data": {"corpus": "pydoc_data.topics.topics", "heldout_topics": held_keys,
                 "train_tokens": len(train_stream), "heldout_tokens": len(held_stream),
                 "prefix": args.prefix, "continuation": args.cont, "windows": len(rows)},
        "training": training,
        "trained": {**trained, "seconds": round(t_trained, 1)},
        "random": {**random_, "heldout_loss": rnd_loss, "seconds": round(t_random, 1)},
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }
    out = Path(args.out or ROOT / f"benchmarks/results/cachegen_quality_cpu_{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print()
    print(table(f"trained weights ({training['steps']} steps, held-out loss "
                f"{training['heldout_loss']:.3f} nats/byte)", trained))
    print()
    print(table(f"random weights (held-out loss {rnd_loss:.3f} nats/byte)", random_))
    print(f"\nnearby tokens' KV (rms of the change / rms of the value): trained "
          f"{trained['kv_structure']}, random {random_['kv_structure']}")
    print(f"\nchecks: trained {trained['checks']}, random {random_['checks']}")
    print(f"wrote {out} ({result['wall_seconds']} s)")
    return result


if __name__ == "__main__":
    main()
