#!/usr/bin/env bash
# CUDA-graph decode with the CPU experts on the stream (doc/benchmarks.md, "Decode without the host in the way"),
# on the lent H200 machine, in two device calls made back to back (each within ~30 s of the last, so /dev/shm and
# the llama.cpp build survive):
#   bash scripts/device_graphs.sh start   in the background: write the random 80B Q4_K_M file (seed 0) to /dev/shm
#                                         and build llama-bench (carry .llama, see device_e2e_baseline.sh); in the
#                                         foreground: the gpu-marked tests
#   bash scripts/device_graphs.sh bench   ktrans bench e2e at full size, serve placement with the experts on the CPU,
#                                         graphs off then on; then llama-bench -ngl 99 -ot exps=CPU on the same file
# Results are JSON/text files under $OUT; the output's tail has the short lines.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
R=optimize_rules
T=$(nproc)
LLB=/tmp/llb

source "$(dirname "$0")/device_common.sh"  # e2e NAME FLAGS...

case "${1:-}" in
start)
  start_writer /tmp/write.log
  start_llama $LLB $((T / 2))
  echo "== gpu tests"
  timeout -k 10 "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider -m gpu ${PYTEST_ARGS:-tests/engine tests/kernels tests/inject tests/model tests/operators tests/bench} 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -40
  echo "== background: $(tail -c 300 /tmp/write.log 2>/dev/null | tr '\r' '\n' | tail -2)"
  echo "== llama build: $(tail -2 /tmp/llb.log 2>/dev/null)"
  ;;
bench)
  for i in $(seq 60); do grep -q done /tmp/write.log 2>/dev/null && break; sleep 5; done
  tail -c 300 /tmp/write.log | tr '\r' '\n' | tail -2
  ls -la "$F"
  if [ -n "${EAGER:-}" ]; then
    e2e eager --optimize_config_path $R/Qwen3Next-serve-cpuexperts.yaml --prompt_len 64 --gen_len 64 \
      --batch_sizes 1,4,16 --no-use_cuda_graph
  fi
  e2e graphs --optimize_config_path $R/Qwen3Next-serve-cpuexperts.yaml --prompt_len 64 --gen_len 64 \
    --batch_sizes 1,4,16 --use_cuda_graph
  # VARIANTS="NAME:ENV=VALUE[,ENV=VALUE] ...": batch 1 again with those environment variables (A/B of a knob)
  for v in ${VARIANTS:-}; do
    name=${v%%:*}
    env $(echo "${v#*:}" | tr , " ") bash -c "source $(dirname "$0")/device_common.sh; OUT=$OUT F=$F; \
      e2e $name --optimize_config_path $R/Qwen3Next-serve-cpuexperts.yaml --prompt_len 64 --gen_len 64 \
      --batch_sizes 1 --use_cuda_graph"
  done
  for i in $(seq 60); do [ -x $LLB/bin/llama-bench ] && break; pgrep -f "ninja -C $LLB" > /dev/null || break; sleep 5; done
  if [ -x $LLB/bin/llama-bench ]; then
    echo "== llama-bench -ngl 99 -ot exps=CPU"
    timeout 240 $LLB/bin/llama-bench -m "$F" -t "$T" -p 512 -n 64 -ngl 99 -ot exps=CPU -r 2 -o json \
      > "$OUT/llama_exps_cpu.json" 2> "$OUT/llama_exps_cpu.err"
    python3 -c "
import json
for r in json.load(open('$OUT/llama_exps_cpu.json')):
    print(r.get('n_prompt'), r.get('n_gen'), round(r.get('avg_ts', 0), 2), '+-', round(r.get('stddev_ts', 0), 2))
" || tail -5 "$OUT/llama_exps_cpu.err"
  else
    echo "no llama-bench: $(tail -5 /tmp/llb.log)"
  fi
  ;;
*)
  echo "usage: $0 start|bench" >&2
  exit 2
  ;;
esac
