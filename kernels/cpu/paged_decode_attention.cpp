// Decode attention (one query token per sequence) read straight from the paged KV cache, for the CPU path.
// Each sequence's K and V rows are read exactly once for all query heads (GQA included), so a step moves the
// cache once instead of gathering a padded copy and reading it again.
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

  // One task per sequence: every token's K (then V) row of all kv heads is one contiguous read, used by every
  // query head, so each cached byte is fetched from memory once.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(num_heads * head_dim);
    std::vector<float> denom(num_heads);
    const int64_t row = num_kv_heads * head_dim;  // floats per token in one block
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t length = len[seq];
      TORCH_CHECK(length >= 1 && length <= max_blocks * block_size, "seq_len outside its block table");
      scores.resize(num_heads * length);
      const float* q_seq = q + seq * num_heads * head_dim;
      const int64_t* seq_table = table + seq * max_blocks;
      for (int64_t t = 0; t < length; ++t) {
        const float* key = k + (seq_table[t / block_size] * block_size + t % block_size) * row;
        for (int64_t kv = 0; kv < num_kv_heads; ++kv) {  // one K head row serves its `group` query heads
          const float* kh = key + kv * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const float* qh = q_seq + h * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
            scores[h * length + t] = dot * fscale;
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * length;
        const float peak = *std::max_element(s, s + length);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < length; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        denom[h] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const float* value = v + (seq_table[t / block_size] * block_size + t % block_size) * row;
        for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
          const float* vh = value + kv * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const float p = scores[h * length + t];
            float* a = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
          }
        }
      }
      float* dst = o + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.f / denom[h];
        for (int64_t d = 0; d < head_dim; ++d) dst[h * head_dim + d] = acc[h * head_dim + d] * inv;
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
