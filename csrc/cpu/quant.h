// GGUF (ggml) weight block formats, the activation formats the kernels pair them with, and the kernel table
// each ISA file fills in.
//
// Weights stay in ggml's own bytes: a matrix [rows, K] is `rows` runs of K / block_size blocks. Activations are
// quantized on the fly into a format chosen per weight type, so that every dot product is an integer one:
//   Q8_0, Q4_0, Q4_1,
//   Q5_0, Q5_1 weights -> ACT_Q8_0:   per 32 values, int8 q, a float scale d and d * sum(q) (for offsets, mins)
//   Q4_K, Q5_K, Q6_K   -> ACT_Q8K:    per 256 values, int8 q, a float scale and int16 sums per 16 values
//                         (ACT_Q8K_P: the same with each 128 values stored as 0-31, 64-95, 32-63, 96-127, the
//                          order in which one 512-bit load of Q4_K/Q5_K nibbles yields them)
//   BF16, F16, F32     -> ACT_F32:    the float row itself (products are exact, sums in float32)
// Everything in this header compiles for the baseline ISA and is shared by all kernel files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "config.h"

namespace ktrans {

enum GgmlType : int {
  GGML_F32 = 0,
  GGML_F16 = 1,
  GGML_Q4_0 = 2,
  GGML_Q4_1 = 3,
  GGML_Q5_0 = 6,
  GGML_Q5_1 = 7,
  GGML_Q8_0 = 8,
  GGML_Q4_K = 12,
  GGML_Q5_K = 13,
  GGML_Q6_K = 14,
  GGML_BF16 = 30,
};

constexpr int QK_K = 256;
constexpr int QK8_0 = 32;

// ktrans's own weight layouts, not ggml types: Q4_K and Q5_K rows repacked 16 at a time at load (repack_x16), the
// layout a VNNI dot product reads, so a kernel needs no transpose. Same bytes per row as the ggml type (144 or 176
// per 256 values). A group of 16 rows is one contiguous run of 16 * row_bytes; in superblock b of the group (16
// blocks' bytes at b * 16 * block_bytes), dword 16 w + r is dword w of row r's block. So it holds
//   heads: 4 x 64 bytes (dwords e = 0..3 of the 16 rows: fp16 d | fp16 dmin, 12 bytes of scales and mins)
//   Q5_K only, fifth bits: 8 x 64 bytes (qh dwords 0..7)
//   quants: 32 x 64 bytes (dwords i = 0..31 of the rows' 128 bytes of nibbles)
// and one 64-byte load gives 4 bytes (8 weights) of each of the 16 rows. Only paths whose Kernels::reads_x16 is set
// take them, for matrices of a multiple of 16 rows.
constexpr int KT_Q4_K_X16 = 1012;
constexpr int KT_Q5_K_X16 = 1013;
// The X16 layout of a ggml type, or -1 where there is none.
constexpr int x16_type(int ggml_type) {
  return ggml_type == 12 ? KT_Q4_K_X16 : ggml_type == 13 ? KT_Q5_K_X16 : -1;
}
constexpr bool is_x16(int type) { return type == KT_Q4_K_X16 || type == KT_Q5_K_X16; }
constexpr int kX16Rows = 16;
constexpr int kX16HeadBytes = 256;

bool type_supported(int type);
const char* type_name(int type);
int type_block_size(int type);       // elements per block
int type_block_bytes(int type);      // bytes per block
size_t type_row_bytes(int type, int64_t k);  // bytes of a row of k elements (k a multiple of the block size)

// Groups [g0, g1) of 16 rows of a Q4_K or Q5_K matrix (`type`; rows of k values, contiguous) from src into its X16
// layout at dst (same offsets: group g at g * 16 * row_bytes in both). src and dst must not overlap.
void repack_x16(int type, const uint8_t* src, uint8_t* dst, int64_t k, int64_t g0, int64_t g1);

enum ActFormat : int { ACT_F32 = 0, ACT_Q8_0 = 1, ACT_Q8K = 2, ACT_Q8K_P = 3 };

// Bytes of one activation row of k elements, rounded up to 64 so rows stay cache-line aligned.
// Row layouts (k multiple of the block):
//   ACT_F32:   float x[k]
//   ACT_Q8_0:  int8 q[k] | float d[k/32] | float s[k/32]  (s = d * sum of the block's q)
//   ACT_Q8K:   int8 q[k] | int16 bsums[k/16] | float d[k/256]
size_t act_row_bytes(ActFormat f, int64_t k);

// Quantize n rows of k floats (row stride ldx floats) into format f (row stride ldo bytes). The same float
// operations on every ISA, so all kernel paths see identical integer activations.
void quantize_act(ActFormat f, const float* x, size_t ldx, int n, int64_t k, uint8_t* out, size_t ldo);

// ---------------------------------------------------------------------------------------------------------
// scalar helpers (used by every kernel file; compiled for the baseline ISA)

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000 | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Q4_K/Q5_K: the 12-byte field of 8 six-bit scales and 8 six-bit mins -> sc[0..7] in bytes 0..7 of out,
// mins in bytes 8..15 (llama.cpp's bit trick on four 32-bit words).
inline void unpack_k4_scales(const uint8_t* s12, uint32_t out[4]) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  uint32_t u[3];
  std::memcpy(u, s12, 12);
  out[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  out[2] = u[1] & kmask1;
  out[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  out[0] = u[0] & kmask1;
}

// Pointers into one activation row.
inline const int8_t* act_q(const uint8_t* row) { return reinterpret_cast<const int8_t*>(row); }
inline const float* act_q8_0_d(const uint8_t* row, int64_t k) { return reinterpret_cast<const float*>(row + k); }
inline const float* act_q8_0_s(const uint8_t* row, int64_t k) {
  return reinterpret_cast<const float*>(row + k + 4 * (k / QK8_0));
}

// Q4_0/Q4_1/Q5_0/Q5_1 blocks of 32: value = d * q + m, q = 4 low bits (| 1 high bit << 4 for Q5); the "_0" types
// have m = -8 d (Q4_0) or -16 d (Q5_0). Element j < 16 is the low nibble of qs[j], element j + 16 its high nibble.
struct LegacyLayout {
  int bytes, qh, qs;  // block size, offset of the 32 high bits (Q5), offset of the 16 nibble bytes
  bool has_min;
  int offset;  // q offset of the "_0" types
};
constexpr LegacyLayout legacy_layout(int t) {
  return t == GGML_Q4_0 ? LegacyLayout{18, 0, 2, false, -8}
       : t == GGML_Q4_1 ? LegacyLayout{20, 0, 4, true, 0}
       : t == GGML_Q5_0 ? LegacyLayout{22, 2, 6, false, -16}
                        : LegacyLayout{24, 4, 8, true, 0};
}
// The additive term of one block: m * s_a, with m the block's min (or offset * d).
inline float legacy_min(const uint8_t* blk, const LegacyLayout& L) {
  return L.has_min ? f16_to_f32(load_u16(blk + 2)) : static_cast<float>(L.offset) * f16_to_f32(load_u16(blk));
}
inline const int16_t* act_q8k_bsums(const uint8_t* row, int64_t k) {
  return reinterpret_cast<const int16_t*>(row + k);
}
inline const float* act_q8k_d(const uint8_t* row, int64_t k) {
  return reinterpret_cast<const float*>(row + k + 2 * (k / 16));
}

// ---------------------------------------------------------------------------------------------------------
// the kernel table of one ISA path

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

struct Kernels {
  Isa isa;
  const char* name;
  // The activation format this path pairs with weight type t.
  ActFormat (*act_format)(int t);
  // c[n * ldc + m] = dot(weight row m, activation row n) for m < M, n < N. Weight row m starts at
  // w + m * ldw (ggml blocks of type t, k elements); act[n] points at an activation row in act_format(t). `cfg`
  // (the calling object's, checked) tunes how: prefetch, tiles, AMX; the results do not depend on it, except that
  // the tiles sum in another order than the row kernels.
  void (*gemm)(const MoEConfig& cfg, int t, const uint8_t* w, size_t ldw, int M, const uint8_t* const* act, int N,
               int64_t k, float* c, size_t ldc);
  // Read n bytes (n a multiple of 256) as fast as possible; returns a value that depends on every byte.
  uint64_t (*stream_read)(const uint8_t* p, size_t n);
  // Whether gemm takes KT_Q4_K_X16 and KT_Q5_K_X16 weights (M a multiple of 16).
  bool reads_x16 = false;
};

const Kernels& kernels_scalar();
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();

// Whether this CPU can run the path, and why not when it cannot.
bool isa_available(Isa isa, const char** why_not = nullptr);
// "auto" (the best available; the KTRANS_CPU_ISA environment variable overrides it), "avx512", "avx2" or
// "scalar". Throws std::invalid_argument for an unknown name or a path this CPU cannot run.
const Kernels& select_kernels(const char* name);

}  // namespace ktrans
