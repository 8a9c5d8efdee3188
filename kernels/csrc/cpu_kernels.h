// The cpu backend's C++ kernels, one library (kernels/cpu_extension.py builds it; bindings.cpp
// names them for Python). Contracts: the comments at each definition and kernels/api.py.
#pragma once

#include <torch/extension.h>

// paged_decode_cpu.cpp
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale);

// layer_ops_cpu.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary(torch::Tensor positions, torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin);
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);

// quant_ops_cpu.cpp
std::vector<torch::Tensor> quantize_per_token(torch::Tensor x, double divisor);
torch::Tensor dequant_rows(torch::Tensor acc, torch::Tensor col_scale, c10::optional<torch::Tensor> row_scale,
                           c10::optional<torch::Tensor> int_bias, c10::optional<torch::Tensor> bias,
                           at::ScalarType out_dtype);
// float32 x [rows, features] (contiguous rows) -> int8 clamp(nearbyint(x / scale + offset))
torch::Tensor quantize_per_tensor(torch::Tensor x, double scale, double offset);

// int8_gemv_cpu.cpp: whether this CPU runs int8_gemv (x86 with AVX512-VNNI), and
// x_q int8 [1..4, in <= 4096] @ weight int8 [out, in]^T (both contiguous) -> int32, exact
constexpr int64_t kInt8GemvMaxRows = 4;      // a decode step's few rows; more go to oneDNN
constexpr int64_t kInt8GemvMaxIn = 64 * 64;  // inputs held as 64 vectors of 64 bytes per row
bool int8_gemv_supported();
torch::Tensor int8_gemv(torch::Tensor x_q, torch::Tensor weight);

// moe_cpu.cpp
torch::Tensor moe_experts_few_rows(torch::Tensor rows, torch::Tensor w13, torch::Tensor w2, std::vector<int64_t> counts);
