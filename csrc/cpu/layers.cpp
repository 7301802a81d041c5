// The decode-step kernels of layers.h: argument checks, the work split over the thread pool, the KV write, and
// the portable (scalar) vector policy. The AVX-512 policy is in layers_avx512.cpp; both run layers_impl.h.
#include "layers.h"

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "layers_impl.h"
#include "pool.h"

namespace ktrans {
namespace {

struct ScalarV {
  template <class T>
  static float dot(const float* a, const T* b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += a[i] * to_f32(b[i]);
    return s;
  }
  template <class T>
  static void axpy(float* y, float s, const T* x, int n) {
    for (int i = 0; i < n; ++i) y[i] += s * to_f32(x[i]);
  }
  static void update_row(float* row, float decay, float ki, const float* delta, float qi, float* o, int n) {
    for (int i = 0; i < n; ++i) {
      row[i] = decay * row[i] + ki * delta[i];
      o[i] += qi * row[i];
    }
  }
};

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// Run fn(task, scratch) for every task: on the pool when it has threads to spare, else here (a pool of one thread
// is a single worker, and handing it the job would only add a wake-up to the step).
template <class F>
void run_tasks(ThreadPool* pool, int n_tasks, int64_t scratch_floats, F fn) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(std::max<int64_t>(scratch_floats, 1));
  if (pool == nullptr || pool->size() <= 1 || n_tasks <= 1) {
    thread_local std::vector<float> scratch;
    if (scratch.size() * sizeof(float) < bytes) scratch.resize(bytes / sizeof(float));
    for (int t = 0; t < n_tasks; ++t) fn(t, scratch.data());
    return;
  }
  auto job = std::make_shared<Job>();
  job->phases.push_back({n_tasks, [&fn, pool, bytes](int t, int thread) {
    fn(t, static_cast<float*>(pool->scratch(thread, bytes)));
  }});
  pool->wait(pool->submit(std::move(job)));
}

template <class Dst>
void copy_rows(Dst* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(dst + i, src[i]);
}

}  // namespace

int64_t gdn_scratch_floats(const GdnDecodeArgs& a) { return 2 * int64_t(a.dk) + int64_t(a.hv / a.hk) * a.dv + 2 * a.dv; }

int64_t attn_scratch_floats(const AttnDecodeArgs& a) {
  const int64_t group = a.hq / a.hkv;
  return group * a.d + group * kAttnBlock + 2 * group;
}

void gdn_task_scalar(const GdnDecodeArgs& a, int64_t seq, int head, float* scratch) {
  gdn_task_dispatch<ScalarV>(a, seq, head, scratch);
}

void attn_task_scalar(const AttnDecodeArgs& a, int64_t seq, int kv_head, float* scratch) {
  attn_task_dispatch<ScalarV>(a, seq, kv_head, scratch);
}

void gdn_decode(const GdnDecodeArgs& a, ThreadPool* pool, bool avx512) {
  need(a.B >= 0, "gdn_decode: B must be >= 0");
  need(a.hk > 0 && a.hv > 0 && a.hv % a.hk == 0, "gdn_decode: value heads must be a positive multiple of key heads");
  need(a.dk > 0 && a.dv > 0 && a.kernel >= 1, "gdn_decode: head dims and the conv width must be positive");
  need(a.mixed && a.z && a.a && a.b && a.slots && a.A_log && a.dt_bias && a.conv_w && a.norm_w && a.conv_pool &&
           a.ssm_pool && a.out, "gdn_decode: a buffer is null");
  std::vector<int64_t> seen(a.slots, a.slots + a.B);
  for (int64_t i = 0; i < a.B; ++i) {
    const int64_t row = a.rows ? a.rows[i] : i;
    need(row >= 0 && row < a.n_rows, "gdn_decode: token row " + std::to_string(row) + " of sequence " +
                                         std::to_string(i) + " is outside [0, " + std::to_string(a.n_rows) + ")");
    need(a.slots[i] >= 0 && a.slots[i] < a.n_slots, "gdn_decode: slot " + std::to_string(a.slots[i]) +
                                                         " is outside [0, " + std::to_string(a.n_slots) + ")");
  }
  std::sort(seen.begin(), seen.end());
  // Two sequences on one slot (pad rows of a padded batch share the pad slot): then each key head's task runs
  // the sequences in order, so no two threads touch one state; they chain like consecutive steps.
  const bool shared = std::adjacent_find(seen.begin(), seen.end()) != seen.end();
  auto task = avx512 ? gdn_task_avx512 : gdn_task_scalar;
  const int hk = a.hk;
  const int64_t B = a.B;
  if (shared) {
    run_tasks(pool, hk, gdn_scratch_floats(a), [&](int t, float* s) {
      for (int64_t i = 0; i < B; ++i) task(a, i, t, s);
    });
  } else {
    run_tasks(pool, static_cast<int>(B * hk), gdn_scratch_floats(a), [&](int t, float* s) { task(a, t / hk, t % hk, s); });
  }
}

void attn_decode(const AttnDecodeArgs& a, ThreadPool* pool, bool avx512) {
  need(a.B >= 0, "attn_decode: B must be >= 0");
  need(a.hq > 0 && a.hkv > 0 && a.hq % a.hkv == 0, "attn_decode: query heads must be a positive multiple of kv heads");
  need(a.d > 0 && a.page_size > 0, "attn_decode: head dim and page size must be positive");
  need(a.q && a.k_new && a.v_new && a.slot_mapping && a.k_cache && a.v_cache && a.kv_lens && a.block_tables && a.out,
       "attn_decode: a buffer is null");
  for (int64_t i = 0; i < a.B; ++i) {
    const int64_t r = a.slot_mapping[i], len = a.kv_lens[i];
    need(r >= 0 && r < a.n_cache_rows, "attn_decode: slot_mapping row " + std::to_string(r) + " is outside [0, " +
                                           std::to_string(a.n_cache_rows) + ")");
    need(len >= 1, "attn_decode: sequence " + std::to_string(i) + " has no KV");
    const int64_t pages = (len + a.page_size - 1) / a.page_size;
    need(pages <= a.ld_bt, "attn_decode: block table has too few pages for " + std::to_string(len) + " tokens");
    for (int64_t p = 0; p < pages; ++p) {
      const int64_t page = a.block_tables[i * a.ld_bt + p];
      need(page >= 0 && (page + 1) * a.page_size <= a.n_cache_rows,
           "attn_decode: sequence " + std::to_string(i) + " names page " + std::to_string(page) + ", outside the cache");
    }
  }
  // The new tokens first: each sequence attends to its own, which the loop below reads from the cache.
  const int64_t row_elems = int64_t(a.hkv) * a.d;
  for (int64_t i = 0; i < a.B; ++i) {
    const int64_t off = a.slot_mapping[i] * row_elems;
    if (a.cache_dtype == PoolDtype::bf16) {
      copy_rows(static_cast<uint16_t*>(a.k_cache) + off, a.k_new + i * row_elems, row_elems);
      copy_rows(static_cast<uint16_t*>(a.v_cache) + off, a.v_new + i * row_elems, row_elems);
    } else {
      copy_rows(static_cast<float*>(a.k_cache) + off, a.k_new + i * row_elems, row_elems);
      copy_rows(static_cast<float*>(a.v_cache) + off, a.v_new + i * row_elems, row_elems);
    }
  }
  auto task = avx512 ? attn_task_avx512 : attn_task_scalar;
  const int hkv = a.hkv;
  run_tasks(pool, static_cast<int>(a.B * hkv), attn_scratch_floats(a), [&](int t, float* s) { task(a, t / hkv, t % hkv, s); });
}

}  // namespace ktrans
