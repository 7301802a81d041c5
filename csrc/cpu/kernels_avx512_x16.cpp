// The Q4_K/Q5_K kernels on the 16-row layouts (KT_Q4_K_X16, KT_Q5_K_X16; quant.h), which CPUMoE repacks at load:
// fused passes for a few activation rows, a Tile unpacked once per superblock for many, and AMX with the weights as
// its B operand. Every result is bitwise that of the VNNI tiles (kernels_avx512_tile.cpp) on the original blocks.
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


// The heads of a KT_Q4_K_X16 superblock (p: its first byte), already one row per lane.
inline void x16_heads(const uint8_t* p, __m512& d, __m512& dmin, __m512 sc[8], __m512 mn[8]) {
  heads_from_dwords(loadu(p), loadu(p + 64), loadu(p + 128), loadu(p + 192), d, dmin, sc, mn);
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
void x16_group(const uint8_t* p, const Prefetch pf, const uint8_t* const* act, const uint32_t* bsp_all, int64_t k,
               int n0, float* c, size_t ldc) {
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
    prefetch_ahead<kSb>(p, pf);
    float da[NT];
    for (int n = 0; n < NT; ++n) da[n] = dap[n][b];
    x16_superblock<Q5, NT>(p, a, bsp, da, acc, macc);
    for (int n = 0; n < NT; ++n) a[n] += QK_K, bsp[n] += 4;
  }
  for (int n = 0; n < NT; ++n) _mm512_storeu_ps(c + (n0 + n) * ldc, _mm512_sub_ps(acc[n], macc[n]));
}

// From cfg.x16_tile_from activation rows on, a Tile is unpacked once per superblock for tile_rows (AMX: gemm_x16_amx,
// from 16 rows); below, fused passes of up to four rows (config.h).
template <bool Q5>
void gemm_x16(const MoEConfig& cfg, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k,
              float* c, size_t ldc) {
  const Prefetch pf = call_prefetch(cfg, w, M * ldw, cfg.x16_prefetch_bytes);
  prefetch_start(w, M * ldw, pf.dist);
  if (N >= cfg.x16_tile_from) {
    const TileScratch ts = tile_scratch(act, N, k);
    float* bsf = ts.bsf;
    __m512 *acc = ts.acc, *macc = ts.macc;
    Tile t;
    constexpr size_t kSb = x16_sb_bytes(Q5);
    for (int m0 = 0; m0 < M; m0 += kX16Rows) {
      for (int n = 0; n < N; ++n) acc[n] = macc[n] = _mm512_setzero_ps();
      const uint8_t* p = w + m0 * ldw;
      for (int64_t b = 0; b < k / QK_K; ++b, p += kSb) {
        prefetch_ahead<kSb>(p, pf);
        unpack_tile_x16<Q5>(p, t);
        tile_rows_all(t, act, bsf, k, b, N, acc, macc);
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
        case 1: x16_group<Q5, 1>(p, pf, act, bsp, k, n0, c + m0, ldc); break;
        case 2: x16_group<Q5, 2>(p, pf, act, bsp, k, n0, c + m0, ldc); break;
        case 3: x16_group<Q5, 3>(p, pf, act, bsp, k, n0, c + m0, ldc); break;
        default: x16_group<Q5, 4>(p, pf, act, bsp, k, n0, c + m0, ldc); break;
      }
    }
  }
}

// ---- AMX on KT_Q4_K_X16: the weights are the B operand of tdpbsud (signed activations x unsigned weights), whose
// layout (B row g: 4 bytes of each of 16 columns) is the X16 Tile's q as it is, and the activations, 16 rows at a
// time, the A operand, read in place from a copy with a fixed stride: no transpose on either side. C is
// [activation row][weight row], one activation row per zmm with a weight row per lane, as in tile_rows, whose float
// operations the epilogue repeats in the same order: results bitwise those of the VNNI tiles.

template <bool Q5, bool kHw>
void gemm_x16_amx(const MoEConfig& cfg, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N,
                  int64_t k, float* c, size_t ldc) {
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
  const Prefetch pf = call_prefetch(cfg, w, M * ldw, cfg.x16_prefetch_bytes);
  prefetch_start(w, M * ldw, pf.dist);
  alignas(64) int32_t cbuf[2 * 256];
  Tile t;
  if (kHw) amx_begin();
  for (int m0 = 0; m0 < M; m0 += kX16Rows) {
    for (int i = 0; i < 2 * G * 16; ++i) acc[i] = _mm512_setzero_ps();
    const uint8_t* p = w + m0 * ldw;
    for (int64_t b = 0; b < nb; ++b, p += kSb) {
      prefetch_ahead<kSb>(p, pf);
      unpack_tile_x16<Q5>(p, t);
      for (int gi = 0; gi < G; ++gi) {
        __m512 P[16];
        for (int n = 0; n < 16; ++n) P[n] = _mm512_setzero_ps();
        const int8_t* ag = abuf + static_cast<size_t>(gi) * 16 * lda + b * QK_K;
        for (int s = 0; s < 8; s += 2) {
          const uint8_t* bq = reinterpret_cast<const uint8_t*>(&t.q[8 * s]);
          if (kHw) amx_pair<false>(ag + 32 * s, lda, bq, cbuf);
          else amx_pair_emulated<false>(ag + 32 * s, lda, bq, cbuf);
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

void gemm_k_x16_avx512(const MoEConfig& cfg, bool q5, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act,
                       int N, int64_t k, float* c, size_t ldc) {
  // AMX under the same conditions as for the original blocks (gemm_k4_tiles_avx512)
  const int mode = amx_mode(cfg.amx);
  if (mode != 0 && N >= 16 && M >= 128) {
    if (q5) (mode == 1 ? gemm_x16_amx<true, true> : gemm_x16_amx<true, false>)(cfg, w, ldw, M, act, N, k, c, ldc);
    else (mode == 1 ? gemm_x16_amx<false, true> : gemm_x16_amx<false, false>)(cfg, w, ldw, M, act, N, k, c, ldc);
    return;
  }
  if (q5) gemm_x16<true>(cfg, w, ldw, M, act, N, k, c, ldc);
  else gemm_x16<false>(cfg, w, ldw, M, act, N, k, c, ldc);
}

}  // namespace ktrans

#pragma GCC pop_options
