// Per-row ops of row_ops.h. Plain loops the compiler vectorizes; at one token they take a microsecond or two.
#include "row_ops.h"

#include <cmath>
#include <stdexcept>
#include <vector>

namespace ktrans {

void rms_norm_rows(int64_t T, int64_t n, const float* x, int64_t ldx, const float* residual, int64_t ldr,
                   float* sum_out, int64_t lds, const float* w, float w_offset, float eps, float* out, int64_t ldo) {
  if (T < 0 || n < 1) throw std::invalid_argument("rms_norm_rows: need T >= 0 rows of n >= 1 values");
  if (residual != nullptr && sum_out == nullptr)
    throw std::invalid_argument("rms_norm_rows: a residual needs sum_out for the sum");
  std::vector<float> scale(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) scale[i] = w[i] + w_offset;  // as torch's (1.0 + weight) in float
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * ldx;
    const float* s = xr;
    if (residual != nullptr) {
      const float* rr = residual + t * ldr;
      float* so = sum_out + t * lds;
      for (int64_t i = 0; i < n; ++i) so[i] = rr[i] + xr[i];
      s = so;
    }
    // 16 partial sums: a fixed order the compiler keeps vectorized (a float reduction is not reassociated).
    float acc[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int j = 0; j < 16; ++j) acc[j] += s[i + j] * s[i + j];
    float ss = 0.f;
    for (int j = 0; j < 16; ++j) ss += acc[j];
    for (; i < n; ++i) ss += s[i] * s[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    float* o = out + t * ldo;
    for (int64_t j = 0; j < n; ++j) o[j] = (s[j] * r) * scale[j];
  }
}

void moe_route(int64_t T, int64_t E, const float* logits, int64_t ld, int k, bool renorm, int64_t* ids,
               float* weights) {
  if (T < 0 || E < 1 || k < 1 || k > E) throw std::invalid_argument("moe_route: need T >= 0, E >= 1, 1 <= k <= E");
  std::vector<float> p(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * ld;
    float m = l[0];
    for (int64_t e = 1; e < E; ++e) m = l[e] > m ? l[e] : m;
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(l[e] - m);
      sum += p[e];
    }
    int64_t* id = ids + t * k;
    float* wt = weights + t * k;
    int n = 0;  // the best n so far, in descending order (insertion: k is ~10 of E ~512)
    for (int64_t e = 0; e < E; ++e) {
      const float v = p[e] / sum;
      if (n == k && !(v > wt[k - 1])) continue;  // a tie with the k-th keeps the lower id already there
      int j = n < k ? n++ : k - 1;
      while (j > 0 && v > wt[j - 1]) {
        wt[j] = wt[j - 1];
        id[j] = id[j - 1];
        --j;
      }
      wt[j] = v;
      id[j] = e;
    }
    if (renorm) {
      float s = 0.f;
      for (int j = 0; j < k; ++j) s += wt[j];
      for (int j = 0; j < k; ++j) wt[j] /= s;
    }
  }
}

void moe_gated_sum(int64_t T, int64_t n, const float* routed, const float* shared, const float* gate, float* out) {
  if (T < 0 || n < 1) throw std::invalid_argument("moe_gated_sum: need T >= 0 rows of n >= 1 values");
  for (int64_t t = 0; t < T; ++t) {
    const float g = 1.f / (1.f + std::exp(-gate[t]));
    const float* r = routed + t * n;
    const float* s = shared + t * n;
    float* o = out + t * n;
    for (int64_t i = 0; i < n; ++i) o[i] = r[i] + g * s[i];
  }
}

}  // namespace ktrans
