// silu(gate) * up over a span of values: the SwiGLU op's math (swiglu.cc), shared with QuantMatMul's fused
// epilogue (quant_matmul.cc), so both give the same floats.
//
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (never overflows).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention_math.h"

namespace engine_kernels {

inline void swiglu_span(const float* gate, const float* up, float* y, int64_t count) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one16 = _mm512_set1_ps(1.0f);
  const __m512i sign16 = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (; i + 16 <= count; i += 16) {  // the 8-lane loop's operations in 16 lanes: the same floats
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = simd::exp_nonpositive(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g), sign16)));
    const __m512 high = _mm512_div_ps(one16, _mm512_add_ps(one16, e));
    const __mmask16 negative = _mm512_cmplt_epi32_mask(_mm512_castps_si512(g), _mm512_setzero_si512());
    const __m512 sig = _mm512_mask_mul_ps(high, negative, e, high);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_loadu_ps(up + i)));
  }
#endif
#ifdef ENGINE_KERNELS_AVX2
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= count; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = simd::exp_nonpositive(_mm256_or_ps(g, sign));   // exp(-|g|)
    const __m256 high = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 sig = _mm256_blendv_ps(high, _mm256_mul_ps(e, high), g);   // the sign bit of g picks e / (1 + e)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < count; ++i) {
    const float e = std::exp(-std::fabs(gate[i])), high = 1.0f / (1.0f + e);
    y[i] = gate[i] * (gate[i] < 0 ? e * high : high) * up[i];
  }
}

// A fused gate|up projection [T, 2 * width] -> out [T, width], one row a ParallelFor item (swiglu_row).
struct SwigluRows {
  const float* projection;
  float* out;
  int64_t width;
};

inline void swiglu_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const SwigluRows*>(opaque);
  const float* gate = j.projection + static_cast<int64_t>(t) * 2 * j.width;
  swiglu_span(gate, gate + j.width, j.out + static_cast<int64_t>(t) * j.width, j.width);
}

}  // namespace engine_kernels
