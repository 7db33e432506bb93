#!/usr/bin/env bash
# Set up llmc, build a CPU engine from the bundled default model, generate text, print a report.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLMC_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q .
LLMC="$VENV/bin/llmc"
"$LLMC" build assets/default-model --target cpu -o engines/default-cpu --force
"$LLMC" run engines/default-cpu --prompt "The for statement" --max-new-tokens 64
"$LLMC" verify engines/default-cpu
"$LLMC" inspect engines/default-cpu
