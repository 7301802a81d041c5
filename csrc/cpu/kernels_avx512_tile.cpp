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
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "isa.h"
#include "prefetch.h"
#include "quant.h"
#include "tiles.h"

namespace ktrans {
namespace {

// Q4_K, one thread (tools/gemm_tiles_bench.py): against the row kernels, the VNNI tiles take 1.0-1.2x at 2-3
// activation rows, 1.2x at 4, 1.5x at 6-8 and 1.8-2.1x from 16 on (a 512 x 2048 matrix on Zen 4; 1.2-1.3x at 2-3
// rows on the Xeon, more for the down projection's small blocks). 3 leaves decode steps of 1-2 tokens per expert
// on the row kernels.
std::atomic<int> g_tile_min{std::max(1, env_int("KTRANS_TILE_MIN_TOKENS", 3))};
std::atomic<int> g_amx{env_int("KTRANS_AMX", 1)};

}  // namespace

int tile_min_tokens() { return g_tile_min.load(std::memory_order_relaxed); }
int set_tile_min_tokens(int n) { return g_tile_min.exchange(std::max(n, 1)); }
int amx_mode() {
  const int m = g_amx.load(std::memory_order_relaxed);
  return m == 2 ? 2 : (m == 1 && isa().amx_int8 ? 1 : 0);
}
int set_amx_mode(int mode) { return g_amx.exchange(mode); }

}  // namespace ktrans

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

namespace ktrans {
namespace {

inline __m512i loadu(const void* p) { return _mm512_loadu_si512(p); }

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

// The heads of a KT_Q4_K_X16 superblock (p: its first byte), already one row per lane.
inline void x16_heads(const uint8_t* p, __m512& d, __m512& dmin, __m512 sc[8], __m512 mn[8]) {
  heads_from_dwords(loadu(p), loadu(p + 64), loadu(p + 128), loadu(p + 192), d, dmin, sc, mn);
}

// One superblock of 16 rows, unpacked.
struct alignas(64) Tile {
  __m512i q[64];  // q[i] lane r: row r's 4 weights at ACT_Q8K_P positions 4i .. 4i + 3 (u8)
  __m512 sc[8];   // per storage sub-block s (positions 32s .. 32s + 31): its six-bit scale, per row
  __m512 mn[8];   // per sub-block j (values 32j .. 32j + 31): its six-bit min, per row
  __m512 d, dmin;
};

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

// ---- KT_Q4_K_X16 (Q4_K repacked at load, quant.h): the tiles' arithmetic straight on the stored layout, whose
// 64-byte quant loads are already the transposed rows (quants dword i of the 16 rows: positions 4i .. 4i + 3 in its
// low nibbles, 4 (i + 16) .. in its high ones, for i < 16; i + 16 and i + 32 for i >= 16). The high nibbles are
// taken as q & 0xF0, 16 times their value, and their sub-blocks' scales as sc / 16: each product with an exact
// integer dot is then the same real number, so every result is bitwise that of gemm_tiles on the Q4_K rows the
// layout came from, with one instruction less per 64 bytes and no transpose.

// Storage sub-blocks 2, 3, 6 and 7 are the high nibbles.
constexpr bool x16_high(int s) { return (s & 2) != 0; }

// Q5_K_X16 keeps its high nibbles at their value (a fifth bit is added to them): no 1/16 there.
template <bool Q5>
inline void x16_scales(const __m512 sc_nat[8], __m512 sc[8]) {
  const __m512 sixteenth = _mm512_set1_ps(1.f / 16.f);
  for (int s = 0; s < 8; ++s)
    sc[s] = !Q5 && x16_high(s) ? _mm512_mul_ps(sc_nat[kNat[s]], sixteenth) : sc_nat[kNat[s]];
}

// Bytes of one 16-row superblock, and where its quants start (Q5_K: after 8 x 64 bytes of fifth bits).
constexpr size_t x16_sb_bytes(bool q5) { return kX16Rows * (q5 ? 176 : 144); }
constexpr int x16_qs_off(bool q5) { return kX16HeadBytes + (q5 ? 512 : 0); }

// Quants dword i = 16c + j of the 16 rows (superblock at p) as unsigned weights: lo the low nibbles (positions
// 4 (32c + j) ..), hi the high ones (+ 64). Q4_K: hi is q & 0xF0, 16 times its value (x16_scales divides).
// Q5_K: each gets its fifth bit from qh dword j % 8 (the same 4 bytes of the row: value 64 ch + l, chunk
// ch = 2c + j / 8, takes bit 2 ch of qh[l] for the low nibble, 2 ch + 1 for the high one).
template <bool Q5>
inline void x16_quants(const uint8_t* p, int c, int j, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i q = loadu(p + x16_qs_off(Q5) + 64 * (16 * c + j));
  lo = _mm512_and_si512(q, m4);
  if (!Q5) {
    hi = _mm512_and_si512(q, _mm512_set1_epi8(static_cast<char>(0xF0)));
    return;
  }
  hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
  const __m512i qh = loadu(p + kX16HeadBytes + 64 * (j % 8));
  const int ch = 2 * c + j / 8;
  const __m512i sixteen = _mm512_set1_epi8(0x10);
  lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, _mm512_set1_epi8(static_cast<char>(1 << (2 * ch)))), lo,
                            sixteen);
  hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, _mm512_set1_epi8(static_cast<char>(1 << (2 * ch + 1)))),
                            hi, sixteen);
}

// A Tile from one X16 superblock (for tile_rows at many activation rows): the loads split, no transpose.
template <bool Q5>
inline void unpack_tile_x16(const uint8_t* p, Tile& t) {
  for (int c = 0; c < 2; ++c)
    for (int j = 0; j < 16; ++j) x16_quants<Q5>(p, c, j, t.q[32 * c + j], t.q[32 * c + 16 + j]);
  __m512 sc[8];
  x16_heads(p, t.d, t.dmin, sc, t.mn);
  x16_scales<Q5>(sc, t.sc);
}

// tile_rows<NT> fused with the unpack, for a few activation rows (a decode step): the integer dots stay in
// registers, no Tile goes through memory. Each half of the quants (c) holds storage sub-blocks 4c .. 4c + 3, so the
// dots of one half at a time are live (4 per activation row) and P is summed in the same sub-block order.
// The heads of an X16 superblock for the fused kernels: d, dmin, the scales as floats in storage order (the high
// nibbles' divided by 16, x16_scales), and the mins as int16 pairs for vpdpwssd against sub-block sums: mp[0] lane r
// holds row r's (m0, m2), mp[1] (m1, m3), mp[2] (m4, m6), mp[3] (m5, m7).
template <bool Q5>
inline void x16_heads_fused(const uint8_t* p, __m512& d, __m512& dmin, __m512 sc[8], __m512i mp[4]) {
  const __m512i h0 = loadu(p);
  d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h0));
  dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h0, 16)));
  __m512i q[4];
  heads_scale_bytes(loadu(p + 64), loadu(p + 128), loadu(p + 192), q);
  const __m512i ff = _mm512_set1_epi32(0xff), pair = _mm512_set1_epi32(0x00ff00ff);
  __m512 sc_nat[8];
  for (int j = 0; j < 4; ++j) {
    sc_nat[j] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q[0], 8 * j), ff));
    sc_nat[4 + j] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(q[1], 8 * j), ff));
  }
  x16_scales<Q5>(sc_nat, sc);
  mp[0] = _mm512_and_si512(q[2], pair);
  mp[1] = _mm512_and_si512(_mm512_srli_epi32(q[2], 8), pair);
  mp[2] = _mm512_and_si512(q[3], pair);
  mp[3] = _mm512_and_si512(_mm512_srli_epi32(q[3], 8), pair);
}

// An activation row's sub-block sums of one superblock as the int16 pairs x16_heads_fused's mins meet:
// (s0, s2), (s1, s3), (s4, s6), (s5, s7). Each is at most 32 * 127 in size.
inline void x16_bsum_pairs(const int16_t* bsums, uint32_t out[4]) {
  int32_t s[8];
  for (int j = 0; j < 8; ++j) s[j] = bsums[2 * j] + bsums[2 * j + 1];
  for (int i = 0; i < 4; ++i) {
    const int lo = (i & 1) + 4 * (i >> 1);
    out[i] = static_cast<uint16_t>(s[lo]) | static_cast<uint32_t>(static_cast<uint16_t>(s[lo + 2])) << 16;
  }
}

// tile_rows<NT> fused with the unpack, for a few activation rows (a decode step): the integer dots stay in
// registers, no Tile goes through memory. Each half of the quants (c) holds storage sub-blocks 4c .. 4c + 3, so the
// dots of one half at a time are live (4 per activation row) and P is summed in the same sub-block order. The mins'
// sum is taken in integers (vpdpwssd): every product and partial sum of it is an integer below 2^24, so it is the
// float sum tile_rows takes, exactly.
template <bool Q5, int NT>
inline void x16_superblock(const uint8_t* p, const int8_t* const* a, const uint32_t* const* bsp, const float* da,
                           __m512* acc, __m512* macc) {
  __m512 d, dmin, sc[8];
  __m512i mp[4];
  x16_heads_fused<Q5>(p, d, dmin, sc, mp);
  __m512 P[NT];
  for (int n = 0; n < NT; ++n) P[n] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int c = 0; c < 2; ++c) {
    __m512i dot[NT][4];  // storage sub-block 4c + i
    for (int n = 0; n < NT; ++n)
      for (int i = 0; i < 4; ++i) dot[n][i] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      __m512i lo, hi;
      x16_quants<Q5>(p, c, j, lo, hi);
      const int plo = 4 * (32 * c + j), phi = plo + 64;  // activation positions of the low and high nibbles
      for (int n = 0; n < NT; ++n) {
        dot[n][j / 8] = dpbusd_bcast(dot[n][j / 8], lo, a[n] + plo);
        dot[n][2 + j / 8] = dpbusd_bcast(dot[n][2 + j / 8], hi, a[n] + phi);
      }
    }
    for (int n = 0; n < NT; ++n)
      for (int i = 0; i < 4; ++i) P[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[n][i]), sc[4 * c + i], P[n]);
  }
  for (int n = 0; n < NT; ++n) {
    __m512i Mi = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) Mi = _mm512_dpwssd_epi32(Mi, mp[i], _mm512_set1_epi32(static_cast<int>(bsp[n][i])));
    const __m512 s = _mm512_set1_ps(da[n]);
    acc[n] = _mm512_fmadd_ps(P[n], _mm512_mul_ps(d, s), acc[n]);
    macc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Mi), _mm512_mul_ps(dmin, s), macc[n]);
  }
}

// Activation rows n0 .. n0 + NT - 1 against rows m0 .. m0 + 15 (the group at p), fused. bsp_all: per activation
// row, x16_bsum_pairs of each superblock (4 per superblock).
template <bool Q5, int NT>
void x16_group(const uint8_t* p, const uint8_t* pf_end, int dist, const uint8_t* const* act,
               const uint32_t* bsp_all, int64_t k, int n0, float* c, size_t ldc) {
  constexpr size_t kSb = x16_sb_bytes(Q5);
  const int64_t nb = k / QK_K;
  const int8_t* a[NT];
  const uint32_t* bsp[NT];
  const float* dap[NT];
  __m512 acc[NT], macc[NT];
  for (int n = 0; n < NT; ++n) {
    a[n] = act_q(act[n0 + n]);
    bsp[n] = bsp_all + (n0 + n) * nb * 4;
    dap[n] = act_q8k_d(act[n0 + n], k);
    acc[n] = macc[n] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b, p += kSb) {
    prefetch_ahead<kSb>(p, pf_end, dist);
    float da[NT];
    for (int n = 0; n < NT; ++n) da[n] = dap[n][b];
    x16_superblock<Q5, NT>(p, a, bsp, da, acc, macc);
    for (int n = 0; n < NT; ++n) a[n] += QK_K, bsp[n] += 4;
  }
  for (int n = 0; n < NT; ++n) _mm512_storeu_ps(c + (n0 + n) * ldc, _mm512_sub_ps(acc[n], macc[n]));
}

// From this many activation rows on, a Tile is unpacked once per superblock for tile_rows (AMX: gemm_x16_amx, from 16
// rows); below, fused passes of up to four rows. One thread on Zen 4 (doc/benchmarks.md): the fused passes are
// 1.15-1.56x the tiles on the original blocks at 5-16 rows, but 0.90-0.98x at 32-256, where the Tile path is 1.02-1.2x.
int g_x16_tile_from = std::max(1, env_int("KTRANS_X16_TILE_FROM", 24));

template <bool Q5>
void gemm_x16(const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k, float* c,
              size_t ldc) {
  set_rows_end(w + M * ldw);
  const uint8_t* const pf_end = rows_end();
  const int dist = g_x16_prefetch_bytes;
  prefetch_start(w, M * ldw, dist);
  if (N >= g_x16_tile_from) {
    thread_local std::vector<float> bsf_buf;
    bsf_buf.resize(static_cast<size_t>(N) * (k / 32));
    float* bsf = bsf_buf.data();
    subblock_sums(act, N, k, bsf);
    struct alignas(64) Lanes {
      float v[16];
    };
    thread_local std::vector<Lanes> acc_buf;
    acc_buf.resize(2 * static_cast<size_t>(N));
    __m512* acc = reinterpret_cast<__m512*>(acc_buf.data());
    __m512* macc = acc + N;
    Tile t;
    constexpr size_t kSb = x16_sb_bytes(Q5);
    for (int m0 = 0; m0 < M; m0 += kX16Rows) {
      for (int n = 0; n < N; ++n) acc[n] = macc[n] = _mm512_setzero_ps();
      const uint8_t* p = w + m0 * ldw;
      for (int64_t b = 0; b < k / QK_K; ++b, p += kSb) {
        prefetch_ahead<kSb>(p, pf_end, dist);
        unpack_tile_x16<Q5>(p, t);
        int n0 = 0;
        for (; n0 + 8 <= N; n0 += 8) tile_rows_at<8>(t, act, bsf, k, b, n0, acc, macc);
        if (N - n0 >= 4) tile_rows_at<4>(t, act, bsf, k, b, n0, acc, macc), n0 += 4;
        if (N - n0 >= 2) tile_rows_at<2>(t, act, bsf, k, b, n0, acc, macc), n0 += 2;
        if (N - n0 >= 1) tile_rows_at<1>(t, act, bsf, k, b, n0, acc, macc);
      }
      for (int n = 0; n < N; ++n) _mm512_storeu_ps(c + n * ldc + m0, _mm512_sub_ps(acc[n], macc[n]));
    }
    return;
  }
  const int64_t nb = k / QK_K;
  thread_local std::vector<uint32_t> bsp_buf;
  bsp_buf.resize(static_cast<size_t>(N) * nb * 4);
  uint32_t* bsp = bsp_buf.data();
  for (int n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) x16_bsum_pairs(act_q8k_bsums(act[n], k) + 16 * b, bsp + (n * nb + b) * 4);
  for (int m0 = 0; m0 < M; m0 += kX16Rows) {
    const uint8_t* p = w + m0 * ldw;
    for (int n0 = 0; n0 < N; n0 += 4) {
      switch (std::min(4, N - n0)) {
        case 1: x16_group<Q5, 1>(p, pf_end, dist, act, bsp, k, n0, c + m0, ldc); break;
        case 2: x16_group<Q5, 2>(p, pf_end, dist, act, bsp, k, n0, c + m0, ldc); break;
        case 3: x16_group<Q5, 3>(p, pf_end, dist, act, bsp, k, n0, c + m0, ldc); break;
        default: x16_group<Q5, 4>(p, pf_end, dist, act, bsp, k, n0, c + m0, ldc); break;
      }
    }
  }
}

template <bool Q5>
void gemm_tiles(const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k, float* c,
                size_t ldc) {
  constexpr int kBytes = Q5 ? 176 : 144;
  const int64_t nb = k / QK_K, nsub = k / 32;
  // Per activation row: its sub-block sums as floats (bsums hold sums of 16), then the 16-lane accumulators.
  thread_local std::vector<float> bsf_buf;
  struct alignas(64) Lanes {
    float v[16];
  };
  thread_local std::vector<Lanes> acc_buf;
  bsf_buf.resize(static_cast<size_t>(N) * nsub);
  acc_buf.resize(2 * static_cast<size_t>(N));
  float* bsf = bsf_buf.data();
  subblock_sums(act, N, k, bsf);
  __m512* acc = reinterpret_cast<__m512*>(acc_buf.data());
  __m512* macc = acc + N;
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
      int n0 = 0;
      for (; n0 + 8 <= N; n0 += 8) tile_rows_at<8>(t, act, bsf, k, b, n0, acc, macc);
      if (N - n0 >= 4) tile_rows_at<4>(t, act, bsf, k, b, n0, acc, macc), n0 += 4;
      if (N - n0 >= 2) tile_rows_at<2>(t, act, bsf, k, b, n0, acc, macc), n0 += 2;
      if (N - n0 >= 1) tile_rows_at<1>(t, act, bsf, k, b, n0, acc, macc);
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << nr) - 1);
    for (int n = 0; n < N; ++n) _mm512_mask_storeu_ps(c + n * ldc + m0, keep, _mm512_sub_ps(acc[n], macc[n]));
  }
}

// ---- AMX: C (16 weight rows x 16 activation rows, int32) += A (weights, u8) . B (activations, s8), per sub-block.
// A is the tile's rows unpacked row-major (no transpose: AMX reads rows), B is 16 activation rows transposed once
// per call into the VNNI layout (B row g: 4 bytes of every activation row). The epilogue has one activation row
// per lane and the same float operations in the same order as tile_rows, so both give bitwise equal results.

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
  _tile_loadconfig(&cfg);
}
__attribute__((target("amx-tile,amx-int8"))) void amx_end() { _tile_release(); }

__attribute__((target("amx-tile,amx-int8"))) void amx_pair(const uint8_t* a, const uint8_t* b, int32_t* c) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_loadd(0, a, 256);
  _tile_loadd(1, a + 32, 256);
  _tile_loadd(2, b, 64);
  _tile_loadd(3, b + 512, 64);
  _tile_dpbusd(4, 0, 2);
  _tile_dpbusd(5, 1, 3);
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
}

// The same arithmetic in plain C++: what the tests check the data flow with on CPUs without AMX.
void amx_pair_emulated(const uint8_t* a, const uint8_t* b, int32_t* c) {
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        int32_t s = 0;
        for (int g = 0; g < 8; ++g)
          for (int e = 0; e < 4; ++e)
            s += a[m * 256 + 32 * h + 4 * g + e] * static_cast<int8_t>(b[512 * h + g * 64 + 4 * n + e]);
        c[256 * h + m * 16 + n] = s;
      }
}

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
          if (kHw) amx_pair(abuf + 32 * s, bg + 8 * s * 64, cbuf);
          else amx_pair_emulated(abuf + 32 * s, bg + 8 * s * 64, cbuf);
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

// ---- AMX on KT_Q4_K_X16: the weights are the B operand of tdpbsud (signed activations x unsigned weights), whose
// layout (B row g: 4 bytes of each of 16 columns) is the X16 Tile's q as it is, and the activations, 16 rows at a
// time, the A operand, read in place from a copy with a fixed stride: no transpose on either side. C is
// [activation row][weight row], one activation row per zmm with a weight row per lane, as in tile_rows, whose float
// operations the epilogue repeats in the same order: results bitwise those of the VNNI tiles.

__attribute__((target("amx-tile,amx-int8"))) void amx_pair_x16(const int8_t* a, size_t lda, const uint8_t* b,
                                                                int32_t* c) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_loadd(0, a, lda);
  _tile_loadd(1, a + 32, lda);
  _tile_loadd(2, b, 64);
  _tile_loadd(3, b + 512, 64);
  _tile_dpbsud(4, 0, 2);
  _tile_dpbsud(5, 1, 3);
  _tile_stored(4, c, 64);
  _tile_stored(5, c + 256, 64);
}

void amx_pair_x16_emulated(const int8_t* a, size_t lda, const uint8_t* b, int32_t* c) {
  for (int h = 0; h < 2; ++h)
    for (int n = 0; n < 16; ++n)
      for (int r = 0; r < 16; ++r) {
        int32_t s = 0;
        for (int g = 0; g < 8; ++g)
          for (int e = 0; e < 4; ++e) s += a[n * lda + 32 * h + 4 * g + e] * b[512 * h + 64 * g + 4 * r + e];
        c[256 * h + 16 * n + r] = s;
      }
}

template <bool Q5, bool kHw>
void gemm_x16_amx(const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k, float* c,
                  size_t ldc) {
  constexpr size_t kSb = x16_sb_bytes(Q5);
  const int64_t nb = k / QK_K, nsub = k / 32;
  const int G = (N + 15) / 16;  // groups of 16 activation rows, the last one padded with zero rows
  struct alignas(64) Lanes {
    float v[16];
  };
  thread_local std::vector<Lanes> abuf_v, f_buf;
  // A rows k + 64 bytes apart: a stride of a multiple of 4 KiB would put all 16 rows of a tile load in one L1 set
  const size_t lda = static_cast<size_t>(k) + 64;
  abuf_v.resize(static_cast<size_t>(G) * 16 * lda / 64);
  f_buf.resize((static_cast<size_t>(G) * 16 * (nsub + nb) + 15) / 16 + 2 * static_cast<size_t>(G) * 16);
  int8_t* abuf = reinterpret_cast<int8_t*>(abuf_v.data());  // [G * 16][lda]
  float* bsf = reinterpret_cast<float*>(f_buf.data());       // [G * 16][nsub]
  float* dab = bsf + static_cast<size_t>(G) * 16 * nsub;     // [G * 16][nb]
  __m512* acc = reinterpret_cast<__m512*>(f_buf.data() + (static_cast<size_t>(G) * 16 * (nsub + nb) + 15) / 16);
  __m512* macc = acc + G * 16;
  for (int n = 0; n < G * 16; ++n) {
    if (n < N) {
      std::memcpy(abuf + n * lda, act_q(act[n]), k);
      const int16_t* bs = act_q8k_bsums(act[n], k);
      for (int64_t j = 0; j < nsub; ++j) bsf[n * nsub + j] = subblock_sum(bs, j);
      std::memcpy(dab + n * nb, act_q8k_d(act[n], k), nb * sizeof(float));
    } else {
      std::memset(abuf + n * lda, 0, k);
      std::fill(bsf + n * nsub, bsf + (n + 1) * nsub, 0.f);
      std::fill(dab + n * nb, dab + (n + 1) * nb, 0.f);
    }
  }
  set_rows_end(w + M * ldw);
  const uint8_t* const pf_end = rows_end();
  const int dist = g_x16_prefetch_bytes;
  prefetch_start(w, M * ldw, dist);
  alignas(64) int32_t cbuf[2 * 256];
  Tile t;
  if (kHw) amx_begin();
  for (int m0 = 0; m0 < M; m0 += kX16Rows) {
    for (int i = 0; i < 2 * G * 16; ++i) acc[i] = _mm512_setzero_ps();
    const uint8_t* p = w + m0 * ldw;
    for (int64_t b = 0; b < nb; ++b, p += kSb) {
      prefetch_ahead<kSb>(p, pf_end, dist);
      unpack_tile_x16<Q5>(p, t);
      for (int gi = 0; gi < G; ++gi) {
        __m512 P[16];
        for (int n = 0; n < 16; ++n) P[n] = _mm512_setzero_ps();
        const int8_t* ag = abuf + static_cast<size_t>(gi) * 16 * lda + b * QK_K;
        for (int s = 0; s < 8; s += 2) {
          const uint8_t* bq = reinterpret_cast<const uint8_t*>(&t.q[8 * s]);
          if (kHw) amx_pair_x16(ag + 32 * s, lda, bq, cbuf);
          else amx_pair_x16_emulated(ag + 32 * s, lda, bq, cbuf);
          for (int n = 0; n < 16; ++n) {
            P[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf + 16 * n)), t.sc[s], P[n]);
            P[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf + 256 + 16 * n)), t.sc[s + 1], P[n]);
          }
        }
        for (int n = 0; n < 16; ++n) {
          const int row = gi * 16 + n;
          const float* bs = bsf + row * nsub + 8 * b;
          __m512 Mf = _mm512_setzero_ps();
          for (int j = 0; j < 8; ++j) Mf = _mm512_fmadd_ps(t.mn[j], _mm512_set1_ps(bs[j]), Mf);
          const __m512 sda = _mm512_set1_ps(dab[row * nb + b]);
          acc[row] = _mm512_fmadd_ps(P[n], _mm512_mul_ps(t.d, sda), acc[row]);
          macc[row] = _mm512_fmadd_ps(Mf, _mm512_mul_ps(t.dmin, sda), macc[row]);
        }
      }
    }
    for (int n = 0; n < N; ++n) _mm512_storeu_ps(c + n * ldc + m0, _mm512_sub_ps(acc[n], macc[n]));
  }
  if (kHw) amx_end();
}

}  // namespace

void gemm_k_x16_avx512(bool q5, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k,
                       float* c, size_t ldc) {
  // AMX under the same conditions as for the original blocks (gemm_k4_tiles_avx512)
  const int mode = amx_mode();
  if (mode != 0 && N >= 16 && M >= 128) {
    if (q5) (mode == 1 ? gemm_x16_amx<true, true> : gemm_x16_amx<true, false>)(w, ldw, M, act, N, k, c, ldc);
    else (mode == 1 ? gemm_x16_amx<false, true> : gemm_x16_amx<false, false>)(w, ldw, M, act, N, k, c, ldc);
    return;
  }
  if (q5) gemm_x16<true>(w, ldw, M, act, N, k, c, ldc);
  else gemm_x16<false>(w, ldw, M, act, N, k, c, ldc);
}

void gemm_k4_tiles_avx512(bool q5, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N,
                          int64_t k, float* c, size_t ldc) {
  // AMX takes activation rows 16 at a time (a partial group is padded) and transposes them once per call, so it
  // pays from 16 rows on and for blocks of at least 128 weight rows (measured on the 16-core Xeon: 2.75x the row
  // kernels at 16 rows of a 512 x 2048 matrix where the VNNI tiles reach 2.0x, but only 0.6-1.2x on the 32 x 512
  // blocks of a down projection task, where the VNNI tiles reach 1.2-2.4x).
  const int mode = amx_mode();
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
