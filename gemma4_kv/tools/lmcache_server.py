"""`gemma4-kv server`: start `lmcache server` with the flags the connector's
`lmcache_server` tier needs (`stores.server.server_argv`), pass any others through, and
print the URL to put in `kv_connector_extra_config`.

    gemma4-kv server [--port 5555] [--l1-size-gb 64] [--l2-adapter JSON ...] [-- FLAGS]

FLAGS after `--` are appended to `lmcache server`'s command line (`lmcache server
--help`); where one repeats a flag set here, LMCache takes the later value. The command
runs the server in the foreground, in a process group of its own: SIGINT (Ctrl-C),
SIGTERM or SIGHUP sends it SIGTERM (on which LMCache closes its server and L1 cleanly;
its SIGINT path ends in a traceback) and waits for it to exit, SIGKILL to its group
after `--stop-timeout` seconds. Exit status: 0 when it stopped on request, else the
server's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..stores.server import server_argv


def lmcache_command() -> list[str] | None:
    """How to run LMCache's CLI: the script beside this Python, one on PATH, or its
    module."""
    here = Path(sys.executable).with_name("lmcache")
    exe = str(here) if here.exists() else shutil.which("lmcache")
    if exe is not None:
        return [exe]
    if importlib.util.find_spec("lmcache") is not None:
        return [sys.executable, "-m", "lmcache.cli.main"]
    return None


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="gemma4-kv server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1",
                   help="address the server listens on (engines must be on this host: "
                        "they map its shared-memory L1)")
    p.add_argument("--port", type=int, default=5555, help="the engines' port")
    p.add_argument("--http-port", type=int, default=8080,
                   help="LMCache's HTTP status port (GET /status)")
    p.add_argument("--l1-size-gb", type=float, default=64.0,
                   help="GiB of the shared-memory L1 (/dev/shm must be larger)")
    p.add_argument("--shm-name", default="gemma4kv", help="name of the L1 segment in /dev/shm")
    p.add_argument("--l2-adapter", action="append", default=[], metavar="JSON",
                   help="an LMCache L2 tier behind the L1 (repeatable), e.g. "
                        '\'{"type": "fs_native", "base_path": "/var/cache/lmcache"}\'')
    p.add_argument("--print-command", action="store_true",
                   help="print the `lmcache server` command line and exit")
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds to wait for the server after SIGINT/SIGTERM")
    return p.parse_args(argv), extra


def command(args, extra: list[str], lmcache: list[str]) -> list[str]:
    l1 = int(args.l1_size_gb) if args.l1_size_gb == int(args.l1_size_gb) else args.l1_size_gb
    argv = server_argv("lmcache", port=args.port, shm_name=args.shm_name,
                       l1_gb=l1, http_port=args.http_port, host=args.host,
                       l2_adapters=args.l2_adapter)
    return lmcache + argv[1:] + extra


def _up(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def main(argv=None) -> int:
    args, extra = parse(sys.argv[1:] if argv is None else list(argv))
    lmcache = lmcache_command()
    if lmcache is None:
        print("gemma4-kv server: LMCache is not installed (pip install lmcache==0.5.6)",
              file=sys.stderr)
        return 2
    cmd = command(args, extra, lmcache)
    if args.print_command:
        print(" ".join(_quote(a) for a in cmd))
        return 0
    env = dict(os.environ)
    env.setdefault("LMCACHE_TRACK_USAGE", "false")
    # The server in a process group of its own: a signal reaches it once, from here.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    stopping = []

    def stop(signum, _frame):
        stopping.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host  # same host
    url = f"tcp://{host}:{args.port}"
    try:
        while proc.poll() is None and not stopping and not _up(args.http_port):
            time.sleep(0.3)
        if proc.poll() is None and not stopping:
            print(f"gemma4-kv server: lmcache server (pid {proc.pid}) at {url}, L1 "
                  f"{args.l1_size_gb:g} GiB in /dev/shm (--shm-name {args.shm_name}), "
                  f"status http://127.0.0.1:{args.http_port}/status\n"
                  f"  engines: --kv-transfer-config '{json.dumps(_config(url))}'",
                  flush=True)
        while proc.poll() is None and not stopping:
            time.sleep(0.2)
    finally:
        rc = _finish(proc, args.stop_timeout)
    if stopping and rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
        return 0
    return rc if rc >= 0 else 128 - rc


def _finish(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for the server (SIGTERM sent) up to `timeout` s, then SIGKILL its process
    group (before reaping it, so the group id is still the server's)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return proc.wait()


def _config(url: str) -> dict:
    return {"kv_connector": "Gemma4KVConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache_server": url}}


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


if __name__ == "__main__":
    sys.exit(main())
