#!/usr/bin/env bash
# One-time setup of the peer engines (not part of CI; nothing here is installed into the repo).
# Work dir: $PEERS_ROOT (default ~/.cache/llmc-peers). Creates $PEERS_ROOT/venv with transformers,
# onnxruntime-genai (+ its model builder's needs) and llama-cpp-python compiled from its sdist
# (the sdist also carries llama.cpp's convert_hf_to_gguf.py and gguf-py, which convert.sh uses),
# then llama.cpp's own llama-bench / llama-quantize from the same CMake build tree.
# llama-cpp-python compiles for ~15 min on 2 cores.  Logs: $PEERS_ROOT/logs/.
set -euo pipefail
R=${PEERS_ROOT:-$HOME/.cache/llmc-peers}; export PEERS_ROOT=$R
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
mkdir -p "$R/logs" "$R/sdist"
[ -x "$R/venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$R/venv"
. "$R/venv/bin/activate"
pip install -q torch==2.13.0                 # the CPU wheel
pip install -q transformers safetensors tokenizers numpy psutil
pip install -q onnxruntime-genai onnxruntime onnx onnx_ir   # onnx_ir: needed by the model builder
pip install -q sentencepiece

if ! python -c "import llama_cpp" 2>/dev/null; then
  if [ ! -d "$R/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON" ]; then
    pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$R/sdist"
    tar xzf "$R/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$R/sdist"
  fi
  echo "building llama-cpp-python $LLAMA_CPP_PYTHON from source (~15 min on 2 cores; log: $R/logs/llama_build.log)"
  # -march=native compiles ggml's AMX kernels where the CPU lists AMX, and on this project's Sapphire Rapids VMs
  # their first LDTILECFG dies with a general-protection fault (llama-bench on a q4_0 model: SIGSEGV, dmesg
  # "general protection fault ... in libggml-cpu.so"; f32 models, which never reach AMX, ran). There, build for
  # the CPU's other x86 features by name and leave AMX out.
  GGML_ARGS="-DGGML_NATIVE=ON"
  if grep -qw amx_tile /proc/cpuinfo; then
    GGML_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    for f in sse4_2:SSE42 f16c:F16C fma:FMA bmi2:BMI2 avx:AVX avx2:AVX2 avx_vnni:AVX_VNNI avx512f:AVX512 \
             avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
      grep -qw "${f%%:*}" /proc/cpuinfo && GGML_ARGS="$GGML_ARGS -DGGML_${f##*:}=ON"
    done
  fi
  echo "ggml: $GGML_ARGS" > "$R/logs/llama_build.log"
  CMAKE_ARGS="$GGML_ARGS -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2} \
    pip install -v --no-cache-dir --config-settings=build-dir="$R/llama-build" \
    "$R/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON" >> "$R/logs/llama_build.log" 2>&1
fi
ln -sfn "$R/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" "$R/llama.cpp"

# llama.cpp's own tools from the same build tree (only the tool sources are compiled)
# llama-server: bench_serve.py's side by side (issue 18); llama-lookup: prompt lookup (bench_speculative.py);
# llama-imatrix: bench_quant_peers.py (importance matrix + llama-quantize, issue 19)
if [ ! -x "$R/llama-build/bin/llama-imatrix" ]; then
  (cd "$R/llama-build" && cmake -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON . \
     > "$R/logs/llama_tools_cfg.log" \
   && ninja -j"${JOBS:-2}" llama-bench llama-quantize llama-server llama-lookup llama-imatrix > "$R/logs/llama_tools_build.log")
fi
# the read-bandwidth probe (an independent check of llmc bench's bandwidth figure)
gcc -O3 -march=native -fopenmp "$(cd "$(dirname "$0")" && pwd)/bw_read.c" -o "$R/bw_read"
echo "peers setup done in $R"
