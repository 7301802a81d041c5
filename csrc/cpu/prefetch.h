// Software prefetch of weight streams, shared by every kernel file (baseline code: prefetches need no wider ISA).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "quant.h"

namespace ktrans {

// One cache line, with the hint KTRANS_PREFETCH_HINT picked (see quant.h).
inline void prefetch_line(const uint8_t* p) {
  if (g_prefetch_hint == 0) __builtin_prefetch(p, 0, 3);       // prefetcht0
  else if (g_prefetch_hint == 1) __builtin_prefetch(p, 0, 2);  // prefetcht1
  else __builtin_prefetch(p, 0, 0);                          // prefetchnta
}

// Where the weight rows of this thread's running gemm call end (each ISA's gemm sets it through set_rows_end): the
// in-loop prefetch stops there. Otherwise every stream's last g_prefetch_bytes pull in bytes past its block: the next
// block's rows, which another task (on another core) reads, or rows no task reads at all (the next expert's). A
// decode step has ~220 such stream ends, ~0.9 MB of its 17.7 MB.
inline thread_local const uint8_t* tl_rows_end = nullptr;
extern std::atomic<bool> g_prefetch_clamp;  // false: no stop (A/B diagnostics, set_prefetch_clamp)

inline void set_rows_end(const uint8_t* end) {
  tl_rows_end = g_prefetch_clamp.load(std::memory_order_relaxed) ? end : reinterpret_cast<const uint8_t*>(~uintptr_t(0));
}
// Read once per kernel call (a thread_local in a shared library costs a call to reach).
inline const uint8_t* rows_end() { return tl_rows_end ? tl_rows_end : reinterpret_cast<const uint8_t*>(~uintptr_t(0)); }

// Touch every cache line of the next Bytes bytes of the weight stream, `dist` (default g_prefetch_bytes) ahead, up
// to `end`.
template <int Bytes>
inline void prefetch_ahead(const uint8_t* w, const uint8_t* end, int dist) {
  const uint8_t* p = w + dist;
  for (int off = 0; off < Bytes; off += 64)
    if (p + off < end) prefetch_line(p + off);
}
template <int Bytes>
inline void prefetch_ahead(const uint8_t* w, const uint8_t* end) {
  prefetch_ahead<Bytes>(w, end, g_prefetch_bytes);
}

// The opening stretch of a block of rows, which the in-loop prefetch (`dist` ahead) never covers.
inline void prefetch_start(const uint8_t* w, size_t bytes, int dist = g_prefetch_bytes) {
  const size_t n = bytes < static_cast<size_t>(dist) ? bytes : static_cast<size_t>(dist);
  for (size_t off = 0; off < n; off += 64) __builtin_prefetch(w + off, 0, 3);
}

// Bytes [lo, hi) of p into L2.
inline void prefetch_l2(const uint8_t* p, size_t lo, size_t hi) {
  for (size_t off = lo; off < hi; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// The prefill tiles: a tile's rows are one contiguous block (the rows of a task are contiguous). While the tile's
// superblock b of nb is worked on, the b-th share of the next tile's block (`bytes` at `next`) goes into L2, so the
// next tile is near when it starts however few activation rows there are to hide its latency (with 3-5 rows per
// expert the tiles were otherwise memory-bound: 15% slower than the row kernels in a 64-token layer on Zen 4).
inline void prefetch_next_tile(const uint8_t* next, size_t bytes, int64_t b, int64_t nb) {
  const size_t share = (bytes / static_cast<size_t>(nb) + 63) & ~size_t(63);
  const size_t lo = static_cast<size_t>(b) * share;
  prefetch_l2(next, lo, lo + share < bytes ? lo + share : bytes);
}

}  // namespace ktrans
