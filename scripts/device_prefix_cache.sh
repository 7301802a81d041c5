#!/usr/bin/env bash
# The prefix cache at full size on the lent H200 machine (issue 18): TTFT of an 8k-token shared prefix on a hit vs a
# miss, the miss overhead and a 10-turn chat, serve placement (experts on the CPU), the random 80B Q4_K_M file.
#   bash scripts/device_prefix_cache.sh      (writes the file to /dev/shm first when it is not there: ~60 s)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
if [ ! -f "$F" ]; then
  ktrans make-tiny --gguf --preset qwen3-next-80b-a3b --quant q4_k_m --seed 0 --out "$F" 2>&1 | tail -1
fi
echo "== ktrans bench prefix-cache --gguf_path $F (serve placement)"
timeout "${BENCH_TIMEOUT:-420}" ktrans bench prefix-cache --gguf_path "$F" \
  --optimize_config_path optimize_rules/Qwen3Next-serve-cpuexperts.yaml --prefix_len 8192 --repeats "${REPEATS:-3}" \
  --turns "${TURNS:-4}" --json > "$OUT/prefix_cache.json" 2> "$OUT/prefix_cache.err"
echo "rc $?"
tail -c 2000 "$OUT/prefix_cache.json"
tail -c 600 "$OUT/prefix_cache.err"
