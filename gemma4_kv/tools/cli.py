"""`gemma4-kv` command line: `inspect` a config's KV groups, run the `demo`, start an
`lmcache server` for the `lmcache_server` tier (`server`)."""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path

import torch

from ..layout.groups import KVLayout

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "fp8": torch.float8_e4m3fn}


def bundled_config(name: str) -> Path:
    """Path of a bundled config such as `gemma4-31b-like`."""
    return Path(str(resources.files("gemma4_kv.model_shapes") / f"{name}.json"))


def _indices(names) -> str:
    """Compact layer list: indices where names are `...layers.N...`, names otherwise."""
    out = []
    for n in names:
        m = re.search(r"(draft_model\.)?layers\.(\d+)\.", n)
        out.append(("d" if m.group(1) else "") + m.group(2) if m else n)
    return ",".join(out) if out else "-"


def format_layout(layout: KVLayout) -> str:
    head = ("group", "kind", "window", "block", "kv heads", "head K/V", "dtype", "page B",
            "B/token", "owning layers", "aliased (KV-shared) layers", "draft layers")
    rows = [head]
    for g in layout.groups:
        rows.append((str(g.group_id), g.kind.value, str(g.window or "-"), str(g.block_size),
                     str(g.num_kv_heads), f"{g.head_size}/{g.head_size_v}",
                     str(g.dtype).removeprefix("torch."), f"{g.page_bytes:,}",
                     f"{g.bytes_per_token:,}", _indices(g.layers),
                     _indices(a for a, _ in g.aliases), _indices(g.draft_layers)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = sum(g.bytes_per_token for g in layout.groups)
    lines.append(f"\n{len(layout.groups)} groups; {total:,} bytes of KV per token; "
                 f"chunk sizes must be multiples of {layout.chunk_multiple} tokens")
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    from ..layout.from_hf import hf_layout, load_text_config

    path = args.config
    if not Path(path).exists() and not path.endswith(".json"):
        path = bundled_config(path)
    cfg = load_text_config(path)
    assistant = load_text_config(args.assistant) if args.assistant else None
    layout = hf_layout(cfg, assistant_config=assistant, dtype=_DTYPES[args.dtype],
                       block_size=args.block_size, tp_size=args.tp)
    print(f"{path}: {cfg.num_hidden_layers} layers, "
          f"{getattr(cfg, 'num_kv_shared_layers', 0)} KV-shared, window {cfg.sliding_window}")
    print(format_layout(layout))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gemma4-kv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="print the KV cache groups vLLM builds for a config")
    i.add_argument("config", help="checkpoint dir, config.json, or a bundled name "
                                  "(gemma4-31b-like, gemma4-12b-like, gemma4-e4b-like, "
                                  "gemma4-e2b-like)")
    i.add_argument("--assistant", help="MTP assistant config (dir or JSON)")
    i.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    i.add_argument("--block-size", type=int, default=16, help="vLLM's --block-size")
    i.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    i.set_defaults(fn=cmd_inspect)
    d = sub.add_parser("demo", help="run a Gemma 4-shaped model in vLLM with the connector",
                       add_help=False)
    d.set_defaults(fn=None)
    sub.add_parser("server", help="start an `lmcache server` the connector can use "
                                  "(`lmcache_server`); `gemma4-kv server -h` for its flags",
                   add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv[:1] == ["server"]:
        from .lmcache_server import main as server_main

        return server_main(argv[1:])
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
