#!/usr/bin/env bash
# Issue 5 on the lent GPU machine's CPU (16-core Xeon, python 3.12, torch 2.11, no network): our CPU MoE
# (`ktrans bench moe`) next to KTransformers' kt-kernel 0.7.2 llamafile backend (scripts/ktkernel_bench.py) on the same
# random Q4_K Qwen3-Next blocks, runs interleaved (ours, theirs, ours, theirs, ...). Results under $OUT.
#
# kt-kernel cannot be installed there (no network; its wheel is 101 MB and pins torch 2.9.1), but its extension
# does not link libtorch: it needs only its own .so, the libraries bundled in the wheel's kt_kernel.libs/ (found
# through the .so's RPATH $ORIGIN/../kt_kernel.libs) and kt_kernel/_cpu_detect.py, which picks the variant for the
# CPU. Those come in .ktk/ (git-ignored; ~31 MB), made here from the cp312 wheel:
#   pip download kt-kernel==0.7.2 --no-deps --python-version 3.12 --only-binary=:all: -d /tmp/w
#   unzip -q /tmp/w/kt_kernel-0.7.2-cp312-*.whl -d /tmp/x && mkdir -p .ktk/kt_kernel .ktk/kt_kernel-0.7.2.dist-info
#   cp /tmp/x/kt_kernel/{__init__,_cpu_detect}.py .ktk/kt_kernel/ && cp -r /tmp/x/kt_kernel.libs .ktk/
#   for v in amx avx512_bf16 avx512_vnni avx2; do cp /tmp/x/kt_kernel/_kt_kernel_ext_$v.*.so .ktk/kt_kernel/; done
#   cp /tmp/x/kt_kernel-0.7.2.dist-info/{METADATA,WHEEL} .ktk/kt_kernel-0.7.2.dist-info/
# (a missing variant falls back to the next lower one: amx -> avx512_bf16 -> vbmi -> vnni -> base -> avx2).
#
# Call it from the device tool with carry [".ktk"] (plus whatever else the run needs), e.g.
#   bash scripts/device_ktkernel.sh
# Env: THREADS (kt-kernel compute threads, default 16,15,8; its dispatcher thread busy-waits on top of them),
#      OURS_THREADS (default 16), TOKENS (default 1,256), ROUNDS (default 2), SKIP_CHECK=1 (skip the correctness
#      check), SKIP_BUILD=1 (ktrans already built there), KT_KERNEL_CPU_VARIANT (force a kt-kernel variant).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
THREADS=${THREADS:-16,15,8}
OURS_THREADS=${OURS_THREADS:-16}
TOKENS=${TOKENS:-1,256}
ROUNDS=${ROUNDS:-2}
ROOT=$(pwd)
if [ ! -f .ktk/kt_kernel/_cpu_detect.py ]; then
  echo "no .ktk/kt_kernel here: carry .ktk (see the top of this script)"; exit 2
fi
# kt_kernel (only its extension is loaded, never its __init__) and the repo (for ktrans's reference in --check)
export PYTHONPATH="$ROOT/.ktk:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

{ date -u; nproc; lscpu | grep -E 'Model name|Socket|NUMA node|Flags' | cut -c1-600; python3 --version
  python3 -c 'import torch; print("torch", torch.__version__)'; ldd --version | head -1; cat /proc/loadavg; } \
  > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" | grep -v Flags

# Does kt-kernel's extension load here, and which variant?
KT_KERNEL_DEBUG=1 python3 -c '
import sys; sys.path.insert(0, "tools")
import ktkernel_bench as kb
ext, variant, so = kb.load_ext()
print("kt-kernel extension:", so, "variant", variant, "version", kb._ktk_version())
' 2>&1 | tee "$OUT/ktk_load.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "kt-kernel extension did not load"; exit 1; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  t0=$(date +%s)
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  echo "ktrans build: $(( $(date +%s) - t0 )) s"
fi

if [ "${SKIP_CHECK:-0}" != 1 ]; then
  python3 scripts/ktkernel_bench.py --check --check-threads 8 > "$OUT/ktk_check.log" 2>&1
  echo "kt-kernel correctness check: exit $?"; grep '^{' "$OUT/ktk_check.log" | cut -c1-200
fi

: > "$OUT/runs.jsonl"
for r in $(seq 1 "$ROUNDS"); do
  echo "# round $r ours $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  ktrans bench moe --shape qwen3-next --quant q4_k --tokens "$TOKENS" --threads "$OURS_THREADS" --json 2>>"$OUT/ours.err" \
    | sed "s/^{/{\"round\": $r, \"impl\": \"ktrans\", /" | tee -a "$OUT/runs.jsonl"
  echo "# round $r kt-kernel $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  python3 scripts/ktkernel_bench.py --threads "$THREADS" --tokens "$TOKENS" 2>>"$OUT/ktk.err" \
    | sed "s/^{/{\"round\": $r, /" | tee -a "$OUT/runs.jsonl"
done

# tokens/s: ours (median over rounds) over kt-kernel's best thread count (its best median over rounds)
python3 - "$OUT/runs.jsonl" <<'EOF' | tee "$OUT/summary.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and "tokens_per_s" in l]
for T in sorted({r["tokens"] for r in rows}):
    ours = [r["tokens_per_s"] for r in rows if r["tokens"] == T and r["impl"] == "ktrans"]
    theirs = {}
    for r in rows:
        if r["tokens"] == T and r["impl"] == "kt-kernel":
            theirs.setdefault(r["threads"], []).append(r["tokens_per_s"])
    if not ours or not theirs:
        continue
    best_n, best = max(((n, statistics.median(v)) for n, v in theirs.items()), key=lambda x: x[1])
    o = statistics.median(ours)
    per = ", ".join(f"{n} thr {statistics.median(v):.1f}" for n, v in sorted(theirs.items()))
    print(f"tokens {T}: ours {o:.1f} tok/s; kt-kernel {per}; best {best_n} threads -> ours/theirs {o / best:.2f}x")
EOF
