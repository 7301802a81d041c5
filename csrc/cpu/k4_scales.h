// Q4_K/Q5_K scale fields in SIMD, shared by the AVX2 and AVX-512 kernel files. Include it after the file's
// `#pragma GCC target` (it needs SSSE3): the anonymous namespace gives each file its own copy, compiled for its ISA.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace ktrans {
namespace {

// The 12 bytes of six-bit scales and mins of one block -> bytes [sc0..sc7 | m0..m7], in SIMD (the scalar
// unpack_k4_scales plus the moves into vector registers cost twice as many instructions):
//   sc0-3 = s0-3 & 63          sc4-7 = (s8-11 & 15) | (s0-3 >> 6) << 4
//   m0-3  = s4-7 & 63          m4-7  = (s8-11 >> 4) | (s4-7 >> 6) << 4
inline __m128i k4_scales_mins_v(__m128i s) {
  const __m128i a = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i b = _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i lo = _mm_or_si128(
      _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
      _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
  return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)));
}

// The same from the block's scale field at p (12 bytes used of the 16 read).
inline __m128i k4_scales_mins(const uint8_t* p) {
  return k4_scales_mins_v(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

}  // namespace
}  // namespace ktrans
