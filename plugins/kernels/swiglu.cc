// SwiGLU: silu(gate) * up of a fused gate|up projection (plugins/gated_mlp.py), one op instead of Split, QuickGelu
// (ORT's fusion of x * Sigmoid(x)) and Mul.
//
//   0 x    float [T, 2I]   gate = x[:, :I], up = x[:, I:]
//   out    float [T, I]    gate * sigmoid(gate) * up
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) (never overflows). Rows run on ORT's
// intra-op threads.
#include <cmath>

#include "attention_math.h"
#include "ort_abi.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "SwiGLU";

struct SwigluJob {
  const float* x;
  float* out;
  int64_t inter;
};

void swiglu_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const SwigluJob*>(opaque);
  const float* gate = j.x + static_cast<int64_t>(t) * 2 * j.inter;
  const float* up = gate + j.inter;
  float* y = j.out + static_cast<int64_t>(t) * j.inter;
  int64_t i = 0;
#ifdef ENGINE_KERNELS_AVX2
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= j.inter; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = simd::exp_nonpositive(_mm256_or_ps(g, sign));   // exp(-|g|)
    const __m256 high = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 sig = _mm256_blendv_ps(high, _mm256_mul_ps(e, high), g);   // the sign bit of g picks e / (1 + e)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < j.inter; ++i) {
    const float e = std::exp(-std::fabs(gate[i])), high = 1.0f / (1.0f + e);
    y[i] = gate[i] * (gate[i] < 0 ? e * high : high) * up[i];
  }
}

void compute(void* opaque, OrtKernelContext* context) {
  const Api& api = *static_cast<Api*>(opaque);
  const std::vector<Tensor> in = inputs(api, context, 1);
  const Tensor& x = in[0];
  require(x.shape.size() == 2 && x.shape[1] % 2 == 0, kName, "x must be [T, 2 * intermediate_size]");
  SwigluJob job{static_cast<const float*>(x.data), nullptr, x.shape[1] / 2};
  job.out = output<float>(api, context, 0, {x.shape[0], job.inter});
  parallel_for(api, context, static_cast<size_t>(x.shape[0]), swiglu_row, &job);
}

KernelOp kOp = simple_op(kName, kFloat, 1, kFloat, compute);

}  // namespace

std::vector<CustomOp*> swiglu_ops() { return {&kOp}; }

}  // namespace engine_kernels
