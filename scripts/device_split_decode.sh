#!/usr/bin/env bash
# Decode at batch 1 under the split prefill rules against the CPU-experts rules, on a slice of the real shapes:
# which part of the split setup (warm-up through a split chunk, chunk size, registration) slows decode.
#   bash scripts/device_split_decode.sh      LAYERS (8), VARIANTS (names below), THRESH (512)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/s${LAYERS:-8}.gguf}
[ -f "$F" ] || ktrans make-tiny --gguf --preset qwen3-next-80b-a3b --quant q4_k_m --seed 0 --layers "${LAYERS:-8}" \
  --out "$F" 2>&1 | tail -1
source "$(dirname "$0")/device_common.sh"
sed -e "s/^\( *gpu_prefill_min_tokens: \)[0-9]*/\1${THRESH:-512}/" ktrans/optimize_rules/Qwen3Next-serve.yaml > /tmp/split.yaml
cpux=ktrans/optimize_rules/Qwen3Next-serve-cpuexperts.yaml
declare -A args=(
  [split_4096]="--optimize_config_path /tmp/split.yaml --chunk_size 4096"
  [split_4096_nowarm]="--optimize_config_path /tmp/split.yaml --chunk_size 4096 --no-warmup"
  [split_512]="--optimize_config_path /tmp/split.yaml --chunk_size 512"
  [cpux_4096]="--optimize_config_path $cpux --chunk_size 4096"
  [cpux_512]="--optimize_config_path $cpux --chunk_size 512"
)
for v in ${VARIANTS:-split_4096 split_4096_nowarm split_512 cpux_4096 cpux_512}; do
  E2E_TIMEOUT=${E2E_TIMEOUT:-120} e2e "dec_$v" ${args[$v]} --prompt_len 64 --gen_len 24 --batch_sizes 1 \
    --profile_steps 0 --use_cuda_graph
done
