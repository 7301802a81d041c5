// Q4_K / Q5_K prefill on AVX-512 VNNI and AMX: 16 weight rows per tile (see tiles.h; AMX below gemm_tiles).
//
// VNNI, per superblock (256 values) of the tile's 16 rows:
//  - the nibbles are unpacked to bytes in ACT_Q8K_P order (the order the activations are stored in) and transposed
//    16 x 16 dwords at a time, so that q[i] holds, in lane r, row r's weights at positions 4i .. 4i + 3;
//  - the six-bit scales and mins and the two fp16 factors are unpacked and transposed the same way (one float
//    per row and sub-block);
//  - every activation row then takes 8 vpdpbusd per sub-block (lane r: the exact integer dot of row r with the
//    sub-block), one multiply-add by the sub-block scale, and per superblock one multiply-add into the row's sum:
//    sum_b d_b * da_b * sum_s sc_s dot_s  -  dmin_b * da_b * sum_j m_j bsum_j.
// The products sc_s * dot_s and m_j * bsum_j are integers below 2^23, so their float sums are exact unless a
// superblock's total passes 2^24; what is left is one rounding per superblock and row, in superblock order.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "prefetch.h"
#include "quant.h"
#include "tiles.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "tiles_avx512.h"  // after the target: compiled for AVX-512 here

namespace ktrans {
namespace {

// In place: lane j of r[i] becomes lane i of r[j] (32-bit lanes).
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
  }
  // u[4q + e], 128-bit lane L: rows 4q .. 4q + 3 of column 4L + e
  for (int q = 0; q < 4; ++q) {
    u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  // column 4L + e gathers 128-bit lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
  for (int e = 0; e < 4; ++e) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), x1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

// The same from the heads of 16 blocks in place (rows[r]: row r's block).
inline void unpack_heads(const uint8_t* const rows[16], __m512& d, __m512& dmin, __m512 sc[8], __m512 mn[8]) {
  __m512i v[4];
  for (int q = 0; q < 4; ++q) {  // v[q], 128-bit lane L: row 4q + L's dwords [d|dmin, u0, u1, u2]
    __m512i x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q])));
    for (int L = 1; L < 4; ++L) {
      const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * q + L]));
      x = L == 1 ? _mm512_inserti32x4(x, r, 1) : (L == 2 ? _mm512_inserti32x4(x, r, 2) : _mm512_inserti32x4(x, r, 3));
    }
    v[q] = x;
  }
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  // after these, dword 4L + i of h[e] is dword e of row L + 4i; the permute puts row r at dword r
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i h0 = _mm512_permutexvar_epi32(order, _mm512_unpacklo_epi64(t0, t2));
  const __m512i u0 = _mm512_permutexvar_epi32(order, _mm512_unpackhi_epi64(t0, t2));
  const __m512i u1 = _mm512_permutexvar_epi32(order, _mm512_unpacklo_epi64(t1, t3));
  const __m512i u2 = _mm512_permutexvar_epi32(order, _mm512_unpackhi_epi64(t1, t3));
  heads_from_dwords(h0, u0, u1, u2, d, dmin, sc, mn);
}

// Bytes 64h .. 64h + 63 of one row's Q4_K/Q5_K quants as unsigned weights: lo holds ACT_Q8K_P positions
// 128h + 0..63 (the low nibbles), hi positions 128h + 64..127 (the high ones); Q5_K adds 16 where its qh bit is
// set: the zmm of sub-blocks (s, s + 2) tests bit s of qh in its low half, bit s + 2 in its high half.
template <bool Q5>
inline void split_nibbles(const uint8_t* block, int h, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i q = loadu(block + (Q5 ? 48 : 16) + 64 * h);
  lo = _mm512_and_si512(q, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
  if (Q5) {
    const __m512i sixteen = _mm512_set1_epi8(0x10);
    const __m512i t0 = _mm512_set_epi64(0x0404040404040404LL, 0x0404040404040404LL, 0x0404040404040404LL,
                                        0x0404040404040404LL, 0x0101010101010101LL, 0x0101010101010101LL,
                                        0x0101010101010101LL, 0x0101010101010101LL);
    const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16)));
    lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hb, _mm512_slli_epi64(t0, 4 * h)), lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(hb, _mm512_slli_epi64(t0, 4 * h + 1)), hi, sixteen);
  }
}

template <bool Q5>
void unpack_tile(const uint8_t* const rows[16], Tile& t) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 2; ++c) {  // qs bytes 64c .. 64c + 63: low nibbles -> positions 128c + 0..63, high -> + 64..127
    if (!Q5) {  // splitting nibbles commutes with the transpose: one transpose of the packed bytes serves both
      __m512i q[16];
      for (int r = 0; r < 16; ++r) q[r] = loadu(rows[r] + 16 + 64 * c);
      transpose16(q);
      for (int j = 0; j < 16; ++j) {
        t.q[32 * c + j] = _mm512_and_si512(q[j], m4);
        t.q[32 * c + 16 + j] = _mm512_and_si512(_mm512_srli_epi16(q[j], 4), m4);
      }
      continue;
    }
    __m512i lo[16], hi[16];
    for (int r = 0; r < 16; ++r) split_nibbles<Q5>(rows[r], c, lo[r], hi[r]);
    transpose16(lo);
    transpose16(hi);
    for (int j = 0; j < 16; ++j) {
      t.q[32 * c + j] = lo[j];
      t.q[32 * c + 16 + j] = hi[j];
    }
  }
  __m512 sc[8];
  unpack_heads(rows, t.d, t.dmin, sc, t.mn);
  for (int i = 0; i < 8; ++i) t.sc[i] = sc[kNat[i]];
}

template <bool Q5>
void gemm_tiles(const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k, float* c,
                size_t ldc) {
  constexpr int kBytes = Q5 ? 176 : 144;
  const int64_t nb = k / QK_K;
  const TileScratch ts = tile_scratch(act, N, k);
  float* bsf = ts.bsf;
  __m512 *acc = ts.acc, *macc = ts.macc;
  Tile t;
  prefetch_l2(w, 0, std::min(16, M) * ldw);
  for (int m0 = 0; m0 < M; m0 += 16) {
    const int nr = std::min(16, M - m0);
    const uint8_t* rows[16];
    for (int n = 0; n < N; ++n) acc[n] = macc[n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if (m0 + 16 < M) prefetch_next_tile(w + (m0 + 16) * ldw, std::min(16, M - m0 - 16) * ldw, b, nb);
      for (int r = 0; r < 16; ++r) rows[r] = w + (m0 + std::min(r, nr - 1)) * ldw + b * kBytes;
      if (b + 1 < nb)
        for (int r = 0; r < nr; ++r)
          for (int off = 0; off < kBytes; off += 64) __builtin_prefetch(rows[r] + kBytes + off, 0, 3);
      unpack_tile<Q5>(rows, t);
      tile_rows_all(t, act, bsf, k, b, N, acc, macc);
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << nr) - 1);
    for (int n = 0; n < N; ++n) _mm512_mask_storeu_ps(c + n * ldc + m0, keep, _mm512_sub_ps(acc[n], macc[n]));
  }
}

// ---- AMX: C (16 weight rows x 16 activation rows, int32) += A (weights, u8) . B (activations, s8), per sub-block.
// A is the tile's rows unpacked row-major (no transpose: AMX reads rows), B is 16 activation rows transposed once
// per call into the VNNI layout (B row g: 4 bytes of every activation row). The epilogue has one activation row
// per lane and the same float operations in the same order as tile_rows, so both give bitwise equal results.

template <bool Q5, bool kHw>
void gemm_amx(const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k, float* c,
              size_t ldc) {
  constexpr int kBytes = Q5 ? 176 : 144;
  const int64_t nb = k / QK_K, nsub = k / 32;
  const int G = (N + 15) / 16;  // groups of 16 activation rows, the last one padded with zeros
  struct alignas(64) Lanes {
    float v[16];
  };
  thread_local std::vector<Lanes> bt_buf, f_buf;
  bt_buf.resize(static_cast<size_t>(G) * (k / 4) * 64 / sizeof(Lanes));  // B: k / 4 rows of 64 bytes per group
  f_buf.resize(static_cast<size_t>(G) * (nb + nsub + 32));                // da, sub-block sums, acc, macc
  uint8_t* bt = reinterpret_cast<uint8_t*>(bt_buf.data());
  __m512* da = reinterpret_cast<__m512*>(f_buf.data());  // [G][nb]
  __m512* bsf = da + G * nb;                              // [G][nsub]
  __m512* acc = bsf + G * nsub;                           // [G][16 rows]
  __m512* macc = acc + 16 * G;
  for (int gi = 0; gi < G; ++gi) {
    alignas(64) float dav[16], bsv[16];
    for (int64_t b = 0; b < nb; ++b) {
      for (int n = 0; n < 16; ++n) dav[n] = gi * 16 + n < N ? act_q8k_d(act[gi * 16 + n], k)[b] : 0.f;
      da[gi * nb + b] = _mm512_load_ps(dav);
    }
    for (int64_t j = 0; j < nsub; ++j) {
      for (int n = 0; n < 16; ++n) {
        const int16_t* bs = gi * 16 + n < N ? act_q8k_bsums(act[gi * 16 + n], k) : nullptr;
        bsv[n] = bs ? subblock_sum(bs, j) : 0.f;
      }
      bsf[gi * nsub + j] = _mm512_load_ps(bsv);
    }
    for (int64_t p = 0; p < k / 64; ++p) {
      __m512i r[16];
      for (int n = 0; n < 16; ++n)
        r[n] = gi * 16 + n < N ? loadu(act_q(act[gi * 16 + n]) + 64 * p) : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(bt + (gi * (k / 4) + 16 * p + j) * 64, r[j]);
    }
  }
  alignas(64) uint8_t abuf[16 * 256];
  alignas(64) int32_t cbuf[2 * 256];
  alignas(64) float scf[16][16];  // [sub-block j: scale j (j < 8) or min j - 8][row]
  alignas(64) float dr[16], dminr[16];
  const uint8_t* heads[16];
  if (kHw) amx_begin();
  prefetch_l2(w, 0, std::min(16, M) * ldw);
  for (int m0 = 0; m0 < M; m0 += 16) {
    const int nr = std::min(16, M - m0);
    for (int i = 0; i < 32 * G; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if (m0 + 16 < M) prefetch_next_tile(w + (m0 + 16) * ldw, std::min(16, M - m0 - 16) * ldw, b, nb);
      for (int r = 0; r < 16; ++r) {
        const uint8_t* row = w + (m0 + std::min(r, nr - 1)) * ldw + b * kBytes;
        if (b + 1 < nb && r < nr)
          for (int off = 0; off < kBytes; off += 64) __builtin_prefetch(row + kBytes + off, 0, 3);
        for (int h = 0; h < 2; ++h) {
          __m512i lo, hi;
          split_nibbles<Q5>(row, h, lo, hi);
          _mm512_store_si512(abuf + r * 256 + 128 * h, lo);
          _mm512_store_si512(abuf + r * 256 + 128 * h + 64, hi);
        }
        heads[r] = row;
      }
      {
        __m512 d, dmin, sc[8], mn[8];
        unpack_heads(heads, d, dmin, sc, mn);
        _mm512_store_ps(dr, d);
        _mm512_store_ps(dminr, dmin);
        for (int j = 0; j < 8; ++j) _mm512_store_ps(scf[j], sc[j]), _mm512_store_ps(scf[8 + j], mn[j]);
      }
      for (int gi = 0; gi < G; ++gi) {
        const uint8_t* bg = bt + (gi * (k / 4) + 64 * b) * 64;
        __m512 P[16];
        for (int r = 0; r < 16; ++r) P[r] = _mm512_setzero_ps();
        for (int s = 0; s < 8; s += 2) {
          if (kHw) amx_pair<true>(abuf + 32 * s, 256, bg + 8 * s * 64, cbuf);
          else amx_pair_emulated<true>(abuf + 32 * s, 256, bg + 8 * s * 64, cbuf);
          for (int r = 0; r < 16; ++r) {
            P[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf + 16 * r)), _mm512_set1_ps(scf[kNat[s]][r]), P[r]);
            P[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf + 256 + 16 * r)),
                                   _mm512_set1_ps(scf[kNat[s + 1]][r]), P[r]);
          }
        }
        const __m512 dab = da[gi * nb + b];
        for (int r = 0; r < 16; ++r) {
          __m512 Mf = _mm512_setzero_ps();
          for (int j = 0; j < 8; ++j) Mf = _mm512_fmadd_ps(_mm512_set1_ps(scf[8 + j][r]), bsf[gi * nsub + 8 * b + j], Mf);
          acc[16 * gi + r] = _mm512_fmadd_ps(P[r], _mm512_mul_ps(_mm512_set1_ps(dr[r]), dab), acc[16 * gi + r]);
          macc[16 * gi + r] = _mm512_fmadd_ps(Mf, _mm512_mul_ps(_mm512_set1_ps(dminr[r]), dab), macc[16 * gi + r]);
        }
      }
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << nr) - 1);
    for (int gi = 0; gi < G; ++gi) {
      __m512i res[16];
      for (int r = 0; r < 16; ++r) res[r] = _mm512_castps_si512(_mm512_sub_ps(acc[16 * gi + r], macc[16 * gi + r]));
      transpose16(res);  // res[n]: activation row gi * 16 + n, one weight row per lane
      for (int n = 0; n < 16 && gi * 16 + n < N; ++n)
        _mm512_mask_storeu_ps(c + (gi * 16 + n) * ldc + m0, keep, _mm512_castsi512_ps(res[n]));
    }
  }
  if (kHw) amx_end();
}

}  // namespace

void gemm_k4_tiles_avx512(const MoEConfig& cfg, bool q5, const uint8_t* w, size_t ldw, int M,
                          const uint8_t* const* act, int N, int64_t k, float* c, size_t ldc) {
  // AMX takes activation rows 16 at a time (a partial group is padded) and transposes them once per call, so it
  // pays from 16 rows on and for blocks of at least 128 weight rows (measured on the 16-core Xeon: 2.75x the row
  // kernels at 16 rows of a 512 x 2048 matrix where the VNNI tiles reach 2.0x, but only 0.6-1.2x on the 32 x 512
  // blocks of a down projection task, where the VNNI tiles reach 1.2-2.4x).
  const int mode = amx_mode(cfg.amx);
  switch (mode != 0 && N >= 16 && M >= 128 ? mode : 0) {
    case 1:
      if (q5) gemm_amx<true, true>(w, ldw, M, act, N, k, c, ldc);
      else gemm_amx<false, true>(w, ldw, M, act, N, k, c, ldc);
      return;
    case 2:
      if (q5) gemm_amx<true, false>(w, ldw, M, act, N, k, c, ldc);
      else gemm_amx<false, false>(w, ldw, M, act, N, k, c, ldc);
      return;
    default:
      if (q5) gemm_tiles<true>(w, ldw, M, act, N, k, c, ldc);
      else gemm_tiles<false>(w, ldw, M, act, N, k, c, ldc);
  }
}

}  // namespace ktrans

#pragma GCC pop_options
