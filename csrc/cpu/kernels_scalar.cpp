// The portable path: plain C++ dot products on ggml blocks, the readable statement of what the vector paths
// compute (same integer sums, same activation formats with natural element order).
#include "quant.h"

namespace ktrans {
namespace {

ActFormat act_format(int t) {
  switch (t) {
    case GGML_Q8_0: case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: return ACT_Q8_0;
    case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K: return ACT_Q8K;
    default: return ACT_F32;
  }
}

float dot_q8_0(const uint8_t* w, const uint8_t* a, int64_t k) {
  const int8_t* aq = act_q(a);
  const float* ad = act_q8_0_d(a, k);
  float sum = 0.f;
  for (int64_t b = 0; b < k / QK8_0; ++b, w += 34) {
    const int8_t* wq = reinterpret_cast<const int8_t*>(w + 2);
    int s = 0;
    for (int i = 0; i < QK8_0; ++i) s += wq[i] * aq[b * QK8_0 + i];
    sum += f16_to_f32(load_u16(w)) * ad[b] * static_cast<float>(s);
  }
  return sum;
}

// Q4_0, Q4_1, Q5_0, Q5_1: value = d * q + m per block of 32 (see LegacyLayout).
template <int T>
float dot_legacy(const uint8_t* w, const uint8_t* a, int64_t k) {
  constexpr LegacyLayout L = legacy_layout(T);
  constexpr bool Q5 = T == GGML_Q5_0 || T == GGML_Q5_1;
  const int8_t* aq = act_q(a);
  const float* ad = act_q8_0_d(a, k);
  const float* as = act_q8_0_s(a, k);
  float sum = 0.f;
  for (int64_t b = 0; b < k / QK8_0; ++b, w += L.bytes, aq += QK8_0) {
    uint32_t qh = 0;
    if (Q5) std::memcpy(&qh, w + L.qh, 4);
    const uint8_t* qs = w + L.qs;
    int s = 0;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 15) | (Q5 ? ((qh >> j) & 1) << 4 : 0);
      const int hi = (qs[j] >> 4) | (Q5 ? ((qh >> (j + 16)) & 1) << 4 : 0);
      s += lo * aq[j] + hi * aq[j + 16];
    }
    sum += f16_to_f32(load_u16(w)) * ad[b] * static_cast<float>(s) + legacy_min(w, L) * as[b];
  }
  return sum;
}

// Q4_K and Q5_K: 8 sub-blocks of 32 with a 6-bit scale and min each; value = d * sc * q - dmin * m.
template <bool Q5>
float dot_q45_k(const uint8_t* w, const uint8_t* a, int64_t k) {
  const int8_t* aq = act_q(a);
  const int16_t* bsums = act_q8k_bsums(a, k);
  const float* ad = act_q8k_d(a, k);
  constexpr int kBytes = Q5 ? 176 : 144;
  float sum = 0.f;
  for (int64_t b = 0; b < k / QK_K; ++b, w += kBytes, aq += QK_K, bsums += 16) {
    uint32_t sm[4];
    unpack_k4_scales(w + 4, sm);
    const uint8_t* sc = reinterpret_cast<const uint8_t*>(sm);
    const uint8_t* mn = sc + 8;
    const uint8_t* qh = w + 16;
    const uint8_t* qs = w + (Q5 ? 48 : 16);
    int isum = 0, msum = 0;
    for (int s = 0; s < 8; ++s) {
      const uint8_t* q = qs + 32 * (s / 2);
      const int shift = 4 * (s % 2);
      int si = 0;
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 15;
        if (Q5) v |= ((qh[l] >> s) & 1) << 4;
        si += v * aq[32 * s + l];
      }
      isum += sc[s] * si;
      msum += mn[s] * (bsums[2 * s] + bsums[2 * s + 1]);
    }
    const float d = f16_to_f32(load_u16(w)), dmin = f16_to_f32(load_u16(w + 2));
    sum += ad[b] * (d * static_cast<float>(isum) - dmin * static_cast<float>(msum));
  }
  return sum;
}

// Q6_K: 16 groups of 16 with an int8 scale; value = d * sc * (q - 32), q = 4 low bits | 2 high bits << 4.
float dot_q6_k(const uint8_t* w, const uint8_t* a, int64_t k) {
  const int8_t* aq = act_q(a);
  const int16_t* bsums = act_q8k_bsums(a, k);
  const float* ad = act_q8k_d(a, k);
  float sum = 0.f;
  for (int64_t b = 0; b < k / QK_K; ++b, w += 210, aq += QK_K, bsums += 16) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    int isum = 0;
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = w + 64 * half;
      const uint8_t* qh = w + 128 + 32 * half;
      for (int j = 0; j < 4; ++j) {  // elements 128*half + 32*j + l
        for (int g = 0; g < 2; ++g) {
          int si = 0;
          for (int l = 16 * g; l < 16 * g + 16; ++l) {
            const int lo = (ql[l + 32 * (j % 2)] >> (4 * (j / 2))) & 15;
            const int hi = (qh[l] >> (2 * j)) & 3;
            si += (lo | (hi << 4)) * aq[128 * half + 32 * j + l];
          }
          const int grp = 8 * half + 2 * j + g;
          isum += sc[grp] * (si - 32 * bsums[grp]);
        }
      }
    }
    sum += ad[b] * f16_to_f32(load_u16(w + 208)) * static_cast<float>(isum);
  }
  return sum;
}

template <int T>
float dot_float(const uint8_t* w, const uint8_t* a, int64_t k) {
  const float* x = reinterpret_cast<const float*>(a);
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    float v;
    if (T == GGML_F32) std::memcpy(&v, w + 4 * i, 4);
    else if (T == GGML_F16) v = f16_to_f32(load_u16(w + 2 * i));
    else v = bf16_to_f32(load_u16(w + 2 * i));
    sum += v * x[i];
  }
  return sum;
}

using DotFn = float (*)(const uint8_t*, const uint8_t*, int64_t);

DotFn dot_for(int t) {
  switch (t) {
    case GGML_Q8_0: return dot_q8_0;
    case GGML_Q4_0: return dot_legacy<GGML_Q4_0>;
    case GGML_Q4_1: return dot_legacy<GGML_Q4_1>;
    case GGML_Q5_0: return dot_legacy<GGML_Q5_0>;
    case GGML_Q5_1: return dot_legacy<GGML_Q5_1>;
    case GGML_Q4_K: return dot_q45_k<false>;
    case GGML_Q5_K: return dot_q45_k<true>;
    case GGML_Q6_K: return dot_q6_k;
    case GGML_F32: return dot_float<GGML_F32>;
    case GGML_F16: return dot_float<GGML_F16>;
    default: return dot_float<GGML_BF16>;
  }
}

// No prefetch and no tiles here: nothing of the config applies.
void gemm(const MoEConfig&, int t, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k,
          float* c, size_t ldc) {
  const DotFn dot = dot_for(t);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) c[n * ldc + m] = dot(w + m * ldw, act[n], k);
}

uint64_t stream_read(const uint8_t* p, size_t n) {
  const uint64_t* q = reinterpret_cast<const uint64_t*>(p);
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i < n / 8; i += 4) {
    s0 ^= q[i];
    s1 ^= q[i + 1];
    s2 ^= q[i + 2];
    s3 ^= q[i + 3];
  }
  return s0 ^ s1 ^ s2 ^ s3;
}

}  // namespace

const Kernels& kernels_scalar() {
  static const Kernels k{Isa::scalar, "scalar", act_format, gemm, stream_read};
  return k;
}

}  // namespace ktrans
