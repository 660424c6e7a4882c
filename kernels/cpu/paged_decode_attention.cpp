// Decode attention (one query token per sequence) read straight from the paged KV cache, for the CPU path.
// Each sequence's K and V rows are read exactly once for all query heads (GQA included), so a step moves the
// cache once instead of gathering a padded copy and reading it again. fp32 caches are read in place; fp8 (e4m3)
// caches are widened a block at a time (e4m3.h), so they move a quarter of the bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "e4m3.h"

namespace {

// The first `tokens` rows (all kv heads of a token: `row` values each) of a cache block, as floats.
struct Fp32Blocks {
  static constexpr bool kWidens = false;  // read in place: no scratch
  const float* base;
  int64_t block_values;  // block_size * row
  const float* operator()(int64_t block, int64_t /*values*/, float* /*scratch*/) const {
    return base + block * block_values;
  }
};

// fp8 blocks are widened into `scratch` once per block, over all its tokens.
struct Fp8Blocks {
  static constexpr bool kWidens = true;
  const uint8_t* base;
  int64_t block_values;
  const float* operator()(int64_t block, int64_t values, float* scratch) const {
    kvflow_e4m3::widen(base + block * block_values, scratch, values);
    return scratch;
  }
};

struct Shape {
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, max_blocks;
};

// out[seq] = softmax(q . k * score_scale) . v * out_scale, per query head; k/v blocks come from `keys`/`values`.
template <typename Blocks>
void attend(const Shape& s, const float* q, Blocks keys, Blocks values, const int64_t* table, const int64_t* len,
            float score_scale, float out_scale, float* o) {
  const int64_t group = s.num_heads / s.num_kv_heads, head_dim = s.head_dim;
  const int64_t row = s.num_kv_heads * head_dim;  // values per token in one block
  // One task per sequence: every token's K (then V) row of all kv heads is one contiguous read, used by every
  // query head, so each cached byte is fetched from memory once.
  at::parallel_for(0, s.num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(s.num_heads * head_dim);
    std::vector<float> denom(s.num_heads);
    std::vector<float> scratch(Blocks::kWidens ? s.block_size * row : 0);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t length = len[seq];
      TORCH_CHECK(length >= 1 && length <= s.max_blocks * s.block_size, "seq_len outside its block table");
      scores.resize(s.num_heads * length);
      const float* q_seq = q + seq * s.num_heads * head_dim;
      const int64_t* seq_table = table + seq * s.max_blocks;
      for (int64_t first = 0; first < length; first += s.block_size) {
        const int64_t tokens = std::min(s.block_size, length - first);
        const float* block = keys(seq_table[first / s.block_size], tokens * row, scratch.data());
        for (int64_t i = 0; i < tokens; ++i) {
          const int64_t t = first + i;
          for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {  // one K head row serves its `group` query heads
            const float* kh = block + i * row + kv * head_dim;
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
      for (int64_t first = 0; first < length; first += s.block_size) {
        const int64_t tokens = std::min(s.block_size, length - first);
        const float* block = values(seq_table[first / s.block_size], tokens * row, scratch.data());
        for (int64_t i = 0; i < tokens; ++i) {
          const int64_t t = first + i;
          for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
            const float* vh = block + i * row + kv * head_dim;
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = kv * group + g;
              const float p = scores[h * length + t];
              float* a = acc.data() + h * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
            }
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

// Both entry points: shapes checked, then `attend` over the blocks `blocks_of(cache, values_per_block)` reads.
template <typename BlocksOf>
torch::Tensor run(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, float score_scale,
                  float out_scale, BlocksOf blocks_of) {
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
  const int64_t block_values = s.block_size * s.num_kv_heads * s.head_dim;
  attend(s, q_all.data_ptr<float>(), blocks_of(key_cache, block_values), blocks_of(value_cache, block_values),
         tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), score_scale, out_scale, out.data_ptr<float>());
  return out;
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(key_cache.scalar_type() == torch::kFloat32 && value_cache.scalar_type() == torch::kFloat32,
              "float32 caches (fp8 ones: paged_decode_attention_fp8)");
  return run(query, key_cache, value_cache, block_tables, seq_lens, static_cast<float>(scale), 1.f,
             [](const torch::Tensor& cache, int64_t values) { return Fp32Blocks{cache.data_ptr<float>(), values}; });
}

// The caches as uint8 views of e4m3 bytes (value / scale).
torch::Tensor paged_decode_attention_fp8(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                         torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                         double k_scale, double v_scale) {
  TORCH_CHECK(key_cache.scalar_type() == torch::kUInt8 && value_cache.scalar_type() == torch::kUInt8,
              "fp8 caches as uint8 views");
  return run(query, key_cache, value_cache, block_tables, seq_lens,
             static_cast<float>(scale * k_scale * kvflow_e4m3::kUnscale),
             static_cast<float>(v_scale * kvflow_e4m3::kUnscale), [](const torch::Tensor& cache, int64_t values) {
               return Fp8Blocks{cache.data_ptr<uint8_t>(), values};
             });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged fp32 KV cache (query [B,H,D] -> [B,H,D])");
  m.def("paged_decode_attention_fp8", &paged_decode_attention_fp8,
        "decode attention over a paged fp8 (e4m3, per-tensor scales) KV cache (query [B,H,D] -> [B,H,D])");
}
