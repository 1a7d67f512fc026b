# Source on the GPU machine (no PyPI there): installs the carried wheels (.whl: lmcache
# and what its storage layer imports) and this package under /tmp, sets PYTHONPATH.
set -e
if [ ! -f /tmp/g4/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/g4site .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/g4 .
  touch /tmp/g4/.done
fi
export PYTHONPATH="/tmp/g4:/tmp/g4site:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
set +e
