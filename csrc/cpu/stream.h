// CPU expert work placed on a CUDA stream: a MoE layer's submit and its wait are enqueued as host functions of
// the stream (cuLaunchHostFunc of the CUDA driver), so the GPU runs them in order with its kernels and copies, the
// Python thread never waits for them, and a captured CUDA graph replays them as host nodes.
//
// The driver is resolved at run time (dlopen of libcuda.so.1, which any process that uses a CUDA GPU has loaded):
// the extension builds and runs without CUDA headers or a CUDA toolkit, and on a machine with no GPU the stream
// path simply reports itself unavailable. A host function must not call CUDA, so every pointer a call reads or
// writes is host memory (pinned buffers at fixed addresses, filled and drained by copies on the same stream).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "moe.h"
#include "pool.h"

namespace ktrans {

// Whether host functions can be enqueued (the CUDA driver was found); `why` says what is missing when not.
bool stream_hooks_available(std::string* why);

// One MoE layer's call on a stream. Its fields are read when the host functions run, not when they are enqueued,
// so a graph replay uses whatever `*rows` holds then: the live row count of a padded batch (pad rows cost nothing).
struct StreamCall {
  const MoE* moe = nullptr;
  ThreadPool* pool = nullptr;
  const float* x = nullptr;      // [max_rows, ldx] fp32, pinned
  const int64_t* ids = nullptr;  // [max_rows, k] int64, pinned
  const float* weights = nullptr;  // [max_rows, k] fp32, pinned
  float* out = nullptr;          // [max_rows, ldo] fp32, pinned
  int64_t ldx = 0, ldo = 0, max_rows = 0;
  int k = 0;
  const int64_t* rows = nullptr;  // host cell holding the live row count (<= max_rows)

  // Run state, touched by the host functions (the driver's callback thread) and read by Python.
  std::atomic<int> in_flight{0};    // between run_submit and run_wait
  std::atomic<uint64_t> calls{0};   // completed waits (tests: a replay ran its host functions)
  // The pool's busy time (ThreadPool::busy) across the last submit..wait: the last job's own compute span when
  // nothing else ran on the pool meanwhile (split prefill reads it as the CPU share's time, never waiting for it).
  std::atomic<int64_t> last_busy_ns{0};
  int64_t busy_at_submit = 0;
  uint64_t ticket = 0;
  bool has_job = false;
  std::mutex error_mu;
  std::string error;               // the first failure since the last take_error()

  void enqueue_submit(uintptr_t stream);
  void enqueue_wait(uintptr_t stream);
  // Submit and wait as one host function: one driver round trip a layer instead of two, the stream (and whatever
  // GPU work would have overlapped the CPU's) held for the whole of the CPU's share.
  void enqueue_submit_wait(uintptr_t stream);
  std::string take_error();

  // The host functions themselves (also callable directly, for tests on machines without CUDA).
  void run_submit();
  void run_wait();
  void run_submit_wait() {
    run_submit();
    run_wait();
  }

  // The flag path: no host functions at all. The GPU's stage-in kernel ends by storing a new sequence number into
  // flags[0] (go); the relay thread (below) sees it, runs submit and wait, and stores the same number into flags[1]
  // (done), which a one-program kernel on the stream polls before the stage-out. flags is pinned host memory mapped
  // into the GPU's address space ([go, done, gpu timed out]), owned by the caller and registered until drop_flags().
  void use_flags(int64_t* f);
  void drop_flags();
  bool serve_flag();              // the relay's: serve a new go if there is one; true if it did
  std::atomic<uint64_t> flag_calls{0};  // go numbers served
  ~StreamCall() { drop_flags(); }

 private:
  int64_t* flags_ = nullptr;
  int64_t seen_ = 0;  // the last go number served
};

// The relay: one thread that serves every StreamCall on the flag path. It polls their go flags (each a cache line
// of pinned host memory the GPU writes over PCIe) and runs a layer's submit and wait itself, helping the pool as
// the host function's thread did: the pool's n - 1 workers plus this caller. It polls for `spin_us` after the last
// layer it served or the last kick, then sleeps (waking each millisecond, or at the next kick: the engine kicks it
// when a step starts).
void relay_kick(int spin_us);
// (go numbers served in total, StreamCalls registered).
std::vector<uint64_t> relay_stats();

}  // namespace ktrans
