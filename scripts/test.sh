#!/usr/bin/env bash
# Set up a virtual environment from nothing and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLMC_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch==2.13.0 is the CPU wheel on this machine's disk; an unpinned torch would pull CUDA builds.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q ".[test]"
"$VENV/bin/ruff" check .

exec "$VENV/bin/python" -m pytest -n 2 -p no:cacheprovider "$@"
