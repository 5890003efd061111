// AddRMSNorm: the residual add and the RMSNorm after it in one op (plugins/rms_norm.py), instead of Add +
// RMSNormalization: two nodes a norm, 61 of a SmolLM2 step's ~400, each paying its own dispatch.
//
//   0 x         float [T, H]
//   1 residual  float [T, H]
//   2 weight    float [H]
//   out 0       float [T, H]   total / sqrt(mean(total^2) + epsilon) * weight,  total = x + residual
//   out 1       float [T, H]   total
// Attribute: epsilon (float). Rows run on ORT's intra-op threads when there are several.
#include <cmath>

#include "attention_math.h"
#include "ort_abi.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "AddRMSNorm";

struct NormKernel {
  Api api;
  float epsilon;
};

struct NormJob {
  const float *x, *residual, *weight;
  float *out, *total;
  int64_t hidden;
  float epsilon;
};

void norm_row(void* opaque, size_t t) {
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

void compute(void* opaque, OrtKernelContext* context) {
  const auto& kernel = *static_cast<NormKernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 3);
  const auto &x = in[0], &residual = in[1], &weight = in[2];
  require(x.shape.size() == 2 && residual.shape == x.shape, kName, "x and residual must both be [T, H]");
  require(weight.shape == std::vector<int64_t>{x.shape[1]}, kName, "weight must be [H]");
  NormJob job{static_cast<const float*>(x.data), static_cast<const float*>(residual.data),
              static_cast<const float*>(weight.data), nullptr, nullptr, x.shape[1], kernel.epsilon};
  job.out = output<float>(kernel.api, context, 0, x.shape);
  job.total = output<float>(kernel.api, context, 1, x.shape);
  if (x.shape[0] == 1) norm_row(&job, 0);  // a decode row: not worth waking the other threads
  else parallel_for(kernel.api, context, static_cast<size_t>(x.shape[0]), norm_row, &job);
}

void* create_kernel(CustomOp*, const void* table, const OrtKernelInfo* info) {
  using GetFloat = OrtStatus* (*)(const OrtKernelInfo*, const char*, float*);
  Api api(table, info);
  float epsilon = 0;
  api.call<GetFloat>(kKernelInfoGetAttributeFloat, info, "epsilon", &epsilon);
  require(epsilon >= 0, kName, "epsilon must not be negative");
  return new NormKernel{api, epsilon};
}

KernelOp kOp = kernel_op(kName, {kFloat, kFloat, kFloat}, kFloat, 2, create_kernel, compute,
                         destroy_kernel<NormKernel>);

}  // namespace

std::vector<CustomOp*> add_rms_norm_ops() { return {&kOp}; }

}  // namespace engine_kernels
