// Fused MoE experts and a dense linear on raw ggml blocks, as jobs for the thread pool.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "pool.h"
#include "quant.h"

namespace ktrans {

// One stacked weight matrix of every expert, like GGUF's ffn_{gate,up,down}_exps: expert e's [rows, cols]
// matrix starts at data + e * rows * row_bytes. The kernels read these bytes as they are given: ggml blocks, or Q4_K
// and Q5_K repacked 16 rows at a time (KT_Q4_K_X16, KT_Q5_K_X16, quant.h), which CPUMoE makes at load in place of its huge-page copy (with
// huge pages off it is a copy of its own; CPUMoE(repack=False, hugepages=False) reads a GGUF map in place).
struct ExpertMatrix {
  const uint8_t* data = nullptr;
  int type = GGML_F32;
  int64_t rows = 0, cols = 0;
  size_t row_bytes() const { return type_row_bytes(type, cols); }
  size_t expert_bytes() const { return static_cast<size_t>(rows) * row_bytes(); }
};

// out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t, k]; negative ids are skipped.
// Work is split by output rows: gate/up tasks are (expert, block of intermediate rows), down tasks are blocks of
// hidden rows that loop over the active experts, so every core streams its own weight rows and no two tasks
// write the same output element. Both run as one pool phase: a down task waits only for the experts whose h
// is not ready yet, in expert order, so the sums do not depend on the thread count.
class MoE {
 public:
  // `config` (checked: std::invalid_argument naming the field) tunes the work split and the kernels of every job.
  MoE(int n_experts, int hidden, int intermediate, ExpertMatrix gate, ExpertMatrix up, ExpertMatrix down,
      const Kernels& kernels, const MoEConfig& config);
  // x [T, hidden] fp32 (row stride ldx), ids [T, k] int64, weights [T, k] fp32, out [T, hidden] fp32 (row stride
  // ldo). The pointers must stay valid until pool.wait(ticket) returns. The job runs with the config of this moment.
  uint64_t submit(ThreadPool& pool, const float* x, int64_t T, int64_t ldx, const int64_t* ids,
                  const float* weights, int k, float* out, int64_t ldo) const;
  const Kernels& kernels() const { return kernels_; }
  MoEConfig config() const { return config_.get(); }
  // Checked; from the next submit on (jobs already submitted keep theirs).
  void set_config(const MoEConfig& c) { config_.set(c); }
  // Weight bytes one call streams for the given routing (each distinct expert once).
  static size_t bytes_per_expert(const ExpertMatrix& g, const ExpertMatrix& u, const ExpertMatrix& d) {
    return g.expert_bytes() + u.expert_bytes() + d.expert_bytes();
  }

 private:
  int n_experts_, hidden_, inter_;
  ExpertMatrix gate_, up_, down_;
  const Kernels& kernels_;
  SharedConfig config_;
};

// y [T, n_out] = x [T, n_in] W^T for W [n_out, n_in] in ggml blocks.
class Linear {
 public:
  // `config`: as MoE's (its work split fields do not apply here).
  Linear(int64_t n_out, int64_t n_in, const uint8_t* w, int type, const Kernels& kernels, const MoEConfig& config);
  uint64_t submit(ThreadPool& pool, const float* x, int64_t T, int64_t ldx, float* y, int64_t ldy) const;
  const Kernels& kernels() const { return kernels_; }
  MoEConfig config() const { return config_.get(); }
  void set_config(const MoEConfig& c) { config_.set(c); }

 private:
  int64_t n_out_, n_in_;
  const uint8_t* w_;
  int type_;
  const Kernels& kernels_;
  SharedConfig config_;
};

// repack_x16 (quant.h) of a whole Q4_K or Q5_K matrix of `rows` (a multiple of 16) rows of k values, split across
// the pool.
void repack_x16(ThreadPool& pool, int type, const uint8_t* src, uint8_t* dst, int64_t rows, int64_t k);

// Best GB/s over `reps` passes of every pool thread streaming its own chunks of [base, base + bytes).
double stream_bandwidth(ThreadPool& pool, const Kernels& kernels, const uint8_t* base, size_t bytes, int reps);

// Diagnostics: seconds from submit to completion of one job whose task i streams the byte ranges tasks[i] (each
// rounded down to 256 bytes) with the widest loads and no arithmetic: a compute step's access pattern alone.
using Range = std::pair<const uint8_t*, size_t>;
double read_tasks(ThreadPool& pool, const Kernels& kernels, const std::vector<std::vector<Range>>& tasks);
// The same over a fresh buffer of `bytes`, first touched by the pool's threads.
double read_bandwidth(ThreadPool& pool, const Kernels& kernels, size_t bytes, int reps);

}  // namespace ktrans
