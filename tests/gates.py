"""The worker side of an engine's gate (`e2e_common.Harness(gate=True)`): a first harness
step that says the engine is up, then holds it until the test opens the gate. Engines
start side by side and then take turns where a test times them."""

from __future__ import annotations

import os
import time
from pathlib import Path


def step(path: str | os.PathLike, timeout: float) -> dict:
    """The harness step of a gate at `path`."""
    return {"call": "gates:wait", "kwargs": {"path": str(path), "timeout": timeout}}


def wait(worker, path: str, timeout: float) -> bool:
    """Write `<path>.ready`, then wait (idle) until `path` exists."""
    Path(path + ".ready").touch()
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never opened the gate {path} ({timeout:.0f} s)")
        time.sleep(0.05)
    return True
