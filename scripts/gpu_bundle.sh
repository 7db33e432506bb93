#!/usr/bin/env bash
# The Python wheels a lent GPU machine lacks for scripts/gpu_check.py, fetched here ahead of the lease.
#
# The device machine (one H100/H200; /work/.library/device/KINDS.md lists its image) has torch, Triton, onnx,
# onnx-ir, onnxscript, onnxruntime, ml_dtypes, safetensors, tokenizers and pybind11, but transformers 5.17 and
# huggingface_hub 1.x, older than llmc builds with (pyproject.toml: transformers 5.25.x), and it reaches no package
# index. This fetches the versions installed here (so the GPU run traces with what CI tested), for CPython 3.12
# manylinux x86-64, into .whl/ (kept out of git through .git/info/exclude), and checks the total stays under the
# device tool's 64 MiB carry limit. On the device, install them before anything imports transformers:
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#     export PYTHONPATH=/tmp/site
#
# Usage: bash scripts/gpu_bundle.sh [DIR]      (default .whl; needs PyPI here, ~20 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${LLMC_PYTHON:-.venv/bin/python}
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF "/$DIR/" "$EXCLUDE" 2>/dev/null || echo "/$DIR/" >> "$EXCLUDE"
# transformers and the hub stack it requires at these versions (Requires-Dist, less what the image holds).
NAMES=(transformers huggingface_hub kernels tomlkit hf-xet httpx2 httpcore2 truststore)
PINS=()
for n in "${NAMES[@]}"; do
  v=$("$PY" -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$v" ] || { echo "error: $n is not installed in $PY; install llmc's test extras first" >&2; exit 2; }
  PINS+=("$n==$v")
done
rm -rf "$DIR" && mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "${PINS[@]}"
bytes=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
printf '%s\n' "${PINS[@]}" > "$DIR/PINS.txt"
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $((bytes / 1048576)) MiB in $DIR: ${PINS[*]}"
if [ "$bytes" -gt $((48 * 1048576)) ]; then  # leave room in the 64 MiB carry for the working tree itself
  echo "error: $DIR holds $((bytes / 1048576)) MiB; the device tool carries 64 MiB in all" >&2
  exit 1
fi
