#!/usr/bin/env bash
# Run on the lent GPU machine's CPU: the Q4_K prefill tiles (AMX, AVX-512 VNNI, row kernels) and the decode
# step's per-thread timeline under the prefetch/task-split knobs. JSON lines under $OUT.
# Usage: bash scripts/device_moe_tuning.sh   (after the build; THREADS defaults to all cores)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$T
cat /sys/kernel/mm/transparent_hugepage/enabled > "$OUT/thp.txt" 2>&1
bench() { ktrans bench moe --shape qwen3-next --quant q4_k --threads "$T" --json "$@" 2>&1; }
{
  bench --tokens 64,256,1024 --tiles amx --reference
  bench --tokens 64,256,1024 --tiles vnni
  bench --tokens 256,1024 --tiles off
} | tee "$OUT/prefill.jsonl" | cut -c1-400
{
  echo '# default'; bench --tokens 1,4 --trace
  echo '# KTRANS_PREFETCH_HINT=t1'; KTRANS_PREFETCH_HINT=t1 bench --tokens 1,4 --trace
  echo '# KTRANS_PREFETCH_HINT=nta'; KTRANS_PREFETCH_HINT=nta bench --tokens 1,4 --trace
  echo '# KTRANS_PREFETCH_BYTES=8192'; KTRANS_PREFETCH_BYTES=8192 bench --tokens 1,4 --trace
  echo '# KTRANS_PREFETCH_BYTES=8192 KTRANS_PREFETCH_HINT=t1'; KTRANS_PREFETCH_BYTES=8192 KTRANS_PREFETCH_HINT=t1 bench --tokens 1,4 --trace
  echo '# KTRANS_PREFETCH_BYTES=2048'; KTRANS_PREFETCH_BYTES=2048 bench --tokens 1,4 --trace
  echo '# KTRANS_GU_TASKS=4 KTRANS_DN_TASKS=2'; KTRANS_GU_TASKS=4 KTRANS_DN_TASKS=2 bench --tokens 1,4 --trace
  echo '# KTRANS_GU_TASKS=2 KTRANS_DN_TASKS=1'; KTRANS_GU_TASKS=2 KTRANS_DN_TASKS=1 bench --tokens 1,4 --trace
  echo '# KTRANS_GU_TASKS=16 KTRANS_DN_TASKS=8'; KTRANS_GU_TASKS=16 KTRANS_DN_TASKS=8 bench --tokens 1,4 --trace
} | tee "$OUT/decode.jsonl" | cut -c1-600
# where a 1-token call's time goes, with the default and the non-temporal prefetch
{ python3 scripts/decode_overhead.py; KTRANS_PREFETCH_HINT=nta python3 scripts/decode_overhead.py; } | tee "$OUT/overhead.jsonl"
