// Q4_K / Q5_K prefill on AVX2: 8 weight rows per tile, the AVX2 counterpart of kernels_avx512_tile.cpp.
//
// Per superblock the 8 rows' nibbles are transposed (8 x 8 dwords) so that one 32-bit lane holds one row's 4
// consecutive weights; each activation row then takes one vpmaddubsw per 4 x 8 weights, summed in int16 over a
// sub-block (Q4_K: 8 products of at most 2 * 15 * 127 fit; Q5_K: 4 of at most 2 * 31 * 127, so two halves), and
// one vpmaddwd per sub-block (per half) to int32: the exact integer dot, with no multiply by the scale inside the
// loop (the row kernel needs vpmaddubsw and vpmaddwd-by-scale per 32 weights). The float part is the AVX-512
// tiles' operation for operation, in the same order, so both paths give bitwise equal results.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "prefetch.h"
#include "quant.h"
#include "tiles.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace ktrans {
namespace {

inline __m256i loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// In place: lane j of r[i] becomes lane i of r[j] (32-bit lanes).
inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int p = 0; p < 4; ++p) {
    t[2 * p] = _mm256_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm256_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
  }
  // u[4q + e], 128-bit lane L: rows 4q .. 4q + 3 of column 4L + e
  for (int q = 0; q < 2; ++q) {
    u[4 * q + 0] = _mm256_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm256_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm256_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm256_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x20);
    r[4 + e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x31);
  }
}

struct alignas(32) Tile8 {
  __m256i q[8][8];  // q[j][g] lane r: row r's weights 32j + 4g .. + 3 (u8), natural order
  __m256 sc[8], mn[8];  // per sub-block j, per row
  __m256 d, dmin;
};

template <bool Q5>
void unpack_tile8(const uint8_t* const rows[8], Tile8& t) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i bit0 = _mm256_set1_epi8(0x01);
  constexpr int qoff = Q5 ? 48 : 16;
  for (int jj = 0; jj < 4; ++jj) {  // qs bytes 32jj .. 32jj + 31: low nibbles sub-block 2jj, high 2jj + 1
    if (!Q5) {  // splitting nibbles commutes with the transpose: one transpose of the packed bytes serves both
      __m256i q[8];
      for (int r = 0; r < 8; ++r) q[r] = loadu(rows[r] + qoff + 32 * jj);
      transpose8(q);
      for (int g = 0; g < 8; ++g) {
        t.q[2 * jj][g] = _mm256_and_si256(q[g], m4);
        t.q[2 * jj + 1][g] = _mm256_and_si256(_mm256_srli_epi16(q[g], 4), m4);
      }
      continue;
    }
    __m256i lo[8], hi[8];
    for (int r = 0; r < 8; ++r) {
      const __m256i q = loadu(rows[r] + qoff + 32 * jj);
      lo[r] = _mm256_and_si256(q, m4);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (Q5) {  // bit 2jj (low) and 2jj + 1 (high) of qh[l] is bit 4 of value l of those sub-blocks
        const __m256i hb = loadu(rows[r] + 16);
        lo[r] = _mm256_or_si256(lo[r], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * jj), bit0), 4));
        hi[r] = _mm256_or_si256(hi[r], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * jj + 1), bit0), 4));
      }
    }
    transpose8(lo);
    transpose8(hi);
    for (int g = 0; g < 8; ++g) {
      t.q[2 * jj][g] = lo[g];
      t.q[2 * jj + 1][g] = hi[g];
    }
  }
  __m256i s[8], m[8];
  alignas(32) uint16_t dh[16];
  for (int r = 0; r < 8; ++r) {
    alignas(16) uint32_t sm[4];
    unpack_k4_scales(rows[r] + 4, sm);
    const __m128i b = _mm_load_si128(reinterpret_cast<const __m128i*>(sm));
    s[r] = _mm256_cvtepu8_epi32(b);
    m[r] = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    dh[r] = load_u16(rows[r]);
    dh[8 + r] = load_u16(rows[r] + 2);
  }
  transpose8(s);
  transpose8(m);
  for (int j = 0; j < 8; ++j) {
    t.sc[j] = _mm256_cvtepi32_ps(s[j]);
    t.mn[j] = _mm256_cvtepi32_ps(m[j]);
  }
  t.d = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh)));
  t.dmin = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dh + 8)));
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The exact integer dot of sub-block j for NT activation rows (a[n]: the superblock's 256 bytes, natural order).
template <bool Q5, int NT>
inline void dots(const Tile8& t, int j, const int8_t* const* a, __m256i* dot) {
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int kRun = Q5 ? 4 : 8;  // groups summed in int16 before widening
  for (int n = 0; n < NT; ++n) dot[n] = _mm256_setzero_si256();
  for (int g0 = 0; g0 < 8; g0 += kRun) {
    __m256i s16[NT];
    for (int n = 0; n < NT; ++n) s16[n] = _mm256_setzero_si256();
    for (int g = g0; g < g0 + kRun; ++g) {
      const __m256i w = t.q[j][g];
      for (int n = 0; n < NT; ++n)
        s16[n] = _mm256_add_epi16(s16[n], _mm256_maddubs_epi16(w, bcast4(a[n] + 32 * j + 4 * g)));
    }
    for (int n = 0; n < NT; ++n) dot[n] = _mm256_add_epi32(dot[n], _mm256_madd_epi16(s16[n], ones));
  }
}

template <bool Q5, int NT>
inline void tile_rows8(const Tile8& t, const uint8_t* const* act, const float* bsf, int64_t k, int64_t b, int n0,
                       __m256* acc, __m256* macc) {
  const int8_t* a[NT];
  const float* bs[NT];
  float da[NT];
  const int64_t nsub = k / 32;
  for (int n = 0; n < NT; ++n) {
    a[n] = act_q(act[n0 + n]) + b * QK_K;
    bs[n] = bsf + (n0 + n) * nsub + 8 * b;
    da[n] = act_q8k_d(act[n0 + n], k)[b];
  }
  __m256 P[NT], Mf[NT];
  for (int n = 0; n < NT; ++n) P[n] = Mf[n] = _mm256_setzero_ps();
  for (int s = 0; s < 8; ++s) {
    const int j = kNat[s];  // the AVX-512 tiles' order, so that both sum P alike
    __m256i dot[NT];
    dots<Q5, NT>(t, j, a, dot);
    for (int n = 0; n < NT; ++n) P[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[n]), t.sc[j], P[n]);
  }
  for (int j = 0; j < 8; ++j)
    for (int n = 0; n < NT; ++n) Mf[n] = _mm256_fmadd_ps(t.mn[j], _mm256_set1_ps(bs[n][j]), Mf[n]);
  for (int n = 0; n < NT; ++n) {
    const __m256 sa = _mm256_set1_ps(da[n]);
    acc[n0 + n] = _mm256_fmadd_ps(P[n], _mm256_mul_ps(t.d, sa), acc[n0 + n]);
    macc[n0 + n] = _mm256_fmadd_ps(Mf[n], _mm256_mul_ps(t.dmin, sa), macc[n0 + n]);
  }
}

template <bool Q5>
void gemm_tiles8(const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k, float* c,
                 size_t ldc) {
  constexpr int kBytes = Q5 ? 176 : 144;
  const int64_t nb = k / QK_K, nsub = k / 32;
  struct alignas(32) Lanes {
    float v[8];
  };
  thread_local std::vector<float> bsf_buf;
  thread_local std::vector<Lanes> acc_buf;
  bsf_buf.resize(static_cast<size_t>(N) * nsub);
  acc_buf.resize(2 * static_cast<size_t>(N));
  float* bsf = bsf_buf.data();
  subblock_sums(act, N, k, bsf);
  __m256* acc = reinterpret_cast<__m256*>(acc_buf.data());
  __m256* macc = acc + N;
  Tile8 t;
  prefetch_l2(w, 0, std::min(8, M) * ldw);
  for (int m0 = 0; m0 < M; m0 += 8) {
    const int nr = std::min(8, M - m0);
    for (int n = 0; n < N; ++n) acc[n] = macc[n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if (m0 + 8 < M) prefetch_next_tile(w + (m0 + 8) * ldw, std::min(8, M - m0 - 8) * ldw, b, nb);
      const uint8_t* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = w + (m0 + std::min(r, nr - 1)) * ldw + b * kBytes;
      unpack_tile8<Q5>(rows, t);
      int n0 = 0;
      for (; n0 + 2 <= N; n0 += 2) tile_rows8<Q5, 2>(t, act, bsf, k, b, n0, acc, macc);
      if (N - n0 >= 2) tile_rows8<Q5, 2>(t, act, bsf, k, b, n0, acc, macc), n0 += 2;
      if (N - n0 >= 1) tile_rows8<Q5, 1>(t, act, bsf, k, b, n0, acc, macc);
    }
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int n = 0; n < N; ++n) _mm256_maskstore_ps(c + n * ldc + m0, keep, _mm256_sub_ps(acc[n], macc[n]));
  }
}

}  // namespace

void gemm_k4_tiles_avx2(bool q5, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k,
                        float* c, size_t ldc) {
  if (q5) gemm_tiles8<true>(w, ldw, M, act, N, k, c, ldc);
  else gemm_tiles8<false>(w, ldw, M, act, N, k, c, ldc);
}

}  // namespace ktrans

#pragma GCC pop_options
