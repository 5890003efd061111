// SwiGLU: silu(gate) * up of a fused gate|up projection (plugins/gated_mlp.py), one op instead of Split, QuickGelu
// (ORT's fusion of x * Sigmoid(x)) and Mul.
//
//   0 x    float [T, 2I]   gate = x[:, :I], up = x[:, I:]
//   out    float [T, I]    gate * sigmoid(gate) * up (swiglu.h)
// Rows run on ORT's intra-op threads. QuantMatMul with swiglu=1 computes the same from its own projection.
#include "ort_abi.h"
#include "swiglu.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "SwiGLU";

void compute(void* opaque, OrtKernelContext* context) {
  const Api& api = *static_cast<Api*>(opaque);
  const std::vector<Tensor> in = inputs(api, context, 1);
  const Tensor& x = in[0];
  require(x.shape.size() == 2 && x.shape[1] % 2 == 0, kName, "x must be [T, 2 * intermediate_size]");
  SwigluRows job{static_cast<const float*>(x.data), nullptr, x.shape[1] / 2};
  job.out = output<float>(api, context, 0, {x.shape[0], job.width});
  parallel_for(api, context, static_cast<size_t>(x.shape[0]), swiglu_row, &job);
}

KernelOp kOp = simple_op(kName, kFloat, 1, kFloat, compute);

}  // namespace

std::vector<OrtCustomOp*> swiglu_ops() { return {&kOp}; }

}  // namespace engine_kernels
