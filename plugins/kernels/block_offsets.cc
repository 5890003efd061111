// BlockOffsets: the float offsets of kept 4-bit blocks in one op (plugins/linear.py: a Q4_1 block of `group_size`
// weights holds d * q + m; MatMulNBits computes the d * q part, this op adds each block's m times the sum of the
// inputs it multiplies). It replaces Reshape + ReduceSum + MatMul + Add, four nodes per projection.
//
//   0 x        float [T, K]
//   1 y        float [T, N]          MatMulNBits' output
//   2 offsets  float [K / group, N]  m of block b of output column n at [b, n]
//   out        float [T, N]          y + sums @ offsets,  sums[t, b] = x[t, b * group : (b + 1) * group].sum()
// Attribute: group_size (int). Items (up to kRows rows of T, a chunk of N columns) run on ORT's intra-op threads.
// With AVX2 + FMA each output tile (rows x 16 to 64 columns) stays in registers while the offsets rows stream past it,
// each offsets load serving every row of the item; otherwise plain loops.
#include <algorithm>
#include <vector>

#include "ort_abi.h"
#include "simd.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "BlockOffsets";
constexpr int64_t kRows = 4;
constexpr int64_t kColumns = 1024;  // columns per work item: a lone decode row still spreads over the threads

struct OffsetsKernel {
  Api api;
  int64_t group;
};

struct OffsetsJob {
  const float *x, *y, *offsets;
  float* out;
  int64_t tokens, k, n, group, chunks;
};

#ifdef ENGINE_KERNELS_AVX2
// out_r[c, c + 8W) = y_r[c, c + 8W) + sum_b sums[r * blocks + b] * offsets[b, c, c + 8W), b in order, for R rows.
template <int R, int W>
inline void offsets_tile(const float* sums, int64_t blocks, const float* offsets, int64_t n, const float* y,
                         float* out, int64_t c) {
  __m256 acc[R][W];
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r)
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) acc[r][w] = _mm256_loadu_ps(y + r * n + c + 8 * w);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 m[W];
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) m[w] = _mm256_loadu_ps(offsets + b * n + c + 8 * w);
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_broadcast_ss(sums + r * blocks + b);
      ENGINE_UNROLL
      for (int w = 0; w < W; ++w) acc[r][w] = _mm256_fmadd_ps(s, m[w], acc[r][w]);
    }
  }
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r)
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(out + r * n + c + 8 * w, acc[r][w]);
}

// At least 8 accumulators (independent FMA chains over the blocks) per tile, whatever the rows.
template <int R>
int64_t offsets_columns(const float* sums, int64_t blocks, const float* offsets, int64_t n, const float* y,
                        float* out, int64_t c0, int64_t c1) {
  constexpr int W = R == 1 ? 8 : R == 2 ? 4 : 2;
  int64_t c = c0;
  for (; c + 8 * W <= c1; c += 8 * W) offsets_tile<R, W>(sums, blocks, offsets, n, y, out, c);
  for (; c + 8 <= c1; c += 8) offsets_tile<R, 1>(sums, blocks, offsets, n, y, out, c);
  return c;
}
#endif

void offsets_item(void* opaque, size_t i) {
  const auto& j = *static_cast<const OffsetsJob*>(opaque);
  const int64_t t0 = static_cast<int64_t>(i) / j.chunks * kRows, rows = std::min(kRows, j.tokens - t0);
  const int64_t c0 = static_cast<int64_t>(i) % j.chunks * kColumns, c1 = std::min(j.n, c0 + kColumns);
  const int64_t blocks = j.k / j.group;
  thread_local std::vector<float> sums;  // [rows, blocks]
  sums.resize(static_cast<size_t>(rows * blocks));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* x = j.x + (t0 + r) * j.k + b * j.group;
      float sum = 0;
      for (int64_t e = 0; e < j.group; ++e) sum += x[e];
      sums[static_cast<size_t>(r * blocks + b)] = sum;
    }
  const float* y = j.y + t0 * j.n;
  float* out = j.out + t0 * j.n;
  int64_t c = c0;
#ifdef ENGINE_KERNELS_AVX2
  switch (rows) {
    case 4: c = offsets_columns<4>(sums.data(), blocks, j.offsets, j.n, y, out, c0, c1); break;
    case 3: c = offsets_columns<3>(sums.data(), blocks, j.offsets, j.n, y, out, c0, c1); break;
    case 2: c = offsets_columns<2>(sums.data(), blocks, j.offsets, j.n, y, out, c0, c1); break;
    default: c = offsets_columns<1>(sums.data(), blocks, j.offsets, j.n, y, out, c0, c1);
  }
#endif
  for (int64_t r = 0; r < rows; ++r)  // the columns left (all of them without AVX2)
    for (int64_t cc = c; cc < c1; ++cc) {
      float acc = y[r * j.n + cc];
      for (int64_t b = 0; b < blocks; ++b) acc += sums[static_cast<size_t>(r * blocks + b)] * j.offsets[b * j.n + cc];
      out[r * j.n + cc] = acc;
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
                 static_cast<const float*>(offsets.data), out, tokens, k, n, kernel.group,
                 (n + kColumns - 1) / kColumns};
  const int64_t row_groups = (tokens + kRows - 1) / kRows;
  parallel_for(kernel.api, context, static_cast<size_t>(row_groups * job.chunks), offsets_item, &job);
}

void* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  Api api(info);
  int64_t group = 0;
  api.check(api->KernelInfoGetAttribute_int64(info, "group_size", &group));
  require(group > 0, kName, "group_size must be positive");
  return new OffsetsKernel{api, group};
}

KernelOp kOp = kernel_op(kName, {kFloat, kFloat, kFloat}, kFloat, 1, create_kernel, compute,
                         destroy_kernel<OffsetsKernel>);

}  // namespace

std::vector<OrtCustomOp*> block_offsets_ops() { return {&kOp}; }

}  // namespace engine_kernels
