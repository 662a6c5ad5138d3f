#include "engine/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <mutex>

extern "C" void openblas_set_num_threads(int);

namespace ecx::engine::ops {

void use_single_thread() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

void matmul(const float* a, const float* b, float* out, int m, int k, int n) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, a, k, b, n, 0.0f, out, n);
}

void layer_norm(float* x, int rows, int n, const float* gamma, const float* beta) {
  for (int r = 0; r < rows; ++r) {
    float* row = x + static_cast<size_t>(r) * n;
    double mean = 0, var = 0;
    for (int i = 0; i < n; ++i) mean += row[i];
    mean /= n;
    for (int i = 0; i < n; ++i) var += (row[i] - mean) * (row[i] - mean);
    var /= n;
    float inv = static_cast<float>(1.0 / std::sqrt(var + 1e-5));
    for (int i = 0; i < n; ++i)
      row[i] = (row[i] - static_cast<float>(mean)) * inv * gamma[i] + beta[i];
  }
}

void gelu(float* x, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    float v = x[i];
    x[i] = 0.5f * v * (1.0f + std::tanh(0.7978845608f * (v + 0.044715f * v * v * v)));
  }
}

void add(float* x, const float* y, size_t count) {
  for (size_t i = 0; i < count; ++i) x[i] += y[i];
}

void attention(const float* q, const float* k, const float* v, float* out, int q_rows, int kv_rows,
               int d, int heads, bool causal, int q_offset) {
  // q rows have stride 3d when they come straight from a qkv projection; callers pass
  // separate contiguous [rows, d] buffers instead, so strides are d here.
  int hd = d / heads;
  float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> scores(kv_rows);
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < q_rows; ++i) {
      const float* qi = q + static_cast<size_t>(i) * d + h * hd;
      int limit = causal ? std::min(kv_rows, q_offset + i + 1) : kv_rows;
      float mx = -INFINITY;
      for (int j = 0; j < limit; ++j) {
        const float* kj = k + static_cast<size_t>(j) * d + h * hd;
        float s = 0;
        for (int t = 0; t < hd; ++t) s += qi[t] * kj[t];
        scores[j] = s * scale;
        mx = std::max(mx, scores[j]);
      }
      float sum = 0;
      for (int j = 0; j < limit; ++j) {
        scores[j] = std::exp(scores[j] - mx);
        sum += scores[j];
      }
      float* oi = out + static_cast<size_t>(i) * d + h * hd;
      std::fill(oi, oi + hd, 0.0f);
      for (int j = 0; j < limit; ++j) {
        const float* vj = v + static_cast<size_t>(j) * d + h * hd;
        float w = scores[j] / sum;
        for (int t = 0; t < hd; ++t) oi[t] += w * vj[t];
      }
    }
  }
}

}  // namespace ecx::engine::ops
