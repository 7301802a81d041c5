// The AVX-512 vector policy of the decode-step kernels (layers.h, layers_impl.h): 16 floats per register, masked
// loads and stores for the tail, so head dims need not be multiples of 16. bf16 rows widen by a 16-bit shift.
#include <immintrin.h>

#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")

#include "layers_impl.h"  // after the target: compiled for AVX-512 here

namespace ktrans {
namespace {

inline __mmask16 tail(int n) { return static_cast<__mmask16>((1u << n) - 1); }
inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

struct Avx512V {
  template <class T>
  static float dot(const float* a, const T* b, int n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
      s0 = _mm512_fmadd_ps(load(a + i, 0xffff), load(b + i, 0xffff), s0);
      s1 = _mm512_fmadd_ps(load(a + i + 16, 0xffff), load(b + i + 16, 0xffff), s1);
    }
    for (; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : tail(n - i);
      s0 = _mm512_fmadd_ps(load(a + i, m), load(b + i, m), s0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
  template <class T>
  static void axpy(float* y, float s, const T* x, int n) {
    const __m512 vs = _mm512_set1_ps(s);
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : tail(n - i);
      _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(vs, load(x + i, m), load(y + i, m)));
    }
  }
  static void update_row(float* row, float decay, float ki, const float* delta, float qi, float* o, int n) {
    const __m512 vd = _mm512_set1_ps(decay), vk = _mm512_set1_ps(ki), vq = _mm512_set1_ps(qi);
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : tail(n - i);
      const __m512 r = _mm512_fmadd_ps(vk, load(delta + i, m), _mm512_mul_ps(vd, load(row + i, m)));
      _mm512_mask_storeu_ps(row + i, m, r);
      _mm512_mask_storeu_ps(o + i, m, _mm512_fmadd_ps(vq, r, load(o + i, m)));
    }
  }
};

}  // namespace

void gdn_task_avx512(const GdnDecodeArgs& a, int64_t seq, int head, float* scratch) {
  gdn_task_dispatch<Avx512V>(a, seq, head, scratch);
}

void attn_task_avx512(const AttnDecodeArgs& a, int64_t seq, int kv_head, float* scratch) {
  attn_task_dispatch<Avx512V>(a, seq, kv_head, scratch);
}

}  // namespace ktrans

#pragma GCC pop_options
