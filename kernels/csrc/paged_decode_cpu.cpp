// Paged decode attention on the CPU, straight over the block tables: one query token per
// sequence attends over its cached context, reading each key and value row once from the
// cache (no gathered copy). Contract: kernels/api.py Backend.decode; caller: kernels/cpu.py.
//
//   query  float32 [num_seqs, num_heads, head_dim] (each head's values contiguous), and
//          the softmax scale it is multiplied by first
//   k/v    [num_blocks, block_size, num_kv_heads, head_dim], float32 / bfloat16 / float16, or
//          int8 codes read as their values (a C8 cache: kernels/kv_int8.py)
//   block_tables int32 [num_seqs, max_blocks], seq_lens int32 [num_seqs] (>= 1); every
//   id a sequence's length reaches is checked against num_blocks (RuntimeError, no read)
//   returns float32 [num_seqs, num_heads, head_dim]
//
// Per sequence: score every query head against every context token, softmax in float32
// (max-subtracted), sum the value rows weighted by the probabilities; sequences spread
// over ATen's threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace {

// Scores, softmax and the weighted value sum of query heads [h0, h1) of sequence s. The
// loops walk the context token by token, and a token's row of every kv head is one
// contiguous run in the cache: the hardware prefetcher streams it (a loop per kv head,
// striding over the other heads' rows, ran 3-4x slower).
template <typename scalar_t>
void attend_heads(const float* query, int64_t query_head_stride, float scale, const scalar_t* k_cache,
                  const scalar_t* v_cache, const int32_t* table, int64_t len, int64_t h0, int64_t h1,
                  int64_t group, int64_t head_dim, int64_t block_size, int64_t block_stride,
                  int64_t token_stride, std::vector<float>& scores, std::vector<float>& scaled,
                  float* out) {
  const int64_t heads = h1 - h0;
  scores.resize(heads * len);
  scaled.resize(heads * head_dim);
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t d = 0; d < head_dim; ++d)
      scaled[(h - h0) * head_dim + d] = query[h * query_head_stride + d] * scale;
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* row = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t h = h0; h < h1; ++h) {
      const float* q = scaled.data() + (h - h0) * head_dim;
      const scalar_t* k = row + (h / group) * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * static_cast<float>(k[d]);
      scores[(h - h0) * len + t] = dot;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* p = scores.data() + h * len;
    const float peak = *std::max_element(p, p + len);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      p[t] = std::exp(p[t] - peak);
      total += p[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < len; ++t) p[t] *= inv;
  }
  float* acc = out + h0 * head_dim;
  std::fill(acc, acc + heads * head_dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* row = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t h = h0; h < h1; ++h) {
      const float p = scores[(h - h0) * len + t];
      const scalar_t* v = row + (h / group) * head_dim;
      float* a = acc + (h - h0) * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * static_cast<float>(v[d]);
    }
  }
}

// One task per sequence; with fewer sequences than threads, a sequence's kv heads are
// split over several tasks so that every thread has work.
template <typename scalar_t>
void decode_tasks(const float* query, int64_t query_seq_stride, int64_t query_head_stride, float scale,
                  const scalar_t* k_cache, const scalar_t* v_cache,
                  const int32_t* block_tables, const int32_t* seq_lens, float* out,
                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                  int64_t block_size, int64_t max_blocks, int64_t block_stride,
                  int64_t token_stride) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = num_seqs >= threads ? 1 : std::min(num_kv_heads, (threads + num_seqs - 1) / num_seqs);
  at::parallel_for(0, num_seqs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, scaled;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / parts, part = task % parts;
      const int64_t kv0 = part * num_kv_heads / parts, kv1 = (part + 1) * num_kv_heads / parts;
      attend_heads<scalar_t>(query + s * query_seq_stride, query_head_stride, scale, k_cache, v_cache,
                             block_tables + s * max_blocks, seq_lens[s], kv0 * group, kv1 * group,
                             group, head_dim, block_size, block_stride, token_stride, scores, scaled,
                             out + s * num_heads * head_dim);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "every tensor must be on the CPU");
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat32 && query.stride(2) == 1,
              "query must be float32 [num_seqs, num_heads, head_dim], each head contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] alike");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3) &&
                  v_cache.strides() == k_cache.strides(),
              "each cache block must be contiguous [block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == query.size(0),
              "block_tables must be contiguous int32 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous() &&
                  seq_lens.numel() == query.size(0),
              "seq_lens must be contiguous int32 [num_seqs]");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0,
              "head_dim must match and num_heads must be a multiple of num_kv_heads");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block_size,
                "seq_lens must be in [1, max_blocks * block_size]");
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      const int32_t id = tables[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_tables holds block id ", id,
                  " outside the cache's ", num_blocks, " blocks");
    }
  }
  auto out = torch::empty(query.sizes(), query.options());
  if (num_seqs == 0) return out;
  auto run = [&](auto* k, auto* v) {
    decode_tasks(query.data_ptr<float>(), query.stride(0), query.stride(1), static_cast<float>(scale), k, v,
                 block_tables.data_ptr<int32_t>(), lens, out.data_ptr<float>(), num_seqs, num_heads,
                 num_kv_heads, head_dim, block_size, block_tables.size(1), k_cache.stride(0), k_cache.stride(1));
  };
  if (k_cache.scalar_type() == at::kChar) {
    // C8: the codes themselves (kernels/kv_int8.py folds the scales around this call)
    run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
      run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>());
    });
  }
  return out;
}
