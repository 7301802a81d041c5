#!/usr/bin/env bash
# Issue 17 on the lent H200 machine: the repack and split-prefill tests on the GPU, this machine's limits (pinned
# host-to-device and CPU read bandwidth), the repack kernel's time for one layer, then bench e2e at full size with the
# shipped serve rules' KExpertsSplit at threshold $THRESH, prefill at 512 and $LENS tokens in steps of $CHUNK tokens.
# Writes the file to /dev/shm first (~40 s, while the tests run).
#   bash scripts/device_split_prefill.sh      TEST_TIMEOUT, E2E_TIMEOUT, LENS (4096), THRESH (256), CHUNK (4096),
#                                             SHARE (auto: cpu_share), STREAM=1 (cpu_on_stream), NO_TESTS=1, RULES (the base rule file),
#                                             TESTS (the test files), NO_KERNELS=1 (skips limits and the repack bench),
#                                             MOE_TOKENS (also bench moe, the CPU experts alone, at these token
#                                             counts), CONTROL=1 (then bench e2e with the experts on the CPU in both
#                                             phases, --chunk_size 512: decode and pp512 beside the split's),
#                                             ITL (a prompt this long arrives while ITL_DECODES (4) requests
#                                             decode: their ITL p50/p99 beside the chunk time)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
source "$(dirname "$0")/device_common.sh"
start_writer "$OUT/mk.log"
if [ -z "${NO_TESTS:-}" ]; then
  echo "== gpu tests"
  timeout -k 10 "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider --tb=short ${TESTS:-tests/kernels/test_triton_repack.py \
    tests/operators/test_experts_split.py tests/engine/test_split_prefill_gpu.py} 2>&1 | tee "$OUT/split_tests.txt" \
    | tail -${TAIL:-25}
fi
while [ -n "$(busy make-tiny)" ]; do sleep 1; done
tail -c 300 "$OUT/mk.log" 2>/dev/null; echo
if [ -z "${NO_KERNELS:-}" ]; then
  echo "== ktrans bench limits"
  timeout 120 ktrans bench limits --json 2>&1 | tail -c 1500
  echo "== ktrans bench kernels --match repack"
  timeout 120 ktrans bench kernels --family quant --match repack --reps 10 2>&1 | tail -8
fi
if [ -n "${MOE_TOKENS:-}" ]; then
  echo "== ktrans bench moe --tokens $MOE_TOKENS"
  timeout 150 ktrans bench moe --tokens "$MOE_TOKENS" 2>&1 | tail -12
fi
sed -e "s/^\( *gpu_prefill_min_tokens: \)[0-9]*/\1${THRESH:-256}/" \
    ${SHARE:+-e "s/^\( *gpu_prefill_min_tokens: [0-9]*\)/\1\n      cpu_share: $SHARE/"} \
    ${STREAM:+-e "s/^\( *gpu_prefill_min_tokens: [0-9]*\)/\1\n      cpu_on_stream: true/"} \
    "${RULES:-ktrans/optimize_rules/Qwen3Next-serve.yaml}" > /tmp/split.yaml
grep -n "gpu_prefill_min_tokens\|cpu_share:\|cpu_on_stream:" /tmp/split.yaml
PYTHONUNBUFFERED=1 E2E_TIMEOUT=${E2E_TIMEOUT:-240} e2e e2e_split --optimize_config_path /tmp/split.yaml \
  --prompt_len 512 --gen_len 8 --batch_sizes 1 --prefill_lens "${LENS:-4096}" --chunk_size "${CHUNK:-4096}" \
  --profile_steps 0 --use_cuda_graph ${ITL:+--itl_prefill_len $ITL --itl_decodes ${ITL_DECODES:-4}}
if [ -n "${CONTROL:-}" ]; then
  PYTHONUNBUFFERED=1 E2E_TIMEOUT=${E2E_TIMEOUT:-240} e2e e2e_cpuexperts \
    --optimize_config_path ktrans/optimize_rules/Qwen3Next-serve-cpuexperts.yaml --prompt_len 512 --gen_len 32 \
    --batch_sizes 1 --chunk_size 512 --profile_steps 0 --use_cuda_graph
fi
