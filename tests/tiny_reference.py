"""One recomputation engine (no connector) for the tiny Gemma 4 model (window 100, float32,
32-token blocks), shared by the modules that time their connector engines against it
(tests/test_e2e_faults.py, tests/test_e2e_shared.py): the greedy tokens every engine
must produce and each prompt's recomputation TTFT. Each prompt runs once, alone, one
at a time, in the order the modules asked for them (`want`, at import), with no other
engine running (`run` is called after the engine pool is drained)."""

from __future__ import annotations

import threading

from gemma4_kv.tools.harness import save_config, tiny_gemma4_config

ENGINE = {"enforce_eager": True, "max_model_len": 4096, "dtype": "float32", "block_size": 32}
MAX_TOKENS = 6

_prompts: dict[tuple, list[int]] = {}


def want(prompts) -> None:
    """Prompts the reference engine must answer (modules call it at import)."""
    for p in prompts:
        _prompts.setdefault(tuple(p), list(p))


class Reference:
    def __init__(self):
        self._lock = threading.Lock()
        self._harness = None
        self._result = None

    def start(self, tmp_path_factory):
        """Start the engine (once): it waits at its gate until `run`."""
        from e2e_common import Harness

        with self._lock:
            if self._harness is None:
                tmp = tmp_path_factory.mktemp("reference")
                model = save_config(tiny_gemma4_config(window=100), tmp / "model")
                spec = {"model": model, "connector": False, "max_tokens": MAX_TOKENS,
                        "engine": ENGINE, "steps": [{"prompts": list(_prompts.values())}]}
                self._harness = Harness(tmp, "reference", spec, gate=True)
            return self._harness

    def ready(self) -> None:
        self._harness.wait_ready()

    def run(self) -> dict:
        """{prompt tuple: (greedy tokens, TTFT s)}; the engine runs its prompts now (first
        call) and nothing else may run meanwhile."""
        with self._lock:
            if self._result is None:
                out, _ = self._harness.open().result()
                self._result = {p: (o, t) for p, o, t in
                                zip(_prompts, out["outputs"], out["ttft"])}
            return self._result

    def close(self) -> None:
        if self._harness is not None:
            self._harness.kill()


REFERENCE = Reference()
