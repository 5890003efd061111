// QuantMatMul: x @ W^T for weights of 4 or 8 bits in blocks of `group_size` along K, each block's column holding
// d * q + m (q unsigned; plugins/quant_matmul.py packs it), with the activations rounded to int8 per block as
// MatMulNBits' accuracy level 4 does. Replaces MatMulNBits (+ BlockOffsets for kept Q4_1 blocks) in one pass over
// the weights, which it reads as one stream:
//
//   0 x        float [T, K]
//   1 weights  uint8 [N/16, K/group, 64 + group * 16 * bits / 8]: per tile of 16 columns and block, a 64-byte
//              header, then the block's sub-blocks of 32 K values. Header: offsets=0: float32 d[16] (m is
//              -zero_point * d, zero_point = 2^(bits-1)); offsets=1: float16 d[16] then float16 m[16].
//              Sub-block, 8-bit: byte 64 i + 4 j + e is q[column j, k = 4 i + e]; 4-bit: byte 64 l + 4 j + e holds
//              q[j, 4 l + e] in its low nibble and q[j, 16 + 4 l + e] in its high one
//   out        float [T, N]   sum over blocks b: d * da_b * (q . qa_b) + m * da_b * sum(qa_b)
// where qa_b = round(x_b * 127 / max|x_b|) (int8) and da_b = max|x_b| / 127 for block b of a row of x; with
// offsets=0 the zero point is taken off in integers: d * da_b * (q . qa_b - zero_point * sum(qa_b)).
// Attributes: N, bits, group_size (a multiple of 32), offsets. N is padded to whole tiles with zero columns.
//
// QuantGather (below) reads rows of the same blocks: a tied embedding and a quantized lm_head share one table.
//
// With AVX-512 VNNI each block's dot products are vpdpbusd of the unsigned weights against broadcast groups of 4
// activations, a tile's columns in the 16 lanes; up to 4 rows share each unpacked weight register. Items (a chunk
// of rows x a chunk of tiles) run on ORT's intra-op threads. Without VNNI, plain loops with the same arithmetic.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ort_abi.h"
#include "simd.h"

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ENGINE_KERNELS_VNNI 1
#endif

namespace engine_kernels {
namespace {

constexpr const char* kName = "QuantMatMul";
constexpr int64_t kLanes = 16;     // columns per tile
constexpr int64_t kSub = 32;       // K values per sub-block
constexpr int64_t kHeader = 64;    // bytes of a block's scales
constexpr int64_t kRowChunk = 64;  // rows per work item
constexpr int kRows = 4;           // rows sharing each unpacked weight register

struct QuantKernel {
  Api api;
  int64_t n, bits, group;
  bool offsets;
};

struct Activations {
  std::vector<int8_t> q;     // [T, K]
  std::vector<float> d;      // [T, K / group]: da
  std::vector<int32_t> sum;  // [T, K / group]: sum(qa)
};

struct QuantJob {
  const float* x;
  const uint8_t* w;
  float* out;
  Activations* a;
  int64_t tokens, k, n, bits, group, groups, block_bytes, tiles, tile_chunk, tile_items;
  bool offsets;
};

inline int64_t sub_bytes(int64_t bits) { return kSub * kLanes * bits / 8; }

// Row t of x -> its int8 values, scales and sums, one block at a time.
void quantize_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const QuantJob*>(opaque);
  const float* x = j.x + static_cast<int64_t>(t) * j.k;
  int8_t* q = j.a->q.data() + static_cast<int64_t>(t) * j.k;
  for (int64_t b = 0; b < j.groups; ++b) {
    const float* xb = x + b * j.group;
    int8_t* qb = q + b * j.group;
    float amax = 0;
    int32_t sum = 0;
    int64_t e = 0;
#ifdef ENGINE_KERNELS_VNNI
    __m512 m = _mm512_setzero_ps();
    for (; e < j.group; e += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + e)));
    amax = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    __m512i total = _mm512_setzero_si512();
    for (e = 0; e < j.group; e += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + e), inv));  // nearest, ties even
      total = _mm512_add_epi32(total, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + e), _mm512_cvtepi32_epi8(v));
    }
    sum = _mm512_reduce_add_epi32(total);
#else
    for (; e < j.group; ++e) amax = std::max(amax, std::fabs(xb[e]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    for (e = 0; e < j.group; ++e) {
      qb[e] = static_cast<int8_t>(std::nearbyint(xb[e] * inv));
      sum += qb[e];
    }
#endif
    j.a->d[static_cast<size_t>(t * j.groups + b)] = amax / 127.0f;
    j.a->sum[static_cast<size_t>(t * j.groups + b)] = sum;
  }
}

// q of column c (0..15) at k = kk (0..31) of one sub-block's bytes, as the header comment lays them out.
inline int32_t weight_at(const uint8_t* p, int64_t bits, int64_t c, int64_t kk) {
  if (bits == 8) return p[64 * (kk / 4) + 4 * c + kk % 4];
  const uint8_t v = p[64 * ((kk % 16) / 4) + 4 * c + kk % 4];
  return kk < 16 ? v & 0x0F : v >> 4;
}

float half_to_float(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
  const float magnitude = (h & 0x7C00) ? std::ldexp(static_cast<float>((h & 0x3FF) | 0x400), ((h >> 10) & 0x1F) - 25)
                                       : std::ldexp(static_cast<float>(h & 0x3FF), -24);
  return (h & 0x8000) ? -magnitude : magnitude;
}

#ifdef ENGINE_KERNELS_VNNI
// The 8 registers of one sub-block: register i holds the 4 values k = 4 i .. 4 i + 3 of each column.
template <int Bits>
inline void load_sub(const uint8_t* p, __m512i w[8]) {
  if constexpr (Bits == 8) {
    ENGINE_UNROLL
    for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(p + 64 * i);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    ENGINE_UNROLL
    for (int l = 0; l < 4; ++l) {
      const __m512i v = _mm512_loadu_si512(p + 64 * l);
      w[l] = _mm512_and_si512(v, low);
      w[l + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  }
}

// Output rows t0 .. t0 + R - 1 of one tile: out[r, 0 .. cols) (cols <= 16).
template <int Bits, bool Offsets, int R>
void tile_rows(const QuantJob& j, int64_t tile, int64_t t0, int64_t cols) {
  const int64_t subs = j.group / kSub;
  const uint8_t* p = j.w + tile * j.groups * j.block_bytes;
  const int8_t* qa = j.a->q.data() + t0 * j.k;
  const float* da = j.a->d.data() + t0 * j.groups;
  const int32_t* sum = j.a->sum.data() + t0 * j.groups;
  __m512 acc[R];
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.groups; ++b) {
    const uint8_t* header = p;
    p += kHeader;
    __m512i dot[R][2];  // two chains a row: vpdpbusd's latency, not its throughput, would bound one
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    for (int64_t s = 0; s < subs; ++s, p += sub_bytes(Bits)) {
      __m512i w[8];
      load_sub<Bits>(p, w);
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) {
        const int32_t* a = reinterpret_cast<const int32_t*>(qa + r * j.k + b * j.group + s * kSub);
        ENGINE_UNROLL
        for (int i = 0; i < 8; ++i) dot[r][i & 1] = _mm512_dpbusd_epi32(dot[r][i & 1], w[i], _mm512_set1_epi32(a[i]));
      }
    }
    if constexpr (Offsets) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header + 32)));
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) {
        const float scale = da[r * j.groups + b];
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(dot[r][0], dot[r][1]));
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(scale * static_cast<float>(sum[r * j.groups + b])), acc[r]);
        acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(scale)), acc[r]);
      }
    } else {
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(header));
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512i zero = _mm512_set1_epi32((1 << (Bits - 1)) * sum[r * j.groups + b]);
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(dot[r][0], dot[r][1]), zero));
        acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(da[r * j.groups + b])), acc[r]);
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(j.out + (t0 + r) * j.n + tile * kLanes, keep, acc[r]);
}

template <int Bits, bool Offsets>
void tile(const QuantJob& j, int64_t tile, int64_t t0, int64_t t1, int64_t cols) {
  int64_t t = t0;
  for (; t + kRows <= t1; t += kRows) tile_rows<Bits, Offsets, kRows>(j, tile, t, cols);
  switch (t1 - t) {
    case 3: tile_rows<Bits, Offsets, 3>(j, tile, t, cols); break;
    case 2: tile_rows<Bits, Offsets, 2>(j, tile, t, cols); break;
    case 1: tile_rows<Bits, Offsets, 1>(j, tile, t, cols); break;
    default: break;
  }
}

void tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols) {
  if (j.bits == 4) j.offsets ? tile<4, true>(j, tl, t0, t1, cols) : tile<4, false>(j, tl, t0, t1, cols);
  else j.offsets ? tile<8, true>(j, tl, t0, t1, cols) : tile<8, false>(j, tl, t0, t1, cols);
}
#else
void tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols) {
  const int64_t subs = j.group / kSub;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t* p = j.w + tl * j.groups * j.block_bytes;
      float acc = 0;
      for (int64_t b = 0; b < j.groups; ++b, p += j.block_bytes) {
        int32_t dot = 0;
        for (int64_t s = 0; s < subs; ++s)
          for (int64_t kk = 0; kk < kSub; ++kk)
            dot += weight_at(p + kHeader + s * sub_bytes(j.bits), j.bits, c, kk) *
                   j.a->q[static_cast<size_t>(t * j.k + b * j.group + s * kSub + kk)];
        const float scale = j.a->d[static_cast<size_t>(t * j.groups + b)];
        const int32_t sum = j.a->sum[static_cast<size_t>(t * j.groups + b)];
        if (j.offsets) {
          acc = std::fma(half_to_float(p + 32 + 2 * c), scale * static_cast<float>(sum), acc);
          acc = std::fma(static_cast<float>(dot), half_to_float(p + 2 * c) * scale, acc);
        } else {
          float d;
          std::memcpy(&d, p + 4 * c, sizeof d);
          acc = std::fma(static_cast<float>(dot - (1 << (j.bits - 1)) * sum), d * scale, acc);
        }
      }
      j.out[t * j.n + tl * kLanes + c] = acc;
    }
}
#endif

// Item i: rows [kRowChunk * (i / tile_items), +kRowChunk) x tiles [tile_chunk * (i % tile_items), +tile_chunk).
void matmul_item(void* opaque, size_t i) {
  const auto& j = *static_cast<const QuantJob*>(opaque);
  const int64_t t0 = static_cast<int64_t>(i) / j.tile_items * kRowChunk, t1 = std::min(j.tokens, t0 + kRowChunk);
  const int64_t first = static_cast<int64_t>(i) % j.tile_items * j.tile_chunk;
  for (int64_t tl = first; tl < std::min(j.tiles, first + j.tile_chunk); ++tl) {
    tile(j, tl, t0, t1, std::min(kLanes, j.n - tl * kLanes));
  }
}

void compute(void* opaque, OrtKernelContext* context) {
  const auto& kernel = *static_cast<QuantKernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 2);
  const auto &x = in[0], &w = in[1];
  require(x.shape.size() == 2, kName, "x must be [T, K]");
  const int64_t tokens = x.shape[0], k = x.shape[1], tiles = (kernel.n + kLanes - 1) / kLanes;
  require(k % kernel.group == 0, kName, "K must be a multiple of group_size");
  const int64_t block_bytes = kHeader + kernel.group / kSub * sub_bytes(kernel.bits);
  require(w.shape == std::vector<int64_t>{tiles, k / kernel.group, block_bytes}, kName,
          "weights must be [ceil(N / 16), K / group_size, 64 + group_size * 16 * bits / 8]");
  float* out = output<float>(kernel.api, context, 0, {tokens, kernel.n});
  if (tokens == 0) return;
  thread_local Activations a;
  a.q.resize(static_cast<size_t>(tokens * k));
  a.d.resize(static_cast<size_t>(tokens * k / kernel.group));
  a.sum.resize(a.d.size());
  // A lone row is spread over ~8 items of tiles; many rows take whole row chunks of up to 4 tiles.
  const int64_t tile_chunk = tokens == 1 ? std::clamp<int64_t>(tiles / 8, 1, 4) : 4;
  QuantJob job{static_cast<const float*>(x.data), static_cast<const uint8_t*>(w.data), out, &a, tokens, k,
               kernel.n, kernel.bits, kernel.group, k / kernel.group, block_bytes, tiles, tile_chunk,
               (tiles + tile_chunk - 1) / tile_chunk, kernel.offsets};
  if (tokens == 1) quantize_row(&job, 0);
  else parallel_for(kernel.api, context, static_cast<size_t>(tokens), quantize_row, &job);
  const int64_t row_chunks = (tokens + kRowChunk - 1) / kRowChunk;
  parallel_for(kernel.api, context, static_cast<size_t>(row_chunks * job.tile_items), matmul_item, &job);
}

// QuantGather: rows `ids` of the weight QuantMatMul's blocks hold, dequantized (a tied embedding reading the
// quantized lm_head's table): inputs 0 blocks uint8 [V/16, H/group, bytes] as QuantMatMul's, 1 ids int64 [T];
// out float [T, H] = (q - zero_point) * d, or d * q + m with offsets. Attributes: bits, group_size, offsets.
struct GatherJob {
  const uint8_t* w;
  const int64_t* ids;
  float* out;
  int64_t hidden, bits, group, groups, block_bytes;
  bool offsets;
};

void gather_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const GatherJob*>(opaque);
  const int64_t id = j.ids[t], c = id % kLanes, subs = j.group / kSub;
  const uint8_t* p = j.w + id / kLanes * j.groups * j.block_bytes;
  float* out = j.out + static_cast<int64_t>(t) * j.hidden;
  for (int64_t b = 0; b < j.groups; ++b, p += j.block_bytes)
    for (int64_t s = 0; s < subs; ++s)
      for (int64_t kk = 0; kk < kSub; ++kk) {
        const int32_t q = weight_at(p + kHeader + s * sub_bytes(j.bits), j.bits, c, kk);
        float& y = out[b * j.group + s * kSub + kk];
        if (j.offsets) {
          y = half_to_float(p + 2 * c) * static_cast<float>(q) + half_to_float(p + 32 + 2 * c);
        } else {
          float d;
          std::memcpy(&d, p + 4 * c, sizeof d);
          y = static_cast<float>(q - (1 << (j.bits - 1))) * d;
        }
      }
}

void gather_compute(void* opaque, OrtKernelContext* context) {
  const auto& kernel = *static_cast<QuantKernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 2);
  const auto &w = in[0], &ids = in[1];
  const int64_t block_bytes = kHeader + kernel.group / kSub * sub_bytes(kernel.bits);
  require(w.shape.size() == 3 && w.shape[2] == block_bytes, kName,
          "QuantGather's table must be [V / 16, H / group_size, 64 + group_size * 16 * bits / 8]");
  require(ids.shape.size() == 1, kName, "QuantGather's ids must be [T]");
  const int64_t rows = w.shape[0] * kLanes, tokens = ids.shape[0];
  const auto* id = static_cast<const int64_t*>(ids.data);
  for (int64_t t = 0; t < tokens; ++t)
    require(id[t] >= 0 && id[t] < rows, kName, "QuantGather: an id is outside the table");
  GatherJob job{static_cast<const uint8_t*>(w.data), id, nullptr, w.shape[1] * kernel.group, kernel.bits,
                kernel.group, w.shape[1], block_bytes, kernel.offsets};
  job.out = output<float>(kernel.api, context, 0, {tokens, job.hidden});
  parallel_for(kernel.api, context, static_cast<size_t>(tokens), gather_row, &job);
}

void* create_kernel(const void* table, const OrtKernelInfo* info, bool gather) {
  using GetInt = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);
  Api api(table);
  int64_t n = 0, bits = 0, group = 0, offsets = 0;
  if (gather) n = 1;  // QuantGather reads its sizes from the table
  else api.call<GetInt>(kKernelInfoGetAttributeInt64, info, "N", &n);
  api.call<GetInt>(kKernelInfoGetAttributeInt64, info, "bits", &bits);
  api.call<GetInt>(kKernelInfoGetAttributeInt64, info, "group_size", &group);
  api.call<GetInt>(kKernelInfoGetAttributeInt64, info, "offsets", &offsets);
  require(n > 0, kName, "N must be positive");
  require(bits == 4 || bits == 8, kName, "bits must be 4 or 8");
  require(group > 0 && group % kSub == 0, kName, "group_size must be a positive multiple of 32");
  return new QuantKernel{api, n, bits, group, offsets != 0};
}

KernelOp kOp = kernel_op(
    kName, {kFloat, kUint8}, kFloat, 1,
    [](CustomOp*, const void* table, const OrtKernelInfo* info) { return create_kernel(table, info, false); },
    compute, destroy_kernel<QuantKernel>);
KernelOp kGatherOp = kernel_op(
    "QuantGather", {kUint8, kInt64}, kFloat, 1,
    [](CustomOp*, const void* table, const OrtKernelInfo* info) { return create_kernel(table, info, true); },
    gather_compute, destroy_kernel<QuantKernel>);

}  // namespace

std::vector<CustomOp*> quant_matmul_ops() { return {&kOp, &kGatherOp}; }

}  // namespace engine_kernels
