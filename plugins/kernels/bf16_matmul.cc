// Bf16MatMul: x @ W^T for a weight stored in bfloat16 (a 16-bit lm_head: half the bytes of float32 at a decode
// step, where lm_head is a quantized engine's largest read), and Bf16Gather: rows of the same table (a tied
// embedding reading it, so the table is stored once).
//
//   0 x        float [T, K], K a multiple of 32
//   1 weights  uint16 [N/16, K/32, 16, 32]: bfloat16 bits, per tile of 16 columns and chunk of 32 K values the
//              AMX B tile: row i holds column j's pair k = 2 i, 2 i + 1 at 2 j, 2 j + 1 (plugins/bf16_matmul.py)
//   out        float [T, N] = bf16(x) @ W^T, the products summed in float32
//
// The activations are rounded to bfloat16 (nearest, ties even) as the AMX-BF16 tiles of QuantMatMul round them:
// a row's 32 K values at a time. Calls of >= 4 rows on AMX-BF16: quant_bf16.h's tile products, reading the stored
// tiles as they are (from 4 rows as fast as the vector code, and at 16 rows 2.5x faster). Fewer rows, or no AMX:
// AVX-512 BF16 vdpbf16ps of each B row against the row's broadcast pair, up to 4 rows sharing each load, the weight
// stream prefetched ahead. Elsewhere: plain loops, the same arithmetic.
// Attribute: N. N is padded to whole tiles with zero columns.
#include <algorithm>
#include <cstring>
#include <vector>

#include "ort_abi.h"
#include "quant_bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define ENGINE_KERNELS_DPBF16 1
#endif

namespace engine_kernels {
namespace {

using quant::kChunk;
using quant::kLanes;

constexpr const char* kName = "Bf16MatMul";
constexpr int kRowsAtOnce = 4;         // rows sharing each loaded B row
constexpr int64_t kAmxFromRows = 4;    // fewest rows a call takes through AMX-BF16 (bench/NOTES.md entry 32)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of its reads the weight stream is prefetched

struct Bf16Kernel {
  Api api;
  int64_t n;
};

struct Bf16Job {
  const float* x;
  const uint16_t* w;
  float* out;
  uint16_t* xb;  // x rounded to bfloat16, [T, K]
  int64_t tokens, k, n, tiles, tile_chunk, tile_items;
};

inline uint16_t to_bf16(float f) {  // nearest, ties even (finite values; NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The element of a tile (its [K / 32][16][32] B tiles) holding column c's value at k: chunk k / 32, B row
// (k % 32) / 2, pair position 2 c + k % 2.
inline int64_t tile_element(int64_t k, int64_t c) {
  return (k / kChunk) * kChunk * kLanes + (k % kChunk) / 2 * kChunk + 2 * c + k % 2;
}

void round_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const Bf16Job*>(opaque);
  const float* x = j.x + static_cast<int64_t>(t) * j.k;
  uint16_t* xb = j.xb + static_cast<int64_t>(t) * j.k;
  int64_t e = 0;
#ifdef ENGINE_KERNELS_DPBF16
  for (; e + 32 <= j.k; e += 32)
    _mm512_storeu_si512(xb + e, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + e + 16), _mm512_loadu_ps(x + e)));
#endif
  for (; e < j.k; ++e) xb[e] = to_bf16(x[e]);
}

// Rows t0 .. t0 + Rows - 1 of tile tl.
template <int Rows>
void tile_rows(const Bf16Job& j, int64_t tl, int64_t t0) {
  const uint16_t* b = j.w + tl * j.k * kLanes;
  const int64_t cols = std::min(kLanes, j.n - tl * kLanes);
#ifdef ENGINE_KERNELS_DPBF16
  __m512 even[Rows], odd[Rows];
  ENGINE_UNROLL
  for (int r = 0; r < Rows; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const auto* pairs = reinterpret_cast<const uint32_t*>(j.xb);   // row t's pair p at t * K / 2 + p
  const int64_t half = j.k / 2;
  for (int64_t p = 0; p < half; p += 2, b += 2 * 2 * kLanes) {  // B rows p, p + 1: pairs p and p + 1 of K
    _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 2 * kLanes);
    ENGINE_UNROLL
    for (int r = 0; r < Rows; ++r) {
      const uint32_t* a = pairs + (t0 + r) * half + p;
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(a[0])), (__m512bh)b0);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(a[1])), (__m512bh)b1);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  ENGINE_UNROLL
  for (int r = 0; r < Rows; ++r)
    _mm512_mask_storeu_ps(j.out + (t0 + r) * j.n + tl * kLanes, keep, _mm512_add_ps(even[r], odd[r]));
#else
  for (int r = 0; r < Rows; ++r) {
    const uint16_t* a = j.xb + (t0 + r) * j.k;
    float sums[kLanes] = {};
    for (int64_t kk = 0; kk < j.k; ++kk)
      for (int64_t c = 0; c < kLanes; ++c) sums[c] += from_bf16(a[kk]) * from_bf16(b[tile_element(kk, c)]);
    for (int64_t c = 0; c < cols; ++c) j.out[(t0 + r) * j.n + tl * kLanes + c] = sums[c];
  }
#endif
}

// Item i: tiles [tile_chunk * i, +tile_chunk) x every row, kRowsAtOnce rows at a time.
void rows_item(void* opaque, size_t i) {
  const auto& j = *static_cast<const Bf16Job*>(opaque);
  const int64_t first = static_cast<int64_t>(i) * j.tile_chunk, last = std::min(j.tiles, first + j.tile_chunk);
  for (int64_t tl = first; tl < last; ++tl) {
    int64_t t = 0;
    for (; t + kRowsAtOnce <= j.tokens; t += kRowsAtOnce) tile_rows<kRowsAtOnce>(j, tl, t);
    for (; t < j.tokens; ++t) tile_rows<1>(j, tl, t);
  }
}

#ifdef ENGINE_KERNELS_AMX_BF16
// Many rows: the stored tiles are quant_bf16.h's B tiles already; item i = tiles 2 i, 2 i + 1 x every row.
void amx_item(void* opaque, size_t i) {
  const auto& j = *static_cast<const quant::QuantJob*>(opaque);
  const int64_t tl = 2 * static_cast<int64_t>(i);
  const auto* w = reinterpret_cast<const uint16_t*>(j.w);
  const FullTiles config;  // as quant_bf16.h's items: 0-3 C, 4-5 A, 6-7 B
  _tile_loadconfig(&config);
  if (tl + 1 < j.tiles) quant::bf16_rows_of<2>(j, tl, w + tl * j.k * kLanes, w + (tl + 1) * j.k * kLanes);
  else quant::bf16_rows_of<1>(j, tl, w + tl * j.k * kLanes, nullptr);
  _tile_release();
}
#endif

void compute(void* opaque, OrtKernelContext* context) {
  const TracedOp traced(kTraceBf16MatMul);
  const auto& kernel = *static_cast<Bf16Kernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 2);
  const auto &x = in[0], &w = in[1];
  require(x.shape.size() == 2 && x.shape[1] % kChunk == 0, kName, "x must be [T, K] with K a multiple of 32");
  const int64_t tokens = x.shape[0], k = x.shape[1], tiles = (kernel.n + kLanes - 1) / kLanes;
  require(w.shape == std::vector<int64_t>{tiles, k / kChunk, kLanes, kChunk}, kName,
          "weights must be [ceil(N / 16), K / 32, 16, 32]");
  float* out = output<float>(kernel.api, context, 0, {tokens, kernel.n});
  if (tokens == 0) return;
#ifdef ENGINE_KERNELS_AMX_BF16
  if (tokens >= kAmxFromRows && quant::amx_ready()) {
    thread_local quant::Activations a;
    quant::QuantJob job{static_cast<const float*>(x.data), static_cast<const uint8_t*>(w.data), out, &a, tokens, k,
                        kernel.n, 16, kChunk, k / kChunk, 0, tiles, 2, (tiles + 1) / 2, false};
    quant::size_bf16_rows(job);
    parallel_for(kernel.api, context, static_cast<size_t>(quant::bf16_groups(tokens)), quant::pack_bf16, &job);
    parallel_for(kernel.api, context, static_cast<size_t>(job.tile_items), amx_item, &job);
    return;
  }
#endif
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(static_cast<size_t>(tokens * k));
  // A lone row is spread over ~8 items of tiles per thread's share; more rows take 4 tiles an item.
  const int64_t tile_chunk = tokens == 1 ? std::clamp<int64_t>(tiles / 8, 1, 4) : 4;
  Bf16Job job{static_cast<const float*>(x.data), static_cast<const uint16_t*>(w.data), out, rounded.data(),
              tokens, k, kernel.n, tiles, tile_chunk, (tiles + tile_chunk - 1) / tile_chunk};
  if (tokens == 1) round_row(&job, 0);
  else parallel_for(kernel.api, context, static_cast<size_t>(tokens), round_row, &job);
  parallel_for(kernel.api, context, static_cast<size_t>(job.tile_items), rows_item, &job);
}

// Bf16Gather: inputs 0 table uint16 [V/16, H/32, 16, 32] as Bf16MatMul's weights, 1 ids int64 [T]; out float [T, H].
struct GatherJob {
  const uint16_t* w;
  const int64_t* ids;
  float* out;
  int64_t hidden;
};

void gather_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const GatherJob*>(opaque);
  const int64_t id = j.ids[t], c = id % kLanes;
  const uint16_t* tile = j.w + id / kLanes * j.hidden * kLanes;
  float* out = j.out + static_cast<int64_t>(t) * j.hidden;
  for (int64_t kk = 0; kk < j.hidden; ++kk) out[kk] = from_bf16(tile[tile_element(kk, c)]);
}

void gather_compute(void* opaque, OrtKernelContext* context) {
  const auto& kernel = *static_cast<Bf16Kernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 2);
  const auto &w = in[0], &ids = in[1];
  require(w.shape.size() == 4 && w.shape[2] == kLanes && w.shape[3] == kChunk, "Bf16Gather",
          "the table must be [V / 16, H / 32, 16, 32]");
  require(ids.shape.size() == 1, "Bf16Gather", "ids must be [T]");
  const int64_t rows = w.shape[0] * kLanes, tokens = ids.shape[0];
  const auto* id = static_cast<const int64_t*>(ids.data);
  for (int64_t t = 0; t < tokens; ++t) require(id[t] >= 0 && id[t] < rows, "Bf16Gather", "an id is outside the table");
  GatherJob job{static_cast<const uint16_t*>(w.data), id, nullptr, w.shape[1] * kChunk};
  job.out = output<float>(kernel.api, context, 0, {tokens, job.hidden});
  parallel_for(kernel.api, context, static_cast<size_t>(tokens), gather_row, &job);
}

void* create_kernel(const OrtKernelInfo* info, bool gather) {
  Api api(info);
  int64_t n = 1;  // Bf16Gather reads its sizes from the table
  if (!gather) api.check(api->KernelInfoGetAttribute_int64(info, "N", &n));
  require(n > 0, kName, "N must be positive");
  return new Bf16Kernel{api, n};
}

KernelOp kOp = kernel_op(
    kName, {kFloat, kUint16}, kFloat, 1,
    [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) { return create_kernel(info, false); },
    compute, destroy_kernel<Bf16Kernel>);
KernelOp kGatherOp = kernel_op(
    "Bf16Gather", {kUint16, kInt64}, kFloat, 1,
    [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) { return create_kernel(info, true); },
    gather_compute, destroy_kernel<Bf16Kernel>);

}  // namespace

std::vector<OrtCustomOp*> bf16_matmul_ops() { return {&kOp, &kGatherOp}; }

}  // namespace engine_kernels
