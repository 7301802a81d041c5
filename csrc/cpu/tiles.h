// Prefill kernels for Q4_K / Q5_K that take 16 (AVX-512, AMX) or 8 (AVX2) weight rows at a time
// (kernels_avx512_tile.cpp, kernels_avx2_tile.cpp), and for Q4_K/Q5_K repacked 16 rows at a time
// (kernels_avx512_x16.cpp).
//
// The row kernels multiply every weight twice per activation row (vpmaddubsw, then vpdpwssd with the sub-block
// scale), which is what bounds a prefill. Here the rows of a tile are unpacked once per superblock into the
// layout of a VNNI dot product (one 32-bit lane per row, 4 consecutive weights in it), so each activation row
// then needs one vpdpbusd per 4 x 16 weights, and the scales are applied once per sub-block. AMX takes the
// unpacked rows as they are (its A tile) and the activations transposed instead (its B tile).
#pragma once

#include <cstddef>
#include <cstdint>

#include "quant.h"

namespace ktrans {

// ACT_Q8K_P stores each 128 values as 0-31, 64-95, 32-63, 96-127: its storage sub-block s (values at positions
// 32s .. 32s + 31) is sub-block kNat[s]. The tiles of every ISA sum the sub-blocks in this order.
constexpr int kNat[8] = {0, 2, 1, 3, 4, 6, 5, 7};

// The activation sum of 32-value sub-block j of a Q8_K row, from its bsums (sums of 16).
inline float subblock_sum(const int16_t* bsums, int64_t j) { return static_cast<float>(bsums[2 * j] + bsums[2 * j + 1]); }

// out[n * (k / 32) + j] = subblock_sum of activation row n, for n < N.
inline void subblock_sums(const uint8_t* const* act, int N, int64_t k, float* out) {
  for (int n = 0; n < N; ++n) {
    const int16_t* bsums = act_q8k_bsums(act[n], k);
    for (int64_t j = 0; j < k / 32; ++j) out[n * (k / 32) + j] = subblock_sum(bsums, j);
  }
}

// Tile kernels are used from MoEConfig::tile_min_tokens activation rows per call on (config.h). The AVX2 tiles
// start at max(tile_min_tokens, this): below 8 activation rows they lose to the AVX2 row kernels (0.70-0.96x at 2-6
// rows, 1.0x at 8 on Zen 4, tools/gemm_tiles_bench.py --isa avx2).
constexpr int kAvx2TileMinTokens = 8;

// c[n * ldc + m] = dot(weight row m, activation row n) as Kernels::gemm, for Q4_K (q5 = false) or Q5_K weights
// and ACT_Q8K_P activations, on AMX or the VNNI tiles as cfg.amx asks. Every output element is computed the same way
// whichever tile, task or thread it falls in: per superblock the exact integer sums, then one float multiply-add per
// superblock.
void gemm_k4_tiles_avx512(const MoEConfig& cfg, bool q5, const uint8_t* w, size_t ldw, int M,
                          const uint8_t* const* act, int N, int64_t k, float* c, size_t ldc);
// The same for KT_Q4_K_X16 (q5 = false) or KT_Q5_K_X16 weights (M a multiple of 16), at any N: bitwise the tiles'
// results on the rows the layout was repacked from (cfg: amx, x16_tile_from, x16_prefetch_bytes and the hint).
void gemm_k_x16_avx512(const MoEConfig& cfg, bool q5, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act,
                       int N, int64_t k, float* c, size_t ldc);
// The same on AVX2 with 8 rows per tile and ACT_Q8K activations (natural order); bitwise equal to the AVX-512 tiles.
void gemm_k4_tiles_avx2(bool q5, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k,
                        float* c, size_t ldc);

}  // namespace ktrans
