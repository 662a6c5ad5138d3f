// Dense float32 building blocks on OpenBLAS (single-threaded for determinism).
#pragma once

#include <span>
#include <vector>

namespace ecx::engine::ops {

// out[m, n] = a[m, k] x b[k, n] (row-major); out is overwritten.
void matmul(const float* a, const float* b, float* out, int m, int k, int n);
// In place, per row of width n.
void layer_norm(float* x, int rows, int n, const float* gamma, const float* beta);
void gelu(float* x, size_t count);
void add(float* x, const float* y, size_t count);
// Multi-head self-attention on qkv [rows, 3*d]; out [rows, d]. With `causal`, row i
// attends to rows <= i + offset of keys (keys/values may include a cache before qkv).
void attention(const float* q, const float* k, const float* v, float* out, int q_rows, int kv_rows,
               int d, int heads, bool causal, int q_offset);
// Pins BLAS to one thread (call once at start-up).
void use_single_thread();

}  // namespace ecx::engine::ops
