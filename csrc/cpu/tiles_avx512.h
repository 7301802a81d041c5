// AVX-512 tile building blocks shared by kernels_avx512_tile.cpp (tiles on ggml's Q4_K/Q5_K blocks) and
// kernels_avx512_x16.cpp (the same arithmetic on the 16-row layouts of quant.h): the heads' unpacking, the unpacked
// superblock (Tile) and its VNNI dot products against activation rows, and the AMX tile configuration. Include it
// after `#pragma GCC target(...avx512...)`: the anonymous namespace gives each file its own copy, compiled for
// AVX-512 (as k4_scales.h does for its callers).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant.h"
#include "tiles.h"

namespace ktrans {
namespace {

inline __m512i loadu(const void* p) { return _mm512_loadu_si512(p); }


// The six-bit scales and mins of 16 rows (dwords 1-3 of their heads, one row per lane) as bytes: q[0] lane r holds
// row r's sc0-3, q[1] sc4-7, q[2] m0-3, q[3] m4-7.
inline void heads_scale_bytes(__m512i u0, __m512i u1, __m512i u2, __m512i q[4]) {
  const __m512i k1 = _mm512_set1_epi32(0x3f3f3f3f), k2 = _mm512_set1_epi32(0x0f0f0f0f), k3 = _mm512_set1_epi32(0x03030303);
  q[0] = _mm512_and_si512(u0, k1);
  q[1] = _mm512_or_si512(_mm512_and_si512(u2, k2), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k3), 4));
  q[2] = _mm512_and_si512(u1, k1);
  q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), k2),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k3), 4));
}

// Dwords 0-3 of 16 rows' 16-byte heads (fp16 d | fp16 dmin, then 12 bytes of six-bit scales and mins), one row
// per lane: d, dmin, sc[j] and mn[j] as floats (j = sub-block 0..7). The bit layout is unpack_k4_scales' (quant.h),
// done on 16 rows at once.
inline void heads_from_dwords(__m512i h0, __m512i u0, __m512i u1, __m512i u2, __m512& d, __m512& dmin, __m512 sc[8],
                              __m512 mn[8]) {
  d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h0));
  dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h0, 16)));
  __m512i q[4];
  heads_scale_bytes(u0, u1, u2, q);
  const __m512i ff = _mm512_set1_epi32(0xff);
  for (int j = 0; j < 4; ++j) {
    sc[j] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q[0], 8 * j), ff));
    sc[4 + j] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q[1], 8 * j), ff));
    mn[j] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q[2], 8 * j), ff));
    mn[4 + j] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q[3], 8 * j), ff));
  }
}

// One superblock of 16 rows, unpacked.
struct alignas(64) Tile {
  __m512i q[64];  // q[i] lane r: row r's 4 weights at ACT_Q8K_P positions 4i .. 4i + 3 (u8)
  __m512 sc[8];   // per storage sub-block s (positions 32s .. 32s + 31): its six-bit scale, per row
  __m512 mn[8];   // per sub-block j (values 32j .. 32j + 31): its six-bit min, per row
  __m512 d, dmin;
};

// acc + dpbusd(a, the dword at p in every lane), with the broadcast folded into the instruction's memory operand
// ({1to16}): GCC emits a separate vpbroadcastd for _mm512_set1_epi32, which on Zen 4 cost 16-22% of the 1-token
// repacked kernel.
inline __m512i dpbusd_bcast(__m512i acc, __m512i a, const int8_t* p) {
  asm("vpdpbusd {%2%{1to16%}, %1, %0|%0, %1, %2%{1to16%}}"  // AT&T | Intel syntax (-masm=intel)
      : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// NT activation rows against one unpacked superblock: acc[n] += P * d * da, macc[n] += M * dmin * da (per row).
// a[n]: the superblock's 256 activation bytes; bs[n]: its 8 sub-block sums (float); da[n]: its scale.
template <int NT>
inline void tile_rows(const Tile& t, const int8_t* const* a, const float* const* bs, const float* da, __m512* acc,
                      __m512* macc) {
  __m512 P[NT], Mf[NT];
  for (int n = 0; n < NT; ++n) P[n] = Mf[n] = _mm512_setzero_ps();
  for (int s = 0; s < 8; ++s) {
    __m512i dot[NT];
    for (int n = 0; n < NT; ++n) dot[n] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const __m512i w = t.q[8 * s + g];
      for (int n = 0; n < NT; ++n) dot[n] = dpbusd_bcast(dot[n], w, a[n] + 32 * s + 4 * g);
    }
    for (int n = 0; n < NT; ++n) P[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[n]), t.sc[s], P[n]);
  }
  for (int j = 0; j < 8; ++j)
    for (int n = 0; n < NT; ++n) Mf[n] = _mm512_fmadd_ps(t.mn[j], _mm512_set1_ps(bs[n][j]), Mf[n]);
  for (int n = 0; n < NT; ++n) {
    const __m512 s = _mm512_set1_ps(da[n]);
    acc[n] = _mm512_fmadd_ps(P[n], _mm512_mul_ps(t.d, s), acc[n]);
    macc[n] = _mm512_fmadd_ps(Mf[n], _mm512_mul_ps(t.dmin, s), macc[n]);
  }
}

template <int NT>
inline void tile_rows_at(const Tile& t, const uint8_t* const* act, const float* bsf, int64_t k, int64_t b, int n0,
                         __m512* acc, __m512* macc) {
  const int8_t* a[NT];
  const float* bs[NT];
  float da[NT];
  const int64_t nsub = k / 32;
  for (int n = 0; n < NT; ++n) {
    a[n] = act_q(act[n0 + n]) + b * QK_K;
    bs[n] = bsf + (n0 + n) * nsub + 8 * b;
    da[n] = act_q8k_d(act[n0 + n], k)[b];
  }
  tile_rows<NT>(t, a, bs, da, acc + n0, macc + n0);
}

// A tile kernel's per-call scratch on this thread: the N activation rows' sub-block sums as floats (bsums hold sums
// of 16; subblock_sums) and their 16-lane accumulators acc[N], macc[N].
struct TileScratch {
  float* bsf;
  __m512 *acc, *macc;
};
inline TileScratch tile_scratch(const uint8_t* const* act, int N, int64_t k) {
  struct alignas(64) Lanes {
    float v[16];
  };
  thread_local std::vector<float> bsf_buf;
  thread_local std::vector<Lanes> acc_buf;
  bsf_buf.resize(static_cast<size_t>(N) * (k / 32));
  acc_buf.resize(2 * static_cast<size_t>(N));
  subblock_sums(act, N, k, bsf_buf.data());
  __m512* acc = reinterpret_cast<__m512*>(acc_buf.data());
  return {bsf_buf.data(), acc, acc + N};
}

// All N activation rows against one unpacked superblock b, eight at a time, then four, two, one.
inline void tile_rows_all(const Tile& t, const uint8_t* const* act, const float* bsf, int64_t k, int64_t b, int N,
                          __m512* acc, __m512* macc) {
  int n0 = 0;
  for (; n0 + 8 <= N; n0 += 8) tile_rows_at<8>(t, act, bsf, k, b, n0, acc, macc);
  if (N - n0 >= 4) tile_rows_at<4>(t, act, bsf, k, b, n0, acc, macc), n0 += 4;
  if (N - n0 >= 2) tile_rows_at<2>(t, act, bsf, k, b, n0, acc, macc), n0 += 2;
  if (N - n0 >= 1) tile_rows_at<1>(t, act, bsf, k, b, n0, acc, macc);
}

struct alignas(64) AmxCfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0/1: A of sub-blocks s, s + 1 (16 rows x 32 bytes); tmm2/3: their B (8 rows x 64 bytes); tmm4/5: C.
__attribute__((target("amx-tile,amx-int8"))) void amx_begin() {
  AmxCfg cfg;
  for (int i = 0; i < 2; ++i) {
    cfg.rows[i] = 16, cfg.colsb[i] = 32;
    cfg.rows[2 + i] = 8, cfg.colsb[2 + i] = 64;
    cfg.rows[4 + i] = 16, cfg.colsb[4 + i] = 64;
  }
  // Not _tile_loadconfig: GCC 12's (amxtileintrin.h) tells the compiler the instruction reads 8 bytes of the
  // config, so at -O2 the stores to rows and colsb above were dropped as dead and every tile stayed unconfigured
  // (tilezero then raised #UD). The operand here is the whole 64-byte struct.
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}
__attribute__((target("amx-tile,amx-int8"))) void amx_end() { _tile_release(); }

// C (tmm4/5: two 16 x 16 int32 tiles, at c and c + 256) = A . B for the sub-blocks s, s + 1 of a superblock: A (16
// rows x 32 bytes at a and a + 32, rows lda bytes apart) against B (8 rows x 64 bytes at b and b + 512, the VNNI
// layout: B row g holds 4 bytes of each of 16 columns). kWeightsA: A holds the unsigned weights and B the signed
// activations (tdpbusd: the tiles on ggml blocks); otherwise A holds the signed activations and B the unsigned
// weights (tdpbsud: the 16-row layouts, which are B's layout as they are).
template <bool kWeightsA>
__attribute__((target("amx-tile,amx-int8"))) void amx_pair(const void* a, size_t lda, const uint8_t* b, int32_t* c) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_loadd(0, a, lda);
  _tile_loadd(1, static_cast<const uint8_t*>(a) + 32, lda);
  _tile_loadd(2, b, 64);
  _tile_loadd(3, b + 512, 64);
  if constexpr (kWeightsA) {
    _tile_dpbusd(4, 0, 2);
    _tile_dpbusd(5, 1, 3);
  } else {
    _tile_dpbsud(4, 0, 2);
    _tile_dpbsud(5, 1, 3);
  }
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
}

// The same arithmetic in plain C++: what the tests check the data flow with on CPUs without AMX.
template <bool kWeightsA>
void amx_pair_emulated(const void* a, size_t lda, const uint8_t* b, int32_t* c) {
  const uint8_t* au = static_cast<const uint8_t*>(a);
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        int32_t s = 0;
        for (int g = 0; g < 8; ++g)
          for (int e = 0; e < 4; ++e) {
            const uint8_t x = au[m * lda + 32 * h + 4 * g + e], y = b[512 * h + 64 * g + 4 * n + e];
            s += kWeightsA ? x * static_cast<int8_t>(y) : static_cast<int8_t>(x) * y;
          }
        c[256 * h + 16 * m + n] = s;
      }
}

}  // namespace
}  // namespace ktrans
