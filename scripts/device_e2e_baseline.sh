#!/usr/bin/env bash
# Full-size baseline on the lent H200 machine (doc/benchmarks.md, "Full size: the baseline"), in three device calls
# made back to back (each within ~30 s of the last, so /dev/shm and the llama.cpp build survive):
#   bash scripts/device_e2e_baseline.sh setup   write the random 80B Q4_K_M file to /dev/shm (timed), the machine's
#                                               limits, a 4-layer smoke run of bench e2e; then build llama-bench
#                                               (carry .llama: the trimmed llama.cpp of llama-cpp-python 0.3.36) while
#                                               the GPU rules try to load the full file (their error is the record)
#   bash scripts/device_e2e_baseline.sh ktrans  bench e2e at full size: serve rules with the experts on the CPU in both
#                                               phases (batch 1 at 512 tokens; 1,4,16 at 64), the shipped serve rules
#   bash scripts/device_e2e_baseline.sh peers   the CPU rules, then llama-bench on the same file (-ngl 99 -ot exps=CPU,
#                                               -ngl 99, -ngl 0 at pp512, pp4096, tg64)
# Every result is a JSON or text file under $OUT; the output's tail has the short lines.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
SEED=${SEED:-0}
R=optimize_rules
T=$(nproc)
LLB=/tmp/llb
source "$(dirname "$0")/device_common.sh"  # e2e NAME FLAGS...

case "${1:-}" in
setup)
  { date -u; uname -r; nproc; free -g; df -h /dev/shm; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm \
    --format=csv; lscpu | grep -E "Model name|Flags" | cut -c1-200; } > "$OUT/machine.txt" 2>&1
  ktrans doctor > "$OUT/doctor.json" 2>&1
  if [ ! -f "$F" ]; then
    echo "== writing $F"
    /usr/bin/time -f "%e s wall, %M KiB max RSS" ktrans make-tiny --gguf --preset qwen3-next-80b-a3b --quant q4_k_m \
      --seed "$SEED" --out "$F" 2>&1 | tr '\r' '\n' | grep -v "it/s\|B/s\]" | tail -3 | tee "$OUT/write.txt"
  fi
  echo "== limits"
  ktrans bench limits --json | tee "$OUT/limits.json"
  echo "== 4-layer smoke"
  ktrans make-tiny --gguf --preset qwen3-next-80b-a3b --quant q4_k_m --layers 4 --out /dev/shm/s4.gguf > /dev/null 2>&1
  F=/dev/shm/s4.gguf E2E_TIMEOUT=150 e2e smoke --optimize_config_path $R/Qwen3Next-serve-cpuexperts.yaml \
    --prompt_len 32 --gen_len 8 --batch_sizes 1,2 --profile_steps 4
  rm -f /dev/shm/s4.gguf
  start_llama $LLB $((T - 1))
  echo "== the GPU rules at full size (expected to fail: the experts are dequantized onto the GPU)"
  timeout 240 ktrans bench e2e --gguf_path "$F" --optimize_config_path $R/Qwen3Next-gpu.yaml --prompt_len 32 \
    --gen_len 8 --batch_sizes 1 --json > "$OUT/gpu_rules.json" 2> "$OUT/gpu_rules.err"
  echo "rc $?"
  tr '\r' '\n' < "$OUT/gpu_rules.err" | grep -v "tensor/s\]$" | tail -4 | cut -c1-600
  for i in $(seq 60); do [ -x $LLB/bin/llama-bench ] && break; pgrep -f "ninja -C $LLB" > /dev/null || break; sleep 5; done
  tail -3 /tmp/llb.log
  ;;
ktrans)
  e2e serve_cpuexperts_p512 --optimize_config_path $R/Qwen3Next-serve-cpuexperts.yaml --prompt_len 512 --gen_len 64 \
    --batch_sizes 1
  e2e serve_cpuexperts_p64 --optimize_config_path $R/Qwen3Next-serve-cpuexperts.yaml --prompt_len 64 --gen_len 64 \
    --batch_sizes 1,4,16
  E2E_TIMEOUT=200 e2e serve_shipped --optimize_config_path $R/Qwen3Next-serve.yaml --prompt_len 32 --gen_len 8 \
    --batch_sizes 1 --profile_steps 4
  ;;
peers)
  E2E_TIMEOUT=200 e2e cpu_rules --optimize_config_path $R/Qwen3Next-cpu.yaml --prompt_len 64 --gen_len 16 \
    --batch_sizes 1
  if [ ! -x $LLB/bin/llama-bench ]; then
    echo "no llama-bench: $(tail -5 /tmp/llb.log)"
    exit 1
  fi
  for spec in "exps_cpu:-ngl 99 -ot exps=CPU -r 2" "all_gpu:-ngl 99 -r 2" "cpu_only:-ngl 0 -r 1"; do
    name=${spec%%:*}
    echo "== llama-bench $name: ${spec#*:}"
    # shellcheck disable=SC2086
    timeout 300 $LLB/bin/llama-bench -m "$F" -t "$T" -p 512,4096 -n 64 ${spec#*:} -o json \
      > "$OUT/llama_$name.json" 2> "$OUT/llama_$name.err"
    echo "rc $?"
    python3 -c "
import json, sys
for r in json.load(open('$OUT/llama_$name.json')):
    print(r.get('n_prompt'), r.get('n_gen'), round(r.get('avg_ts', 0), 2), '+-', round(r.get('stddev_ts', 0), 2))
" || tail -5 "$OUT/llama_$name.err"
  done
  ;;
*)
  echo "usage: $0 setup|ktrans|peers" >&2
  exit 2
  ;;
esac
