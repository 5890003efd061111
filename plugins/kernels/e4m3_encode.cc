// E4m3Encode: the e4m3fn codes (as uint8) of x / scale, for the fp8 KV pools (plugins/e4m3.py draws the format).
// One op instead of the 18 elementwise nodes of the standard-ONNX encoder, per K and V of every layer.
//
//   0 x      float [T, C]
//   1 scale  float [C]
//   out      uint8 [T, C]   x / scale rounded to nearest even on the e4m3 grid, saturated to +-448 (as
//                           QuantizeLinear to float8e4m3fn with saturate=1); NaN gives the NaN code 0x7f (+ sign)
// Rows run on ORT's intra-op threads.
#include <cmath>
#include <cstring>

#include "ort_abi.h"

namespace engine_kernels {
namespace {

uint8_t e4m3_code(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (std::isnan(a)) return sign | 0x7f;
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0.015625f)  // below the smallest normal 2^-6: subnormal steps of 2^-9 (rounding up to 2^-6 gives 0x08)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  int exponent = 0;
  const float fraction = std::frexp(a, &exponent);            // a = fraction * 2^exponent, fraction in [0.5, 1)
  int mantissa = static_cast<int>(std::nearbyint((fraction * 2.0f - 1.0f) * 8.0f));   // of 1.m, 0..8
  int biased = exponent - 1 + 7;
  if (mantissa == 8) mantissa = 0, ++biased;                   // rounded up into the next binade
  return sign | static_cast<uint8_t>(biased << 3 | mantissa);
}

struct EncodeJob {
  const float *x, *scale;
  uint8_t* out;
  int64_t channels;
};

void encode_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const EncodeJob*>(opaque);
  const float* x = j.x + static_cast<int64_t>(t) * j.channels;
  uint8_t* out = j.out + static_cast<int64_t>(t) * j.channels;
  for (int64_t c = 0; c < j.channels; ++c) out[c] = e4m3_code(x[c] / j.scale[c]);
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

CustomOp make_op() {
  CustomOp op = custom_op_base();
  op.CreateKernel = [](CustomOp*, const void* table, const OrtKernelInfo*) -> void* { return new Api(table); };
  op.GetName = [](CustomOp*) { return "E4m3Encode"; };
  op.GetInputType = [](CustomOp*, size_t) { return static_cast<int>(kFloat); };
  op.GetInputTypeCount = [](CustomOp*) { return size_t{2}; };
  op.GetOutputType = [](CustomOp*, size_t) { return static_cast<int>(kUint8); };
  op.GetOutputTypeCount = [](CustomOp*) { return size_t{1}; };
  op.KernelCompute = compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Api*>(kernel); };
  return op;
}

CustomOp kOp = make_op();

}  // namespace

std::vector<CustomOp*> e4m3_encode_ops() { return {&kOp}; }

}  // namespace engine_kernels
