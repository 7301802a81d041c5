#!/usr/bin/env bash
# The Triton kernels on the lent H200 machine (issues 15 and 16): their gpu- and triton-marked tests compiled, then
# `ktrans bench kernels` (CUDA-graph replay, cold L2; fla-core as the GDN peer when its wheel is carried in .whl).
#   bash scripts/device_triton.sh [TEST_FILES...]   (default: every kernels/operators test that names triton/quant)
#   E2E=1 ...   then bench e2e at full size, serve placement with the experts on the CPU, reference ops vs the Triton
#               layer ops vs those plus the quantized linears (rules made by scripts/rules_with_ops.py)
#   VARIANTS="triton triton_quant"  only those e2e variants;  NO_KERNELS=1  skips `bench kernels`;  TB=short  tracebacks
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  mapfile -t files < <(ls tests/kernels/test_*triton*.py tests/kernels/test_*quant*.py tests/operators/test_*triton*.py \
    tests/operators/test_*marlin*.py tests/operators/test_gpu_quant_rules.py tests/bench/test_kernels_*.py 2>/dev/null)
fi
echo "== tests: ${files[*]}"
timeout -k 10 "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider --tb="${TB:-short}" -m "gpu or triton" "${files[@]}" 2>&1 \
  | tee "$OUT/triton_tests.txt" | tail -${TAIL:-30}
[ -n "${NO_KERNELS:-}" ] || {
echo "== ktrans bench kernels"
timeout "${BENCH_TIMEOUT:-200}" ktrans bench kernels --json --reps "${REPS:-20}" ${BENCH_ARGS:-} > "$OUT/kernels.jsonl" 2> "$OUT/kernels.err"
echo "rc $?"
python3 - "$OUT/kernels.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    keep = {k: v for k, v in r.items() if k not in ("device", "hbm_gb_per_s", "bytes")}
    print(" ".join(f"{k}={v}" for k, v in keep.items()))
PY
tail -c 600 "$OUT/kernels.err"
}

if [ -n "${E2E:-}" ]; then
  F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
  [ -f "$F" ] || ktrans make-tiny --gguf --preset qwen3-next-80b-a3b --quant q4_k_m --seed 0 --out "$F" 2>&1 | tail -1
  source "$(dirname "$0")/device_common.sh"
  base=ktrans/optimize_rules/Qwen3Next-serve-cpuexperts.yaml
  python3 "$(dirname "$0")/rules_with_ops.py" $base /tmp/serve-triton.yaml triton
  python3 "$(dirname "$0")/rules_with_ops.py" $base /tmp/serve-triton-quant.yaml triton+quant
  declare -A rules=([reference]=$base [triton]=/tmp/serve-triton.yaml [triton_quant]=/tmp/serve-triton-quant.yaml)
  for name in ${VARIANTS:-reference triton triton_quant}; do
    v=$name:${rules[$name]}
    KTRANS_CPU_SPIN_US=${KTRANS_CPU_SPIN_US:-20000} e2e "e2e_${v%%:*}" --optimize_config_path "${v#*:}" \
      --prompt_len 64 --gen_len 64 --batch_sizes ${BATCHES:-1,16} --use_cuda_graph
  done
fi
