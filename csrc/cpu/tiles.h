// Prefill kernels for Q4_K / Q5_K that take 16 (AVX-512, AMX) or 8 (AVX2) weight rows at a time
// (kernels_avx512_tile.cpp, kernels_avx2_tile.cpp).
//
// The row kernels multiply every weight twice per activation row (vpmaddubsw, then vpdpwssd with the sub-block
// scale), which is what bounds a prefill. Here the rows of a tile are unpacked once per superblock into the
// layout of a VNNI dot product (one 32-bit lane per row, 4 consecutive weights in it), so each activation row
// then needs one vpdpbusd per 4 x 16 weights, and the scales are applied once per sub-block. AMX takes the
// unpacked rows as they are (its A tile) and the activations transposed instead (its B tile).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ktrans {

// Tile kernels are used from this many activation rows per call on (below it, unpacking 16 rows costs more than
// it saves). KTRANS_TILE_MIN_TOKENS sets the start value; set_tile_min_tokens changes it (tests, tuning) and
// returns the previous one. A huge value turns the tile kernels off.
int tile_min_tokens();
int set_tile_min_tokens(int n);
// How the tiles run: 1 = AMX tiles (asked for, and the CPU has AMX-INT8 and the OS granted tile data), 0 = AVX-512
// VNNI, 2 = the AMX data flow with the tile multiply done in plain C++ (tests check it on CPUs without AMX).
// KTRANS_AMX (default 1) sets what is asked for at start; set_amx_mode changes it and returns the previous request.
int amx_mode();
int set_amx_mode(int mode);

// c[n * ldc + m] = dot(weight row m, activation row n) as Kernels::gemm, for Q4_K (q5 = false) or Q5_K weights
// and ACT_Q8K_P activations. Every output element is computed the same way whichever tile, task or thread it
// falls in: per superblock the exact integer sums, then one float multiply-add per superblock.
void gemm_k4_tiles_avx512(bool q5, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N,
                          int64_t k, float* c, size_t ldc);
// The same on AVX2 with 8 rows per tile and ACT_Q8K activations (natural order); bitwise equal to the AVX-512 tiles.
void gemm_k4_tiles_avx2(bool q5, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N, int64_t k,
                        float* c, size_t ldc);

}  // namespace ktrans
