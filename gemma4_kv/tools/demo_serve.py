"""`gemma4-kv demo --serve`: what a deployment runs. vLLM's OpenAI server with the
connector (`--kv-transfer-config '{"kv_connector": "Gemma4KVConnector", "kv_role":
"kv_both", ...}'`), the same long prompt sent twice to `/v1/completions` and a chat
twice to `/v1/chat/completions` (HTTP, as `curl` sends them; streamed, so the time to
the first token shows). Between the two sends of
each, `POST /reset_prefix_cache` empties vLLM's own prefix cache (not the connector's),
so the second answer's prefix comes from gemma4-kv's CPU tier; `/metrics` shows it.
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path


def fit_words(model: str, tokens: int, seed: int) -> tuple[str, int]:
    """Text of about `tokens` tokens under the model's tokenizer (and its count)."""
    import transformers

    from .served import words

    tok = transformers.AutoTokenizer.from_pretrained(model)
    n = max(1, tokens // 4)
    while True:
        text = words(n, seed)
        count = len(tok(text)["input_ids"])
        if count >= tokens or n > 8 * tokens:
            break
        n += max(1, (tokens - count) // 2)
    return text, count


def run(model: str | None, tokens: int, cpu_gb: float, cuda: bool, spinner) -> int:
    from .demo import demo_model_config
    from .served import OpenAIServer, connector_args, server_env, write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="gemma4-kv-serve-"))
    if model is None:
        with spinner("writing a small random-weight Gemma 4 checkpoint with a tokenizer..."):
            model = write_checkpoint(demo_model_config(cuda), work / "model")
    args = ["--max-model-len", str(tokens + 1024), "--enforce-eager",
            "--dtype", "bfloat16" if cuda else "float32", "--enable-prompt-tokens-details",
            "--seed", "0", *(["--gpu-memory-utilization", "0.5"] if cuda else
                             ["--block-size", "32"]),
            *connector_args("kv_both", {"cpu_gb": cpu_gb})]
    env = server_env(**({} if cuda else {"VLLM_CPU_KVCACHE_SPACE": "2"}))
    server = OpenAIServer(model, args, work / "server.log", env=env, deadline_s=600,
                          timeout_s=300)
    print("server: " + " ".join(shlex.quote(a) for a in
                                ["python", "-m", "vllm.entrypoints.openai.api_server",
                                 "--model", model, *args]))
    print(f"  its log: {server.log_path}")
    prompt, n = fit_words(model, tokens, seed=1)
    chat, _ = fit_words(model, tokens // 2, seed=2)
    bodies = [("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16,
                                   "temperature": 0}),
              ("/v1/chat/completions", {"model": model, "max_tokens": 16, "temperature": 0,
                                        "messages": [{"role": "user", "content": chat}]})]
    with spinner("starting vLLM's OpenAI server with the gemma4-kv connector..."):
        server.start()
    try:
        line = next((x for x in server.log_text().splitlines() if "gemma4-kv: rank" in x), "")
        if line:
            print("  " + line[line.index("gemma4-kv: rank"):])
        rows, same = [], True
        for route, body in bodies:
            answers = []
            for name in ("cold", "warm"):
                before = server.metrics()
                out = server.stream(route, body)
                after = server.metrics()
                usage = out["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                hit = (after.get("vllm:external_prefix_cache_hits_total", 0)
                       - before.get("vllm:external_prefix_cache_hits_total", 0))
                rows.append((f"{route} {name}", out["ttft_s"], out["wall_s"],
                             usage.get("prompt_tokens", 0), cached, hit))
                answers.append(out["text"])
                server.reset_prefix_cache()  # vLLM's own cache only; the connector keeps its
            same &= answers[0] == answers[1]
        metrics = server.metrics()
    finally:
        server.stop()
    print(f"\n{'request':28} {'TTFT s':>7} {'wall s':>7} {'prompt tokens':>14} "
          f"{'cached tokens':>14} {'connector hit':>14}")
    for name, ttft, wall, prompt_tokens, cached, hit in rows:
        print(f"{name:28} {ttft:7.3f} {wall:7.3f} {prompt_tokens:14} {cached:14} {hit:14.0f}")
    print(f"\ncold / warm TTFT: completions {rows[0][1] / rows[1][1]:.1f}x, "
          f"chat {rows[2][1] / rows[3][1]:.1f}x (streamed, first text event; 16 tokens each)")
    shown = ("vllm:external_prefix_cache_hits_total", "vllm:gemma4_kv_hit_tokens_total",
             "vllm:gemma4_kv_load_bytes_total", "vllm:gemma4_kv_save_bytes_total")
    print("/metrics: " + ", ".join(f"{k.removeprefix('vllm:')} {metrics.get(k, 0):.0f}"
                                   for k in shown))
    print(f"greedy outputs identical cold vs warm (16 tokens): {same}")
    hits = rows[1][5] > 0 and rows[3][5] > 0
    return 0 if same and hits else 1

