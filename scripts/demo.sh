#!/usr/bin/env bash
# Set up .venv if needed, then run the demo: a small Gemma 4-shaped random-weight model
# in vLLM with the gemma4-kv connector and the embedded LMCache store, a long prompt
# sent twice and a prompt sharing its prefix. Extra arguments go to `gemma4-kv demo`
# (--model CHECKPOINT_DIR, --tokens N; --serve: vLLM's OpenAI server with the
# connector, the prompt sent twice over HTTP; --shared: two engines, one store).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec gemma4-kv demo "$@"
