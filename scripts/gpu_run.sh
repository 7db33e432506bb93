#!/usr/bin/env bash
# The one command of a GPU lease (issue 37): on the lent machine, from a copy of this repository, install the wheels
# scripts/gpu_bundle.sh fetched (carried as .whl/), build llmc's C++ extensions in place, make the checkout
# importable as `llmc`, and run scripts/gpu_check.py with the given flags, its JSON and log under $OUT.
#
#     run(command="bash scripts/gpu_run.sh --budget-s 420 --profile", carry=[".whl"], timeout_s=560)
#     bash scripts/gpu_run.sh --cpu-smoke          # the same path on a machine without a GPU
#
# Exit status: gpu_check's (0 every check passed, 1 one failed, 2 no GPU), or 3 when the setup failed (its log in
# $OUT/setup.log).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/llmc-gpu-out.XXXX)}
mkdir -p "$OUT"
SITE=${LLMC_GPU_SITE:-/tmp/llmc-site}
setup() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE/wheels" \
      .whl/*.whl || return 1
    export PYTHONPATH="$SITE/wheels${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # The repository root is the package `llmc` (flat layout): a link named llmc makes it importable as such.
  mkdir -p "$SITE/src" && ln -sfn "$PWD" "$SITE/src/llmc" || return 1
  export PYTHONPATH="$SITE/src${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" setup.py -q build_ext --inplace || return 1
  "$PY" -c "import llmc.runtime, transformers, torch, triton; print('llmc ready: transformers', \
transformers.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
}
t0=$(date +%s)
if ! setup > "$OUT/setup.log" 2>&1; then
  tail -40 "$OUT/setup.log"
  echo "error: setup failed after $(( $(date +%s) - t0 )) s (log: $OUT/setup.log)" >&2
  exit 3
fi
tail -1 "$OUT/setup.log"
echo "setup: $(( $(date +%s) - t0 )) s"
export PYTHONUNBUFFERED=1
"$PY" scripts/gpu_check.py --out "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
