"""A real multimodal Gemma 4 through the connector on a CUDA GPU: vLLM's
`Gemma4ForConditionalGeneration` with random weights and its vision tower (small), image
prompts through `LLM.generate` with `multi_modal_data`, bf16 in batch-invariant mode as in
tests/test_e2e_gpu.py. Run by `benchmarks/gpu.sh mm`; skipped without a GPU (vLLM's CPU
build lacks what Gemma 4's processor imports: torchvision).

The model directory is written by the test: a config (Gemma 4 text layers as in the other
end-to-end tests, `use_bidirectional_attention: "vision"` as in Gemma 4's checkpoints, so
an image's tokens attend both ways), a word-level tokenizer with Gemma 4's image tokens,
and the processor transformers' `Gemma4Processor` saves.

Three engines over the same prompts, side by side: recomputation (no connector), the
connector, and the connector with its loads skipped (tests/broken_connector.py). Checked:
(a) tokens identical to recomputation; (b) a request with an image hits the chunk that
holds it only when an earlier request had the same image (a different image of the same
size, so equal token ids, hits only the text chunk before it); (c) no hit ends inside an
image: a prompt whose limit falls inside its image is cut to the image's start
(`layout.plan.cut_before` over `keys.request.placeholder_spans`). Negative controls: the
recomputation engine's tokens change with the image, and skipped loads change tokens.

Every check and what it saw go to the JSON file named by G4KV_MM_RESULT (gpu.sh keeps it).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from needs import require
from e2e_common import Harness, stats_events

pytestmark = [pytest.mark.cuda, pytest.mark.vllm]

BLOCK = 16
CHUNK = 256
WINDOW = 512  # the last prompt tokens see the image in sliding layers too
ENGINE = {"dtype": "bfloat16", "block_size": BLOCK, "gpu_memory_utilization": 0.1,
          "kv_cache_memory_bytes": 2 << 30, "enforce_eager": True, "max_model_len": 4096,
          "skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1, "video": 0}}
ENV = {"VLLM_BATCH_INVARIANT": "1"}
PRELOAD = ["vllm_standins"]
EXTRA = {"cpu_gb": 0.25, "retention_interval": CHUNK, "intermediate_ends": "always"}
MAX_TOKENS = 8

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
SPAN = 64 + 2
PRE, POST, SHORT = 480, 250, 10
"""Text before the image, after it, and after it in the prompt whose limit it cuts."""
IMAGE_AT = (PRE, PRE + SPAN)  # [480, 546): inside chunk 1, across the block end 512


def prompts() -> list[dict]:
    """(name, harness PROMPT, hit the connector must give, why), sent one at a time.

    Hand derivation (chunk 256, hit multiple 32 = the largest block, every chunk end kept
    for the sliding groups: `retention_interval` 256, `intermediate_ends` always). A hit
    is at most min(whole prompt chunks, (P - 1) // 32 * 32), then cut before any image it
    would end inside."""
    rng = random.Random(36)
    text = [rng.randrange(16, VOCAB - 12) for _ in range(PRE + POST)]
    pre, post = text[:PRE], text[PRE:]

    def p(seed, after):
        return {"tokens": pre + [IMAGE] + after, "images": [{"seed": seed, "size": SIZE}]}

    return [
        ("a", p(1, post), 0, "cold; P = 480 + 66 + 250 = 796"),
        ("a again", p(1, post), 768,
         "limit min(3 chunks, 795 // 32 * 32) = 768 is past the image: all 3 chunks hit"),
        ("b", p(2, post), 256,
         "another image of the same size: chunk 1 holds it, so only the text chunk 0 hits"),
        ("b again", p(2, post), 768, "b's chunks were stored under b's own keys"),
        ("a cut", p(1, post[:SHORT]), 480,
         "P = 556, limit min(2 chunks, 555 // 32 * 32) = 512 is inside the image "
         "[480, 546): cut to its start 480 (uncut, chunk 1 of a would serve 512)"),
    ]


def write_model(path: Path) -> str:
    """A random-weight Gemma 4 with a small vision tower, its tokenizer and processor."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models.gemma4 import (Gemma4AudioFeatureExtractor,
                                            Gemma4ImageProcessor, Gemma4Processor,
                                            Gemma4VideoProcessor)

    from gemma4_kv.tools.harness import tiny_gemma4_config

    text = tiny_gemma4_config(window=WINDOW, vocab=VOCAB, use_bidirectional_attention="vision")
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
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(max_soft_tokens=MAX_SOFT),
        tokenizer=tokenizer, video_processor=Gemma4VideoProcessor(),
        image_seq_length=MAX_SOFT)
    processor.save_pretrained(path)
    return str(path)


def start(tmp_path, name: str, model: str, connector_class: str | None) -> tuple:
    """One engine over `prompts()`, started: (its harness, its stats file)."""
    stats = Path(tmp_path) / f"{name}.stats.jsonl"
    spec = {"model": model, "prompts": [p for _, p, _, _ in prompts()],
            "connector": connector_class is not None, "max_tokens": MAX_TOKENS,
            "prompt_ids": True, "engine": ENGINE, "preload": PRELOAD,
            "extra_config": {**EXTRA, "stats_file": str(stats)}}
    if connector_class not in (None, "Gemma4KVConnector"):
        spec.update(connector_class=connector_class, connector_module="broken_connector")
    return Harness(tmp_path, name, spec, env=ENV, timeout=600.0), stats


def image_spans(ids: list[int]) -> list[tuple[int, int]]:
    """[boi, eoi + 1) of every image in a prompt's token ids as vLLM ran them."""
    starts = [i for i, t in enumerate(ids) if t == BOI]
    ends = [i + 1 for i, t in enumerate(ids) if t == EOI]
    return list(zip(starts, ends))


def inside(hit: int, spans) -> bool:
    return any(a < hit < b for a, b in spans)


def evaluate(base: dict, conn: dict, broken: dict, events: list) -> dict:
    """Every check of the case: {name: {"ok": bool, "detail": str}}, and what was seen."""
    cases = prompts()
    names = [n for n, _, _, _ in cases]
    want = [h for _, _, h, _ in cases]
    spans = [image_spans(ids) for ids in base["prompt_ids"]]
    hits = conn["cached"]
    loads = sorted(e["end"] for e in events if e["event"] == "load")
    checks = {}

    def check(name, ok, detail):
        checks[name] = {"ok": bool(ok), "detail": detail}

    soft = [sum(t == IMAGE for t in ids) for ids in base["prompt_ids"]]
    check("image_expanded",
          all(s == [IMAGE_AT] for s in spans) and soft == [SPAN - 2] * len(cases)
          and conn["prompt_ids"] == base["prompt_ids"] == broken["prompt_ids"],
          f"image spans {spans}, image tokens {soft} (want [{IMAGE_AT}] and {SPAN - 2} "
          "each; another count means this transformers/vLLM sizes images differently and "
          "the hand-derived hits do not apply); prompt ids equal across engines: "
          f"{conn['prompt_ids'] == base['prompt_ids'] == broken['prompt_ids']}")
    check("recomputation_computes_all", base["cached"] == [0] * len(cases),
          f"engine without the connector cached {base['cached']} (want all 0: vLLM's "
          "prefix cache is off)")
    check("tokens_match_recomputation", conn["outputs"] == base["outputs"],
          "; ".join(f"{n}: {'same' if c == b else f'conn {c} != recomputed {b}'}"
                    for n, c, b in zip(names, conn["outputs"], base["outputs"])))
    check("same_image_hits", hits[1] == want[1] and hits[3] == want[3]
          and min(hits[1], hits[3]) >= IMAGE_AT[1],
          f"'a again' hit {hits[1]}, 'b again' hit {hits[3]} (want {want[1]}, {want[3]}: "
          f"past the image's end {IMAGE_AT[1]})")
    check("other_image_misses_its_chunk", hits[2] == want[2] and hits[2] <= IMAGE_AT[0],
          f"'b' (another image, same size and token ids) hit {hits[2]} (want {want[2]}: "
          f"the text chunk before the image at {IMAGE_AT[0]}, not the chunk holding it)")
    check("no_hit_ends_inside_an_image",
          not any(inside(h, s) for h, s in zip(hits, spans)) and hits[4] == want[4]
          and not any(inside(e, [IMAGE_AT]) for e in loads),
          f"hits {hits} with image spans {spans}; 'a cut' hit {hits[4]} (want {want[4]}, "
          f"its limit 512 cut to the image's start); loads ended at {loads}")
    check("hits_as_derived", hits == want and loads == sorted(h for h in want if h),
          f"hits {hits}, want {want}; loads ended at {loads}")
    check("control_image_changes_tokens", base["outputs"][0] != base["outputs"][2],
          f"recomputed tokens with image a {base['outputs'][0]}, with image b "
          f"{base['outputs'][2]} (same text): equal tokens would mean the token comparison "
          "cannot see a wrong image's KV")
    changed = [n for n, h, o, b in zip(names, hits, broken["outputs"], base["outputs"])
               if h and o != b]
    check("control_skipped_loads_change_tokens",
          broken["cached"] == hits and bool(changed),
          f"with loads skipped: hits {broken['cached']} (want {hits}), tokens changed on "
          f"{changed or 'no request'} (want at least one)")
    seen = [{"name": n, "hit": h, "want": w, "why": why, "image_spans": s,
             "prompt_len": len(ids), "broken_hit": bh, "tokens_recomputed": b,
             "tokens_connector": c, "tokens_skipped_loads": o}
            for (n, _, w, why), h, s, ids, bh, b, c, o in zip(
                cases, hits, spans, base["prompt_ids"], broken["cached"], base["outputs"],
                conn["outputs"], broken["outputs"])]
    return {"checks": checks, "requests": seen, "load_ends": loads}


def summary_lines(result: dict) -> list[str]:
    lines = [f"mm {r['name']:8s} len {r['prompt_len']} image {r['image_spans']} hit "
             f"{r['hit']} (want {r['want']}, skipped-loads engine {r['broken_hit']}) "
             f"tokens recomputed {r['tokens_recomputed']} connector {r['tokens_connector']} "
             f"skipped-loads {r['tokens_skipped_loads']}" for r in result["requests"]]
    lines += [f"mm check {k}: {'ok' if v['ok'] else 'FAILED'}: {v['detail']}"
              for k, v in result["checks"].items()]
    return lines


@pytest.fixture(scope="module")
def mm_case(tmp_path_factory):
    """The three engines' runs, side by side on the one GPU, and their checks."""
    require("vllm")
    import torch
    import transformers

    tmp = tmp_path_factory.mktemp("mm")
    model = write_model(tmp / "model")
    started = {name: start(tmp, name, model, cls) for name, cls in
               (("base", None), ("conn", "Gemma4KVConnector"),
                ("broken", "SkipLoadConnector"))}
    runs = {name: h.result()[0] for name, (h, _) in started.items()}
    result = evaluate(runs["base"], runs["conn"], runs["broken"],
                      stats_events(started["conn"][1]))
    import vllm

    result["versions"] = {"vllm": vllm.__version__, "transformers": transformers.__version__,
                          "torch": torch.__version__,
                          "device": torch.cuda.get_device_name(0)}
    result["startup_s"] = {n: r.get("startup_s") for n, r in runs.items()}
    lines = summary_lines(result)
    result["summary"] = lines
    if os.environ.get("G4KV_MM_RESULT"):
        Path(os.environ["G4KV_MM_RESULT"]).write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    return result


@pytest.mark.parametrize("check", [
    "image_expanded", "recomputation_computes_all", "tokens_match_recomputation",
    "same_image_hits", "other_image_misses_its_chunk", "no_hit_ends_inside_an_image",
    "hits_as_derived", "control_image_changes_tokens", "control_skipped_loads_change_tokens"])
def test_gpu_multimodal(mm_case, check):
    c = mm_case["checks"][check]
    assert c["ok"], f"{check}: {c['detail']}\n" + "\n".join(mm_case["summary"])
