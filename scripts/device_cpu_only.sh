#!/usr/bin/env bash
# The CPU-only placement at full size against llama.cpp -ngl 0 (issue 14), two calls made back to back (each within
# ~30 s of the last, so /dev/shm and the llama.cpp build survive; carry .llama.tgz or .llama):
#   bash scripts/device_cpu_only.sh start   writes the full-size file and builds llama-bench (background, ~4 min)
#   bash scripts/device_cpu_only.sh bench   once both are done: bench e2e with Qwen3Next-cpu.yaml for each variant
#                                           (VARIANTS, default: flat, the flat decode step; modules,
#                                           KTRANS_CPU_DECODE=0; flat_spin, KTRANS_CPU_SPIN_US=20000), llama-bench
#                                           -ngl 0 between them (ROUNDS, default 2)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
LBB=/tmp/llb
T=$(nproc)
source "$(dirname "$0")/device_common.sh"
case "${1:-}" in
start)
  start_writer /tmp/write.log
  start_llama $LBB $((T - 1))
  for i in $(seq 100); do [ -n "$(busy 'make-tiny|ninja')" ] || break; sleep 5; done
  echo "== file: $(tail -c 200 /tmp/write.log 2>/dev/null | tr '\r' '\n' | tail -1)"
  echo "== llama: $(tail -1 /tmp/llb.log 2>/dev/null)"
  ;;
bench)
  declare -A envs=([flat]="KTRANS_CPU_DECODE=1" [modules]="KTRANS_CPU_DECODE=0"
                   [flat_spin]="KTRANS_CPU_DECODE=1 KTRANS_CPU_SPIN_US=20000")
  for r in $(seq "${ROUNDS:-2}"); do
    if [ -x $LBB/bin/llama-bench ]; then
      quiet llama
      timeout 150 $LBB/bin/llama-bench -m "$F" -t "$T" -p 0 -n 32 -ngl 0 -r 2 -o json > "$OUT/llama_cpu_$r.json" \
        2> "$OUT/llama_cpu_$r.err"
      python3 -c "import json; print('llama -ngl 0 tg32', [round(x['avg_ts'], 2) for x in json.load(open('$OUT/llama_cpu_$r.json'))])" \
        || tail -3 "$OUT/llama_cpu_$r.err"
    fi
    for v in ${VARIANTS:-flat modules flat_spin}; do
      env ${envs[$v]} bash -c "source $(dirname "$0")/device_common.sh; OUT=$OUT F=$F E2E_TIMEOUT=${E2E_TIMEOUT:-200}; \
        e2e cpu_${v}_$r --optimize_config_path ktrans/optimize_rules/Qwen3Next-cpu.yaml --prompt_len 64 --gen_len 32 \
        --batch_sizes 1 --profile_steps 0"
    done
  done
  ;;
*)
  echo "usage: bash scripts/device_cpu_only.sh start|bench" >&2
  exit 2
  ;;
esac
