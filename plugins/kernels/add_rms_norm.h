// The residual add and RMSNorm of one row, shared by AddRMSNorm (add_rms_norm.cc) and QuantMatMulAddRMSNorm's
// epilogue (quant_matmul.cc), so the fused op's rows are the unfused pair's bit for bit:
//   total = x + residual,  out = total / sqrt(mean(total^2) + epsilon) * weight
// x may be total itself (the epilogue adds the residual to the projection in place).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention_math.h"

namespace engine_kernels {

struct NormJob {
  const float *x, *residual, *weight;
  float *out, *total;
  int64_t hidden;
  float epsilon;
};

inline void norm_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const NormJob*>(opaque);
  const int64_t offset = static_cast<int64_t>(t) * j.hidden;
  const float *x = j.x + offset, *r = j.residual + offset;
  float *out = j.out + offset, *total = j.total + offset;
  int64_t i = 0;
  float squares = 0;
#ifdef ENGINE_KERNELS_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= j.hidden; i += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(r + i));
    _mm256_storeu_ps(total + i, v);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  squares = simd::hsum(acc);
#endif
  for (; i < j.hidden; ++i) {
    total[i] = x[i] + r[i];
    squares += total[i] * total[i];
  }
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(j.hidden) + j.epsilon);
  i = 0;
#ifdef ENGINE_KERNELS_AVX2
  const __m256 scale = _mm256_set1_ps(inv);
  for (; i + 8 <= j.hidden; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(total + i), scale),
                                            _mm256_loadu_ps(j.weight + i)));
#endif
  for (; i < j.hidden; ++i) out[i] = total[i] * inv * j.weight[i];
}

}  // namespace engine_kernels
