"""collective_rpc targets for tests/test_e2e_mp_server.py (run on every worker of an
engine by `gemma4_kv.tools.harness` "call" steps)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def signal_and_wait(worker, ready: str, go: str, timeout: float = 600.0) -> bool:
    """Say this engine got here (`ready`), then hold it, alive and registered with the
    server, until the test says go (another engine runs meanwhile)."""
    Path(ready).touch()
    deadline = time.monotonic() + timeout
    while not Path(go).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def kill_server(worker, pid: int) -> bool:
    """SIGKILL the test's `lmcache server` (by the pid the test started it with)."""
    os.kill(pid, signal.SIGKILL)
    return True


def waited_out(worker) -> int:
    """Calls of the worker's server store that waited out its timeout
    (`ServerConnection.waited_out`)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.store.conn.waited_out


def store_kind(worker) -> str:
    """Which store the worker's connector opened."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return type(get_kv_transfer_group()._worker.store).__name__
