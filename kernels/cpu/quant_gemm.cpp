// Group-wise quantized linear layers for the CPU path (engine/quant/group_quant.py documents the layout):
// 4-bit weights (two per byte, GGUF's 32-element sub-block order) or 8-bit, float16 scales per group, and per
// group either a float16 min (w = d*q + m), a uint8 zero (w = (q - z)*d) or nothing (w = q*d).
//
// quant_gemv: y[M, N] = x[M, K] W^T for a few rows: each weight row is dequantized once into a cache-resident
// buffer (the exact reference values) and dotted with every input row; the weights stream from memory at 4 bits.
// dequantize: rows of W as float32 (larger batches multiply dequantized tiles).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

namespace {

constexpr int64_t kSub = 32;

inline float half_bits(int16_t bits) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
}

void check(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& offsets, int64_t bits,
           int64_t kind, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(kind >= 0 && kind <= 2, "kind must be 0 (min), 1 (zero) or 2 (sym)");
  TORCH_CHECK(group_size % kSub == 0, "group_size must be a multiple of 32");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && offsets.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(scales.scalar_type() == torch::kInt16, "scales are float16 bits in int16");
  if (kind == 0) TORCH_CHECK(offsets.scalar_type() == torch::kInt16 && offsets.sizes() == scales.sizes(), "mins");
  if (kind == 1) TORCH_CHECK(offsets.scalar_type() == torch::kUInt8 && offsets.sizes() == scales.sizes(), "zeros");
}

// W's arrays as dequant_row reads them: 4-bit or 8-bit codes, float16 scales, float16 mins or uint8 zeros
// (the arrays its bits and kind do not use are null).
struct QuantArrays {
  const uint8_t* q4;
  const int8_t* q8;
  const int16_t* sc;
  const int16_t* mins;
  const uint8_t* zeros;
};

QuantArrays quant_arrays(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& offsets,
                         int64_t bits, int64_t kind) {
  return {bits == 4 ? qweight.data_ptr<uint8_t>() : nullptr, bits == 8 ? qweight.data_ptr<int8_t>() : nullptr,
          scales.data_ptr<int16_t>(), kind == 0 ? offsets.data_ptr<int16_t>() : nullptr,
          kind == 1 ? offsets.data_ptr<uint8_t>() : nullptr};
}

// Row n of W as float32 into `dst` (exactly the reference's arithmetic; vectorizes: no fused multiply-adds).
// `w` is taken by value: its pointers are the function's own, which no store to `dst` can be thought to change.
inline void dequant_row(QuantArrays w, int64_t bits, int64_t kind, int64_t K, int64_t group_size, int64_t n,
                        float* dst) {
  const auto [q4, q8, sc, mins, zeros] = w;
  const int64_t G = K / group_size;
  for (int64_t g = 0; g < G; ++g) {
    const float d = half_bits(sc[n * G + g]);
    const float off = kind == 0 ? half_bits(mins[n * G + g]) : kind == 1 ? static_cast<float>(zeros[n * G + g]) : 0.f;
    for (int64_t s = 0; s < group_size / kSub; ++s) {
      const int64_t k0 = g * group_size + s * kSub;
      float* out = dst + k0;
      if (bits == 4) {
        const uint8_t* q = q4 + n * (K / 2) + k0 / 2;
        if (kind == 0) {
#pragma omp simd
          for (int j = 0; j < 16; ++j) {
            out[j] = d * static_cast<float>(q[j] & 0x0F) + off;
            out[j + 16] = d * static_cast<float>(q[j] >> 4) + off;
          }
        } else {
#pragma omp simd
          for (int j = 0; j < 16; ++j) {
            out[j] = (static_cast<float>(q[j] & 0x0F) - off) * d;
            out[j + 16] = (static_cast<float>(q[j] >> 4) - off) * d;
          }
        }
      } else {
        const int8_t* q = q8 + n * K + k0;
#pragma omp simd
        for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j]) * d;
      }
    }
  }
}

torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor offsets,
                         int64_t bits, int64_t kind, int64_t group_size) {
  check(qweight, scales, offsets, bits, kind, group_size);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0), G = K / group_size;
  TORCH_CHECK(qweight.size(1) == (bits == 4 ? K / 2 : K) && scales.size(1) == G, "weight shape vs K");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const QuantArrays w = quant_arrays(qweight, scales, offsets, bits, kind);
  float* o = out.data_ptr<float>();
  // Per output row: dequantize it once into an L1-resident buffer, then one dot product per input row.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      dequant_row(w, bits, kind, K, group_size, n, row.data());
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xp + m * K;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += row[k] * xm[k];
        o[m * N + n] = acc;
      }
    }
  });
  return out;
}

torch::Tensor dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor offsets, int64_t bits,
                         int64_t kind, int64_t group_size) {
  check(qweight, scales, offsets, bits, kind, group_size);
  const int64_t N = qweight.size(0), K = bits == 4 ? qweight.size(1) * 2 : qweight.size(1), G = K / group_size;
  TORCH_CHECK(scales.size(1) == G, "scales shape vs K");
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  const QuantArrays w = quant_arrays(qweight, scales, offsets, bits, kind);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequant_row(w, bits, kind, K, group_size, n, o + n * K);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_gemv", &quant_gemv, "x[M,K] @ W^T with W group-quantized (few rows)");
  m.def("dequantize", &dequantize, "group-quantized rows -> float32");
}
