// LoraAdd: a projection's output plus each token's LoRA delta, for a step whose tokens use different adapters
// (plugins/lora.py, core/lora.py):
//
//   0 y       float [T, N]      the projection's output
//   1 x       float [T, K]      its input
//   2 index   int64 [T]         each token's adapter slot; slot 0 is "no adapter" (its tokens are copied)
//   3 a       W [S, R, K]       per slot, R rows of A: M row blocks of R / M rows, one per module of the group
//   4 b       W [S, R, N]       per slot, the rows of B^T (scaled); block m's rows add only to its own columns
// W is float (LoraAdd) or bfloat16 (LoraAddBf16: half the bytes a token streams, BuildConfig.lora_dtype).
//   out       float [T, N]      y + (a[s_t] x_t) @ b[s_t]
// Attribute: columns (ints, 2M): [start, stop) of each row block's output columns (q|k|v of a qkv projection).
//
// Two passes on the kernels' threads: u[t, r] = a[s_t, r] . x_t (items: 4 tokens x 16 rows), then each output
// item (4 tokens x 512 columns) copies y and adds u[t, r] * b[s_t, r] over its block's rows in order. Each token's
// arithmetic depends on its own row alone, so a token gets the same floats in any batch (batched == single).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ort_abi.h"
#include "simd.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "LoraAdd";
constexpr int64_t kTokens = 4, kRows = 16, kColumns = 512;

struct Bf16 {
  uint16_t bits;
};

inline float value(float w) { return w; }
inline float value(Bf16 w) {
  const uint32_t bits = static_cast<uint32_t>(w.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef ENGINE_KERNELS_AVX2
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const Bf16* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

struct LoraKernel {
  Api api;
  std::vector<int64_t> columns;  // 2 per row block
};

template <typename W>
struct LoraJob {
  const float *x, *y;
  const W *a, *b;
  const int64_t* index;
  float *out, *u;
  const int64_t* columns;
  int64_t tokens, k, n, r, slots, blocks, row_chunks, column_chunks;
};

template <typename W>
inline float dot(const float* x, const W* w, int64_t k) {
  int64_t i = 0;
  float sum = 0;
#ifdef ENGINE_KERNELS_AVX2
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; i + 32 <= k; i += 32)
    ENGINE_UNROLL
    for (int v = 0; v < 4; ++v) acc[v] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8 * v), load8(w + i + 8 * v), acc[v]);
  for (; i + 8 <= k; i += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w + i), acc[0]);
  const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  sum = _mm_cvtss_f32(h);
#endif
  for (; i < k; ++i) sum += x[i] * value(w[i]);
  return sum;
}

// out[c0, c1) += u * b[c0, c1)
template <typename W>
inline void axpy(float u, const W* b, float* out, int64_t c0, int64_t c1) {
  int64_t c = c0;
#ifdef ENGINE_KERNELS_AVX2
  const __m256 s = _mm256_set1_ps(u);
  for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(out + c, _mm256_fmadd_ps(s, load8(b + c), _mm256_loadu_ps(out + c)));
#endif
  for (; c < c1; ++c) out[c] += u * value(b[c]);
}

template <typename W>
void down_item(void* opaque, size_t i) {  // u for 4 tokens x 16 rows of A
  const auto& j = *static_cast<const LoraJob<W>*>(opaque);
  const int64_t t0 = static_cast<int64_t>(i) / j.row_chunks * kTokens, t1 = std::min(j.tokens, t0 + kTokens);
  const int64_t r0 = static_cast<int64_t>(i) % j.row_chunks * kRows, r1 = std::min(j.r, r0 + kRows);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t s = j.index[t];
    if (s == 0) continue;
    const W* a = j.a + s * j.r * j.k;
    for (int64_t r = r0; r < r1; ++r) j.u[t * j.r + r] = dot(j.x + t * j.k, a + r * j.k, j.k);
  }
}

template <typename W>
void up_item(void* opaque, size_t i) {  // out for 4 tokens x 512 columns
  const auto& j = *static_cast<const LoraJob<W>*>(opaque);
  const int64_t t0 = static_cast<int64_t>(i) / j.column_chunks * kTokens, t1 = std::min(j.tokens, t0 + kTokens);
  const int64_t c0 = static_cast<int64_t>(i) % j.column_chunks * kColumns, c1 = std::min(j.n, c0 + kColumns);
  const int64_t rank = j.r / j.blocks;
  for (int64_t t = t0; t < t1; ++t) {
    float* out = j.out + t * j.n;
    std::memcpy(out + c0, j.y + t * j.n + c0, static_cast<size_t>(c1 - c0) * sizeof(float));
    const int64_t s = j.index[t];
    if (s == 0) continue;
    for (int64_t m = 0; m < j.blocks; ++m) {
      const int64_t lo = std::max(c0, j.columns[2 * m]), hi = std::min(c1, j.columns[2 * m + 1]);
      if (lo >= hi) continue;
      for (int64_t r = m * rank; r < (m + 1) * rank; ++r) {
        const float u = j.u[t * j.r + r];
        if (u != 0) axpy(u, j.b + (s * j.r + r) * j.n, out, lo, hi);  // a zero-padded rank row adds nothing
      }
    }
  }
}

template <typename W>
void compute(void* opaque, OrtKernelContext* context) {
  const auto& kernel = *static_cast<LoraKernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 5);
  const auto &y = in[0], &x = in[1], &index = in[2], &a = in[3], &b = in[4];
  require(y.shape.size() == 2 && x.shape.size() == 2 && y.shape[0] == x.shape[0], kName,
          "y must be [T, N] and x [T, K]");
  const int64_t tokens = y.shape[0], n = y.shape[1], k = x.shape[1];
  require(index.shape == std::vector<int64_t>{tokens}, kName, "index must be [T]");
  require(a.shape.size() == 3 && a.shape[2] == k, kName, "a must be [S, R, K]");
  const int64_t slots = a.shape[0], r = a.shape[1], blocks = static_cast<int64_t>(kernel.columns.size()) / 2;
  require(b.shape == std::vector<int64_t>{slots, r, n}, kName, "b must be [S, R, N] with a's S and R");
  require(r % blocks == 0, kName, "a's R must be a whole number of rows per row block");
  for (int64_t m = 0; m < blocks; ++m)
    require(0 <= kernel.columns[2 * m] && kernel.columns[2 * m] <= kernel.columns[2 * m + 1] &&
                kernel.columns[2 * m + 1] <= n, kName, "columns must lie within [0, N)");
  const auto* slot = static_cast<const int64_t*>(index.data);
  for (int64_t t = 0; t < tokens; ++t) require(0 <= slot[t] && slot[t] < slots, kName, "index out of [0, S)");
  float* out = output<float>(kernel.api, context, 0, {tokens, n});
  thread_local std::vector<float> u;
  u.assign(static_cast<size_t>(tokens * r), 0.0f);
  LoraJob<W> job{static_cast<const float*>(x.data), static_cast<const float*>(y.data), static_cast<const W*>(a.data),
                 static_cast<const W*>(b.data), slot, out, u.data(), kernel.columns.data(), tokens, k, n, r, slots,
                 blocks, (r + kRows - 1) / kRows, (n + kColumns - 1) / kColumns};
  const int64_t token_blocks = (tokens + kTokens - 1) / kTokens;
  if (r > 0) parallel_for(kernel.api, context, static_cast<size_t>(token_blocks * job.row_chunks), down_item<W>, &job);
  parallel_for(kernel.api, context, static_cast<size_t>(token_blocks * job.column_chunks), up_item<W>, &job);
}

void* create_kernel(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  Api api(info);
  size_t count = 0;
  api.check(api->KernelInfoGetAttributeArray_int64(info, "columns", nullptr, &count));
  std::vector<int64_t> columns(count);
  if (count) api.check(api->KernelInfoGetAttributeArray_int64(info, "columns", columns.data(), &count));
  require(count >= 2 && count % 2 == 0, kName, "columns must hold [start, stop) pairs");
  return new LoraKernel{api, std::move(columns)};
}

KernelOp kOp = kernel_op(kName, {kFloat, kFloat, kInt64, kFloat, kFloat}, kFloat, 1, create_kernel, compute<float>,
                         destroy_kernel<LoraKernel>);
KernelOp kOpBf16 = kernel_op("LoraAddBf16", {kFloat, kFloat, kInt64, kBFloat16, kBFloat16}, kFloat, 1, create_kernel,
                             compute<Bf16>, destroy_kernel<LoraKernel>);

}  // namespace

std::vector<OrtCustomOp*> lora_ops() { return {&kOp, &kOpBf16}; }

}  // namespace engine_kernels
