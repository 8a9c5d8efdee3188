// int8 x int8 -> int32 for the few rows of a decode step, with AVX512-VNNI: every weight row
// streamed once, each 64-byte chunk multiplied into every activation row. oneDNN's int8 GEMM
// (torch._int_mm) read SmolLM2's 120 projections at 17.9 GB/s for one row (12-13 for 2 and
// 4), this at 29.1 (26, 18) on a Zen 4 EPYC (bench/int8_gemv.py): W8A8's decode step went
// from 0.50x float32's to 0.43x.
//
// vpdpbusd multiplies unsigned by signed bytes, so the activations are shifted into
// 0..255 (x + 128) and 128 * sum_k w[n, k] is taken off again, that sum computed by the same
// instruction against a vector of ones: exact integer arithmetic, the result equals
// torch._int_mm's. Built with a target attribute and used only where the CPU reports
// avx512vnni at run time (int8_gemv_supported()); on other architectures not built at all.
//
// int8_gemv(x_q int8 [rows 1..4, in 1..4096] contiguous, weight int8 [out, in] contiguous)
// -> int32 [rows, out] = x_q @ weight^T.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace {

constexpr int64_t kOutGrain = 64;     // output features per parallel task

__attribute__((target("avx512f,avx512bw,avx512vnni"))) void gemv_rows(
    const int8_t* x, int64_t rows, int64_t k, const int8_t* w, int64_t n0, int64_t n1, int32_t* out, int64_t n_total) {
  const __m512i shift = _mm512_set1_epi8(static_cast<char>(0x80));   // x + 128 as unsigned: flip the sign bit
  const __m512i ones = _mm512_set1_epi8(1);
  // sums stay far inside int32: |(x + 128) * w| <= 255 * 128 per product, 4096 products
  const int64_t full = k / 64, tail = k % 64;
  const __mmask64 tail_mask = tail ? (~0ULL >> (64 - tail)) : 0;
  __m512i xs[kInt8GemvMaxRows][kInt8GemvMaxIn / 64];   // the shifted rows, 64 bytes a vector
  const int64_t chunks = full + (tail ? 1 : 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < full; ++c)
      xs[r][c] = _mm512_xor_si512(_mm512_loadu_si512(x + r * k + c * 64), shift);
    if (tail)   // lanes past k: x + 128 would be 128 against a zero weight: zero them instead
      xs[r][full] = _mm512_maskz_mov_epi8(tail_mask,
                                          _mm512_xor_si512(_mm512_maskz_loadu_epi8(tail_mask, x + r * k + full * 64), shift));
  }
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * k;
    __m512i acc[kInt8GemvMaxRows];
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_si512();
    __m512i wsum = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i wv = c < full ? _mm512_loadu_si512(wr + c * 64) : _mm512_maskz_loadu_epi8(tail_mask, wr + c * 64);
      wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
      for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], xs[r][c], wv);
    }
    const int32_t correction = 128 * _mm512_reduce_add_epi32(wsum);
    for (int64_t r = 0; r < rows; ++r) out[r * n_total + n] = _mm512_reduce_add_epi32(acc[r]) - correction;
  }
}

}  // namespace

bool int8_gemv_supported() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }
#else
namespace {
void gemv_rows(const int8_t*, int64_t, int64_t, const int8_t*, int64_t, int64_t, int32_t*, int64_t) {}
}  // namespace

bool int8_gemv_supported() { return false; }
#endif

torch::Tensor int8_gemv(torch::Tensor x_q, torch::Tensor weight) {
  TORCH_CHECK(int8_gemv_supported(), "int8_gemv needs a CPU with AVX512-VNNI");
  TORCH_CHECK(x_q.device().is_cpu() && x_q.dim() == 2 && x_q.is_contiguous() && x_q.scalar_type() == torch::kInt8,
              "x_q must be a contiguous CPU int8 matrix [rows, in]");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == torch::kInt8,
              "weight must be a contiguous CPU int8 matrix [out, in]");
  const int64_t rows = x_q.size(0), k = x_q.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "weight has ", weight.size(1), " inputs, x_q ", k);
  TORCH_CHECK(rows >= 1 && rows <= kInt8GemvMaxRows, "int8_gemv takes 1 to ", kInt8GemvMaxRows, " rows, got ", rows);
  TORCH_CHECK(k >= 1 && k <= kInt8GemvMaxIn, "int8_gemv takes 1 to ", kInt8GemvMaxIn, " inputs, got ", k);
  auto out = torch::empty({rows, n}, x_q.options().dtype(torch::kInt32));
  const int8_t* px = x_q.data_ptr<int8_t>();
  const int8_t* pw = weight.data_ptr<int8_t>();
  int32_t* po = out.data_ptr<int32_t>();
  at::parallel_for(0, n, kOutGrain, [&](int64_t n0, int64_t n1) { gemv_rows(px, rows, k, pw, n0, n1, po, n); });
  return out;
}
