#!/usr/bin/env bash
# Build one HF checkpoint with every engine: ONNX Runtime GenAI's model builder (fp32, int4), llama.cpp
# (convert_hf_to_gguf.py from the llama-cpp-python sdist: f32, then llama-quantize: q4_0) and llmc (fp32, int4).
# usage: convert.sh <small|1b>      (after setup.sh; makes the model with make_model.py if it is missing)
#   small: $PEERS_ROOT/model    -> $PEERS_ROOT/small/{ortgenai-*,gguf,llmc-*}
#   1b   : $PEERS_ROOT/model-1b -> $PEERS_ROOT/1b/...
# env: LLMC (the llmc command; default: `python -m llmc.cli.main` of the python that has llmc, $LLMC_PYTHON
#      or python3), ONLY (regex of build names to make, e.g. 'llmc'), FORCE=1 (rebuild).
set -euo pipefail
TAG=${1:-small}
HERE=$(cd "$(dirname "$0")" && pwd)
R=${PEERS_ROOT:-$HOME/.cache/llmc-peers}; export PEERS_ROOT=$R
LLMC=${LLMC:-"${LLMC_PYTHON:-python3} -m llmc.cli.main"}
PY=$R/venv/bin/python
export LLMC_CACHE_DIR=${LLMC_CACHE_DIR:-$R/llmc-cache}   # keep big engines out of the user cache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$TAG" = small ]; then HF=$R/model; else HF=$R/model-$TAG; fi
O=$R/$TAG
mkdir -p "$O/gguf" "$R/logs"
[ -f "$HF/config.json" ] || "$PY" "$HERE/make_model.py" "$TAG"   # tokenizer + random Llama of that shape
LOG=$R/logs/convert_$TAG.log
CMDS=$O/commands.txt
want() { [[ "$1" =~ ${ONLY:-.} ]] && { [ -n "${FORCE:-}" ] || [ ! -e "$2" ]; }; }
run() { echo "+ $*" | tee -a "$CMDS"; local t=$SECONDS; "$@" >> "$LOG" 2>&1; echo "  ($((SECONDS - t)) s)"; }

for p in fp32 int4; do  # the builder + one fix (ortgenai_build.py says which)
  want "ortgenai-$p" "$O/ortgenai-$p/model.onnx" && \
    run "$PY" "$HERE/ortgenai_build.py" -i "$HF" -o "$O/ortgenai-$p" -p $p -e cpu -c "$R/cache_dir" \
      --extra_options hf_token=false
done
want gguf-f32 "$O/gguf/model-f32.gguf" && run "$PY" "$HERE/convert_gguf.py" "$HF" "$O/gguf/model-f32.gguf" f32
want gguf-q4_0 "$O/gguf/model-q4_0.gguf" && \
  run "$R/llama-build/bin/llama-quantize" "$O/gguf/model-f32.gguf" "$O/gguf/model-q4_0.gguf" Q4_0 2
# llmc: the product's own command, as a user runs it (fp32; int4 = RTN, group 128, MatMulNBits int8 compute,
# with a float16 KV cache as llama.cpp keeps by default; ORT GenAI's CPU int4 model keeps float32)
want llmc-fp32 "$O/llmc-fp32/manifest.json" && run $LLMC build "$HF" --target cpu -o "$O/llmc-fp32" --force -q
want llmc-int4 "$O/llmc-int4/manifest.json" && \
  run $LLMC build "$HF" --target cpu --quant int4 --kv-cache-dtype fp16 -o "$O/llmc-int4" --force -q
du -sh "$O"/* | tee -a "$LOG"
echo "convert $TAG done"
