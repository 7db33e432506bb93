#!/usr/bin/env bash
# One command: every engine on one model, one process each, back to back, then the side-by-side report
# (ratios of llmc to the faster peer) in benchmarks/results/peers_<tag>.{json,md}.
# usage: run.sh <small|1b> [engine-regex]     (after setup.sh, make_model.py and convert.sh <tag>)
# env: BENCH_THREADS (2) BENCH_REPEATS (3) BENCH_WARMUP (1), BATCHES (1,8,32), HF_BATCHES (1,8),
#      STREAM (1: run llmc's request-stream workload too), LLMC / LLMC_PYTHON (as in convert.sh),
#      RESULTS (repo results dir; default <repo>/benchmarks/results), LLMC_REV (what llmc is measured, for the
#      report; default: this checkout's commit)
set -uo pipefail
TAG=${1:-small}
FILTER=${2:-.}
HERE=$(cd "$(dirname "$0")" && pwd)
R=${PEERS_ROOT:-$HOME/.cache/llmc-peers}; export PEERS_ROOT=$R
LLMC=${LLMC:-"${LLMC_PYTHON:-python3} -m llmc.cli.main"}
PY=$R/venv/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T=${BENCH_THREADS:-2}
export OMP_NUM_THREADS=$T MKL_NUM_THREADS=$T OPENBLAS_NUM_THREADS=$T BENCH_THREADS=$T
export BENCH_REPEATS=${BENCH_REPEATS:-3} BENCH_WARMUP=${BENCH_WARMUP:-1}
BATCHES=${BATCHES:-1,8,32}
if [ "$TAG" = small ]; then HF=$R/model; else HF=$R/model-$TAG; fi
O=$R/$TAG
RUN=${RUN_DIR:-$R/results/$TAG/$(date +%Y%m%d-%H%M%S)}   # RUN_DIR=an earlier run: re-run some engines into it
mkdir -p "$RUN" "$R/logs"
CMDS=$RUN/commands.txt
[ -f "$R/prompts.json" ] || "$PY" -c "import sys; sys.path.insert(0, '$HERE'); import bench_common as b; b.make_prompts()"

probe() {  # name: load average, the C read-bandwidth probe (2 threads, 1 GiB, 20 passes) and, right after it,
  # llmc bench's own probe (the pair checks llmc bench's bandwidth figure at one instant) -> $RUN/probe.jsonl
  local bw np
  bw=$(OMP_NUM_THREADS=$T "$R/bw_read" 20)
  np=$(${LLMC_PYTHON:-python3} -c "from llmc.bench.machine import measure_read_bandwidth as m; \
print(m(threads=$T).read_GBps)" 2>/dev/null || echo null)
  echo "{\"at\": \"$1\", \"time\": $(date +%s), \"loadavg\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"bw_read\": $bw, \
\"llmc_probe_GBps\": $np}" >> "$RUN/probe.jsonl"
}

bench() {  # name, command...
  local name=$1; shift
  echo "$name" | grep -Eq "$FILTER" || return 0
  echo "+ $*" >> "$CMDS"
  echo "== $TAG/$name (load $(cut -d' ' -f1 /proc/loadavg))"
  probe "before $name"
  local t=$SECONDS
  "$@" > "$R/logs/bench_${TAG}_$name.out" 2> "$R/logs/bench_${TAG}_$name.err"
  local rc=$?
  probe "after $name"
  [ $rc -eq 0 ] || { echo "   FAILED rc=$rc (see $R/logs/bench_${TAG}_$name.err)";
                     echo "{\"failed\": true, \"rc\": $rc, \"engine\": \"$name\"}" > "$RUN/$name.failed.json"; }
  echo "   $((SECONDS - t)) s"
}

[ -f "$RUN/run.json" ] && echo "{\"rerun\": \"$FILTER\", \"start\": \"$(date -Is)\"}" >> "$RUN/reruns.jsonl" || \
echo "{\"tag\": \"$TAG\", \"threads\": $T, \"repeats\": $BENCH_REPEATS, \"warmup\": $BENCH_WARMUP, \"batches\": \"$BATCHES\", \"host\": \"$(hostname)\", \
\"llmc\": \"${LLMC_REV:-$(git -C "$HERE" rev-parse --short HEAD 2>/dev/null)}\", \"nproc\": $(nproc), \"cpu\": \"$(lscpu | sed -n 's/^Model name: *//p')\", \"start\": \"$(date -Is)\"}" > "$RUN/run.json"
bench llmc-fp32 $LLMC bench "$O/llmc-fp32" --threads "$T" --repeats "$BENCH_REPEATS" --warmup "$BENCH_WARMUP" \
  --batch "$BATCHES" --workloads "prefill,decode$([ "${STREAM:-1}" = 1 ] && echo ,stream)" --json --out "$RUN/llmc-fp32.json" -q
bench llmc-int4 $LLMC bench "$O/llmc-int4" --threads "$T" --repeats "$BENCH_REPEATS" --warmup "$BENCH_WARMUP" \
  --batch "$BATCHES" --workloads "prefill,decode$([ "${STREAM:-1}" = 1 ] && echo ,stream)" --json --out "$RUN/llmc-int4.json" -q
for p in fp32 int4; do
  bench ortgenai-$p "$PY" "$HERE/bench_ortgenai.py" --model "$O/ortgenai-$p" --precision $p --batches "$BATCHES" \
    --out "$RUN/ortgenai-$p.json"
done
for t in f32 q4_0; do
  bench llamacpp-$t "$PY" "$HERE/bench_llamacpp.py" --model "$O/gguf/model-$t.gguf" --precision $t \
    --batches "$BATCHES" --out "$RUN/llamacpp-$t.json"
done
bench hf-fp32 "$PY" "$HERE/bench_hf.py" --model "$HF" --dtype float32 --batches "${HF_BATCHES:-1,8}" \
  --out "$RUN/hf-fp32.json"
[ -n "${RUN_DIR:-}" ] || sed -i "s/}\$/, \"end\": \"$(date -Is)\"}/" "$RUN/run.json"
"${LLMC_PYTHON:-python3}" "$HERE/report.py" "$RUN" --tag "$TAG" --out-dir "${RESULTS:-$HERE/../results}"
