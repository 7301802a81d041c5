// MoE experts, dense linear and the read-bandwidth probe as thread-pool jobs. Baseline ISA: the heavy lifting
// happens in the kernel table's gemm; this file routes tokens, owns the per-job buffers and splits the work.
#include "moe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace ktrans {
namespace {

constexpr int kRowsPerQuant = 8;  // activation rows per quantization task
// Up to this many (token, expert) pairs the down projection runs per expert (see `down_experts`): a decode step
// up to ~25 tokens at top-10, y taking at most 256 x hidden floats.
constexpr int kDownByExpertPairs = 256;
constexpr int kSortRouteMax = 64;  // up to this many expert ids per call, routing sorts instead of counting

// Rows per task: about `tasks_per_thread` tasks per thread, so a slow core is balanced out, but blocks as large as
// that allows (multiples of 16 rows, at most `cap`), since every block is a separate stream the prefetcher must
// pick up again.
int64_t block_rows(int64_t total_rows, int threads, int tasks_per_thread, int64_t cap) {
  int64_t r = total_rows / (static_cast<int64_t>(threads) * tasks_per_thread);
  r = std::min(r, cap) & ~int64_t(15);
  return std::max<int64_t>(r, 16);
}

class Buffer {
 public:
  void alloc(size_t n) {
    n = ((n ? n : 1) + 63) & ~size_t(63);
    p_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, n)));
    if (!p_) throw std::bad_alloc();
  }
  uint8_t* get() const { return p_.get(); }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> p_;
};

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// exp(x) for float32, branch-free so the loop below vectorizes on the baseline ISA: x = n ln2 + r, |r| <= ln2/2,
// Cephes' degree-6 polynomial for e^r (relative error ~1e-7), 2^n through the exponent bits.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// h = silu(g) * u over n values.
void silu_mul(const float* __restrict g, const float* __restrict u, float* __restrict h, int n) {
  for (int i = 0; i < n; ++i) h[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
}

void check_matrix(const char* what, const ExpertMatrix& m, int64_t rows, int64_t cols, const Kernels& K) {
  const std::string name(what);
  if (is_x16(m.type) && !K.reads_x16)
    throw std::invalid_argument(name + ": the " + std::string(K.name) + " kernels do not read repacked " +
                                type_name(m.type) + " weights");
  if (is_x16(m.type) && rows % kX16Rows)
    throw std::invalid_argument(name + ": " + type_name(m.type) + " needs a multiple of 16 rows, got " +
                                std::to_string(rows));
  if (!type_supported(m.type))
    throw std::invalid_argument(name + ": ggml type " + std::to_string(m.type) +
                                " is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)");
  if (m.rows != rows || m.cols != cols)
    throw std::invalid_argument(name + ": expected [" + std::to_string(rows) + ", " + std::to_string(cols) +
                                "] per expert, got [" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "]");
  if (cols % type_block_size(m.type))
    throw std::invalid_argument(name + ": " + type_name(m.type) + " needs rows of a multiple of " +
                                std::to_string(type_block_size(m.type)) + " values, got " + std::to_string(cols));
  if (!m.data) throw std::invalid_argument(name + ": null weight pointer");
}

struct MoEJob : Job {
  MoEConfig cfg;              // the MoE's config when the job was submitted
  std::vector<int> experts;   // active expert ids, ascending
  std::vector<int> offsets;   // pairs of experts[a] are offsets[a] .. offsets[a + 1]
  std::vector<int> pair_tok;  // (token, slot) pairs grouped by expert
  std::vector<float> pair_w;
  std::vector<uint8_t> tok_used;  // per token: routed to at least one expert here (prefill's quantize skips others)
  std::vector<const uint8_t*> xg, xu, hin;  // per pair: activation rows for gate, up, down
  Buffer xg_buf, xu_buf, h_buf, hq_buf, y_buf;
  int max_group = 0;
  // Per active expert (a cache line each): gate/up blocks finished. The task finishing the last block quantizes the
  // expert's h rows for down and then adds one more, so `> blocks` means "h of this expert is ready".
  std::unique_ptr<std::atomic<int>[]> ready;
};

constexpr int kReadyStride = 16;  // ints per expert in MoEJob::ready: one cache line each, no false sharing

struct LinearJob : Job {
  MoEConfig cfg;
  std::vector<const uint8_t*> xrows;
  Buffer xq_buf;
};

}  // namespace

MoE::MoE(int n_experts, int hidden, int intermediate, ExpertMatrix gate, ExpertMatrix up, ExpertMatrix down,
         const Kernels& kernels, const MoEConfig& config)
    : n_experts_(n_experts), hidden_(hidden), inter_(intermediate), gate_(gate), up_(up), down_(down),
      kernels_(kernels), config_(config) {
  if (n_experts < 1 || hidden < 1 || intermediate < 1)
    throw std::invalid_argument("MoE: n_experts, hidden and intermediate must be positive");
  check_matrix("gate", gate_, intermediate, hidden, kernels_);
  check_matrix("up", up_, intermediate, hidden, kernels_);
  check_matrix("down", down_, hidden, intermediate, kernels_);
}

uint64_t MoE::submit(ThreadPool& pool, const float* x, int64_t T, int64_t ldx, const int64_t* ids,
                     const float* weights, int k, float* out, int64_t ldo) const {
  if (T < 0 || k < 1) throw std::invalid_argument("MoE.submit: need T >= 0 tokens and k >= 1 experts per token");
  auto job = std::make_shared<MoEJob>();
  MoEJob& J = *job;
  J.cfg = config_.get();

  // Route: group the (token, slot) pairs by expert, in token order within an expert.
  const int64_t n_ids = T * k;
  for (int64_t i = 0; i < n_ids; ++i)
    if (ids[i] >= n_experts_)
      throw std::invalid_argument("MoE.submit: expert id " + std::to_string(ids[i]) + " (token " + std::to_string(i / k) +
                                  ", slot " + std::to_string(i % k) + ") is outside [0, " +
                                  std::to_string(n_experts_) + ")");
  int n_pairs = 0;
  if (n_ids <= kSortRouteMax) {
    // A decode step: sort (expert, position) keys, which touches a few cache lines instead of two per-expert arrays.
    uint64_t key[kSortRouteMax];
    for (int64_t i = 0; i < n_ids; ++i)
      if (ids[i] >= 0) key[n_pairs++] = static_cast<uint64_t>(ids[i]) << 32 | static_cast<uint64_t>(i);
    std::sort(key, key + n_pairs);
    J.experts.reserve(n_pairs);
    J.offsets.reserve(n_pairs + 1);
    J.pair_tok.resize(n_pairs);
    J.pair_w.resize(n_pairs);
    int max_run = 0;
    for (int p = 0; p < n_pairs; ++p) {
      const int e = static_cast<int>(key[p] >> 32), i = static_cast<int>(key[p] & 0xffffffffu);
      if (p == 0 || e != J.experts.back()) {
        J.experts.push_back(e);
        J.offsets.push_back(p);
      }
      max_run = std::max(max_run, p + 1 - J.offsets.back());
      J.pair_tok[p] = i / k;
      J.pair_w[p] = weights[i];
    }
    J.max_group = max_run;
  } else {
    std::vector<int> count(n_experts_, 0);
    for (int64_t i = 0; i < n_ids; ++i)
      if (ids[i] >= 0) ++count[ids[i]];
    std::vector<int> pos(n_experts_);
    for (int e = 0; e < n_experts_; ++e) {
      pos[e] = n_pairs;
      if (count[e]) {
        J.experts.push_back(e);
        J.offsets.push_back(n_pairs);
        J.max_group = std::max(J.max_group, count[e]);
      }
      n_pairs += count[e];
    }
    J.pair_tok.resize(n_pairs);
    J.pair_w.resize(n_pairs);
    for (int64_t i = 0; i < n_ids; ++i) {
      const int64_t e = ids[i];
      if (e < 0) continue;
      const int p = pos[e]++;
      J.pair_tok[p] = static_cast<int>(i / k);
      J.pair_w[p] = weights[i];
    }
  }
  J.offsets.push_back(n_pairs);

  // Buffers: quantized x (one per distinct activation format of gate and up), h = silu(gate) * up per pair,
  // and h quantized for down.
  const Kernels& K = kernels_;
  const ActFormat fg = K.act_format(gate_.type), fu = K.act_format(up_.type), fd = K.act_format(down_.type);
  const int64_t H = hidden_, I = inter_;
  const size_t lg = act_row_bytes(fg, H), lu = act_row_bytes(fu, H), ld = act_row_bytes(fd, I);
  const int64_t ldh = (I + 15) & ~int64_t(15);
  const bool sep_u = fu != fg;
  if (fg != ACT_F32) J.xg_buf.alloc(T * lg);
  if (sep_u && fu != ACT_F32) J.xu_buf.alloc(T * lu);
  J.h_buf.alloc(static_cast<size_t>(n_pairs) * ldh * sizeof(float));
  if (fd != ACT_F32) J.hq_buf.alloc(static_cast<size_t>(n_pairs) * ld);
  auto xrow = [&](ActFormat f, const Buffer& buf, size_t l, int t) -> const uint8_t* {
    return f == ACT_F32 ? reinterpret_cast<const uint8_t*>(x + t * ldx) : buf.get() + t * l;
  };
  J.xg.resize(n_pairs);
  J.xu.resize(n_pairs);
  J.hin.resize(n_pairs);
  float* hf = reinterpret_cast<float*>(J.h_buf.get());
  for (int p = 0; p < n_pairs; ++p) {
    J.xg[p] = xrow(fg, J.xg_buf, lg, J.pair_tok[p]);
    J.xu[p] = sep_u ? xrow(fu, J.xu_buf, lu, J.pair_tok[p]) : J.xg[p];
    J.hin[p] = fd == ACT_F32 ? reinterpret_cast<const uint8_t*>(hf + p * ldh) : J.hq_buf.get() + p * ld;
  }

  const ExpertMatrix G = gate_, U = up_, D = down_;
  MoEJob* jp = job.get();
  ThreadPool* pl = &pool;
  const int n_active = static_cast<int>(J.experts.size());

  // A decode step's few rows are quantized right here (a microsecond or two), not as a one-task phase that every
  // other thread would wait behind.
  if (T <= kRowsPerQuant) {
    if (fg != ACT_F32) quantize_act(fg, x, ldx, static_cast<int>(T), H, J.xg_buf.get(), lg);
    if (sep_u && fu != ACT_F32) quantize_act(fu, x, ldx, static_cast<int>(T), H, J.xu_buf.get(), lu);
  } else if (fg != ACT_F32 || (sep_u && fu != ACT_F32)) {
    // Only the rows some pair reads: a share of the experts (split prefill's CPU part, a probe of one expert)
    // routes few of a long step's tokens here, and quantizing all of them cost more than the experts' work.
    J.tok_used.assign(static_cast<size_t>(T), 0);
    for (int p = 0; p < n_pairs; ++p) J.tok_used[J.pair_tok[p]] = 1;
    job->phases.push_back({ceil_div(T, kRowsPerQuant), [=, &K](int task, int) {
      const int64_t end = std::min<int64_t>(static_cast<int64_t>(task + 1) * kRowsPerQuant, T);
      for (int64_t t0 = static_cast<int64_t>(task) * kRowsPerQuant; t0 < end;) {  // runs of used rows
        if (!jp->tok_used[t0]) {
          ++t0;
          continue;
        }
        int64_t t1 = t0 + 1;
        while (t1 < end && jp->tok_used[t1]) ++t1;
        const int n = static_cast<int>(t1 - t0);
        if (fg != ACT_F32) quantize_act(fg, x + t0 * ldx, ldx, n, H, jp->xg_buf.get() + t0 * lg, lg);
        if (sep_u && fu != ACT_F32) quantize_act(fu, x + t0 * ldx, ldx, n, H, jp->xu_buf.get() + t0 * lu, lu);
        t0 = t1;
      }
    }});
  }

  const bool by_expert = n_pairs > 0 && n_pairs <= kDownByExpertPairs;  // (no pairs: zero rows)
  const int64_t rows_gu = block_rows(n_active * I, pool.size(), J.cfg.gate_up_tasks, I);
  const int64_t rows_dn = block_rows((by_expert ? n_active : 1) * H, pool.size(), J.cfg.down_tasks,
                                    by_expert ? J.cfg.down_expert_rows : 256);
  const int blocks_gu = ceil_div(I, rows_gu), blocks_dn = ceil_div(H, rows_dn);
  const int n_gu = n_active * blocks_gu, n_dn = by_expert ? n_active * blocks_dn : blocks_dn;
  if (by_expert) J.y_buf.alloc(static_cast<size_t>(n_pairs) * H * sizeof(float));
  // Byte sizes once here: type_row_bytes is an out-of-line switch, too slow for the per-task (and, in the
  // prefetch loop, per-cache-line) arithmetic below.
  const size_t g_rb = G.row_bytes(), g_eb = G.expert_bytes(), u_rb = U.row_bytes(), u_eb = U.expert_bytes();
  const size_t d_rb = D.row_bytes(), d_eb = D.expert_bytes();
  // ready[a]: gate/up blocks of expert a done; ready[n_active + b]: experts done with down row block b (by_expert)
  const int n_ready = n_active + (by_expert ? blocks_dn : 0);
  J.ready.reset(new std::atomic<int>[static_cast<size_t>(std::max(n_ready, 1)) * kReadyStride]);
  for (int a = 0; a < n_ready; ++a) J.ready[a * kReadyStride].store(0, std::memory_order_relaxed);

  // One phase, no barrier: tasks [0, n_gu) are gate/up blocks (expert-major), the rest are down blocks. Tasks are
  // taken in order, so by the time a thread takes a down task every gate/up task has been taken by a running
  // thread; a down task waits for its experts' h only where it is not ready yet.
  auto gate_up = [=, &K](int task, int thread) {
    const int a = task / blocks_gu;
    const int64_t r0 = static_cast<int64_t>(task % blocks_gu) * rows_gu;
    const int m = static_cast<int>(std::min<int64_t>(rows_gu, I - r0));
    const int e = jp->experts[a], p0 = jp->offsets[a], n = jp->offsets[a + 1] - p0;
    float* hbase = reinterpret_cast<float*>(jp->h_buf.get());
    // Counted even when a kernel throws, so the down tasks never wait forever (the job then fails anyway).
    struct Mark {
      MoEJob* jp;
      int a, p0, n;
      int blocks;
      ActFormat fd;
      int64_t I, ldh;
      size_t ld;
      float* hbase;
      ~Mark() {
        std::atomic<int>& r = jp->ready[a * kReadyStride];
        if (r.fetch_add(1, std::memory_order_acq_rel) + 1 == blocks) {
          if (fd != ACT_F32) quantize_act(fd, hbase + p0 * ldh, ldh, n, I, jp->hq_buf.get() + p0 * ld, ld);
          r.fetch_add(1, std::memory_order_release);
        }
      }
    } mark{jp, a, p0, n, blocks_gu, fd, I, ldh, ld, hbase};
    float* g = static_cast<float*>(pl->scratch(thread, 2 * sizeof(float) * n * m));
    float* u = g + n * m;
    K.gemm(jp->cfg, G.type, G.data + e * g_eb + r0 * g_rb, g_rb, m, &jp->xg[p0], n, H, g, m);
    K.gemm(jp->cfg, U.type, U.data + e * u_eb + r0 * u_rb, u_rb, m, &jp->xu[p0], n, H, u, m);
    for (int i = 0; i < n; ++i) silu_mul(g + i * m, u + i * m, hbase + (p0 + i) * ldh + r0, m);
  };

  // Until expert a's h is ready (false: the job failed, stop).
  auto wait_h = [=](int a) {
    const std::atomic<int>& r = jp->ready[a * kReadyStride];
    spin_until([&] { return r.load(std::memory_order_acquire) > blocks_gu || jp->failed(); });
    return !jp->failed();
  };

  // Down, two ways. Few (token, expert) pairs (a decode step): a task is one expert's block of rows, one contiguous
  // stream, writing y for that expert's pairs into the job's buffer; whoever finishes a row block's last expert
  // sums the block's outputs over the pairs in expert order. Many pairs (a prefill): a task is a block of output
  // rows across all experts in order, accumulated in the thread's scratch (the y buffer would take
  // pairs x hidden floats). Both sum in the same order, so the result does not depend on which way ran.
  auto down_rows = [=, &K](int task, int thread) {
    const int64_t c0 = static_cast<int64_t>(task) * rows_dn;
    const int m = static_cast<int>(std::min<int64_t>(rows_dn, H - c0));
    for (int64_t t = 0; t < T; ++t) std::memset(out + t * ldo + c0, 0, m * sizeof(float));
    float* y = static_cast<float*>(pl->scratch(thread, sizeof(float) * std::max(jp->max_group, 1) * m));
    auto chunk = [&](int a) { return D.data + jp->experts[a] * d_eb + c0 * d_rb; };
    const int chunk_bytes = static_cast<int>(std::min<size_t>(jp->cfg.prefetch_bytes, m * d_rb));
    for (int a = 0; a < n_active; ++a) {
      const int p0 = jp->offsets[a], n = jp->offsets[a + 1] - p0;
      // The kernels prefetch ahead within a chunk; start the next expert's chunk now so it is not cold.
      if (a + 1 < n_active) {
        const uint8_t* next = chunk(a + 1);
        for (int off = 0; off < chunk_bytes; off += 64) __builtin_prefetch(next + off);
      }
      if (!wait_h(a)) return;
      K.gemm(jp->cfg, D.type, chunk(a), d_rb, m, &jp->hin[p0], n, I, y, m);
      for (int i = 0; i < n; ++i) {
        float* o = out + jp->pair_tok[p0 + i] * ldo + c0;
        const float w = jp->pair_w[p0 + i];
        for (int r = 0; r < m; ++r) o[r] += w * y[i * m + r];
      }
    }
  };
  auto down_experts = [=, &K](int task, int) {
    const int a = task / blocks_dn, blk = task % blocks_dn;
    const int64_t c0 = static_cast<int64_t>(blk) * rows_dn;
    const int m = static_cast<int>(std::min<int64_t>(rows_dn, H - c0));
    const int p0 = jp->offsets[a], n = jp->offsets[a + 1] - p0;
    if (!wait_h(a)) return;
    float* yb = reinterpret_cast<float*>(jp->y_buf.get());
    K.gemm(jp->cfg, D.type, D.data + jp->experts[a] * d_eb + c0 * d_rb, d_rb, m, &jp->hin[p0], n, I,
           yb + p0 * H + c0, H);
    if (jp->ready[(n_active + blk) * kReadyStride].fetch_add(1, std::memory_order_acq_rel) + 1 < n_active) return;
    for (int64_t t = 0; t < T; ++t) std::memset(out + t * ldo + c0, 0, m * sizeof(float));
    for (int p = 0; p < jp->offsets[n_active]; ++p) {
      float* o = out + jp->pair_tok[p] * ldo + c0;
      const float* y = yb + p * H + c0;
      const float w = jp->pair_w[p];
      for (int r = 0; r < m; ++r) o[r] += w * y[r];
    }
  };

  job->phases.push_back({n_gu + n_dn, [=](int task, int thread) {
    if (task < n_gu) gate_up(task, thread);
    else if (by_expert) down_experts(task - n_gu, thread);
    else down_rows(task - n_gu, thread);
  }});
  return pool.submit(std::move(job));
}

Linear::Linear(int64_t n_out, int64_t n_in, const uint8_t* w, int type, const Kernels& kernels,
               const MoEConfig& config)
    : n_out_(n_out), n_in_(n_in), w_(w), type_(type), kernels_(kernels), config_(config) {
  if (n_out < 1 || n_in < 1) throw std::invalid_argument("Linear: n_out and n_in must be positive");
  check_matrix("linear weight", ExpertMatrix{w, type, n_out, n_in}, n_out, n_in, kernels_);
}

uint64_t Linear::submit(ThreadPool& pool, const float* x, int64_t T, int64_t ldx, float* y, int64_t ldy) const {
  auto job = std::make_shared<LinearJob>();
  LinearJob* jp = job.get();
  jp->cfg = config_.get();
  const Kernels& K = kernels_;
  const ActFormat f = K.act_format(type_);
  const size_t l = act_row_bytes(f, n_in_);
  const int64_t k = n_in_, N = n_out_;
  if (f != ACT_F32) jp->xq_buf.alloc(T * l);
  jp->xrows.resize(T);
  for (int64_t t = 0; t < T; ++t)
    jp->xrows[t] = f == ACT_F32 ? reinterpret_cast<const uint8_t*>(x + t * ldx) : jp->xq_buf.get() + t * l;
  if (f != ACT_F32) {
    job->phases.push_back({ceil_div(T, kRowsPerQuant), [=](int task, int) {
      const int t0 = task * kRowsPerQuant;
      const int n = static_cast<int>(std::min<int64_t>(kRowsPerQuant, T - t0));
      quantize_act(f, x + t0 * ldx, ldx, n, k, jp->xq_buf.get() + t0 * l, l);
    }});
  }
  // Blocks of 16-64 rows, at least ~4 per thread when there are enough rows; for 16+ activation rows (a prefill)
  // up to 256, at least ~2 per thread, so the Q4_K/Q5_K tiles can take them on AMX (which wants 128+ rows).
  const int64_t cap = T >= 16 ? 256 : 64, per = T >= 16 ? 2 : 4;
  const int64_t rows = std::max<int64_t>(16, std::min<int64_t>(cap, (N / (per * pool.size())) & ~int64_t(15)));
  const size_t rb = type_row_bytes(type_, k);
  const uint8_t* w = w_;
  const int type = type_;
  job->phases.push_back({ceil_div(N, rows), [=, &K](int task, int) {
    const int64_t r0 = task * rows;
    const int m = static_cast<int>(std::min<int64_t>(rows, N - r0));
    if (T > 0) K.gemm(jp->cfg, type, w + r0 * rb, rb, m, jp->xrows.data(), static_cast<int>(T), k, y + r0, ldy);
  }});
  return pool.submit(std::move(job));
}

double stream_bandwidth(ThreadPool& pool, const Kernels& kernels, const uint8_t* base, size_t bytes, int reps) {
  if (bytes < 256) throw std::invalid_argument("read bandwidth: the buffer needs at least 256 bytes");
  const int n_tasks = static_cast<int>(std::min<size_t>(pool.size() * 16, bytes / 256));
  const size_t chunk = (bytes / n_tasks) & ~size_t(255);
  std::vector<std::vector<Range>> tasks(n_tasks);
  for (int t = 0; t < n_tasks; ++t) tasks[t] = {Range(base + t * chunk, chunk)};
  double best = 0.0;
  for (int r = 0; r < std::max(reps, 1); ++r)
    best = std::max(best, static_cast<double>(chunk) * n_tasks / read_tasks(pool, kernels, tasks) / 1e9);
  return best;
}

void repack_x16(ThreadPool& pool, int type, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t k) {
  if (x16_type(type) < 0)
    throw std::invalid_argument("repack_x16: only Q4_K and Q5_K have a 16-row layout, got " + std::string(type_name(type)));
  if (rows % kX16Rows || k % QK_K)
    throw std::invalid_argument("repack_x16: needs a multiple of 16 rows of a multiple of 256 values, got [" +
                                std::to_string(rows) + ", " + std::to_string(k) + "]");
  const size_t rb = type_row_bytes(type, k);
  if (src < dst + rows * rb && dst < src + rows * rb) throw std::invalid_argument("repack_x16: src and dst overlap");
  const int64_t groups = rows / kX16Rows, per = 64;  // 64 groups (~4.7 MB at k = 2048) per task
  auto job = std::make_shared<Job>();
  job->phases.push_back({static_cast<int>((groups + per - 1) / per), [=](int t, int) {
    repack_x16(type, src, dst, k, t * per, std::min(groups, (t + 1) * per));
  }});
  pool.wait(pool.submit(job));
}

double read_tasks(ThreadPool& pool, const Kernels& kernels, const std::vector<std::vector<Range>>& tasks) {
  if (tasks.empty()) throw std::invalid_argument("read_tasks: no tasks");
  std::vector<uint64_t> sink((pool.size() + 1) * 8, 0);
  uint64_t* sp = sink.data();
  const Kernels* K = &kernels;
  const std::vector<std::vector<Range>>* tp = &tasks;
  auto job = std::make_shared<Job>();
  job->phases.push_back({static_cast<int>(tasks.size()), [=](int t, int thread) {
    for (const Range& r : (*tp)[t]) sp[thread * 8] ^= K->stream_read(r.first, r.second & ~size_t(255));
  }});
  const auto t0 = std::chrono::steady_clock::now();
  pool.wait(pool.submit(job));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double read_bandwidth(ThreadPool& pool, const Kernels& kernels, size_t bytes, int reps) {
  const size_t chunk = (bytes / (pool.size() * 16)) & ~size_t(255);
  Buffer buf;
  buf.alloc(chunk * pool.size() * 16 + 64);
  uint8_t* base = buf.get();
  // First touch from the workers, so pages land near the threads that read them.
  auto fill = std::make_shared<Job>();
  fill->phases.push_back({pool.size() * 16, [=](int t, int) { std::memset(base + t * chunk, t + 1, chunk); }});
  pool.wait(pool.submit(fill));
  return stream_bandwidth(pool, kernels, base, chunk * pool.size() * 16, reps);
}

}  // namespace ktrans
