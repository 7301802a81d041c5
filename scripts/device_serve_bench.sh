#!/usr/bin/env bash
# Serve a random-weight `small` Q4_K_M GGUF under given rules and run `ktrans bench serve` against it.
# Usage: bash scripts/device_serve_bench.sh RULES.yaml PORT [bench args...]   (results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}; rules=$1; port=$2; shift 2
name=$(basename "$rules" .yaml)
[ -f /tmp/small-q4km.gguf ] || ktrans make-tiny --gguf --out /tmp/small-q4km.gguf --preset small --quant q4_k_m
ktrans serve --gguf_path /tmp/small-q4km.gguf --optimize_config_path "$rules" --port "$port" \
  > "$OUT/serve_$name.log" 2>&1 &
pid=$!
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
ktrans bench serve --url "http://127.0.0.1:$port" "$@" 2>&1 | tee "$OUT/bench_serve_$name.txt"
kill $pid; wait $pid 2>/dev/null
tail -25 "$OUT/serve_$name.log"
