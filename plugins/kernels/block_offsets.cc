// BlockOffsets: the float offsets of kept 4-bit blocks in one op (plugins/linear.py: a Q4_1 block of `group_size`
// weights holds d * q + m; MatMulNBits computes the d * q part, this op adds each block's m times the sum of the
// inputs it multiplies). It replaces Reshape + ReduceSum + MatMul + Add, four nodes per projection.
//
//   0 x        float [T, K]
//   1 y        float [T, N]          MatMulNBits' output
//   2 offsets  float [K / group, N]  m of block b of output column n at [b, n]
//   out        float [T, N]          y + sums @ offsets,  sums[t, b] = x[t, b * group : (b + 1) * group].sum()
// Attribute: group_size (int). Items (a row of T, a chunk of N columns) run on ORT's intra-op threads.
#include <algorithm>

#include "ort_abi.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "BlockOffsets";
constexpr int64_t kColumns = 1024;  // columns per work item: a lone decode row still spreads over the threads

struct OffsetsKernel {
  Api api;
  int64_t group;
};

struct OffsetsJob {
  const float *x, *y, *offsets;
  float* out;
  int64_t k, n, group, chunks;
};

void offsets_item(void* opaque, size_t i) {
  const auto& j = *static_cast<const OffsetsJob*>(opaque);
  const int64_t t = static_cast<int64_t>(i) / j.chunks, c0 = static_cast<int64_t>(i) % j.chunks * kColumns;
  const int64_t c1 = std::min(j.n, c0 + kColumns);
  const float* x = j.x + t * j.k;
  float* __restrict__ out = j.out + t * j.n;
  std::copy(j.y + t * j.n + c0, j.y + t * j.n + c1, out + c0);
  for (int64_t b = 0; b < j.k / j.group; ++b) {
    float sum = 0;
    for (int64_t e = b * j.group; e < (b + 1) * j.group; ++e) sum += x[e];
    const float* __restrict__ m = j.offsets + b * j.n;
    for (int64_t c = c0; c < c1; ++c) out[c] += sum * m[c];
  }
}

void compute(void* opaque, OrtKernelContext* context) {
  const auto& kernel = *static_cast<OffsetsKernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 3);
  const auto &x = in[0], &y = in[1], &offsets = in[2];
  require(x.shape.size() == 2 && y.shape.size() == 2 && x.shape[0] == y.shape[0], kName,
          "x must be [T, K] and y [T, N]");
  const int64_t tokens = x.shape[0], k = x.shape[1], n = y.shape[1];
  require(k % kernel.group == 0 && offsets.shape == std::vector<int64_t>{k / kernel.group, n}, kName,
          "offsets must be [K / group_size, N]");
  float* out = output<float>(kernel.api, context, 0, {tokens, n});
  OffsetsJob job{static_cast<const float*>(x.data), static_cast<const float*>(y.data),
                 static_cast<const float*>(offsets.data), out, k, n, kernel.group, (n + kColumns - 1) / kColumns};
  parallel_for(kernel.api, context, static_cast<size_t>(tokens * job.chunks), offsets_item, &job);
}

void* create_kernel(CustomOp*, const void* table, const OrtKernelInfo* info) {
  using GetInt = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);
  Api api(table);
  int64_t group = 0;
  api.call<GetInt>(kKernelInfoGetAttributeInt64, info, "group_size", &group);
  require(group > 0, kName, "group_size must be positive");
  return new OffsetsKernel{api, group};
}

CustomOp make_op() {
  CustomOp op = custom_op_base();
  op.CreateKernel = create_kernel;
  op.GetName = [](CustomOp*) { return kName; };
  op.GetInputType = [](CustomOp*, size_t) { return static_cast<int>(kFloat); };
  op.GetInputTypeCount = [](CustomOp*) { return size_t{3}; };
  op.GetOutputType = [](CustomOp*, size_t) { return static_cast<int>(kFloat); };
  op.GetOutputTypeCount = [](CustomOp*) { return size_t{1}; };
  op.KernelCompute = compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<OffsetsKernel*>(kernel); };
  return op;
}

CustomOp kOp = make_op();

}  // namespace

std::vector<CustomOp*> block_offsets_ops() { return {&kOp}; }

}  // namespace engine_kernels
