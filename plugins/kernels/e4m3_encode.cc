// E4m3Encode: the e4m3fn codes (as uint8) of x / scale, for the fp8 KV pools (plugins/e4m3.py draws the format).
// One op instead of the 18 elementwise nodes of the standard-ONNX encoder, per K and V of every layer.
//
//   0 x      float [T, C]
//   1 scale  float [C]
//   out      uint8 [T, C]   x / scale rounded to nearest even on the e4m3 grid, saturated to +-448 (as
//                           QuantizeLinear to float8e4m3fn with saturate=1); NaN gives the NaN code 0x7f (+ sign)
// Rows run on ORT's intra-op threads.
#include "attention_math.h"
#include "ort_abi.h"

namespace engine_kernels {
namespace {

struct EncodeJob {
  const float *x, *scale;
  uint8_t* out;
  int64_t channels;
};

void encode_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const EncodeJob*>(opaque);
  const float* x = j.x + static_cast<int64_t>(t) * j.channels;
  uint8_t* out = j.out + static_cast<int64_t>(t) * j.channels;
  write_row(x, j.scale, j.channels, out);
}

void compute(void* opaque, OrtKernelContext* context) {
  const Api& api = *static_cast<Api*>(opaque);
  const std::vector<Tensor> in = inputs(api, context, 2);
  const auto &x = in[0], &scale = in[1];
  require(x.shape.size() == 2 && scale.shape == std::vector<int64_t>{x.shape[1]}, "E4m3Encode",
          "x must be [T, C] and scale [C]");
  EncodeJob job{static_cast<const float*>(x.data), static_cast<const float*>(scale.data),
                output<uint8_t>(api, context, 0, x.shape), x.shape[1]};
  parallel_for(api, context, static_cast<size_t>(x.shape[0]), encode_row, &job);
}

KernelOp kOp = simple_op("E4m3Encode", kFloat, 2, kUint8, compute);

}  // namespace

std::vector<OrtCustomOp*> e4m3_encode_ops() { return {&kOp}; }

}  // namespace engine_kernels
