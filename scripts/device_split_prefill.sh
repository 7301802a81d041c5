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
echo "== bench e2e, ${RULES:=ktrans/optimize_rules/Qwen3Next-serve.yaml}"
PYTHONUNBUFFERED=1 timeout "${E2E_TIMEOUT:-220}" ktrans bench e2e --gguf_path "$F" --optimize_config_path "$RULES" \
  --prompt_len 512 --gen_len 8 --batch_sizes 1 --prefill_lens "${LENS:-4096}" --profile_steps 0 --use_cuda_graph \
  --json > "$OUT/e2e_split.json" 2> "$OUT/e2e_split.err"
echo "rc $?"
python3 - "$OUT/e2e_split.json" <<'PY'
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception as e:
    sys.exit(f"no JSON: {e}")
print({k: r.get(k) for k in ("load_s", "prefill_tok_s", "prefill", "decode_tok_s", "ttft_ms", "split_prefill",
                             "host_rss_gib", "gpu_memory")})
PY
tail -c 1500 "$OUT/e2e_split.err"
