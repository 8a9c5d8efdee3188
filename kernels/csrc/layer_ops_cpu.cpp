// The small ops around a decoder layer's matmuls, each one pass over its rows on the CPU:
// RMSNorm (with the residual add folded in), SiLU-and-multiply, rotary embedding in place,
// and the KV-cache write. Contracts: kernels/api.py (rms_norm, add_rms_norm, silu_and_mul,
// rotary, write_kv); caller: kernels/cpu.py.
//
// Why: at a decode batch of a few tokens each of these is 5-10 tiny ATen ops in torch
// (cast, pow, mean, rsqrt, mul, chunk, cat, index_select, index_copy_, ...), and their
// dispatch cost, not their arithmetic, was a third of SmolLM2's decode step on 2 cores.
//
// Every op computes in float32 and stores in the tensor's dtype (float32, bfloat16,
// float16), as the torch reference does; rows spread over ATen's threads only when there
// are enough of them to pay for it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kRowGrain = 16;   // rows per task: a decode batch stays on one thread

template <typename scalar_t>
float sum_squares(const scalar_t* x, int64_t n) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    total += v * v;
  }
  return total;
}

template <typename scalar_t>
void normalize_row(const scalar_t* x, const scalar_t* weight, int64_t n, float eps, scalar_t* out) {
  const float r = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<scalar_t>(static_cast<float>(x[i]) * r * static_cast<float>(weight[i]));
}

// h += a (rounded to the dtype), then the normed h into out
template <typename scalar_t>
void add_normalize_row(scalar_t* h, const scalar_t* a, const scalar_t* weight, int64_t n, float eps, scalar_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<scalar_t>(static_cast<float>(h[i]) + static_cast<float>(a[i]));
  normalize_row(h, weight, n, eps, out);
}

template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, int64_t width, scalar_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<scalar_t>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
  }
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              name, " must be a CPU tensor [rows, features] with contiguous rows");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [features] in x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) normalize_row(src + r * stride, w, n, static_cast<float>(eps), dst + r * n);
    });
  });
  return out;
}

// residual += x (rounded to the dtype, as `residual + x` in torch), then the RMSNorm of the
// sum. residual is updated in place; returns the normed rows.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous and shaped like x, in x's dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [features] in x's dtype");
  auto out = torch::empty_like(residual);
  const int64_t n = x.size(1), stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        add_normalize_row(res + r * n, src + r * stride, w, n, static_cast<float>(eps), dst + r * n);
    });
  });
  return out;
}

// x [rows, 2 * width] = [gate | up] -> silu(gate) * up [rows, width]
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold [gate | up]: an even number of features");
  const int64_t width = x.size(1) / 2, stride = x.stride(0);
  auto out = torch::empty({x.size(0), width}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) silu_mul_row(src + r * stride, src + r * stride + width, width, dst + r * width);
    });
  });
  return out;
}

namespace {

template <typename scalar_t>
void rotate_heads(scalar_t* x, int64_t heads, int64_t head_stride, int64_t half, const float* c, const float* s) {
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* x1 = x + h * head_stride;
    scalar_t* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
      x1[i] = static_cast<scalar_t>(a * c[i] - b * s[i]);
      x2[i] = static_cast<scalar_t>(b * c[i] + a * s[i]);
    }
  }
}

void check_heads(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              name, " must be a CPU tensor [tokens, heads, head_dim] with contiguous heads");
}

}  // namespace

// Rotate-half rotary embedding of query and key in place; cos/sin float32 [max_positions,
// head_dim / 2]; a position outside the tables is an error (nothing is written).
void rotary(torch::Tensor positions, torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin) {
  check_heads(query, "query");
  check_heads(key, "key");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && query.size(0) == key.size(0) &&
                  query.size(2) == key.size(2) && query.size(2) % 2 == 0,
              "query and key must share dtype, tokens and an even head_dim");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
                  cos.size(1) * 2 == query.size(2),
              "cos and sin must be contiguous float32 [max_positions, head_dim / 2]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == query.size(0),
              "positions must be contiguous int64 [tokens]");
  const int64_t tokens = query.size(0), half = cos.size(1), max_positions = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "position ", pos[t], " is outside the rotary tables' ",
                max_positions, " positions");
  const float* cos_table = cos.data_ptr<float>();
  const float* sin_table = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary", [&] {
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = cos_table + pos[t] * half;
        const float* s = sin_table + pos[t] * half;
        rotate_heads(q + t * query.stride(0), query.size(1), query.stride(1), half, c, s);
        rotate_heads(k + t * key.stride(0), key.size(1), key.stride(1), half, c, s);
      }
    });
  });
}

// key/value [tokens, kv_heads, head_dim] into the caches [num_blocks, block_size, kv_heads,
// head_dim] at slot_mapping (int64 [tokens]; -1 skips the token). A slot outside the cache
// is an error and nothing is written.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  check_heads(key, "key");
  check_heads(value, "value");
  TORCH_CHECK(key.sizes() == value.sizes() && key.stride(1) == key.size(2) && value.stride(1) == value.size(2),
              "key and value must be alike, each token's heads one contiguous run");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] alike, "
              "each block contiguous");
  TORCH_CHECK(k_cache.scalar_type() == key.scalar_type() && v_cache.scalar_type() == key.scalar_type() &&
                  value.scalar_type() == key.scalar_type(),
              "key, value and the caches must share one dtype");
  TORCH_CHECK(k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "key's heads and head_dim must match the cache's");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be contiguous int64 [tokens]");
  const int64_t tokens = key.size(0), block_size = k_cache.size(1);
  const int64_t slots = k_cache.size(0) * block_size, row = key.size(1) * key.size(2);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < slots, "slot_mapping holds slot ", slot[t], " outside the cache's ",
                slots, " slots");
  const int64_t elem = key.element_size();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, tokens, kRowGrain * 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slot[t] < 0) continue;
      const int64_t at = (slot[t] / block_size) * k_cache.stride(0) + (slot[t] % block_size) * k_cache.stride(1);
      std::memcpy(kc + at * elem, k + t * key.stride(0) * elem, row * elem);
      std::memcpy(vc + at * elem, v + t * value.stride(0) * elem, row * elem);
    }
  });
}
