// Decode attention (one query token per sequence) read straight from the paged KV cache, for the CPU path.
// Each sequence's K and V rows are read exactly once for all query heads (GQA included), so a step moves the
// cache once instead of gathering a padded copy and reading it again. fp32 caches are read in place; fp8 (e4m3)
// caches are widened a token row at a time through a 256-entry table, so they move a quarter of the bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// A token's K or V row (all kv heads) as floats. `slot` is block * block_size + offset.
struct Fp32Rows {
  const float* base;
  int64_t row;
  const float* operator()(int64_t slot, float* /*scratch*/) const { return base + slot * row; }
};

struct Fp8Rows {
  const uint8_t* base;
  int64_t row;
  const float* table;  // e4m3 bits -> value (the cache stores value / scale; the scale is applied outside)
  const float* operator()(int64_t slot, float* scratch) const {
    const uint8_t* src = base + slot * row;
    for (int64_t i = 0; i < row; ++i) scratch[i] = table[src[i]];
    return scratch;
  }
};

struct Shape {
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, max_blocks;
};

// out[seq] = softmax(q . k * score_scale) . v * out_scale, per query head; k/v rows come from `keys`/`values`.
template <typename Rows>
void attend(const Shape& s, const float* q, Rows keys, Rows values, const int64_t* table, const int64_t* len,
            float score_scale, float out_scale, float* o) {
  const int64_t group = s.num_heads / s.num_kv_heads, head_dim = s.head_dim;
  const int64_t row = s.num_kv_heads * head_dim;  // values per token in one block
  // One task per sequence: every token's K (then V) row of all kv heads is one contiguous read, used by every
  // query head, so each cached byte is fetched from memory once.
  at::parallel_for(0, s.num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(s.num_heads * head_dim);
    std::vector<float> denom(s.num_heads);
    std::vector<float> scratch(row);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t length = len[seq];
      TORCH_CHECK(length >= 1 && length <= s.max_blocks * s.block_size, "seq_len outside its block table");
      scores.resize(s.num_heads * length);
      const float* q_seq = q + seq * s.num_heads * head_dim;
      const int64_t* seq_table = table + seq * s.max_blocks;
      for (int64_t t = 0; t < length; ++t) {
        const float* key = keys(seq_table[t / s.block_size] * s.block_size + t % s.block_size, scratch.data());
        for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {  // one K head row serves its `group` query heads
          const float* kh = key + kv * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const float* qh = q_seq + h * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
            scores[h * length + t] = dot * score_scale;
          }
        }
      }
      for (int64_t h = 0; h < s.num_heads; ++h) {
        float* sc = scores.data() + h * length;
        const float peak = *std::max_element(sc, sc + length);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < length; ++t) {
          sc[t] = std::exp(sc[t] - peak);
          total += sc[t];
        }
        denom[h] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < length; ++t) {
        const float* value = values(seq_table[t / s.block_size] * s.block_size + t % s.block_size, scratch.data());
        for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
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
      float* dst = o + seq * s.num_heads * head_dim;
      for (int64_t h = 0; h < s.num_heads; ++h) {
        const float inv = out_scale / denom[h];
        for (int64_t d = 0; d < head_dim; ++d) dst[h * head_dim + d] = acc[h * head_dim + d] * inv;
      }
    }
  });
}

// Both entry points: shapes checked, then `attend` over the rows `rows_of(cache, values_per_token)` builds.
template <typename RowsOf>
torch::Tensor run(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, float score_scale,
                  float out_scale, RowsOf rows_of) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "query [B,H,D], caches [blocks,block_size,kv_heads,D]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "float32 queries only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const auto q_all = query.contiguous();
  const auto tables = block_tables.to(torch::kInt64).contiguous();
  const auto lens = seq_lens.to(torch::kInt64).contiguous();
  const Shape s{q_all.size(0), q_all.size(1), q_all.size(2), key_cache.size(1), key_cache.size(2), tables.size(1)};
  TORCH_CHECK(key_cache.size(3) == s.head_dim && s.num_heads % s.num_kv_heads == 0, "head shapes disagree");
  auto out = torch::empty_like(q_all);
  const int64_t row = s.num_kv_heads * s.head_dim;
  attend(s, q_all.data_ptr<float>(), rows_of(key_cache, row), rows_of(value_cache, row), tables.data_ptr<int64_t>(),
         lens.data_ptr<int64_t>(), score_scale, out_scale, out.data_ptr<float>());
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(key_cache.scalar_type() == torch::kFloat32 && value_cache.scalar_type() == torch::kFloat32,
              "float32 caches (fp8 ones: paged_decode_attention_fp8)");
  return run(query, key_cache, value_cache, block_tables, seq_lens, static_cast<float>(scale), 1.f,
             [](const torch::Tensor& cache, int64_t row) { return Fp32Rows{cache.data_ptr<float>(), row}; });
}

// The caches as uint8 views of e4m3 bytes; `e4m3_values` [256] float32 maps a byte to its value.
torch::Tensor paged_decode_attention_fp8(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                         torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                         double k_scale, double v_scale, torch::Tensor e4m3_values) {
  TORCH_CHECK(key_cache.scalar_type() == torch::kUInt8 && value_cache.scalar_type() == torch::kUInt8,
              "fp8 caches as uint8 views");
  TORCH_CHECK(e4m3_values.scalar_type() == torch::kFloat32 && e4m3_values.numel() == 256 &&
                  e4m3_values.is_contiguous(), "e4m3_values: 256 contiguous float32");
  const float* table = e4m3_values.data_ptr<float>();
  return run(query, key_cache, value_cache, block_tables, seq_lens, static_cast<float>(scale * k_scale),
             static_cast<float>(v_scale), [table](const torch::Tensor& cache, int64_t row) {
               return Fp8Rows{cache.data_ptr<uint8_t>(), row, table};
             });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged fp32 KV cache (query [B,H,D] -> [B,H,D])");
  m.def("paged_decode_attention_fp8", &paged_decode_attention_fp8,
        "decode attention over a paged fp8 (e4m3, per-tensor scales) KV cache (query [B,H,D] -> [B,H,D])");
}
