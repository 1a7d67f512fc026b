"""Why the GPU end-to-end tests run vLLM in batch-invariant mode: in vLLM's default
bf16 numerics, how many greedy tokens does a prefix hit change against recomputation,
for vLLM's own GPU prefix cache and for this connector? Same prompts and model as the
"medium" GPU end-to-end case (tests/test_e2e_gpu.py).

    python benchmarks/numerics_gpu.py OUT.json      (on a GPU machine, tests/ on PYTHONPATH)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from e2e_common import run_engine, save_config, tiny_gemma4_config
from test_e2e_gpu import ENGINE, VARIANTS


def differing(a: list, b: list) -> dict:
    """Prompts whose outputs differ, and differing token positions over all prompts."""
    prompts = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    tokens = sum(t != u for x, y in zip(a, b) for t, u in zip(x, y))
    return {"prompts": prompts, "tokens": tokens, "of_tokens": sum(len(x) for x in a)}


def main(out: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="numerics-"))
    model = save_config(tiny_gemma4_config(**VARIANTS["medium"]), tmp / "model")
    runs = {
        "recompute": dict(connector=False, engine=ENGINE),
        "vllm_prefix_cache": dict(connector=False,
                                  engine={**ENGINE, "enable_prefix_caching": True}),
        "gemma4_kv": dict(connector=True, engine=ENGINE),
    }
    results = {name: run_engine(tmp, name, model, **kw)[0] for name, kw in runs.items()}
    base = results["recompute"]["outputs"]
    report = {name: dict(cached=r["cached"], differing_from_recompute=differing(r["outputs"], base))
              for name, r in results.items()}
    Path(out).write_text(json.dumps(report, indent=1))
    for name, r in report.items():
        print(f"{name:18} cached {r['cached']} differing {r['differing_from_recompute']}")


if __name__ == "__main__":
    main(sys.argv[1])
