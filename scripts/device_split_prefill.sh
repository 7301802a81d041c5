#!/usr/bin/env bash
# Issue 17 on the lent H200 machine: the split-prefill tests on the GPU, then bench e2e at full size with the shipped
# serve rules (KExpertsSplit prefill), prefill at 512 and $LENS tokens. Writes the file to /dev/shm first (~40 s,
# while the tests run).
#   bash scripts/device_split_prefill.sh      TEST_TIMEOUT, E2E_TIMEOUT, LENS (default 4096), RULES
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
[ -f "$F" ] || (ktrans make-tiny --gguf --preset qwen3-next-80b-a3b --quant q4_k_m --seed 0 --out "$F" > "$OUT/mk.log" 2>&1 &)
echo "== gpu tests"
timeout "${TEST_TIMEOUT:-110}" python3 -m pytest -q -p no:cacheprovider --tb=short tests/operators/test_experts_split.py \
  tests/engine/test_split_prefill_gpu.py tests/operators/test_gdn_triton.py::test_triton_op_in_cuda_graphs_matches_torch_op \
  2>&1 | tee "$OUT/split_tests.txt" | tail -${TAIL:-25}
while pgrep -f "make-tiny" > /dev/null; do sleep 1; done
tail -c 300 "$OUT/mk.log" 2>/dev/null; echo
source "$(dirname "$0")/device_common.sh"
PYTHONUNBUFFERED=1 E2E_TIMEOUT=${E2E_TIMEOUT:-220} e2e e2e_split \
  --optimize_config_path "${RULES:-ktrans/optimize_rules/Qwen3Next-serve.yaml}" --prompt_len 512 --gen_len 8 \
  --batch_sizes 1 --prefill_lens "${LENS:-4096}" --profile_steps 0 --use_cuda_graph
