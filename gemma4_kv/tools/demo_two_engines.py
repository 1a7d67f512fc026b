"""`gemma4-kv demo --shared`: two engines, one after the other, sharing one store.

Engine A computes a long prompt and stores its KV; engine B, another process with an
empty CPU tier, then gets the same prompt and one sharing its start, and serves them
from the shared tier: a Valkey/Redis server started on loopback when `valkey-server`
or `redis-server` is installed (`bash scripts/install_servers.sh`), else a directory
both engines use as LMCache's disk tier.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(work: Path):
    """(process, l2 spec) of a Valkey/Redis server on loopback, or (None, None)."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        return None, None
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(work)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    spec = {"type": "valkey", "startup_nodes": f"127.0.0.1:{port}", "request_timeout": 2.0,
            "connection_timeout": 2.0}
    return proc, spec


def run_engine(name: str, spec: dict, work: Path, spinner) -> dict:
    spec_path, out_path = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    with spinner(f"engine {name}: starting vLLM and running its prompts..."):
        proc = subprocess.run([sys.executable, "-m", "gemma4_kv.tools.harness", str(spec_path),
                               str(out_path)], capture_output=True, text=True,
                              env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"))
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"engine {name} failed")
    return json.loads(out_path.read_text())


def run(model: str, work: Path, engine: dict, long_prompt: list, shared: list,
        cpu_gb: float, spinner) -> int:
    server, l2 = start_server(work)
    tier = {"l2_adapters": [l2]} if l2 else {"disk_path": str(work / "shared-disk")}
    where = f"a Valkey/Redis server at {l2['startup_nodes']}" if l2 else \
        f"an LMCache disk tier in {tier['disk_path']} (no valkey-server/redis-server found)"
    print(f"\nshared store: {where}")
    try:
        base = {"model": model, "connector": True, "max_tokens": 16, "engine": engine,
                # sliding-window chunks kept every 1024 tokens: a shared start hits there
                "extra_config": {"cpu_gb": cpu_gb, "retention_interval": 1024, **tier}}
        a = run_engine("A", {**base, "prompts": [long_prompt]}, work, spinner)
        b = run_engine("B", {**base, "prompts": [long_prompt, shared]}, work, spinner)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    rows = [("A (stores)", "long prompt", a["cached"][0], a["ttft"][0]),
            ("B (fresh CPU tier)", "same long prompt", b["cached"][0], b["ttft"][0]),
            ("B (fresh CPU tier)", "prompt sharing its start", b["cached"][1], b["ttft"][1])]
    print(f"\n{'engine':20} {'request':26} {'cached tokens':>14} {'TTFT s':>8}")
    for row in rows:
        print(f"{row[0]:20} {row[1]:26} {row[2]:14} {row[3]:8.3f}")
    same = a["outputs"][0] == b["outputs"][0]
    print(f"\nengine B's hits came from the shared store; greedy outputs of the long prompt "
          f"identical in A and B: {same}")
    return 0 if same and b["cached"][0] > 0 else 1
