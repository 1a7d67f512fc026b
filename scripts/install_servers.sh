#!/usr/bin/env bash
# Install the server programs the remote-tier tests start themselves (tests/tier_servers.py):
# Debian's valkey-server where the release has it (Debian 13+), else redis-server
# (Debian 12: 7.0.15), with its command-line client. Idempotent: does nothing when a
# server is already on PATH. No service is started; the tests run their own on loopback.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

if { have valkey-server && have valkey-cli; } || { have redis-server && have redis-cli; }; then
    exit 0
fi
if ! have apt-get; then
    echo "install_servers.sh: no valkey-server/redis-server and no apt-get to install one" >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    have sudo || { echo "install_servers.sh: need root (or sudo) for apt-get" >&2; exit 1; }
    sudo="sudo"
fi

echo "installing a Redis-protocol server for the remote-tier tests (about 10 s)..." >&2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
run() {  # quiet unless it fails
    "$@" >"$log" 2>&1 || { cat "$log" >&2; echo "install_servers.sh: failed: $*" >&2; exit 1; }
}

run $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q
if apt-cache show valkey-server >/dev/null 2>&1; then
    pkgs=valkey-server  # depends on valkey-tools (valkey-cli)
else
    pkgs=redis-server  # depends on redis-tools (redis-cli)
fi
run $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs

if ! { have valkey-server || have redis-server; }; then
    echo "install_servers.sh: installed $pkgs but no server is on PATH" >&2
    exit 1
fi
