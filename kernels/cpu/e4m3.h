// fp8 (e4m3, "fn": no infinities, one NaN code per sign) KV values for the CPU kernels, widened to float32.
// Shared by paged_decode_attention.cpp and prefill_attention.cpp; kernels/cpu_decode_attention.py folds a hash of
// this file into the build flags, so an edit here rebuilds both.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvflow_e4m3 {

// e4m3 (fn) codes -> their values x 2^-8, through fp16, which holds every e4m3 value: the sign and the 7
// exponent|mantissa bits move up to fp16's fields (bits 15 and 7-13). fp16's exponent bias is 15 against e4m3's 7,
// so that reads as the value x 2^-8, and e4m3's subnormals land on fp16 subnormals exactly; the callers fold the
// 2^8 into their scales. With AVX-512 the hardware widens 16 halves at a time (vcvtph2ps); elsewhere, and for a
// tail, the same value is built from float32 fields. No NaN code is ever stored (writes saturate at +-448).
constexpr float kUnscale = 256.f;

inline float to_scaled_float(uint8_t code) {
  const uint32_t magnitude_bits = code & 0x7Fu;
  const float subnormal = static_cast<float>(magnitude_bits) * (1.f / 131072.f);  // mantissa x 2^-9 x 2^-8
  const uint32_t bits = (magnitude_bits << 20) + (112u << 23);  // exponent bias 127 - 7, minus 8
  float normal;
  std::memcpy(&normal, &bits, sizeof normal);
  const float magnitude = magnitude_bits < 8 ? subnormal : normal;
  return (code & 0x80u) ? -magnitude : magnitude;
}

inline void widen(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m256i sign = _mm256_set1_epi16(static_cast<int16_t>(0x8000));
  const __m256i magnitude = _mm256_set1_epi16(0x7F00);
  for (; i + 16 <= n; i += 16) {
    const __m256i high = _mm256_slli_epi16(
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 8);
    const __m256i half = _mm256_or_si256(_mm256_and_si256(high, sign),
                                         _mm256_srli_epi16(_mm256_and_si256(high, magnitude), 1));
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(half));
  }
#endif
  for (; i < n; ++i) dst[i] = to_scaled_float(src[i]);
}

}  // namespace kvflow_e4m3
