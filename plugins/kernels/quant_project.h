// QuantMatMul's projection (quant_matmul.cc), for the ops of other files that project their input first:
// QuantRotaryPagedAttention* (paged_attention.cc) runs the q|k|v projection before the attention.
#pragma once

#include <cstdint>
#include <string>

#include "ort_abi.h"

namespace engine_kernels {

// One projection's weights: N columns of `bits` in blocks of `group`, with offsets or not, SwiGLU after it or not,
// the blocks' scales one a block or GGUF's K-quant sub-block scales (quant_tiles.h kScales*).
struct Projection {
  int64_t n, bits, group;
  bool offsets, swiglu;
  int64_t scales = 0;
  bool float_x = false;  // float32 activations over the dequantized weights (an accuracy report's reference)
  int64_t out_n() const { return swiglu ? n / 2 : n; }
};

// The attributes of one projection, named with `prefix` ("down_" for QuantMLP's second); a table QuantGather reads
// has no N or swiglu (`sized` false).
Projection projection_of(const Api& api, const OrtKernelInfo* info, const std::string& prefix, bool sized);

// The weights of projection p, checked against its input width k (std::invalid_argument naming `op`).
void check_weights(const Projection& p, int64_t k, const Tensor& w, const char* op);

namespace quant {
struct Activations;
}

// Int8 rows a projection is handed or asked for (QuantMLP): x's, already quantized by the projection before it
// (then x's floats are not read again for them); `next`, where a SwiGLU projection's vector tiles quantize its
// output for the projection `after` it (its down: that one's blocks and zero point), while the rows are in cache.
struct Quantized {
  quant::Activations* x = nullptr;
  quant::Activations* next = nullptr;
  const Projection* after = nullptr;
};

// out [T, p.out_n()] = x @ W^T (then silu(gate) * up with swiglu), as quant_matmul.cc's header describes. True
// when `quantized.next` now holds out's int8 rows (only the SwiGLU tiles of the vector code write them).
bool project(const Api& api, OrtKernelContext* context, const Projection& p, const Tensor& x, const Tensor& w,
             float* out, const Quantized& quantized = {});

}  // namespace engine_kernels
