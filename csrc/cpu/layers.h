// Decode-step kernels of the non-expert layers on the CPU: the fused Gated DeltaNet step and paged attention.
//
// Both take one new token for each of B sequences and work in place on the engine's pools (the DeltaNet state
// slots, the paged KV cache), so a decode step of a CPU-only model runs each layer's core in one call instead of
// tens of small torch ops. Activations and outputs are float32; the conv window and the KV cache are float32 or
// bf16 (the pools take the model dtype); the recurrent state is always float32. The torch references they match
// are ktrans/kernels/torch/{conv,gated_delta,attention}.py and ktrans/operators/norm.py rms_norm_gated.
#pragma once

#include <cstdint>

namespace ktrans {

class ThreadPool;

// Element type of a pool: the conv window and the KV cache.
enum class PoolDtype : int { f32 = 0, bf16 = 1 };

struct GdnDecodeArgs {
  int64_t B = 0;                  // sequences, one token each
  int hk = 0, hv = 0, dk = 0, dv = 0, kernel = 0;  // key heads, value heads (a multiple of hk), head dims, conv width
  const float* mixed = nullptr;   // [*, 2*hk*dk + hv*dv] q|k|v before the conv, row stride ld_mixed
  int64_t ld_mixed = 0;
  const float* z = nullptr;       // [*, hv*dv] output gate, row stride ld_z
  int64_t ld_z = 0;
  const float* a = nullptr;       // [*, hv] decay input, row stride ld_ab
  const float* b = nullptr;       // [*, hv] beta input, row stride ld_ab
  int64_t ld_ab = 0;
  const int64_t* rows = nullptr;  // [B] token row of sequence i, or null: row i
  int64_t n_rows = 0;             // rows of mixed, z, a and b: a row index outside [0, n_rows) is refused
  const int64_t* slots = nullptr;  // [B] state slot of sequence i
  int64_t n_slots = 0;            // slots of the pools: a slot outside [0, n_slots) is refused
  const float* A_log = nullptr;   // [hv]
  const float* dt_bias = nullptr;  // [hv]
  const float* conv_w = nullptr;  // [conv_dim, kernel]
  const float* norm_w = nullptr;  // [dv] the gated RMSNorm's weight
  float eps = 1e-6f;              // of the gated RMSNorm
  void* conv_pool = nullptr;      // [slots, conv_dim, kernel - 1] of conv_dtype
  PoolDtype conv_dtype = PoolDtype::f32;
  float* ssm_pool = nullptr;      // [slots, hv, dk, dv] float32
  float* out = nullptr;           // [B, hv*dv] the normed, gated core output, row stride ld_out
  int64_t ld_out = 0;
};

struct AttnDecodeArgs {
  int64_t B = 0;
  int hq = 0, hkv = 0, d = 0, page_size = 0;
  float scale = 1.f;
  const float* q = nullptr;       // [B, hq, d] contiguous
  const float* k_new = nullptr;   // [B, hkv, d] this step's keys and values, contiguous
  const float* v_new = nullptr;
  const int64_t* slot_mapping = nullptr;  // [B] the cache row each new token goes to
  void* k_cache = nullptr;        // [rows, hkv, d] of cache_dtype
  void* v_cache = nullptr;
  PoolDtype cache_dtype = PoolDtype::f32;
  const int64_t* kv_lens = nullptr;       // [B] tokens of KV per sequence, the new one included
  const int64_t* block_tables = nullptr;  // [B, ld_bt] pages per sequence
  int64_t ld_bt = 0;
  int64_t n_cache_rows = 0;       // rows of the caches: a row outside [0, n) is refused
  float* out = nullptr;           // [B, hq, d]
};

// Run one decode step in place. With `pool` of more than one thread the work splits over (sequence, key head)
// (DeltaNet) or (sequence, kv head) (attention) tasks on it; else it runs on the calling thread. Throws
// std::invalid_argument on bad sizes or an index out of range (checked before anything is written).
void gdn_decode(const GdnDecodeArgs& args, ThreadPool* pool, bool avx512);
void attn_decode(const AttnDecodeArgs& args, ThreadPool* pool, bool avx512);

// The per-task bodies, one per ISA (layers_impl.h instantiated in layers.cpp and layers_avx512.cpp). scratch
// holds at least gdn_scratch_floats / attn_scratch_floats floats.
int64_t gdn_scratch_floats(const GdnDecodeArgs& a);
int64_t attn_scratch_floats(const AttnDecodeArgs& a);
void gdn_task_scalar(const GdnDecodeArgs& a, int64_t seq, int head, float* scratch);
void gdn_task_avx512(const GdnDecodeArgs& a, int64_t seq, int head, float* scratch);
void attn_task_scalar(const AttnDecodeArgs& a, int64_t seq, int kv_head, float* scratch);
void attn_task_avx512(const AttnDecodeArgs& a, int64_t seq, int kv_head, float* scratch);

}  // namespace ktrans
