// The AVX2 + FMA + F16C path: 256-bit integer dot products (maddubs/madd) on ggml blocks.
//
// Everything between push_options and pop_options is compiled for AVX2 and lives in an anonymous namespace
// (no std templates), so no AVX2 instruction can leak into code the baseline path runs. The table accessor at
// the bottom is compiled for the baseline ISA.
//
// A row kernel computes one weight row against C <= 4 activation rows: the row's blocks are unpacked once and
// used C times, which is what makes prefill (many tokens per expert) a GEMM rather than C separate GEMVs.
#include <immintrin.h>

#include <algorithm>

#include "prefetch.h"
#include "quant.h"
#include "tiles.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "k4_scales.h"  // after the target: compiled for AVX2 here

namespace ktrans {
namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float f16(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

inline __m256i loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Byte i of v (the same 16 bytes in both lanes) zero-extended into every int16 lane.
inline __m256i bcast_u8_as_16(__m256i v, int i) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<short>(0x8000 | i)));
}

// ---- Q8_0 x ACT_Q8_0: |w| * sign(a, w) keeps maddubs' unsigned x signed form exact.
template <int C>
void row_q8_0(const Prefetch pf, const uint8_t* w, const uint8_t* const* act, int64_t k, float* out, size_t ldc) {
  __m256 acc[C];
  const int8_t* aq[C];
  const float* ad[C];
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_setzero_ps();
    aq[c] = act_q(act[c]);
    ad[c] = act_q8_0_d(act[c], k);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < k / QK8_0; ++b, w += 34) {
    prefetch_ahead<34>(w, pf);
    const __m256i wq = loadu(w + 2);
    const __m256i wabs = _mm256_sign_epi8(wq, wq);
    const float dw = f16(w);
    for (int c = 0; c < C; ++c) {
      const __m256i a = _mm256_sign_epi8(loadu(aq[c] + b * QK8_0), wq);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, a), ones);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * ad[c][b]), acc[c]);
    }
  }
  for (int c = 0; c < C; ++c) out[c * ldc] = hsum(acc[c]);
}

// ---- Q4_0 / Q4_1 / Q5_0 / Q5_1 x ACT_Q8_0: 16 nibble bytes -> 32 values in order (low nibbles first).

// 0xFF in byte j where bit j of the 32 bits at p is set (llama.cpp's bytes_from_bits_32).
inline __m256i bytes_from_bits_32(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
  const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf),
                                        _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

template <int T>
inline __m256i legacy_q(const uint8_t* blk) {
  constexpr LegacyLayout L = legacy_layout(T);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + L.qs));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
  if (T == GGML_Q5_0 || T == GGML_Q5_1)
    v = _mm256_or_si256(v, _mm256_and_si256(bytes_from_bits_32(blk + L.qh), _mm256_set1_epi8(0x10)));
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
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < k / QK8_0; ++b, w += L.bytes) {
    prefetch_ahead<L.bytes>(w, pf);
    const __m256i q = legacy_q<T>(w);
    const float d = f16(w), m = legacy_min(w, L);
    for (int c = 0; c < C; ++c) {
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, loadu(act_q(act[c]) + b * QK8_0)), ones);
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * act_q8_0_d(act[c], k)[b]), acc[c]);
      mins[c] += m * act_q8_0_s(act[c], k)[b];
    }
  }
  for (int c = 0; c < C; ++c) out[c * ldc] = hsum(acc[c]) + mins[c];
}

// ---- Q4_K / Q5_K x ACT_Q8K. Per 64 values j: low nibbles are sub-block 2j, high nibbles 2j+1.
template <bool Q5, int C>
void row_q45_k(const Prefetch pf, const uint8_t* w, const uint8_t* const* act, int64_t k, float* out, size_t ldc) {
  constexpr int kBytes = Q5 ? 176 : 144;
  __m256 acc[C], macc[C];
  for (int c = 0; c < C; ++c) acc[c] = macc[c] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i bit0 = _mm256_set1_epi8(0x01);
  for (int64_t b = 0; b < k / QK_K; ++b, w += kBytes) {
    prefetch_ahead<kBytes>(w, pf);
    const __m256i scm = _mm256_broadcastsi128_si256(k4_scales_mins(w + 4));
    // each min twice as int16 (bsums are per 16 values): lane 0 takes m0-m3, lane 1 m4-m7
    const __m256i mins = _mm256_shuffle_epi8(scm, _mm256_setr_epi8(8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1,
                                                                   12, -1, 12, -1, 13, -1, 13, -1, 14, -1, 14, -1, 15, -1, 15, -1));
    const uint8_t* qs = w + (Q5 ? 48 : 16);
    __m256i hb = _mm256_setzero_si256();
    if (Q5) hb = loadu(w + 16);
    __m256i sumi[C];
    for (int c = 0; c < C; ++c) sumi[c] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i s_lo = bcast_u8_as_16(scm, 2 * j), s_hi = bcast_u8_as_16(scm, 2 * j + 1);
      const __m256i q = loadu(qs + 32 * j);
      __m256i lo = _mm256_and_si256(q, m4);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (Q5) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), bit0), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), bit0), 4));
      }
      for (int c = 0; c < C; ++c) {
        const int8_t* a = act_q(act[c]) + b * QK_K + 64 * j;
        const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, loadu(a)), s_lo);
        const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, loadu(a + 32)), s_hi);
        sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(p_lo, p_hi));
      }
    }
    const float d = f16(w), dmin = f16(w + 2);
    for (int c = 0; c < C; ++c) {
      const float da = act_q8k_d(act[c], k)[b];
      const __m256i pm = _mm256_madd_epi16(mins, loadu(act_q8k_bsums(act[c], k) + 16 * b));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[c]), _mm256_set1_ps(d * da), acc[c]);
      macc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * da), macc[c]);
    }
  }
  for (int c = 0; c < C; ++c) out[c * ldc] = hsum(acc[c]) - hsum(macc[c]);
}

// ---- Q6_K x ACT_Q8K. Per 128 values: ql[0..31] low nibbles are 0-31, ql[32..63] low 32-63, high nibbles
// 64-95 and 96-127; qh[l] holds the two high bits of those four values. Scales are per 16 values.
template <int C>
void row_q6_k(const Prefetch pf, const uint8_t* w, const uint8_t* const* act, int64_t k, float* out, size_t ldc) {
  __m256 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m30 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < k / QK_K; ++b, w += 210) {
    prefetch_ahead<210>(w, pf);
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192));
    __m256i sumi[C];
    for (int c = 0; c < C; ++c) sumi[c] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = loadu(w + 64 * h), ql1 = loadu(w + 64 * h + 32), qh = loadu(w + 128 + 32 * h);
      __m256i q[4];
      q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
      q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
      q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
      q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
      for (int j = 0; j < 4; ++j) {
        const int g = 8 * h + 2 * j;  // groups g (values 0-15 of the 32) and g + 1
        const __m128i ctrl = _mm_set_epi64x(0x0101010101010101LL * (g + 1), 0x0101010101010101LL * g);
        const __m256i s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, ctrl));
        for (int c = 0; c < C; ++c) {
          const int8_t* a = act_q(act[c]) + b * QK_K + 128 * h + 32 * j;
          sumi[c] = _mm256_add_epi32(sumi[c], _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], loadu(a)), s));
        }
      }
    }
    // q is stored + 32: subtract 32 * sum_g sc_g * bsum_g
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    const float d = f16(w + 208);
    for (int c = 0; c < C; ++c) {
      const __m256i corr = _mm256_madd_epi16(sc16, loadu(act_q8k_bsums(act[c], k) + 16 * b));
      sumi[c] = _mm256_sub_epi32(sumi[c], _mm256_slli_epi32(corr, 5));
      acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[c]), _mm256_set1_ps(d * act_q8k_d(act[c], k)[b]), acc[c]);
    }
  }
  for (int c = 0; c < C; ++c) out[c * ldc] = hsum(acc[c]);
}

// ---- F32 / F16 / BF16 x ACT_F32: widen 8 weights to float, FMA.
template <int T>
inline __m256 load8(const uint8_t* w, int64_t i) {
  if (T == GGML_F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * i));
  if (T == GGML_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int T>
inline float scalar_w(const uint8_t* w, int64_t i) {
  if (T == GGML_F32) {
    float v;
    std::memcpy(&v, w + 4 * i, 4);
    return v;
  }
  if (T == GGML_F16) return f16_to_f32(load_u16(w + 2 * i));
  return bf16_to_f32(load_u16(w + 2 * i));
}

template <int T, int C>
void row_float(const Prefetch pf, const uint8_t* w, const uint8_t* const* act, int64_t k, float* out, size_t ldc) {
  __m256 acc0[C], acc1[C];
  const float* x[C];
  for (int c = 0; c < C; ++c) {
    acc0[c] = acc1[c] = _mm256_setzero_ps();
    x[c] = reinterpret_cast<const float*>(act[c]);
  }
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    prefetch_ahead<(T == GGML_F32 ? 4 : 2) * 16>(w + (T == GGML_F32 ? 4 : 2) * i, pf);
    const __m256 w0 = load8<T>(w, i), w1 = load8<T>(w, i + 8);
    for (int c = 0; c < C; ++c) {
      acc0[c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[c] + i), acc0[c]);
      acc1[c] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[c] + i + 8), acc1[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    float s = hsum(_mm256_add_ps(acc0[c], acc1[c]));
    for (int64_t t = i; t < k; ++t) s += scalar_w<T>(w, t) * x[c][t];
    out[c * ldc] = s;
  }
}

// ---- dispatch

using RowFn = void (*)(Prefetch, const uint8_t*, const uint8_t* const*, int64_t, float*, size_t);

template <int C>
RowFn row_fn(int t) {
  switch (t) {
    case GGML_Q8_0: return row_q8_0<C>;
    case GGML_Q4_0: return row_legacy<GGML_Q4_0, C>;
    case GGML_Q4_1: return row_legacy<GGML_Q4_1, C>;
    case GGML_Q5_0: return row_legacy<GGML_Q5_0, C>;
    case GGML_Q5_1: return row_legacy<GGML_Q5_1, C>;
    case GGML_Q4_K: return row_q45_k<false, C>;
    case GGML_Q5_K: return row_q45_k<true, C>;
    case GGML_Q6_K: return row_q6_k<C>;
    case GGML_F32: return row_float<GGML_F32, C>;
    case GGML_F16: return row_float<GGML_F16, C>;
    default: return row_float<GGML_BF16, C>;
  }
}

RowFn row_fn(int t, int c) {
  switch (c) {
    case 1: return row_fn<1>(t);
    case 2: return row_fn<2>(t);
    case 3: return row_fn<3>(t);
    default: return row_fn<4>(t);
  }
}

void gemm(const MoEConfig& cfg, int t, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N,
          int64_t k, float* c, size_t ldc) {
  // prefill: 8 rows at a time (1.1-1.2x the row kernels from 16 activation rows on a 512 x 2048 matrix, 1.2-1.4x
  // on the small blocks of a down projection)
  if ((t == GGML_Q4_K || t == GGML_Q5_K) && N >= std::max(cfg.tile_min_tokens, kAvx2TileMinTokens)) {
    gemm_k4_tiles_avx2(t == GGML_Q5_K, w, ldw, M, act, N, k, c, ldc);
    return;
  }
  const Prefetch pf = call_prefetch(cfg, w, M * ldw, cfg.prefetch_bytes);
  prefetch_start(w, M * ldw, pf.dist);
  for (int n0 = 0; n0 < N; n0 += 4) {
    const int nc = N - n0 < 4 ? N - n0 : 4;
    const RowFn fn = row_fn(t, nc);
    for (int m = 0; m < M; ++m) fn(pf, w + m * ldw, act + n0, k, c + n0 * ldc + m, ldc);
  }
}

ActFormat act_format(int t) {
  switch (t) {
    case GGML_Q8_0: case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: return ACT_Q8_0;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return ACT_Q8K;
    default: return ACT_F32;
  }
}

uint64_t stream_read(const uint8_t* p, size_t n) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < n; i += 128) {
    s0 = _mm256_xor_si256(s0, loadu(p + i));
    s1 = _mm256_xor_si256(s1, loadu(p + i + 32));
    s2 = _mm256_xor_si256(s2, loadu(p + i + 64));
    s3 = _mm256_xor_si256(s3, loadu(p + i + 96));
  }
  const __m256i s = _mm256_xor_si256(_mm256_xor_si256(s0, s1), _mm256_xor_si256(s2, s3));
  const __m128i x = _mm_xor_si128(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return static_cast<uint64_t>(_mm_cvtsi128_si64(x)) ^ static_cast<uint64_t>(_mm_extract_epi64(x, 1));
}

}  // namespace
}  // namespace ktrans

#pragma GCC pop_options

namespace ktrans {

const Kernels& kernels_avx2() {
  static const Kernels k{Isa::avx2, "avx2", act_format, gemm, stream_read};
  return k;
}

}  // namespace ktrans
