// The tuning of the CPU kernels and of how a MoE job splits its work: one MoEConfig per MoE (or Linear) object,
// copied into every job it submits and passed down to the kernels, so that two objects in one process can run with
// different settings. There is no process-wide tuning state: the KTRANS_* environment variables below only give
// MoEConfig::defaults(). (KTRANS_CPU_ISA, which picks the kernel path in select_kernels, is about the machine, not
// a knob, and stays process-wide; so does KTRANS_QUANT_SCALAR, a test switch read once in quant.cpp.)
#pragma once

#include <mutex>

namespace ktrans {

struct MoEConfig {
  // How a MoE job splits its work: about `gate_up_tasks` and `down_tasks` tasks per pool thread (more tasks balance
  // uneven cores, fewer make longer streams for the prefetchers and fewer trips through the shared task counter),
  // and at most `down_expert_rows` rows per down task when down runs per expert (decode). 4 and 2 measured best on
  // the 16-core Xeon for a 1-token step (0.203-0.209 ms against 0.218-0.243 ms with 8 and 4, 0.248 with 2 and 1);
  // on 2 cores the blocks hit their caps either way. KTRANS_GU_TASKS, KTRANS_DN_TASKS, KTRANS_DN_ROWS.
  int gate_up_tasks = 4;
  int down_tasks = 2;
  int down_expert_rows = 256;
  // Weight rows are streamed once from DRAM. The kernels prefetch `prefetch_bytes` ahead of the block they read (on
  // into the call's next rows, never past the last while `prefetch_clamp` holds: see prefetch.h), and each call
  // first prefetches its opening stretch. 4 KiB measured best on both machines: on the dev box (Zen 4) 2 KiB left a
  // decode step 13-18% slower, 3-6 KiB within 1%, 8 KiB 3-4% slower; on the 16-core Xeon 2 and 8 KiB were slower
  // too. `prefetch_hint` 1 (t1) prefetches into L2 (prefetcht1), 2 (nta) non-temporally (prefetchnta): both measured
  // slower (nta at 0.44 of the Xeon's bandwidth instead of 0.66). KTRANS_PREFETCH_BYTES (rounded down to a multiple
  // of 64), KTRANS_PREFETCH_HINT=t0|t1|nta.
  int prefetch_bytes = 4096;
  int prefetch_hint = 0;  // 0: t0, 1: t1, 2: nta
  // The distance of the Q4_K_X16/Q5_K_X16 kernels (same hint), which compute 2-3x as fast per byte as the row
  // kernels: on the 16-core Xeon 4 KiB stays best (1 KiB 2-3% slower, none 5%, at 2, 4 and 16 threads), on the
  // 2-core Zen 4 1 KiB and none are 1.5-6% faster than 4 KiB (its hardware prefetcher keeps up; the row kernels there
  // still lose 13-18% at 2 KiB). So defaults() gives 1 KiB on AMD CPUs, 4 KiB elsewhere; KTRANS_X16_PREFETCH_BYTES.
  int x16_prefetch_bytes = 4096;
  // From this many activation rows per gemm call on, Q4_K/Q5_K run on the tile kernels (tiles.h; below it,
  // unpacking 16 rows costs more than it saves; a huge value turns them off). One thread (tools/gemm_tiles_bench.py):
  // against the row kernels, the VNNI tiles take 1.0-1.2x at 2-3 activation rows, 1.2x at 4, 1.5x at 6-8 and
  // 1.8-2.1x from 16 on (a 512 x 2048 matrix on Zen 4; 1.2-1.3x at 2-3 rows on the Xeon, more for the down
  // projection's small blocks). 3 leaves decode steps of 1-2 tokens per expert on the row kernels.
  // KTRANS_TILE_MIN_TOKENS.
  int tile_min_tokens = 3;
  // From this many activation rows on, the repacked (X16) kernels unpack a Tile once per superblock; below, fused
  // passes of up to four rows. One thread on Zen 4 (doc/benchmarks.md): the fused passes are 1.15-1.56x the tiles on
  // the original blocks at 5-16 rows, but 0.90-0.98x at 32-256, where the Tile path is 1.02-1.2x.
  // KTRANS_X16_TILE_FROM.
  int x16_tile_from = 24;
  // How the Q4_K/Q5_K prefill tiles run: 1 = AMX where the CPU has AMX-INT8 and the OS granted tile data (else the
  // VNNI tiles), 0 = AVX-512 VNNI, 2 = the AMX data flow with the tile multiply in plain C++ (tests check it on CPUs
  // without AMX). KTRANS_AMX.
  int amx = 1;
  // Whether the in-loop prefetch stops at the end of a gemm call's rows (prefetch.h); false only for A/B diagnostics.
  bool prefetch_clamp = true;

  // The values above with the KTRANS_* environment variables applied (read at every call: an object takes them
  // when it is made, and they never change an object that exists).
  static MoEConfig defaults();
  // Throws std::invalid_argument naming the first field out of range ("gate_up_tasks: must be at least 1, got 0").
  void check() const;
};

// The MoEConfig of one MoE or Linear object: checked when set, replaceable while other threads submit jobs with it
// (each job takes a copy at submit, so a job already submitted runs with the config it was submitted with).
class SharedConfig {
 public:
  explicit SharedConfig(const MoEConfig& c) : c_(c) { c.check(); }
  MoEConfig get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return c_;
  }
  void set(const MoEConfig& c) {
    c.check();
    std::lock_guard<std::mutex> lock(mu_);
    c_ = c;
  }

 private:
  mutable std::mutex mu_;
  MoEConfig c_;
};

// How the Q4_K/Q5_K tiles run under `amx` (MoEConfig::amx) on this CPU: 1 AMX, 0 AVX-512 VNNI, 2 emulated AMX.
int amx_mode(int amx);

}  // namespace ktrans
