// Software prefetch of weight streams, shared by every kernel file (baseline code: prefetches need no wider ISA).
#pragma once

#include <cstddef>
#include <cstdint>

#include "config.h"

namespace ktrans {

// One cache line, with `hint` (MoEConfig::prefetch_hint: 0 t0, 1 t1, 2 nta).
inline void prefetch_line(const uint8_t* p, int hint) {
  if (hint == 0) __builtin_prefetch(p, 0, 3);       // prefetcht0
  else if (hint == 1) __builtin_prefetch(p, 0, 2);  // prefetcht1
  else __builtin_prefetch(p, 0, 0);                 // prefetchnta
}

// The in-loop prefetch of one gemm call, made by each ISA's gemm from the caller's MoEConfig (call_prefetch) and
// passed to its row kernels by value. `end`: where the call's weight rows end, and the prefetch stops. Otherwise
// every stream's last `dist` bytes pull in bytes past its block: the next block's rows, which another task (on
// another core) reads, or rows no task reads at all (the next expert's). A decode step has ~220 such stream ends,
// ~0.9 MB of its 17.7 MB. With MoEConfig::prefetch_clamp off (A/B diagnostics) there is no stop.
struct Prefetch {
  const uint8_t* end;
  int dist;  // bytes ahead of the block being read
  int hint;  // prefetch_line's
};

// The Prefetch of a call whose weight rows are [w, w + bytes), `dist` ahead (MoEConfig::prefetch_bytes for the row
// kernels, x16_prefetch_bytes for the repacked ones).
inline Prefetch call_prefetch(const MoEConfig& cfg, const uint8_t* w, size_t bytes, int dist) {
  return {cfg.prefetch_clamp ? w + bytes : reinterpret_cast<const uint8_t*>(~uintptr_t(0)), dist, cfg.prefetch_hint};
}

// Touch every cache line of the next Bytes bytes of the weight stream, pf.dist ahead, up to pf.end.
template <int Bytes>
inline void prefetch_ahead(const uint8_t* w, const Prefetch& pf) {
  const uint8_t* p = w + pf.dist;
  for (int off = 0; off < Bytes; off += 64)
    if (p + off < pf.end) prefetch_line(p + off, pf.hint);
}

// The opening stretch of a block of rows, which the in-loop prefetch (`dist` ahead) never covers.
inline void prefetch_start(const uint8_t* w, size_t bytes, int dist) {
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
