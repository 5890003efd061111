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
// Attribute: columns (ints, 2M): [start, stop) of each row block's output columns (q|k|v of a qkv projection),
// consecutive and covering [0, N).
//
// One pass on the kernels' threads, items of 4 tokens x up to 1024 columns of one row block: each copies y and adds
// u[r] * b[s_t, r] over its block's rows in order, u = a[s_t] x_t over those rows. A decode's small nodes take one
// hand-over to the threads (or none: a one-item node runs inline), which is most of their cost. Each token's
// arithmetic depends on its own row alone, so a token gets the same floats in any batch (batched == single).
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ort_abi.h"
#include "simd.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "LoraAdd";
constexpr int64_t kTokens = 4, kColumns = 1024, kMaxRank = 1024;

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
  float* out;
  const std::array<int64_t, 3>* chunk_list;  // (row block, first column, end column) of each column chunk
  int64_t tokens, k, n, r, blocks, chunks;
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

// One item: tokens [t0, t0 + 4) x columns [c0, c1) of one row block (module) m: y copied, then for each token of a
// slot, u = a[s] x over m's rank rows and u @ b[s] over those columns. A module split over several items computes
// its u in each (its A rows then come from the shared cache): one pass, one hand-over to the threads per node.
template <typename W>
void item(void* opaque, size_t i) {
  const auto& j = *static_cast<const LoraJob<W>*>(opaque);
  const int64_t t0 = static_cast<int64_t>(i) / j.chunks * kTokens, t1 = std::min(j.tokens, t0 + kTokens);
  const auto& chunk = j.chunk_list[static_cast<size_t>(i) % static_cast<size_t>(j.chunks)];
  const int64_t m = chunk[0], c0 = chunk[1], c1 = chunk[2], rank = j.r / j.blocks;
  float u[kMaxRank];
  for (int64_t t = t0; t < t1; ++t) {
    float* out = j.out + t * j.n;
    std::memcpy(out + c0, j.y + t * j.n + c0, static_cast<size_t>(c1 - c0) * sizeof(float));
    const int64_t s = j.index[t];
    if (s == 0) continue;
    const W* a = j.a + (s * j.r + m * rank) * j.k;
    for (int64_t r = 0; r < rank; ++r) u[r] = dot(j.x + t * j.k, a + r * j.k, j.k);
    const W* b = j.b + (s * j.r + m * rank) * j.n;
    for (int64_t r = 0; r < rank; ++r)
      if (u[r] != 0) axpy(u[r], b + r * j.n, out, c0, c1);   // a zero-padded rank row adds nothing
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
  require(r / blocks <= kMaxRank, kName, "a's rows per row block exceed 1024");
  int64_t covered = 0;   // the row blocks' ranges follow each other and cover [0, N): every column is written
  for (int64_t m = 0; m < blocks; ++m) {
    require(kernel.columns[2 * m] == covered && covered <= kernel.columns[2 * m + 1], kName,
            "columns must split [0, N) into consecutive ranges, one per row block");
    covered = kernel.columns[2 * m + 1];
  }
  require(covered == n, kName, "columns must split [0, N) into consecutive ranges, one per row block");
  const auto* slot = static_cast<const int64_t*>(index.data);
  for (int64_t t = 0; t < tokens; ++t) require(0 <= slot[t] && slot[t] < slots, kName, "index out of [0, S)");
  float* out = output<float>(kernel.api, context, 0, {tokens, n});
  thread_local std::vector<std::array<int64_t, 3>> chunk_list;
  chunk_list.clear();
  for (int64_t m = 0; m < blocks; ++m)
    for (int64_t c = kernel.columns[2 * m]; c < kernel.columns[2 * m + 1]; c += kColumns)
      chunk_list.push_back({m, c, std::min(c + kColumns, kernel.columns[2 * m + 1])});
  const int64_t chunks = static_cast<int64_t>(chunk_list.size());
  LoraJob<W> job{static_cast<const float*>(x.data), static_cast<const float*>(y.data), static_cast<const W*>(a.data),
                 static_cast<const W*>(b.data), slot, out, chunk_list.data(), tokens, k, n, r, blocks, chunks};
  parallel_for(kernel.api, context, static_cast<size_t>((tokens + kTokens - 1) / kTokens * chunks), item<W>, &job);
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
