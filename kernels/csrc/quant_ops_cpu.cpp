// The two halves of a W8A8 linear layer around its int8 GEMM (torch._int_mm), each one pass
// over its rows: per-token dynamic (or per-tensor static) quantization of the activations,
// and the int32 accumulator back to floats with the scales and biases. Contracts: kernels/api.py
// (quantize_per_token, int8_scaled_matmul); caller: kernels/cpu.py.
//
// Why: in torch each is 4-8 tiny ATen ops (cast, abs, amax, where, div, round, clamp, to;
// float, mul, mul, add, to) per projection; at a decode batch of one token their dispatch
// cost about as much as the int8 GEMM itself, which left W8A8 no faster than float32.
//
// The arithmetic is the torch reference's, in float32 and in its order: scale = max|x| /
// divisor (1 for an all-zero row), q = clamp(nearbyint(x / scale), -128, 127) (round half to
// even, the default rounding mode); static: q = clamp(nearbyint(x / scale + offset), -128, 127);
// out = ((acc + int_bias) * col_scale * row_scale + bias).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kRowGrain = 16;

template <typename scalar_t>
void quantize_row(const scalar_t* x, int64_t n, float divisor, int8_t* q, float* scale) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float s = amax > 0.f ? amax / divisor : 1.f;
  *scale = s;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(static_cast<float>(x[i]) / s);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
  }
}

template <typename out_t>
void dequant_row(const int32_t* acc, int64_t n, const float* col_scale, float row_scale, const int32_t* int_bias,
                 const float* bias, out_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    float v = static_cast<float>(int_bias != nullptr ? acc[j] + int_bias[j] : acc[j]) * col_scale[j];
    v = v * row_scale;
    if (bias != nullptr) v = v + bias[j];
    out[j] = static_cast<out_t>(v);
  }
}

}  // namespace

std::vector<torch::Tensor> quantize_per_token(torch::Tensor x, double divisor) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU matrix [rows, features] with contiguous rows");
  TORCH_CHECK(divisor > 0, "divisor must be > 0, got ", divisor);
  const int64_t rows = x.size(0), n = x.size(1);
  auto q = torch::empty({rows, n}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({rows, 1}, x.options().dtype(torch::kFloat32));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_per_token", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    int8_t* pq = q.data_ptr<int8_t>();
    float* ps = scale.data_ptr<float>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) quantize_row(px + r * stride, n, static_cast<float>(divisor), pq + r * n, ps + r);
    });
  });
  return {q, scale};
}

torch::Tensor dequant_rows(torch::Tensor acc, torch::Tensor col_scale, c10::optional<torch::Tensor> row_scale,
                           c10::optional<torch::Tensor> int_bias, c10::optional<torch::Tensor> bias,
                           at::ScalarType out_dtype) {
  TORCH_CHECK(acc.device().is_cpu() && acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == torch::kInt32,
              "acc must be a contiguous CPU int32 matrix [rows, out]");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(col_scale.device().is_cpu() && (!row_scale || row_scale->device().is_cpu()) &&
                  (!int_bias || int_bias->device().is_cpu()) && (!bias || bias->device().is_cpu()),
              "col_scale, row_scale, int_bias and bias must be CPU tensors");
  TORCH_CHECK(col_scale.scalar_type() == torch::kFloat32 && col_scale.is_contiguous() && col_scale.numel() == n,
              "col_scale must be contiguous float32 with one value per output (", n, ")");
  if (row_scale)
    TORCH_CHECK(row_scale->scalar_type() == torch::kFloat32 && row_scale->is_contiguous() && row_scale->numel() == rows,
                "row_scale must be contiguous float32 with one value per row (", rows, ")");
  if (int_bias)
    TORCH_CHECK(int_bias->scalar_type() == torch::kInt32 && int_bias->is_contiguous() && int_bias->numel() == n,
                "int_bias must be contiguous int32 with one value per output (", n, ")");
  if (bias)
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                "bias must be contiguous float32 with one value per output (", n, ")");
  auto out = torch::empty({rows, n}, acc.options().dtype(out_dtype));
  const int32_t* pa = acc.data_ptr<int32_t>();
  const float* cs = col_scale.data_ptr<float>();
  const float* rs = row_scale ? row_scale->data_ptr<float>() : nullptr;
  const int32_t* ib = int_bias ? int_bias->data_ptr<int32_t>() : nullptr;
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "dequant_rows", [&] {
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequant_row(pa + r * n, n, cs, rs ? rs[r] : 1.f, ib, b, po + r * n);
    });
  });
  return out;
}

torch::Tensor quantize_per_tensor(torch::Tensor x, double scale, double offset) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be a float32 CPU matrix [rows, features] with contiguous rows");
  TORCH_CHECK(scale > 0, "scale must be > 0, got ", scale);
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto q = torch::empty({rows, n}, x.options().dtype(torch::kInt8));
  const float* px = x.data_ptr<float>();
  int8_t* pq = q.data_ptr<int8_t>();
  const float s = static_cast<float>(scale), off = static_cast<float>(offset);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = px + r * stride;
      int8_t* qr = pq + r * n;
      for (int64_t i = 0; i < n; ++i)
        qr[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, std::nearbyint(xr[i] / s + off))));
    }
  });
  return q;
}
