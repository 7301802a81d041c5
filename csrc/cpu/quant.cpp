// Type table, activation quantization and the choice of kernel path. Baseline ISA only.
#include "quant.h"

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ktrans {

bool type_supported(int t) {
  switch (t) {
    case GGML_F32: case GGML_F16: case GGML_BF16: case GGML_Q8_0: case GGML_Q4_K: case GGML_Q5_K: case GGML_Q6_K:
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case KT_Q4_K_X16: case KT_Q5_K_X16:
      return true;
    default:
      return false;
  }
}

const char* type_name(int t) {
  switch (t) {
    case GGML_F32: return "F32";
    case GGML_F16: return "F16";
    case GGML_BF16: return "BF16";
    case GGML_Q8_0: return "Q8_0";
    case GGML_Q4_K: return "Q4_K";
    case GGML_Q5_K: return "Q5_K";
    case GGML_Q6_K: return "Q6_K";
    case GGML_Q4_0: return "Q4_0";
    case GGML_Q4_1: return "Q4_1";
    case GGML_Q5_0: return "Q5_0";
    case GGML_Q5_1: return "Q5_1";
    case KT_Q4_K_X16: return "Q4_K_X16";
    case KT_Q5_K_X16: return "Q5_K_X16";
    default: return "unsupported";
  }
}

int type_block_size(int t) {
  switch (t) {
    case GGML_F32: case GGML_F16: case GGML_BF16: return 1;
    case GGML_Q8_0: case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: return QK8_0;
    default: return QK_K;
  }
}

int type_block_bytes(int t) {
  switch (t) {
    case GGML_F32: return 4;
    case GGML_F16: case GGML_BF16: return 2;
    case GGML_Q8_0: return 34;
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: return legacy_layout(t).bytes;
    case GGML_Q4_K: case KT_Q4_K_X16: return 144;
    case GGML_Q5_K: case KT_Q5_K_X16: return 176;
    case GGML_Q6_K: return 210;
    default: throw std::invalid_argument("unsupported ggml type " + std::to_string(t));
  }
}

size_t type_row_bytes(int t, int64_t k) {
  return static_cast<size_t>(k / type_block_size(t)) * type_block_bytes(t);
}

void repack_x16(int type, const uint8_t* src, uint8_t* dst, int64_t k, int64_t g0, int64_t g1) {
  const size_t rb = type_row_bytes(type, k), bb = type_block_bytes(type);
  const int64_t nb = k / QK_K;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* s = src + g * kX16Rows * rb + b * bb;
      uint8_t* d = dst + g * kX16Rows * rb + b * kX16Rows * bb;
      for (int r = 0; r < kX16Rows; ++r)
        for (size_t w = 0; w < bb / 4; ++w) std::memcpy(d + 4 * (16 * w + r), s + r * rb + 4 * w, 4);
    }
}

size_t act_row_bytes(ActFormat f, int64_t k) {
  size_t n = 0;
  switch (f) {
    case ACT_F32: n = 4 * k; break;
    case ACT_Q8_0: n = k + 8 * (k / QK8_0); break;
    case ACT_Q8K: case ACT_Q8K_P: n = k + 2 * (k / 16) + 4 * (k / QK_K); break;
  }
  return (n + 63) & ~size_t(63);
}

namespace {

// Round to nearest, ties to even, for |v| < 2^22: the same rounding as the vector float->int conversions,
// and (unlike nearbyintf) vectorisable for the baseline ISA.
inline int round_even(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return static_cast<int>((v + magic) - magic);
}

#if defined(__x86_64__)
// quantize_block with AVX2, for n a multiple of 32: the same float operations, so the same bytes. max_ps(a, m) is
// "a > m ? a : m" (a NaN a leaves m), the maximum does not depend on the order, and cvtps2dq rounds to nearest even
// as round_even does (no multiply-add is fused: the target has no FMA).
__attribute__((target("avx2"))) float quantize_block_avx2(const float* x, int n, int8_t* q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  if (amax == 0.f) {
    std::memset(q, 0, n);
    return 0.f;
  }
  const __m256 is = _mm256_set1_ps(127.f / amax);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < n; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j)
      v[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), is)), hi), lo);
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(b, order));
  }
  return amax / 127.f;
}
#endif

// One block of n values -> int8 q (symmetric, scale amax / 127). Returns the scale.
inline float quantize_block(const float* x, int n, int8_t* q) {
#if defined(__x86_64__)
  // KTRANS_QUANT_SCALAR: a test switch (the scalar loop on an AVX2 CPU), read once; not a tuning knob.
  static const bool avx2 = isa().avx2 && std::getenv("KTRANS_QUANT_SCALAR") == nullptr;
  if (avx2 && n % 32 == 0) return quantize_block_avx2(x, n, q);
#endif
  float amax = 0.f;
  // A plain compare, not std::fmax: fmax's NaN rule keeps it a libm call per value (a serial cost of ~10 us per
  // decode step for the 10 rows of h); the two differ only for NaN inputs.
  for (int i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    amax = a > amax ? a : amax;
  }
  if (amax == 0.f) {
    std::memset(q, 0, n);
    return 0.f;
  }
  const float iscale = 127.f / amax;
  for (int i = 0; i < n; ++i) {
    int v = round_even(x[i] * iscale);
    q[i] = static_cast<int8_t>(v > 127 ? 127 : (v < -127 ? -127 : v));
  }
  return amax / 127.f;
}

void quantize_row(ActFormat f, const float* x, int64_t k, uint8_t* out) {
  if (f == ACT_F32) {
    std::memcpy(out, x, 4 * k);
    return;
  }
  int8_t* q = reinterpret_cast<int8_t*>(out);
  if (f == ACT_Q8_0) {
    float* d = reinterpret_cast<float*>(out + k);
    float* sums = d + k / QK8_0;
    for (int64_t b = 0; b < k / QK8_0; ++b) {
      d[b] = quantize_block(x + b * QK8_0, QK8_0, q + b * QK8_0);
      int s = 0;
      for (int i = 0; i < QK8_0; ++i) s += q[b * QK8_0 + i];
      sums[b] = d[b] * static_cast<float>(s);
    }
    return;
  }
  int16_t* bsums = reinterpret_cast<int16_t*>(out + k);
  float* d = reinterpret_cast<float*>(out + k + 2 * (k / 16));
  int8_t tmp[QK_K];
  for (int64_t b = 0; b < k / QK_K; ++b) {
    d[b] = quantize_block(x + b * QK_K, QK_K, tmp);
    for (int g = 0; g < QK_K / 16; ++g) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += tmp[g * 16 + i];
      bsums[b * 16 + g] = static_cast<int16_t>(s);
    }
    int8_t* dst = q + b * QK_K;
    if (f == ACT_Q8K) {
      std::memcpy(dst, tmp, QK_K);
    } else {  // ACT_Q8K_P: each 128 as 0-31, 64-95, 32-63, 96-127
      for (int h = 0; h < QK_K; h += 128) {
        std::memcpy(dst + h, tmp + h, 32);
        std::memcpy(dst + h + 32, tmp + h + 64, 32);
        std::memcpy(dst + h + 64, tmp + h + 32, 32);
        std::memcpy(dst + h + 96, tmp + h + 96, 32);
      }
    }
  }
}

}  // namespace

void quantize_act(ActFormat f, const float* x, size_t ldx, int n, int64_t k, uint8_t* out, size_t ldo) {
  for (int i = 0; i < n; ++i) quantize_row(f, x + i * ldx, k, out + i * ldo);
}

bool isa_available(Isa path, const char** why_not) {
  const IsaInfo& i = isa();
  const char* reason = nullptr;
  switch (path) {
    case Isa::scalar:
      break;
    case Isa::avx2:
      if (!i.avx2) reason = "this CPU (or OS) lacks AVX2/FMA/F16C";
      break;
    case Isa::avx512:
      if (!(i.avx2 && i.avx512f && i.avx512bw && i.avx512vl))
        reason = "this CPU (or OS) lacks AVX-512 F/BW/VL";
      else if (!i.avx512vnni)
        reason = "this CPU has AVX-512 but not VNNI, which the AVX-512 kernels need";
      break;
  }
  if (why_not) *why_not = reason;
  return reason == nullptr;
}

const Kernels& select_kernels(const char* name) {
  std::string want = name ? name : "auto";
  if (want == "auto" || want.empty()) {
    // Process-wide on purpose: which kernel path this machine runs, not a tuning knob (those are MoEConfig's).
    const char* env = std::getenv("KTRANS_CPU_ISA");
    want = (env && *env) ? env : "auto";
  }
  if (want == "auto") {
    if (isa_available(Isa::avx512)) return kernels_avx512();
    if (isa_available(Isa::avx2)) return kernels_avx2();
    return kernels_scalar();
  }
  Isa path;
  if (want == "avx512") path = Isa::avx512;
  else if (want == "avx2") path = Isa::avx2;
  else if (want == "scalar") path = Isa::scalar;
  else throw std::invalid_argument("unknown CPU kernel path '" + want + "' (expected auto, avx512, avx2 or scalar)");
  const char* why = nullptr;
  if (!isa_available(path, &why))
    throw std::invalid_argument("CPU kernel path '" + want + "' cannot run here: " + why);
  switch (path) {
    case Isa::avx512: return kernels_avx512();
    case Isa::avx2: return kernels_avx2();
    default: return kernels_scalar();
  }
}

}  // namespace ktrans
