// Decode attention (one query token per sequence) read straight from the paged KV cache, for the CPU path.
// Each (sequence, kv head) task reads its K and V blocks exactly once for all the query heads that share them
// (GQA), so a step moves the cache once instead of gathering a padded copy and reading it again.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "query [B,H,D], caches [blocks,block_size,kv_heads,D]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
                  value_cache.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const auto q_all = query.contiguous();
  const auto tables = block_tables.to(torch::kInt64).contiguous();
  const auto lens = seq_lens.to(torch::kInt64).contiguous();
  const int64_t num_seqs = q_all.size(0), num_heads = q_all.size(1), head_dim = q_all.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  const int64_t group = num_heads / num_kv_heads, max_blocks = tables.size(1);
  auto out = torch::empty_like(q_all);
  const float* q = q_all.data_ptr<float>();
  const float* k = key_cache.data_ptr<float>();
  const float* v = value_cache.data_ptr<float>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t length = len[seq];
      TORCH_CHECK(length >= 1 && length <= max_blocks * block_size, "seq_len outside its block table");
      scores.assign(group * length, 0.f);
      const float* q_seq = q + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t t = 0; t < length; ++t) {
        const int64_t block = table[seq * max_blocks + t / block_size];
        const float* key = k + ((block * block_size + t % block_size) * num_kv_heads + kv_head) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q_seq + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * key[d];
          scores[g * length + t] = dot * fscale;
        }
      }
      std::vector<float> denom(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * length;
        const float peak = *std::max_element(s, s + length);
        float total = 0.f;
        for (int64_t t = 0; t < length; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        denom[g] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const int64_t block = table[seq * max_blocks + t / block_size];
        const float* value = v + ((block * block_size + t % block_size) * num_kv_heads + kv_head) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * length + t];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * value[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* dst = o + (seq * num_heads + kv_head * group + g) * head_dim;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[g * head_dim + d] * inv;
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged fp32 KV cache (query [B,H,D] -> [B,H,D])");
}
