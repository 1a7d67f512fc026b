"""Shared by the multimodal end-to-end tests (tests/test_e2e_gpu_mm.py on a GPU,
tests/test_e2e_mm.py on vLLM's CPU build): a real `Gemma4ForConditionalGeneration` with
random weights and a small vision tower, image prompts through `LLM.generate` with
`multi_modal_data`, three engines over the same prompts (recomputation, the connector,
the connector with its loads skipped: tests/broken_connector.py), and the checks.

The model directory is written by a process of its own (`write_model`: run as
`python e2e_mm.py DIR VARIANT`): a config (Gemma 4 text layers as in the other end-to-end
tests), a word-level tokenizer with Gemma 4's image tokens, and the processor
transformers' `Gemma4Processor` saves. On the GPU the text config says
`use_bidirectional_attention: "vision"`, as Gemma 4's checkpoints do (an image's tokens
attend both ways); vLLM's CPU attention has no such mode, so on CPU they attend causally
(the connector cuts hits before images either way). On CPU, where torchvision is absent,
the processes run with `STANDIN` on their path (see tests/torchvision_standin).

Checked: (a) tokens identical to recomputation; (b) a request with an image hits the
chunk that holds it only when an earlier request had the same image (another image of the
same size, so equal token ids, hits only the text chunk before it); (c) no hit ends
inside an image: a prompt whose limit falls inside its image is cut to the image's start
(`layout.plan.cut_before` over `keys.request.placeholder_spans`). Negative controls: the
recomputation engine's tokens change with the image, and skipped loads change tokens."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

CHUNK = 256
WINDOW = 512  # the last prompt tokens see the image in sliding layers too
EXTRA = {"cpu_gb": 0.25, "retention_interval": CHUNK, "intermediate_ends": "always"}
"""Every chunk end kept for the sliding groups: the hits below depend only on which
chunks a request's keys find."""
MAX_TOKENS = 8
MM_ENGINE = {"enforce_eager": True, "max_model_len": 4096, "skip_tokenizer_init": False,
             "limit_mm_per_prompt": {"image": 1, "video": 0}}
STANDIN = str(Path(__file__).resolve().parent / "torchvision_standin")

# Tokenizer ids: Gemma 4's special tokens at small ids of a 512-token vocabulary.
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|image|>", "<|image>", "<image|>",
          "<|audio|>", "<|audio>", "<audio|>", "<|video|>"]
ID = {t: i for i, t in enumerate(TOKENS)}
IMAGE, BOI, EOI = ID["<|image|>"], ID["<|image>"], ID["<image|>"]
NAMED = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
         "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
VOCAB = 512

# An image of 384 x 384 at Gemma 4's smallest budget (70 soft tokens, 16-pixel patches,
# 3 x 3 pooling): 24 x 24 patches pooled to 64 soft tokens, so `boi + 64 x image + eoi`.
MAX_SOFT = 70
SIZE = [384, 384]
SOFT = 64
PRE, POST, SHORT = 480, 250, 10
"""Text before the image, after it, and after it in the prompt whose limit it cuts."""
IMAGE_AT = (PRE, PRE + SOFT + 2)  # [480, 546): inside chunk 1, across the token 512


def prompts() -> list[tuple[str, dict, str]]:
    """(name, harness PROMPT, why it hits what `expected_hits` says), sent one at a time."""
    rng = random.Random(36)
    text = [rng.randrange(16, VOCAB - 12) for _ in range(PRE + POST)]
    pre, post = text[:PRE], text[PRE:]

    def p(seed, after):
        return {"tokens": pre + [IMAGE] + after, "images": [{"seed": seed, "size": SIZE}]}

    return [
        ("a", p(1, post), "cold; P = 480 + 66 + 250 = 796"),
        ("a again", p(1, post), "limit min(3 chunks, 795 // m * m) = 768 is past the image"),
        ("b", p(2, post), "another image of the same size: chunk 1 holds it, so only the "
                          "text chunk 0 hits"),
        ("b again", p(2, post), "b's chunks were stored under b's own keys"),
        ("a cut", p(1, post[:SHORT]), "P = 556, limit min(2 chunks, 555 // m * m) = 512 is "
                                      "inside the image [480, 546): cut to 480 // m * m "
                                      "(uncut, a's chunk 1 would serve 512)"),
    ]


def expected_hits(m: int) -> list[int]:
    """Derived by hand for the hit multiple `m` (the largest block size, <= 256): a hit
    is at most min(whole prompt chunks, (P - 1) // m * m), then cut before any image it
    would end inside, and ends where the chunks its keys find run out."""
    return [0, 768, 256, 768, IMAGE_AT[0] - IMAGE_AT[0] % m]


def write_model(path: Path, *, gpu: bool) -> str:
    """The model directory, written by a process of its own (on CPU with `STANDIN`)."""
    env = dict(os.environ)
    if not gpu:
        env["PYTHONPATH"] = os.pathsep.join([STANDIN, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, __file__, str(path), "gpu" if gpu else "cpu"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"writing the model failed:\n{out.stdout}\n{out.stderr}"
    return str(path)


def _write_model(path: str, gpu: bool) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models import gemma4

    from gemma4_kv.tools.harness import tiny_gemma4_config

    text = tiny_gemma4_config(window=WINDOW, vocab=VOCAB,
                              use_bidirectional_attention="vision" if gpu else None)
    text.architectures = None
    vision = transformers.Gemma4VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, patch_size=16, pooling_kernel_size=3,
        position_embedding_size=128, default_output_length=MAX_SOFT)
    cfg = transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, image_token_id=IMAGE,
        boi_token_id=BOI, eoi_token_id=EOI, video_token_id=ID["<|video|>"],
        audio_token_id=ID["<|audio|>"], boa_token_id=ID["<|audio>"],
        eoa_token_index=ID["<audio|>"])
    cfg.architectures = ["Gemma4ForConditionalGeneration"]
    cfg.save_pretrained(path)

    vocab = {t: i for i, t in enumerate(TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(TOKENS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", extra_special_tokens=NAMED)
    images = gemma4.Gemma4ImageProcessor if gpu else gemma4.Gemma4ImageProcessorPil
    processor = gemma4.Gemma4Processor(
        feature_extractor=gemma4.Gemma4AudioFeatureExtractor(),
        image_processor=images(max_soft_tokens=MAX_SOFT), tokenizer=tokenizer,
        video_processor=gemma4.Gemma4VideoProcessor(), image_seq_length=MAX_SOFT)
    processor.save_pretrained(path)


def harness(tmp_path, name: str, model: str, connector_class: str | None, *,
            engine: dict, env: dict, preload: list) -> tuple:
    """One engine over `prompts()`, started: (its `Harness`, its stats file)."""
    from e2e_common import Harness

    stats = Path(tmp_path) / f"{name}.stats.jsonl"
    spec = {"model": model, "prompts": [p for _, p, _ in prompts()],
            "connector": connector_class is not None, "max_tokens": MAX_TOKENS,
            "prompt_ids": True, "engine": {**MM_ENGINE, **engine}, "preload": preload,
            "extra_config": {**EXTRA, "stats_file": str(stats)}}
    if connector_class not in (None, "Gemma4KVConnector"):
        spec.update(connector_class=connector_class, connector_module="broken_connector")
    return Harness(tmp_path, name, spec, env=env, timeout=600.0), stats


ENGINES = (("base", None), ("conn", "Gemma4KVConnector"), ("broken", "SkipLoadConnector"))
"""The three engines: recomputation, the connector, the connector with loads skipped."""


def image_spans(ids: list[int]) -> list[tuple[int, int]]:
    """[boi, eoi + 1) of every image in a prompt's token ids as vLLM ran them."""
    starts = [i for i, t in enumerate(ids) if t == BOI]
    ends = [i + 1 for i, t in enumerate(ids) if t == EOI]
    return list(zip(starts, ends))


def _inside(hit: int, spans) -> bool:
    return any(a < hit < b for a, b in spans)


CHECKS = ("image_expanded", "recomputation_computes_all", "tokens_match_recomputation",
          "same_image_hits", "other_image_misses_its_chunk", "no_hit_ends_inside_an_image",
          "hits_as_derived", "control_image_changes_tokens",
          "control_skipped_loads_change_tokens")


def evaluate(base: dict, conn: dict, broken: dict, events: list) -> dict:
    """Every check of `CHECKS`: {"checks": {name: {"ok", "detail"}}, what was seen}."""
    cases = prompts()
    names = [n for n, _, _ in cases]
    layout = next((e for e in events if e["event"] == "layout"), None)
    m = max(g["block_size"] for g in layout["groups"]) if layout else None
    want = expected_hits(m) if m else None
    spans = [image_spans(ids) for ids in base["prompt_ids"]]
    hits = conn["cached"]
    loads = sorted(e["end"] for e in events if e["event"] == "load")
    checks = {}

    def check(name, ok, detail):
        checks[name] = {"ok": bool(ok), "detail": detail}

    soft = [sum(t == IMAGE for t in ids) for ids in base["prompt_ids"]]
    same_ids = conn["prompt_ids"] == base["prompt_ids"] == broken["prompt_ids"]
    check("image_expanded", all(s == [IMAGE_AT] for s in spans)
          and soft == [SOFT] * len(cases) and same_ids,
          f"image spans {spans}, image tokens {soft} (want [{IMAGE_AT}] and {SOFT} each; "
          "another count means this transformers/vLLM sizes images differently and the "
          f"hand-derived hits do not apply); prompt ids equal across engines: {same_ids}")
    check("recomputation_computes_all", base["cached"] == [0] * len(cases),
          f"engine without the connector cached {base['cached']} (want all 0: vLLM's "
          "prefix cache is off)")
    check("tokens_match_recomputation", conn["outputs"] == base["outputs"],
          "; ".join(f"{n}: {'same' if c == b else f'connector {c} != recomputed {b}'}"
                    for n, c, b in zip(names, conn["outputs"], base["outputs"])))
    if want is None:
        for name in CHECKS[3:7]:
            check(name, False, "the connector's stats file has no layout event: "
                               f"{len(events)} events")
    else:
        check("same_image_hits", hits[1] == want[1] and hits[3] == want[3]
              and min(hits[1], hits[3]) >= IMAGE_AT[1],
              f"'a again' hit {hits[1]}, 'b again' hit {hits[3]} (want {want[1]}, "
              f"{want[3]}: past the image's end {IMAGE_AT[1]})")
        check("other_image_misses_its_chunk", hits[2] == want[2] and hits[2] <= IMAGE_AT[0],
              f"'b' (another image, same size and token ids) hit {hits[2]} (want {want[2]}: "
              f"the text chunk before the image at {IMAGE_AT[0]}, not the chunk holding it)")
        check("no_hit_ends_inside_an_image",
              not any(_inside(h, s) for h, s in zip(hits, spans)) and hits[4] == want[4]
              and not any(_inside(e, [IMAGE_AT]) for e in loads),
              f"hits {hits} with image spans {spans}; 'a cut' hit {hits[4]} (want "
              f"{want[4]}: its limit 512 cut to the image's start at multiple {m}); loads "
              f"ended at {loads}")
        check("hits_as_derived", hits == want and loads == sorted(h for h in want if h),
              f"hits {hits}, want {want} (hit multiple {m}); loads ended at {loads}")
    check("control_image_changes_tokens", base["outputs"][0] != base["outputs"][2],
          f"recomputed tokens with image a {base['outputs'][0]}, with image b "
          f"{base['outputs'][2]} (same text): equal tokens would mean the token comparison "
          "cannot see a wrong image's KV")
    changed = [n for n, h, o, b in zip(names, hits, broken["outputs"], base["outputs"])
               if h and o != b]
    check("control_skipped_loads_change_tokens", broken["cached"] == hits and bool(changed),
          f"with loads skipped: hits {broken['cached']} (want {hits}), tokens changed on "
          f"{changed or 'no request'} (want at least one)")
    seen = [{"name": n, "why": why, "hit": h, "want": want[i] if want else None,
             "image_spans": spans[i], "prompt_len": len(base["prompt_ids"][i]),
             "skipped_loads_hit": broken["cached"][i], "tokens_recomputed": base["outputs"][i],
             "tokens_connector": conn["outputs"][i],
             "tokens_skipped_loads": broken["outputs"][i]}
            for i, ((n, _, why), h) in enumerate(zip(cases, hits))]
    return {"checks": checks, "requests": seen, "load_ends": loads, "hit_multiple": m}


def summary_lines(result: dict) -> list[str]:
    lines = [f"mm {r['name']:8s} len {r['prompt_len']} image {r['image_spans']} hit "
             f"{r['hit']} (want {r['want']}, loads skipped {r['skipped_loads_hit']}) tokens "
             f"recomputed {r['tokens_recomputed']} connector {r['tokens_connector']} loads "
             f"skipped {r['tokens_skipped_loads']}" for r in result["requests"]]
    lines += [f"mm check {k}: {'ok' if v['ok'] else 'FAILED'}: {v['detail']}"
              for k, v in result["checks"].items()]
    return lines


def conclude(runs: dict, events: list, **about) -> dict:
    """The checks over the three engines' outputs and the connector's stats events, with
    `about` (versions, device) and a summary; also written to the JSON file
    G4KV_MM_RESULT names, if set (benchmarks/gpu.sh keeps it)."""
    result = {**evaluate(runs["base"], runs["conn"], runs["broken"], events), **about,
              "startup_s": {n: r.get("startup_s") for n, r in runs.items()}}
    result["summary"] = summary_lines(result)
    if os.environ.get("G4KV_MM_RESULT"):
        Path(os.environ["G4KV_MM_RESULT"]).write_text(json.dumps(result, indent=1))
    print("\n".join(result["summary"]))
    return result


def assert_check(result: dict, name: str) -> None:
    c = result["checks"][name]
    assert c["ok"], f"{name}: {c['detail']}\n" + "\n".join(result["summary"])


if __name__ == "__main__":
    _write_model(sys.argv[1], sys.argv[2] == "gpu")
