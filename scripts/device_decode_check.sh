#!/usr/bin/env bash
# Issue 5's decode target on the lent GPU machine's CPU in one device call (after the build): interleaved A/B of the
# decode-step options (scripts/decode_overhead.py --ab), the 1-token timeline, `ktrans bench moe` three times, and
# kt-kernel 0.7.2 (needs carry [".ktk"], see scripts/device_ktkernel.sh). JSON lines under $OUT.
# Usage: bash scripts/device_decode_check.sh   (THREADS defaults to all cores; SKIP_KT=1 leaves kt-kernel out;
#        AB_ROUNDS (default 3) A/B runs; AB sets the configurations, e.g. AB="base=4,2,256 norepack=4,2,256,norepack")
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$T
{ uname -r; nproc; cat /sys/kernel/mm/transparent_hugepage/enabled; } > "$OUT/machine.txt" 2>&1
AB=${AB:-"base=4,2,256 norepack=4,2,256,norepack nohp=4,2,256,nohp"}
for i in $(seq "${AB_ROUNDS:-3}"); do
  # shellcheck disable=SC2086
  python3 scripts/decode_overhead.py --threads "$T" --iters 400 --ab $AB
done 2>&1 | tee "$OUT/ab.jsonl" | cut -c1-400
python3 scripts/decode_overhead.py --threads "$T" --iters 300 2>&1 | tee "$OUT/overhead.jsonl" | cut -c1-400
for i in 1 2 3; do
  ktrans bench moe --shape qwen3-next --quant q4_k --threads "$T" --json --tokens 1,4,16
done 2>&1 | tee "$OUT/bench.jsonl" | cut -c1-300
if [ -z "${SKIP_KT:-}" ] && [ -d .ktk ]; then
  SKIP_BUILD=1 SKIP_CHECK=1 ROUNDS=3 THREADS=$((T - 1)) OURS_THREADS=$T TOKENS=1,256 bash scripts/device_ktkernel.sh 2>&1 |
    grep -E "^tokens|^# round"
fi
