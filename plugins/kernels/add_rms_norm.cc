// AddRMSNorm: the residual add and the RMSNorm after it in one op (plugins/rms_norm.py), instead of Add +
// RMSNormalization: two nodes a norm, 61 of a SmolLM2 step's ~400, each paying its own dispatch.
//
//   0 x         float [T, H]
//   1 residual  float [T, H]
//   2 weight    float [H]
//   out 0       float [T, H]   total / sqrt(mean(total^2) + epsilon) * weight,  total = x + residual
//   out 1       float [T, H]   total
// Attribute: epsilon (float). Rows run on ORT's intra-op threads when there are several. The row's math is
// add_rms_norm.h's, which QuantMatMulAddRMSNorm (quant_matmul.cc) shares: where the x of a norm is a QuantMatMul's
// output, that op does the add and the norm itself (plugins/rms_norm.py).
#include "add_rms_norm.h"
#include "ort_abi.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "AddRMSNorm";

struct NormKernel {
  Api api;
  float epsilon;
};

void compute(void* opaque, OrtKernelContext* context) {
  const TracedOp traced(kTraceAddRMSNorm);
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

void* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  Api api(info);
  float epsilon = 0;
  api.check(api->KernelInfoGetAttribute_float(info, "epsilon", &epsilon));
  require(epsilon >= 0, kName, "epsilon must not be negative");
  return new NormKernel{api, epsilon};
}

KernelOp kOp = kernel_op(kName, {kFloat, kFloat, kFloat}, kFloat, 2, create_kernel, compute,
                         destroy_kernel<NormKernel>);

}  // namespace

std::vector<OrtCustomOp*> add_rms_norm_ops() { return {&kOp}; }

}  // namespace engine_kernels
