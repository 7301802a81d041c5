// The per-task bodies of the decode-step kernels (layers.h), written once over a vector policy V and included by
// layers.cpp (scalar V) and layers_avx512.cpp (AVX-512 V, after its target pragma, so it compiles for AVX-512
// there). Everything sits in an anonymous namespace: each including file gets its own copy.
//
// V provides, for T = float or uint16_t (bf16 bits) on the right-hand side:
//   dot(a, b, n)                   sum a[i] * b[i]
//   axpy(y, s, x, n)               y += s * x
//   update_row(row, decay, ki, delta, qi, o, n)   row = decay * row + ki * delta; o += qi * row
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "layers.h"

namespace ktrans {
namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// float -> bf16 rounding to nearest even, as torch's .to(torch.bfloat16) (NaN stays a quiet NaN).
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<uint16_t>((u >> 16) | 0x40);
    return;
  }
  *p = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float silu(float x) { return x / (1.f + std::exp(-x)); }
// torch.nn.functional.softplus with its defaults (beta 1, threshold 20: linear above it).
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// ---------------------------------------------------------------------------------------------------------
// Gated DeltaNet: one (sequence, key head) task owns that head's conv channels (its q and k channels and the
// channels of its r = hv / hk value heads) and those value heads' recurrent states, so tasks never share memory.

template <class V, class T>
void gdn_task(const GdnDecodeArgs& a, int64_t seq, int h, float* scratch) {
  const int dk = a.dk, dv = a.dv, r = a.hv / a.hk, width = a.kernel - 1;
  const int64_t key_dim = int64_t(a.hk) * dk, conv_dim = 2 * key_dim + int64_t(a.hv) * dv;
  const int64_t row = a.rows ? a.rows[seq] : seq, slot = a.slots[seq];
  const float* x = a.mixed + row * a.ld_mixed;
  T* window = static_cast<T*>(a.conv_pool) + slot * conv_dim * width;
  float* q = scratch;
  float* k = q + dk;
  float* v = k + dk;
  float* kv = v + int64_t(r) * dv;
  float* o = kv + dv;

  // Causal conv over the window [oldest .. newest] then this token, SiLU; the window shifts by one.
  auto conv = [&](int64_t c0, int n, float* dst) {
    for (int i = 0; i < n; ++i) {
      const int64_t c = c0 + i;
      T* st = window + c * width;
      const float* w = a.conv_w + c * a.kernel;
      float acc = 0.f;
      for (int j = 0; j < width; ++j) acc += to_f32(st[j]) * w[j];
      acc += x[c] * w[width];
      for (int j = 0; j + 1 < width; ++j) st[j] = st[j + 1];
      if (width > 0) store(&st[width - 1], x[c]);
      dst[i] = silu(acc);
    }
  };
  conv(int64_t(h) * dk, dk, q);
  conv(key_dim + int64_t(h) * dk, dk, k);
  conv(2 * key_dim + int64_t(h) * r * dv, r * dv, v);

  // L2 norm with eps inside the root (as FLA and the reference), q also scaled by dk^-1/2.
  const float qs = 1.f / std::sqrt(V::dot(q, q, dk) + 1e-6f) / std::sqrt(float(dk));
  const float ks = 1.f / std::sqrt(V::dot(k, k, dk) + 1e-6f);
  for (int i = 0; i < dk; ++i) q[i] *= qs, k[i] *= ks;

  for (int jj = 0; jj < r; ++jj) {
    const int j = h * r + jj;
    const float g = -std::exp(a.A_log[j]) * softplus(a.a[row * a.ld_ab + j] + a.dt_bias[j]);
    const float decay = std::exp(g), beta = sigmoid(a.b[row * a.ld_ab + j]);
    float* S = a.ssm_pool + (slot * a.hv + j) * int64_t(dk) * dv;
    const float* vj = v + int64_t(jj) * dv;
    // Two passes over the head's state (it stays in L2 between them): k^T S first, for the delta; then the
    // decayed update and the output row by row, S = decay * S + k delta^T, o = S^T q.
    std::memset(kv, 0, sizeof(float) * dv);
    for (int i = 0; i < dk; ++i) V::axpy(kv, k[i], S + int64_t(i) * dv, dv);
    for (int e = 0; e < dv; ++e) kv[e] = beta * (vj[e] - decay * kv[e]);  // kv now holds the delta
    std::memset(o, 0, sizeof(float) * dv);
    for (int i = 0; i < dk; ++i) V::update_row(S + int64_t(i) * dv, decay, k[i], kv, q[i], o, dv);

    // Gated RMSNorm of the head's output: o / rms(o) * w * SiLU(z).
    const float inv = 1.f / std::sqrt(V::dot(o, o, dv) / float(dv) + a.eps);
    const float* z = a.z + row * a.ld_z + int64_t(j) * dv;
    float* out = a.out + seq * a.ld_out + int64_t(j) * dv;
    for (int e = 0; e < dv; ++e) out[e] = a.norm_w[e] * (o[e] * inv) * silu(z[e]);
  }
}

template <class V>
void gdn_task_dispatch(const GdnDecodeArgs& a, int64_t seq, int h, float* scratch) {
  if (a.conv_dtype == PoolDtype::bf16) gdn_task<V, uint16_t>(a, seq, h, scratch);
  else gdn_task<V, float>(a, seq, h, scratch);
}

// ---------------------------------------------------------------------------------------------------------
// Paged attention: one (sequence, kv head) task runs the kv head's group of query heads over the sequence's
// keys in blocks, with an online softmax (running max and sum per query head), so the scores never need more
// than a block of memory however long the sequence.

constexpr int kAttnBlock = 64;

template <class V, class T>
void attn_task(const AttnDecodeArgs& a, int64_t seq, int kvh, float* scratch) {
  const int d = a.d, group = a.hq / a.hkv;
  const int64_t len = a.kv_lens[seq];
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const int64_t* table = a.block_tables + seq * a.ld_bt;
  const float* q = a.q + (seq * a.hq + int64_t(kvh) * group) * d;
  float* acc = scratch;                        // [group, d]
  float* s = acc + int64_t(group) * d;         // [group, block]
  float* m = s + int64_t(group) * kAttnBlock;  // [group] running max
  float* l = m + group;                        // [group] running sum of exp
  int64_t rows[kAttnBlock];
  std::memset(acc, 0, sizeof(float) * group * d);
  for (int g = 0; g < group; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
  for (int64_t t0 = 0; t0 < len; t0 += kAttnBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kAttnBlock, len - t0));
    for (int t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      rows[t] = (table[pos / a.page_size] * a.page_size + pos % a.page_size) * a.hkv + kvh;
      for (int g = 0; g < group; ++g) s[g * kAttnBlock + t] = a.scale * V::dot(q + int64_t(g) * d, kc + rows[t] * d, d);
    }
    for (int g = 0; g < group; ++g) {
      float* sg = s + g * kAttnBlock;
      float mx = m[g];
      for (int t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
      const float c = std::exp(m[g] - mx);  // 0 on the first block (m = -inf)
      m[g] = mx;
      l[g] *= c;
      float* ag = acc + int64_t(g) * d;
      for (int e = 0; e < d; ++e) ag[e] *= c;
      for (int t = 0; t < n; ++t) sg[t] = std::exp(sg[t] - mx), l[g] += sg[t];
    }
    for (int t = 0; t < n; ++t)
      for (int g = 0; g < group; ++g) V::axpy(acc + int64_t(g) * d, s[g * kAttnBlock + t], vc + rows[t] * d, d);
  }
  for (int g = 0; g < group; ++g) {
    float* out = a.out + (seq * a.hq + int64_t(kvh) * group + g) * d;
    const float inv = 1.f / l[g];
    for (int e = 0; e < d; ++e) out[e] = acc[int64_t(g) * d + e] * inv;
  }
}

template <class V>
void attn_task_dispatch(const AttnDecodeArgs& a, int64_t seq, int kvh, float* scratch) {
  if (a.cache_dtype == PoolDtype::bf16) attn_task<V, uint16_t>(a, seq, kvh, scratch);
  else attn_task<V, float>(a, seq, kvh, scratch);
}

}  // namespace
}  // namespace ktrans
