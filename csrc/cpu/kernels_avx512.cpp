// The AVX-512 path (F/BW/VL + VNNI): 512-bit integer dot products on ggml blocks.
//
// Same structure as kernels_avx2.cpp (a row kernel per format against C <= 4 activation rows; push/pop_options
// around an anonymous namespace so no AVX-512 code leaks into baseline callers). Differences:
//  - Q4_K/Q5_K read 64 bytes of nibbles at once, whose low nibbles are sub-blocks (0, 2) and high nibbles (1, 3);
//    their activations come in ACT_Q8K_P order to match, so every activation load is one aligned zmm.
//  - int16 products are scaled and accumulated in one VNNI vpdpwssd; Q8_0 uses vpdpbusd on |w| and sign(a, w).
//  - float formats use masked loads for the tail instead of a scalar loop.
#include <immintrin.h>

#include "prefetch.h"
#include "quant.h"
#include "tiles.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

#include "k4_scales.h"  // after the target: compiled for AVX-512 here

namespace ktrans {
namespace {

inline float f16(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }
inline __m512i loadu(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i loadu256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 upper256(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

inline float hsum512(__m512 v) { return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), upper256(v))); }

// [a x 8 | b x 8] (no AVX512DQ needed)
inline __m512 halves(float a, float b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)), _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}

// k4_scales_mins_v (k4_scales.h) on four blocks at once, one per 128-bit lane of a zmm (the decode kernel's four
// rows).
inline __m512i k4_scales_mins_v(__m512i s) {
  const __m512i a = _mm512_shuffle_epi8(s, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)));
  const __m512i b = _mm512_shuffle_epi8(s, _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)));
  const __m512i lo = _mm512_or_si512(
      _mm512_and_si512(a, _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0))),
      _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15))));
  return _mm512_or_si512(lo, _mm512_and_si512(_mm512_srli_epi16(b, 2), _mm512_set1_epi8(0x30)));
}

// From bytes v (the same 16 in every 128-bit lane): int16 lanes holding byte a in 128-bit lanes 0,1 and byte b in
// lanes 2,3, zero-extended (shuffle index -1 writes zero).
inline __m512i pick_u8_as_16(__m512i v, int a, int b) {
  const long long ca = static_cast<long long>(0x8000800080008000ULL) | (0x0001000100010001LL * a);
  const long long cb = static_cast<long long>(0x8000800080008000ULL) | (0x0001000100010001LL * b);
  return _mm512_shuffle_epi8(v, _mm512_set_epi64(cb, cb, cb, cb, ca, ca, ca, ca));
}

// ---- Q8_0 x ACT_Q8_0, two blocks per zmm.
template <int C>
void row_q8_0(const Prefetch pf, const uint8_t* w, const uint8_t* const* act, int64_t k, float* out, size_t ldc) {
  __m512 acc[C];
  const int8_t* aq[C];
  const float* ad[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm512_setzero_ps();
    aq[c] = act_q(act[c]);
    ad[c] = act_q8_0_d(act[c], k);
  }
  const int64_t nb = k / QK8_0;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2, w += 68) {
    prefetch_ahead<68>(w, pf);
    const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(loadu256(w + 2)), loadu256(w + 36), 1);
    const __m512i wabs = _mm512_abs_epi8(wq);
    const __mmask64 neg = _mm512_movepi8_mask(wq);
    const __m512 dw = halves(f16(w), f16(w + 34));
    for (int c = 0; c < C; ++c) {
      const __m512i a = loadu(aq[c] + b * QK8_0);
      const __m512i as = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, as);
      const __m512 da = halves(ad[c][b], ad[c][b + 1]);
      acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, da), acc[c]);
    }
  }
  float tail[C];
  for (int c = 0; c < C; ++c) tail[c] = 0.f;
  if (b < nb) {  // an odd last block, on 256 bits
    const __m256i wq = loadu256(w + 2);
    const __m256i wabs = _mm256_abs_epi8(wq);
    const __mmask32 neg = _mm256_movepi8_mask(wq);
    for (int c = 0; c < C; ++c) {
      const __m256i a = loadu256(aq[c] + b * QK8_0);
      const __m256i as = _mm256_mask_sub_epi8(a, neg, _mm256_setzero_si256(), a);
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, as);
      tail[c] = f16(w) * ad[c][b] * hsum256(_mm256_cvtepi32_ps(p));
    }
  }
  for (int c = 0; c < C; ++c) out[c * ldc] = hsum512(acc[c]) + tail[c];
}

// ---- Q4_0 / Q4_1 / Q5_0 / Q5_1 x ACT_Q8_0, one block per 256-bit VNNI dot product.
template <int T>
inline __m256i legacy_q(const uint8_t* blk) {
  constexpr LegacyLayout L = legacy_layout(T);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + L.qs));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m4)),
                                      _mm_and_si128(_mm_srli_epi16(q, 4), m4), 1);
  if (T == GGML_Q5_0 || T == GGML_Q5_1) {
    uint32_t qh;
    std::memcpy(&qh, blk + L.qh, 4);
    v = _mm256_mask_add_epi8(v, static_cast<__mmask32>(qh), v, _mm256_set1_epi8(0x10));
  }
  return v;
}

template <int T, int C>
void row_legacy(const Prefetch pf, const uint8_t* w, const uint8_t* const* act, int64_t k, float* out, size_t ldc) {
  constexpr LegacyLayout L = legacy_layout(T);
  __m256 acc[C];
  float mins[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_setzero_ps();
    mins[c] = 0.f;
  }
  for (int64_t b = 0; b < k / QK8_0; ++b, w += L.bytes) {
    prefetch_ahead<L.bytes>(w, pf);
    const __m256i q = legacy_q<T>(w);
    const float d = f16(w), m = legacy_min(w, L);
    for (int c = 0; c < C; ++c) {
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, loadu256(act_q(act[c]) + b * QK8_0));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * act_q8_0_d(act[c], k)[b]), acc[c]);
      mins[c] += m * act_q8_0_s(act[c], k)[b];
    }
  }
  for (int c = 0; c < C; ++c) out[c * ldc] = hsum256(acc[c]) + mins[c];
}

// ---- Q4_K / Q5_K x ACT_Q8K_P. R rows x C activation rows: a decode step (C = 1) takes 4 rows at once, which
// shares the activation loads and overlaps four independent dependency chains.
template <bool Q5, int R, int C>
void rows_q45_k(const Prefetch pf, const uint8_t* w, size_t ldw, const uint8_t* const* act,
                int64_t k, float* out, size_t ldc) {
  constexpr int kBytes = Q5 ? 176 : 144;
  __m512 acc[R * C];
  __m256 macc[R * C];
  for (int i = 0; i < R * C; ++i) {
    acc[i] = _mm512_setzero_ps();
    macc[i] = _mm256_setzero_ps();
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi8(0x10);
  // Q5_K high bits: the zmm of sub-blocks (s, s + 2) tests bit s of qh in its low half, bit s + 2 in its high half.
  const __m512i t0 = _mm512_set_epi64(0x0404040404040404LL, 0x0404040404040404LL, 0x0404040404040404LL, 0x0404040404040404LL, 0x0101010101010101LL, 0x0101010101010101LL, 0x0101010101010101LL, 0x0101010101010101LL);
  // vpermd indices that copy 128-bit lane r to all four
  __m512i lane_of[R];
  for (int r = 0; r < R; ++r) lane_of[r] = _mm512_add_epi32(_mm512_set1_epi32(4 * r), _mm512_set_epi32(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0));
  for (int64_t b = 0; b < k / QK_K; ++b) {
    // The R rows are read side by side, so prefetch their bytes as one stream, R blocks per step.
    prefetch_ahead<R * kBytes>(w + b * R * kBytes, pf);
    // Four rows (a decode step): their scale fields unpacked together, one row per 128-bit lane (7% faster on
    // Zen 4 than one row at a time; converting the four rows' fp16 d and dmin together gained nothing more).
    __m512i scm4 = _mm512_setzero_si512();
    if (R == 4) {
      const uint8_t* s0 = w + b * kBytes + 4;
      auto ld = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s0 + r * ldw)); };
      scm4 = k4_scales_mins_v(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(
          _mm512_castsi128_si512(ld(0)), ld(1), 1), ld(2), 2), ld(3 % R), 3));
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = w + r * ldw + b * kBytes;
      const __m512i sc = R == 4 ? _mm512_permutexvar_epi32(lane_of[r], scm4) : _mm512_broadcast_i32x4(k4_scales_mins(wb + 4));
      // each min twice as int16 (bsums are per 16 values): lane 0 takes m0-m3, lane 1 m4-m7
      const __m256i mins = _mm256_shuffle_epi8(
          _mm512_castsi512_si256(sc),
          _mm256_setr_epi8(8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1,
                           12, -1, 12, -1, 13, -1, 13, -1, 14, -1, 14, -1, 15, -1, 15, -1));
      const uint8_t* qs = wb + (Q5 ? 48 : 16);
      const __m512i q0 = loadu(qs), q1 = loadu(qs + 64);
      __m512i v[4];
      v[0] = _mm512_and_si512(q0, m4);
      v[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
      v[2] = _mm512_and_si512(q1, m4);
      v[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
      if (Q5) {
        const __m512i hb = _mm512_broadcast_i64x4(loadu256(wb + 16));
        for (int i = 0; i < 4; ++i) {  // v[i] holds sub-blocks (s, s + 2), s = 0, 1, 4, 5
          const int s = (i & 1) + 4 * (i >> 1);
          const __mmask64 h = _mm512_test_epi8_mask(hb, _mm512_slli_epi64(t0, s));
          v[i] = _mm512_mask_add_epi8(v[i], h, v[i], sixteen);
        }
      }
      const __m512i s0 = pick_u8_as_16(sc, 0, 2), s1 = pick_u8_as_16(sc, 1, 3);
      const __m512i s2 = pick_u8_as_16(sc, 4, 6), s3 = pick_u8_as_16(sc, 5, 7);
      const float d = f16(wb), dmin = f16(wb + 2);
      for (int c = 0; c < C; ++c) {
        const int8_t* a = act_q(act[c]) + b * QK_K;
        __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(v[0], loadu(a)), s0);
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(v[1], loadu(a + 64)), s1);
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(v[2], loadu(a + 128)), s2);
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(v[3], loadu(a + 192)), s3);
        const float da = act_q8k_d(act[c], k)[b];
        acc[r * C + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d * da), acc[r * C + c]);
        const __m256i pm = _mm256_madd_epi16(mins, loadu256(act_q8k_bsums(act[c], k) + 16 * b));
        macc[r * C + c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * da), macc[r * C + c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[c * ldc + r] = hsum512(acc[r * C + c]) - hsum256(macc[r * C + c]);
}

// ---- Q6_K x ACT_Q8K. Per 128 values one zmm of ql gives values 0-63 (low nibbles) and 64-127 (high).
template <int R, int C>
void rows_q6_k(const Prefetch pf, const uint8_t* w, size_t ldw, const uint8_t* const* act,
               int64_t k, float* out, size_t ldc) {
  __m512 acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i m30 = _mm512_set1_epi8(0x30);
  const __m512i sh_lo = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);  // << : qh bits (0,1) | (2,3) -> (4,5)
  const __m512i sh_hi = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);  // >> : qh bits (4,5) | (6,7) -> (4,5)
  for (int64_t b = 0; b < k / QK_K; ++b) {
    prefetch_ahead<R * 210>(w + b * R * 210, pf);  // the R rows as one stream, as in rows_q45_k
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = w + r * ldw + b * 210;
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 192));
      const __m256i sc8x2 = _mm256_broadcastsi128_si256(sc8);
      __m512i v[4], s[4];
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = loadu(wb + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(loadu256(wb + 128 + 32 * h));
        v[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi64(qh, sh_lo), m30));
        v[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                       _mm512_and_si512(_mm512_srlv_epi64(qh, sh_hi), m30));
        for (int j = 0; j < 2; ++j) {  // groups of 16: g .. g + 3 in the four 128-bit lanes
          const long long g = 8 * h + 4 * j;
          const long long rep = 0x0101010101010101LL;
          const __m256i ctrl = _mm256_set_epi64x(rep * (g + 3), rep * (g + 2), rep * (g + 1), rep * g);
          s[2 * h + j] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(sc8x2, ctrl));
        }
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      const float d = f16(wb + 208);
      for (int c = 0; c < C; ++c) {
        const int8_t* a = act_q(act[c]) + b * QK_K;
        __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(v[0], loadu(a)), s[0]);
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(v[1], loadu(a + 64)), s[1]);
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(v[2], loadu(a + 128)), s[2]);
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(v[3], loadu(a + 192)), s[3]);
        // q is stored + 32: subtract 32 * sum_g sc_g * bsum_g
        const __m256i corr = _mm256_madd_epi16(sc16, loadu256(act_q8k_bsums(act[c], k) + 16 * b));
        p = _mm512_sub_epi32(p, _mm512_zextsi256_si512(_mm256_slli_epi32(corr, 5)));
        acc[r * C + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d * act_q8k_d(act[c], k)[b]),
                                         acc[r * C + c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[c * ldc + r] = hsum512(acc[r * C + c]);
}

// ---- F32 / F16 / BF16 x ACT_F32.
template <int T>
inline __m512 load16(const uint8_t* w, int64_t i, __mmask16 m) {
  if (T == GGML_F32) return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(w) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, w + 2 * i);
  if (T == GGML_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int T, int C>
void row_float(const Prefetch pf, const uint8_t* w, const uint8_t* const* act, int64_t k, float* out, size_t ldc) {
  __m512 acc0[C], acc1[C];
  const float* x[C];
  for (int c = 0; c < C; ++c) {
    acc0[c] = acc1[c] = _mm512_setzero_ps();
    x[c] = reinterpret_cast<const float*>(act[c]);
  }
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    prefetch_ahead<(T == GGML_F32 ? 4 : 2) * 32>(w + (T == GGML_F32 ? 4 : 2) * i, pf);
    const __m512 w0 = load16<T>(w, i, 0xffff), w1 = load16<T>(w, i + 16, 0xffff);
    for (int c = 0; c < C; ++c) {
      acc0[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[c] + i), acc0[c]);
      acc1[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[c] + i + 16), acc1[c]);
    }
  }
  for (; i < k; i += 16) {
    const __mmask16 m = k - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (k - i)) - 1);
    const __m512 w0 = load16<T>(w, i, m);
    for (int c = 0; c < C; ++c) acc0[c] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, x[c] + i), acc0[c]);
  }
  for (int c = 0; c < C; ++c) out[c * ldc] = hsum512(_mm512_add_ps(acc0[c], acc1[c]));
}

// ---- dispatch

// Computes R weight rows (stride ldw) against C activation rows: out[c * ldc + r].
using RowsFn = void (*)(Prefetch, const uint8_t*, size_t, const uint8_t* const*, int64_t, float*, size_t);

// Formats without a multi-row kernel run their single-row one R times.
template <void (*Row)(Prefetch, const uint8_t*, const uint8_t* const*, int64_t, float*, size_t), int R>
void repeat_rows(const Prefetch pf, const uint8_t* w, size_t ldw, const uint8_t* const* act,
                 int64_t k, float* out, size_t ldc) {
  for (int r = 0; r < R; ++r) Row(pf, w + r * ldw, act, k, out + r, ldc);
}

template <int R, int C>
RowsFn rows_fn(int t) {
  switch (t) {
    case GGML_Q8_0: return repeat_rows<row_q8_0<C>, R>;
    case GGML_Q4_0: return repeat_rows<row_legacy<GGML_Q4_0, C>, R>;
    case GGML_Q4_1: return repeat_rows<row_legacy<GGML_Q4_1, C>, R>;
    case GGML_Q5_0: return repeat_rows<row_legacy<GGML_Q5_0, C>, R>;
    case GGML_Q5_1: return repeat_rows<row_legacy<GGML_Q5_1, C>, R>;
    case GGML_Q4_K: return rows_q45_k<false, R, C>;
    case GGML_Q5_K: return rows_q45_k<true, R, C>;
    case GGML_Q6_K: return rows_q6_k<R, C>;
    case GGML_F32: return repeat_rows<row_float<GGML_F32, C>, R>;
    case GGML_F16: return repeat_rows<row_float<GGML_F16, C>, R>;
    default: return repeat_rows<row_float<GGML_BF16, C>, R>;
  }
}

RowsFn rows_fn(int t, int r, int c) {
  if (r == 4) return rows_fn<4, 1>(t);  // decode: one activation row, four weight rows
  switch (c) {  // prefill: one weight row, up to 4 activation rows (8 measured no faster: the multiply ports are full)
    case 1: return rows_fn<1, 1>(t);
    case 2: return rows_fn<1, 2>(t);
    case 3: return rows_fn<1, 3>(t);
    default: return rows_fn<1, 4>(t);
  }
}

// Every output element is computed by the same row arithmetic whichever tile it falls in, so the result does not
// depend on how the rows were split between tasks.
void gemm(const MoEConfig& cfg, int t, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N,
          int64_t k, float* c, size_t ldc) {
  if (is_x16(t)) {  // repacked at load: always the tiles' arithmetic, fused for a few activation rows
    gemm_k_x16_avx512(cfg, t == KT_Q5_K_X16, w, ldw, M, act, N, k, c, ldc);
    return;
  }
  if ((t == GGML_Q4_K || t == GGML_Q5_K) && N >= cfg.tile_min_tokens) {  // prefill: 16 rows at a time
    gemm_k4_tiles_avx512(cfg, t == GGML_Q5_K, w, ldw, M, act, N, k, c, ldc);
    return;
  }
  const Prefetch pf = call_prefetch(cfg, w, M * ldw, cfg.prefetch_bytes);
  prefetch_start(w, M * ldw, pf.dist);
  for (int n0 = 0; n0 < N; n0 += 4) {
    const int nc = N - n0 < 4 ? N - n0 : 4;
    int m = 0;
    if (nc == 1) {
      const RowsFn fn4 = rows_fn(t, 4, 1);
      for (; m + 4 <= M; m += 4) fn4(pf, w + m * ldw, ldw, act + n0, k, c + n0 * ldc + m, ldc);
    }
    const RowsFn fn = rows_fn(t, 1, nc);
    for (; m < M; ++m) fn(pf, w + m * ldw, ldw, act + n0, k, c + n0 * ldc + m, ldc);
  }
}

ActFormat act_format(int t) {
  switch (t) {
    case GGML_Q8_0: case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: return ACT_Q8_0;
    case GGML_Q4_K: case GGML_Q5_K: case KT_Q4_K_X16: case KT_Q5_K_X16: return ACT_Q8K_P;
    case GGML_Q6_K: return ACT_Q8K;
    default: return ACT_F32;
  }
}

uint64_t stream_read(const uint8_t* p, size_t n) {
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < n; i += 256) {
    s0 = _mm512_xor_si512(s0, loadu(p + i));
    s1 = _mm512_xor_si512(s1, loadu(p + i + 64));
    s2 = _mm512_xor_si512(s2, loadu(p + i + 128));
    s3 = _mm512_xor_si512(s3, loadu(p + i + 192));
  }
  const __m512i s = _mm512_xor_si512(_mm512_xor_si512(s0, s1), _mm512_xor_si512(s2, s3));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(s));
}

}  // namespace
}  // namespace ktrans

#pragma GCC pop_options

namespace ktrans {

const Kernels& kernels_avx512() {
  static const Kernels k{Isa::avx512, "avx512", act_format, gemm, stream_read, true};
  return k;
}

}  // namespace ktrans
