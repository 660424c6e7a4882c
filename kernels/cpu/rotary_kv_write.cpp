// Rotary embedding of q and k, in place inside the fused qkv projection, and the write of k and v into the paged
// KV cache: one pass over the step's new tokens for the CPU fp32 path, instead of ~10 torch ops per layer (a
// positions gather of cos and sin, four products, a subtraction and an addition into strided halves, a copy of v
// and two index_copy_ calls).
//
// The arithmetic is torch's, operation for operation: first = x[:half], second = x[half:],
//   out[:half] = first * cos - second * sin;  out[half:] = second * cos + first * sin,
// each product rounded to float before the sum (built with -ffp-contract=off and without -ffast-math, so the
// compiler may vectorize but never fuses a multiply-add), so the results are bit-identical to the torch path.
// An fp8 (e4m3) cache gets e4m3(value / scale) as `quantize_fp8` (kernels/fp8_kv.py) computes it: a float
// division, a clamp to +-448 and a round to nearest even, bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTokensPerTask = 16;  // small decode batches stay on the calling thread (no fork-join cost)

void rotate_head(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float first = x[i];
    const float second = x[i + half];
    const float first_cos = first * cos[i];
    const float second_sin = second * sin[i];
    const float second_cos = second * cos[i];
    const float first_sin = first * sin[i];
    x[i] = first_cos - second_sin;
    x[i + half] = second_cos + first_sin;
  }
}

// float -> e4m3 (fn) bits: x / scale clamped to +-448, rounded to the nearest e4m3 value, ties to even. The
// rounding is the Triton kernels' `round_to_e4m3`: divide by the ulp of x's binade (a power of two: exact), round
// to an integer with the 1.5 x 2^23 trick (exact IEEE adds, which is why this file is built without fast-math).
inline uint8_t to_e4m3(float value, float scale) {
  float x = value / scale;
  x = x < -448.f ? -448.f : (x > 448.f ? 448.f : x);
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xFFu) - 127;
  if (exponent < -6) exponent = -6;  // e4m3's subnormals share the ulp of its smallest normal binade
  const uint32_t ulp_bits = static_cast<uint32_t>(exponent - 3 + 127) << 23;
  float ulp;
  std::memcpy(&ulp, &ulp_bits, sizeof ulp);
  const float shifted = std::fabs(x) / ulp + 12582912.f;
  const uint32_t steps = static_cast<uint32_t>(shifted - 12582912.f);  // 0..16 ulps
  if (steps < 8) return sign | static_cast<uint8_t>(steps);  // exponent -6 only: a subnormal (or zero)
  if (steps == 16) return sign | static_cast<uint8_t>((exponent + 8) << 3);  // rounded up into the next binade
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | (steps - 8));
}

// Rotates q and k inside qkv, then hands each token's slot and k, v rows (all kv heads) to `write`.
template <typename Write>
void rotate_and_write(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_half, torch::Tensor sin_half,
                      const torch::Tensor& key_cache, const torch::Tensor& value_cache, torch::Tensor slot_mapping,
                      int64_t num_heads, int64_t num_kv_heads, Write write) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat32,
              "qkv must be a contiguous float32 [tokens, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(), "caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  const int64_t head_dim = key_cache.size(3), half = head_dim / 2;
  const int64_t num_tokens = qkv.size(0), width = qkv.size(1);
  TORCH_CHECK(key_cache.size(2) == num_kv_heads && head_dim % 2 == 0 &&
                  width == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width disagrees with the head counts");
  TORCH_CHECK(cos_half.is_contiguous() && sin_half.is_contiguous() && cos_half.sizes() == sin_half.sizes() &&
                  cos_half.dim() == 2 && cos_half.size(1) == half && cos_half.scalar_type() == torch::kFloat32 &&
                  sin_half.scalar_type() == torch::kFloat32, "cos/sin tables must be float32 [positions, head_dim / 2]");
  const auto pos = positions.to(torch::kInt64).contiguous();
  const auto slots = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(pos.numel() == num_tokens && slots.numel() == num_tokens, "one position and one slot per token");
  const int64_t num_positions = cos_half.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t kv_row = num_kv_heads * head_dim;
  float* data = qkv.data_ptr<float>();
  const float* cos = cos_half.data_ptr<float>();
  const float* sin = sin_half.data_ptr<float>();
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {  // checked up front: a bad index must not write out of bounds
    TORCH_CHECK(pos_ptr[t] >= 0 && pos_ptr[t] < num_positions, "position outside the rotary table");
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < num_slots, "slot outside the KV cache");
  }
  at::parallel_for(0, num_tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = data + t * width;
      const float* c = cos + pos_ptr[t] * half;
      const float* s = sin + pos_ptr[t] * half;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rotate_head(row + h * head_dim, c, s, half);
      const float* k = row + num_heads * head_dim;
      write(slot_ptr[t] * kv_row, k, k + kv_row, kv_row);
    }
  });
}

void rotary_kv_write(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_half, torch::Tensor sin_half,
                     torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slot_mapping,
                     int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(key_cache.scalar_type() == torch::kFloat32 && value_cache.scalar_type() == torch::kFloat32,
              "float32 caches (fp8 ones: rotary_kv_write_fp8)");
  float* k_out = key_cache.data_ptr<float>();
  float* v_out = value_cache.data_ptr<float>();
  rotate_and_write(qkv, positions, cos_half, sin_half, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
                   [=](int64_t offset, const float* k, const float* v, int64_t n) {
                     std::memcpy(k_out + offset, k, n * sizeof(float));
                     std::memcpy(v_out + offset, v, n * sizeof(float));
                   });
}

// The caches as uint8 views of e4m3 bytes; each holds e4m3(value / its scale).
void rotary_kv_write_fp8(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_half, torch::Tensor sin_half,
                         torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slot_mapping,
                         int64_t num_heads, int64_t num_kv_heads, double k_scale, double v_scale) {
  TORCH_CHECK(key_cache.scalar_type() == torch::kUInt8 && value_cache.scalar_type() == torch::kUInt8,
              "fp8 caches as uint8 views");
  uint8_t* k_out = key_cache.data_ptr<uint8_t>();
  uint8_t* v_out = value_cache.data_ptr<uint8_t>();
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);  // torch divides by float(scale)
  rotate_and_write(qkv, positions, cos_half, sin_half, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads,
                   [=](int64_t offset, const float* k, const float* v, int64_t n) {
                     for (int64_t i = 0; i < n; ++i) k_out[offset + i] = to_e4m3(k[i], ks);
                     for (int64_t i = 0; i < n; ++i) v_out[offset + i] = to_e4m3(v[i], vs);
                   });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_kv_write", &rotary_kv_write,
        "rotate q and k in place inside qkv and write k and v into the paged KV cache (CPU, float32)");
  m.def("rotary_kv_write_fp8", &rotary_kv_write_fp8,
        "rotary_kv_write into an fp8 (e4m3, per-tensor scales) KV cache given as uint8 views");
}
