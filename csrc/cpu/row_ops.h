// Small per-row ops of a CPU decode step, on the calling thread: the residual add with the RMSNorm, the router's
// softmax/top-k, and the MoE block's gated sum. Each replaces a chain of 3-10 torch calls whose dispatch cost, not
// their arithmetic (a few thousand floats at one token), was the time. References: ktrans/operators/norm.py
// rms_norm and ktrans/operators/moe.py route / KRouterTorch.combine.
#pragma once

#include <cstdint>

namespace ktrans {

// out[t] = s / sqrt(mean(s^2) + eps) * (w + w_offset), s = x[t] (+ residual[t] when residual is given; s is then
// also written to sum_out[t]). w_offset is 1 for Qwen3-Next's zero-centred norm. out may alias x; sum_out may alias
// residual. Row strides ldx, ldr, lds, ldo in floats.
void rms_norm_rows(int64_t T, int64_t n, const float* x, int64_t ldx, const float* residual, int64_t ldr,
                   float* sum_out, int64_t lds, const float* w, float w_offset, float eps, float* out, int64_t ldo);

// Per row of logits [T, E] (row stride ld): softmax over the E experts, the k largest probabilities in descending
// order (ties: the lower expert id first) into ids [T, k] and weights [T, k], renormalised to sum 1 when renorm.
void moe_route(int64_t T, int64_t E, const float* logits, int64_t ld, int k, bool renorm, int64_t* ids,
               float* weights);

// out[t] = routed[t] + sigmoid(gate[t]) * shared[t], rows of n contiguous floats; gate [T] (one logit per token).
// out may alias routed.
void moe_gated_sum(int64_t T, int64_t n, const float* routed, const float* shared, const float* gate, float* out);

}  // namespace ktrans
