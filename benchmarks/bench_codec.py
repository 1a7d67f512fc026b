"""`l2_codec` speed and size per attention group of the Gemma 4 shapes.

    python benchmarks/bench_codec.py --out codec.json [--plot codec.png] [--bits 4]

For each bundled shape (12B-like, 31B-like) and group (sliding, full), one 256-token
chunk object, KV_2LTD [2, layers, 256, kv_heads x head_size] in bf16, smooth random
KV (nearby tokens alike) sealed with its trailer, and per codec mode:
- bytes per token of the group, stored (a frame: `cachegen.frame_size`, or the object
  itself for `none`) and the ratio to `none`;
- `cachegen` core on the device (`encode_tensors` / `decode_tensors` on KV already
  there): GB/s of KV, CUDA events, the median of `--repeats`;
- the serde's path end to end (`encode_into` / `decode_into` on host bytes: the bytes
  go up, the frame's come down, the frame's BLAKE3 on the CPU): GB/s of KV, wall
  clock, per device (`cuda` where there is one, and `cpu`);
- `lossless` (zstd, CPU only, where `zstandard` is installed) the same way, with its
  ratio on this KV.
Prints a table, writes the JSON and a bar plot. KV of random weights has less structure
than trained KV: the ratios of `cachegen` are fixed by its format, `lossless`'s are not
(see cachegen_quality.py for quality on trained weights)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from gemma4_kv.layout import integrity
from gemma4_kv.layout.from_hf import hf_layout, load_text_config
from gemma4_kv.stores import cachegen, codec
from gemma4_kv.tools.cli import bundled_config
from common.plots import pyplot, save
from common.timing import cuda_median

CHUNK = 256
KEY = integrity.key64("bench_codec", b"b" * 32, 1)


def sealed(shape, seed: int) -> tuple[torch.Tensor, bytes]:
    g = torch.Generator().manual_seed(seed)
    x = torch.cumsum(torch.randn(shape, generator=g) * 0.05, dim=2)
    kv = x.to(torch.bfloat16).contiguous()
    trailer = torch.zeros(4, dtype=torch.int64)
    integrity.seal(kv, trailer, KEY)
    return kv, kv.view(torch.uint8).numpy().tobytes() + trailer.numpy().tobytes()


def wall(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def group_row(shape_name: str, group, bits: int, repeats: int, devices,
              profile: bool = False) -> dict:
    shape = (2, len(group.layers), CHUNK, group.num_kv_heads * group.head_size)
    kv, raw = sealed(shape, len(group.layers))
    kv_bytes = kv.numel() * 2
    frame = cachegen.frame_size(shape, bits)
    row = dict(shape=shape_name, group=group.kind.value, object=list(shape),
               kv_bytes=kv_bytes, bytes_per_token={"none": len(raw) / CHUNK,
                                                   "cachegen": frame / CHUNK},
               ratio_cachegen=len(raw) / frame, gbps={})
    out = bytearray(frame)
    back = bytearray(len(raw))
    for dev in devices:
        d = torch.device(dev)
        cachegen.encode_into(raw, out, shape, torch.bfloat16, bits, d)  # warm
        enc = wall(lambda: cachegen.encode_into(raw, out, shape, torch.bfloat16, bits, d),
                   repeats)
        dec = wall(lambda: cachegen.decode_into(bytes(out), back, d), repeats)
        row["gbps"][f"cachegen_serde_{dev}"] = [kv_bytes / enc / 1e9, kv_bytes / dec / 1e9]
        if dev == "cuda":
            x = kv.to(d).float().view(2 * shape[1], CHUNK, shape[3])
            arrays = cachegen.encode_tensors(x, bits)
            body = torch.cat(arrays)
            p, t, c = x.shape
            enc_k = cuda_median(lambda: cachegen.encode_tensors(x, bits), repeats)[0]
            dec_k = cuda_median(lambda: cachegen.decode_tensors(body, p, t, c, bits,
                                                               torch.bfloat16), repeats)[0]
            row["gbps"]["cachegen_core_cuda"] = [kv_bytes / enc_k / 1e9, kv_bytes / dec_k / 1e9]
            if profile:  # where the serde's time goes, beside the core's
                import cProfile
                import pstats

                for what, fn in (("encode", lambda: cachegen.encode_into(
                        raw, out, shape, torch.bfloat16, bits, d)),
                        ("decode", lambda: cachegen.decode_into(bytes(out), back, d))):
                    prof = cProfile.Profile()
                    prof.runcall(fn)
                    print(f"profile of the cuda serde's {what}, {row['shape']} {row['group']}")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(10)
    try:
        import zstandard  # noqa: F401  (lossless's coder; the GPU machine has none)
    except ImportError:
        return row
    lossless = bytearray(codec.frame_size(len(raw), 1.0))
    codec.encode_into(raw, lossless, 2)
    payload = int.from_bytes(lossless[16:24], "little")
    row["bytes_per_token"]["lossless_payload"] = (codec.HEADER + payload) / CHUNK
    row["ratio_lossless_payload"] = len(raw) / (codec.HEADER + payload)
    enc = wall(lambda: codec.encode_into(raw, lossless, 2), repeats)
    dec = wall(lambda: codec.decode_into(bytes(lossless), back), repeats)
    row["gbps"]["lossless_serde_cpu"] = [kv_bytes / enc / 1e9, kv_bytes / dec / 1e9]
    return row


def print_table(result: dict) -> None:
    cols = sorted({k for r in result["rows"] for k in r["gbps"]})
    print(f"codec bench ({result['meta']['gpu']}, bits {result['meta']['bits']}); "
          "GB/s of KV, encode/decode")
    print("shape | group | B/token none | cachegen (x) | lossless payload (x) | "
          + " | ".join(cols))
    for r in result["rows"]:
        b = r["bytes_per_token"]
        lossless = (f"{b['lossless_payload']:.0f} ({r['ratio_lossless_payload']:.2f})"
                    if "lossless_payload" in b else "-")
        print(f"{r['shape']} | {r['group']} | {b['none']:.0f} | {b['cachegen']:.0f} "
              f"({r['ratio_cachegen']:.2f}) | {lossless} | "
              + " | ".join("%.2f / %.2f" % tuple(r["gbps"][c]) if c in r["gbps"] else "-"
                           for c in cols))


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    cols = sorted({k for r in rows for k in r["gbps"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, i, what in ((axes[0], 0, "encode"), (axes[1], 1, "decode")):
        width = 0.8 / len(cols)
        for j, c in enumerate(cols):
            ax.bar([k + j * width for k in range(len(rows))],
                   [r["gbps"].get(c, [0, 0])[i] for r in rows], width, label=c)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rows))],
                      [f"{r['shape']}\n{r['group']}" for r in rows], fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{what}, GB/s of KV ({result['meta']['gpu']})")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default="gemma4-12b-like,gemma4-31b-like")
    args = ap.parse_args(argv)
    devices = (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]
    rows = []
    for name in args.shapes.split(","):
        cfg = load_text_config(bundled_config(name))
        cfg.architectures = ["Gemma4ForCausalLM"]
        seen = set()
        for group in hf_layout(cfg, dtype=torch.bfloat16).groups:
            kind = (group.kind, len(group.layers), group.num_kv_heads, group.head_size)
            if kind in seen:  # vLLM splits a kind into groups of one size: one row each
                continue
            seen.add(kind)
            rows.append(group_row(name, group, args.bits, args.repeats, devices,
                                  profile=not rows))
            print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_properties(0).name if torch.cuda.is_available() else "CPU"
    result = dict(meta=dict(gpu=gpu, bits=args.bits, repeats=args.repeats, chunk=CHUNK,
                            torch=torch.__version__, threads=torch.get_num_threads(),
                            date=time.strftime("%Y-%m-%d"),
                            command="python benchmarks/bench_codec.py " + " ".join(
                                sys.argv[1:] if argv is None else argv)),
                  rows=rows)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
