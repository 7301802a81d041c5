# Shared by the device_*.sh scripts (sourced): e2e NAME FLAGS... runs `ktrans bench e2e --gguf_path $F --json FLAGS`
# under $E2E_TIMEOUT (default 420 s), keeps its JSON and log under $OUT/NAME.{json,err} and prints the short lines.
# Out of time, `watchdog` records what the command is doing into NAME.watchdog, sends it SIGUSR1 (ktrans prints every
# thread's Python stack into NAME.err) and kills it 10 s later: a stuck run says where it waited.
# Before it starts, e2e waits (up to $QUIET_WAIT s, default 240) for background builds and file writers to end: the
# CPU pool's pinned workers wait for the slowest of them, so a compiler beside a measurement multiplied the experts'
# time by ~9 on 2026-12-02 (doc/benchmarks.md, session 11). A run that starts anyway says so.
# busy PATTERN: the PIDs whose command line matches PATTERN, this shell, its subshell and its ancestors left out. A
# caller's own command line may name what it waits for (`bash -c '... make-tiny ...; wait for make-tiny'`): a bare
# `pgrep -f` loop then waits on itself, which spent a whole device call on 2026-12-02.
busy() {
  local skip=" $$ $BASHPID " p=$$ q f
  while [ "${p:-1}" -gt 1 ]; do p=$(ps -o ppid= -p "$p" | tr -d ' '); skip+="$p "; done
  f=$(mktemp)
  pgrep -f "$1" > "$f"
  while read -r q; do [[ $skip == *" $q "* ]] || echo "$q"; done < "$f"
  rm -f "$f"
}
# start_writer LOG: write the full-size random file $F in the background (setsid: it outlives the call) unless it is
# there; its progress goes to LOG. Wait for it with `busy make-tiny`.
start_writer() {
  # one 48 GB file in the shm mount at a time: two, with the experts' 47 GB in RAM, run the machine out of memory
  # (session 20: `hot` left its skewed file, the next call wrote the uniform one beside it); so before writing $F,
  # every other *.gguf there goes, wherever $F itself is
  local g
  if [ ! -f "$F" ]; then for g in /dev/shm/*.gguf; do [ -f "$g" ] && [ "$g" != "$F" ] && rm -f "$g"; done; fi
  [ -f "$F" ] || setsid bash -c "ktrans make-tiny --gguf --preset qwen3-next-80b-a3b --quant q4_k_m --seed 0 --out $F \
    > $1 2>&1; echo done >> $1" < /dev/null > /dev/null 2>&1 &
}
# start_llama DIR JOBS: build llama-bench from the carried .llama.tgz (`tar czf .llama.tgz .llama`: one file) or
# .llama into DIR in the background (NOTES.md's flags; ~3.5 min at 15 jobs) unless neither is there or
# DIR/bin/llama-bench is; its log goes to /tmp/llb.log.
start_llama() {
  [ ! -x "$1/bin/llama-bench" ] || return 0
  local src=.llama
  if [ -f .llama.tgz ]; then  # the tree as one archive (session 20: a file of the carried folder was missing there)
    src=/tmp/llama-src
    if [ ! -d $src ]; then  # unpacked beside, moved into place whole: a failed unpack leaves nothing half-made
      rm -rf $src.part && mkdir -p $src.part && tar xzf .llama.tgz -C $src.part --strip-components 1 \
        && mv $src.part $src || { echo "start_llama: .llama.tgz did not unpack" >&2; return 0; }
    fi
  fi
  [ -d $src ] || return 0
  setsid bash -c "cmake -S $src -B $1 -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release && ninja -C $1 -j $2 llama-bench" > /tmp/llb.log 2>&1 < /dev/null &
}
# start_fi_warm: where flashinfer imports, its JIT compiles of the kernels the flashinfer bench family and
# KAttentionFlashInfer run at the 80B shapes (head_dim 256), in the background (setsid), so a later bench times
# kernels, not nvcc: in session 25 the family's 80 s cap ended inside the compiles. Log /tmp/fi_warm.log; wait with
# `busy fi_warm`.
start_fi_warm() {
  python3 -c "import flashinfer" 2>/dev/null || return 0
  setsid bash -c ": fi_warm; ktrans bench kernels --json --reps 1 --family flashinfer" > /tmp/fi_warm.log 2>&1 \
    < /dev/null &
}
quiet() {
  local i
  for i in $(seq "${QUIET_WAIT:-240}"); do
    [ -n "$(busy 'ninja|nvcc|cicc|cc1plus|make-tiny')" ] || return 0
    sleep 1
  done
  echo "WARNING: a build or writer is still running ($(busy 'ninja|nvcc|cicc|cc1plus|make-tiny' | head -2 |
    xargs -r ps -o args= -p | cut -c1-80 | tr '\n' ' ')): $1's figures are not from a quiet machine"
}
# watchdog PID SECONDS LOG: wait for PID; past SECONDS, write what it is doing to LOG (and stdout) -- its state and
# kernel wait channel, each thread's, its children (a compiler), the GPU's utilization and memory -- then send it
# SIGUSR1 (a ktrans command prints every thread's Python stack to its stderr), look again 10 s later and kill it.
# Session 36's stuck run printed no stack, so whether it waited on the GPU, a child or the kernel was not known.
# Returns PID's exit status (137 once killed).
watchdog() {
  local pid=$1 limit=$2 log=$3 t=0
  while kill -0 "$pid" 2> /dev/null; do
    if [ "$t" -ge "$limit" ]; then
      { echo "== watchdog: pid $pid still running after ${t} s"
        ps -o pid,stat,wchan:32,etime,pcpu,rss -p "$pid"
        grep -E "^(State|Threads|VmRSS)" "/proc/$pid/status"
        for task in /proc/$pid/task/*; do  # thread name, state, wait channel; counted
          echo "$(cat "$task/comm") $(awk '{print $3}' "$task/stat") $(cat "$task/wchan")"
        done | sort | uniq -c | sort -rn | head -12
        echo "-- children:"; ps -o pid,stat,etime,pcpu,args --ppid "$pid" | cut -c1-160
        nvidia-smi --query-gpu=utilization.gpu,memory.used,power.draw --format=csv,noheader
        free -g | head -2
        kill -USR1 "$pid"; sleep 10
        echo "-- 10 s after SIGUSR1:"; ps -o pid,stat,wchan:32,pcpu -p "$pid"
        nvidia-smi --query-gpu=utilization.gpu,memory.used,power.draw --format=csv,noheader
      } 2>&1 | tee "$log"
      kill -9 "$pid" 2> /dev/null
      break
    fi
    sleep 1
    t=$((t + 1))
  done
  wait "$pid"
}
e2e() {
  local name=$1
  shift
  quiet "$name"
  echo "== $name: ktrans bench e2e --gguf_path $F $*"
  ktrans bench e2e --gguf_path "$F" --json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err" &
  watchdog $! "${E2E_TIMEOUT:-420}" "$OUT/$name.watchdog"
  echo "rc $?"
  python3 - "$OUT/$name.json" <<'EOF'
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception as e:
    sys.exit(f"no JSON: {e}")
print({k: r.get(k) for k in ("load_s", "prefill_tok_s", "prefill", "decode_tok_s", "ttft_ms", "tpot_ms", "split_ms",
                             "split_prefill", "cuda_graphs", "host_rss_gib", "host_hugepages_gib", "gpu_memory",
                             "triton_compiles", "triton_autotuned") if r.get(k) is not None})
EOF
  tail -c 800 "$OUT/$name.err"
}
