// A Mixture-of-Experts layer's experts for the few rows a decode step gives each of them, in
// two passes of one parallel region each (contract: kernels/cpu.py CpuBackend.routed_experts):
//
//   rows   [P, H]        the (token, choice) rows, sorted by expert: counts[e] rows for local
//                        expert e, in order
//   pass 1 gate_up[p] = rows[p] @ w13[e]^T            [P, 2I]   work: (expert, 64 weight rows)
//          h[p]       = silu(gate_up[p, :I]) * gate_up[p, I:]
//   pass 2 out[p]     = h[p] @ w2[e]^T                [P, H]    work: (expert, 64 weight rows)
//
// Why: with 1-4 rows an expert each matmul is a GEMV, bound by reading the expert's weights;
// a library GEMM per expert (two per expert, 60 a layer) pays its threading and setup per
// call, ~a third of the step on 2 cores. Here every weight row is read once from memory and
// dotted with the expert's rows while it sits in L1, and the threads split the weight rows
// of all active experts at once. More rows an expert (a prefill) are compute-bound: the caller
// runs those through a GEMM instead.
//
// Weights in the model's dtype (float32, bfloat16, float16), accumulated in float32, h and
// out stored in the rows' dtype, as the torch path rounds them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kWeightRowsPerTask = 64;

template <typename scalar_t>
float dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return total;
}

struct Task {
  int64_t expert, first_row, num_rows, weight_row;
};

// one task per (active expert, block of its weight rows)
std::vector<Task> tasks_for(const std::vector<int64_t>& counts, int64_t weight_rows) {
  std::vector<Task> tasks;
  int64_t first = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] > 0)
      for (int64_t j = 0; j < weight_rows; j += kWeightRowsPerTask) tasks.push_back({e, first, counts[e], j});
    first += counts[e];
  }
  return tasks;
}

// out[p, j] = a[p] . w[e, j] for the task's rows p and weight rows j; a [P, k], w [E, n, k]
template <typename scalar_t>
void rows_times_weights(const std::vector<Task>& tasks, const scalar_t* a, const scalar_t* w, int64_t k, int64_t n,
                        float* out) {
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      const int64_t end = std::min(task.weight_row + kWeightRowsPerTask, n);
      for (int64_t j = task.weight_row; j < end; ++j) {
        const scalar_t* wj = w + (task.expert * n + j) * k;
        for (int64_t p = task.first_row; p < task.first_row + task.num_rows; ++p) out[p * n + j] = dot(a + p * k, wj, k);
      }
    }
  });
}

}  // namespace

torch::Tensor moe_experts_few_rows(torch::Tensor rows, torch::Tensor w13, torch::Tensor w2,
                                   std::vector<int64_t> counts) {
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 2 && rows.is_contiguous(), "rows must be contiguous [P, H] on the CPU");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous(),
              "w13 [E, 2I, H] and w2 [E, H, I] must be contiguous");
  const int64_t experts = w13.size(0), two_i = w13.size(1), hidden = w13.size(2), inter = two_i / 2;
  TORCH_CHECK(w2.size(0) == experts && w2.size(1) == hidden && w2.size(2) == inter && rows.size(1) == hidden,
              "shapes: rows [P, H], w13 [E, 2I, H], w2 [E, H, I]");
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == experts, "counts must have one entry per expert");
  TORCH_CHECK(rows.scalar_type() == w13.scalar_type() && w2.scalar_type() == w13.scalar_type(),
              "rows, w13 and w2 must share a dtype");
  int64_t total = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "counts must be >= 0");
    total += c;
  }
  TORCH_CHECK(total == rows.size(0), "counts must sum to the rows");
  auto gate_up = torch::empty({total, two_i}, rows.options().dtype(at::kFloat));
  auto h = torch::empty({total, inter}, rows.options());
  auto out32 = torch::empty({total, hidden}, rows.options().dtype(at::kFloat));
  const auto first_tasks = tasks_for(counts, two_i), second_tasks = tasks_for(counts, hidden);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows.scalar_type(), "moe_experts_few_rows", [&] {
    rows_times_weights(first_tasks, rows.data_ptr<scalar_t>(), w13.data_ptr<scalar_t>(), hidden, two_i,
                       gate_up.data_ptr<float>());
    const float* g = gate_up.data_ptr<float>();
    scalar_t* hp = h.data_ptr<scalar_t>();
    for (int64_t p = 0; p < total; ++p) {
      for (int64_t j = 0; j < inter; ++j) {
        // the gate and up products rounded to the dtype first, as the torch path's linear returns them
        const float gate = static_cast<float>(static_cast<scalar_t>(g[p * two_i + j]));
        const float up = static_cast<float>(static_cast<scalar_t>(g[p * two_i + inter + j]));
        hp[p * inter + j] = static_cast<scalar_t>(gate / (1.f + std::exp(-gate)) * up);
      }
    }
    rows_times_weights(second_tasks, static_cast<const scalar_t*>(hp), w2.data_ptr<scalar_t>(), inter, hidden,
                       out32.data_ptr<float>());
  });
  return out32.to(rows.scalar_type());
}
