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
// One pass on the kernels' threads. The tokens are grouped by slot (up to 8 of one slot a group), and an item is a
// group x up to 2048 columns of one row block: it copies y and adds u[r] * b[s, r] over the block's rows in order,
// u = a[s] x over those rows, each A and B row loaded once for the group. A decode's small nodes take one hand-over
// to the threads (or none: a one-item node runs inline), which is most of their cost. Each token's arithmetic
// depends on its own row alone, so a token gets the same floats in any batch (batched == single).
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
constexpr int64_t kTokens = 8, kColumns = 2048, kMaxRank = 1024;

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
inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

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
  const int64_t *index, *order;              // order: the tokens sorted by slot
  const std::array<int64_t, 2>* groups;      // [first, end) in `order` of up to kTokens tokens of one slot
  const std::array<int64_t, 3>* chunk_list;  // (row block, first column, end column) of each column chunk
  float* out;
  int64_t k, n, r, blocks, chunks;
};

// u[t * rank + r] = a[r] . x_t for the group's N tokens, each A row loaded once for all of them. A token's sum is
// two 8-lane chains (even and odd 8-column steps) added at the end, whatever N: its floats do not depend on the
// tokens beside it.
template <int N, typename W>
void group_dots(const float* const* xs, const W* a, int64_t rank, int64_t k, float* u) {
  for (int64_t r = 0; r < rank; ++r) {
    const W* w = a + r * k;
    int64_t i = 0;
    float sums[N] = {};
#ifdef ENGINE_KERNELS_AVX2
    __m256 acc[N][2];
    ENGINE_UNROLL
    for (int t = 0; t < N; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (; i + 16 <= k; i += 16) {
      const __m256 w0 = load8(w + i), w1 = load8(w + i + 8);
      ENGINE_UNROLL
      for (int t = 0; t < N; ++t) {
        acc[t][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + i), w0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + i + 8), w1, acc[t][1]);
      }
    }
    if (i + 8 <= k) {
      const __m256 w0 = load8(w + i);
      ENGINE_UNROLL
      for (int t = 0; t < N; ++t) acc[t][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[t] + i), w0, acc[t][0]);
      i += 8;
    }
    ENGINE_UNROLL
    for (int t = 0; t < N; ++t) sums[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
#endif
    for (int t = 0; t < N; ++t) {
      float sum = sums[t];
      for (int64_t e = i; e < k; ++e) sum += xs[t][e] * value(w[e]);
      u[t * rank + r] = sum;
    }
  }
}

// outs[t][c0, c1) = ys[t][c0, c1) + sum over r of u[t * rank + r] * b[r][c0, c1), r in order; each b row loaded once
// for the group's N tokens. Rows that are zero for every token (a lower rank's padding) are skipped.
template <int N, typename W>
void group_adds(const float* u, int64_t rank, const W* b, int64_t n, const float* const* ys, float* const* outs,
                int64_t c0, int64_t c1) {
  bool live[kMaxRank];
  for (int64_t r = 0; r < rank; ++r) {
    live[r] = false;
    for (int t = 0; t < N; ++t) live[r] = live[r] || u[t * rank + r] != 0;
  }
  int64_t c = c0;
#ifdef ENGINE_KERNELS_AVX2
  for (; c + 8 <= c1; c += 8) {
    __m256 acc[N];
    ENGINE_UNROLL
    for (int t = 0; t < N; ++t) acc[t] = _mm256_loadu_ps(ys[t] + c);
    for (int64_t r = 0; r < rank; ++r) {
      if (!live[r]) continue;
      const __m256 bv = load8(b + r * n + c);
      ENGINE_UNROLL
      for (int t = 0; t < N; ++t) acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(u[t * rank + r]), bv, acc[t]);
    }
    ENGINE_UNROLL
    for (int t = 0; t < N; ++t) _mm256_storeu_ps(outs[t] + c, acc[t]);
  }
#endif
  for (; c < c1; ++c)
    for (int t = 0; t < N; ++t) {
      float o = ys[t][c];
      for (int64_t r = 0; r < rank; ++r)
        if (live[r]) o += u[t * rank + r] * value(b[r * n + c]);
      outs[t][c] = o;
    }
}

template <int N, typename W>
void group(const LoraJob<W>& j, const int64_t* tokens, int64_t m, int64_t c0, int64_t c1) {
  const int64_t rank = j.r / j.blocks, s = j.index[tokens[0]];
  const float* xs[N];
  const float* ys[N];
  float* outs[N];
  for (int t = 0; t < N; ++t) {
    xs[t] = j.x + tokens[t] * j.k;
    ys[t] = j.y + tokens[t] * j.n;
    outs[t] = j.out + tokens[t] * j.n;
  }
  if (s == 0) {   // no adapter: the projection's output as it is
    for (int t = 0; t < N; ++t) std::memcpy(outs[t] + c0, ys[t] + c0, static_cast<size_t>(c1 - c0) * sizeof(float));
    return;
  }
  float u[N * kMaxRank];
  group_dots<N>(xs, j.a + (s * j.r + m * rank) * j.k, rank, j.k, u);
  group_adds<N>(u, rank, j.b + (s * j.r + m * rank) * j.n, j.n, ys, outs, c0, c1);
}

// One item: a group of same-slot tokens x one column chunk of one row block (module) m. A module split over several
// chunks computes its u in each (its A rows then come from the shared cache): one pass, one hand-over to the
// threads per node, none for a one-item node.
template <typename W>
void item(void* opaque, size_t i) {
  const auto& j = *static_cast<const LoraJob<W>*>(opaque);
  const auto& g = j.groups[i / static_cast<size_t>(j.chunks)];
  const auto& chunk = j.chunk_list[i % static_cast<size_t>(j.chunks)];
  const int64_t* tokens = j.order + g[0];
  switch (g[1] - g[0]) {
    case 8: group<8>(j, tokens, chunk[0], chunk[1], chunk[2]); break;
    case 7: group<7>(j, tokens, chunk[0], chunk[1], chunk[2]); break;
    case 6: group<6>(j, tokens, chunk[0], chunk[1], chunk[2]); break;
    case 5: group<5>(j, tokens, chunk[0], chunk[1], chunk[2]); break;
    case 4: group<4>(j, tokens, chunk[0], chunk[1], chunk[2]); break;
    case 3: group<3>(j, tokens, chunk[0], chunk[1], chunk[2]); break;
    case 2: group<2>(j, tokens, chunk[0], chunk[1], chunk[2]); break;
    default: group<1>(j, tokens, chunk[0], chunk[1], chunk[2]);
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
  thread_local std::vector<int64_t> order;
  thread_local std::vector<std::array<int64_t, 2>> groups;
  order.resize(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) order[static_cast<size_t>(t)] = t;
  std::stable_sort(order.begin(), order.end(), [slot](int64_t p, int64_t q) { return slot[p] < slot[q]; });
  groups.clear();
  for (int64_t first = 0; first < tokens;) {
    int64_t end = first + 1;
    while (end < tokens && end - first < kTokens && slot[order[end]] == slot[order[first]]) ++end;
    groups.push_back({first, end});
    first = end;
  }
  thread_local std::vector<std::array<int64_t, 3>> chunk_list;
  chunk_list.clear();
  for (int64_t m = 0; m < blocks; ++m)
    for (int64_t c = kernel.columns[2 * m]; c < kernel.columns[2 * m + 1]; c += kColumns)
      chunk_list.push_back({m, c, std::min(c + kColumns, kernel.columns[2 * m + 1])});
  const int64_t chunks = static_cast<int64_t>(chunk_list.size());
  LoraJob<W> job{static_cast<const float*>(x.data), static_cast<const float*>(y.data), static_cast<const W*>(a.data),
                 static_cast<const W*>(b.data), slot, order.data(), groups.data(), chunk_list.data(), out, k, n, r,
                 blocks, chunks};
  parallel_for(kernel.api, context, groups.size() * static_cast<size_t>(chunks), item<W>, &job);
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
