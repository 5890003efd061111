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
// A call of >= 64 rows on a CPU with AMX-BF16 computes x @ W^T in bfloat16 instead (quant_bf16.h: W and x rounded
// to bfloat16, summed in float32), closer to the exact product than int8 activations.
// Attributes: N, bits, group_size (a multiple of 32), offsets; swiglu (optional, default 0): 1 makes the output
// [T, N / 2] = silu(y[:, :N/2]) * y[:, N/2:] of the projection y (a fused gate|up, N / 2 a multiple of 16; the
// SwiGLU op's math, swiglu.h), which the bfloat16 and the vector tiles write without storing y (AMX int8 tiles stage
// it). N is padded to whole tiles with zero columns.
//
// bits=32: the weights are float32 (a float32 engine's projections, plugins/quant_matmul.py pack_float), a tile's
// K x 16 values in order with no header, and out = x @ W^T in float32 on the vector code (float_tiles.h) for any
// number of rows: weights uint8 [N/16, K/group, group * 64] (the builder gives group_size = K: one block a tile),
// offsets=0. Every fused form below takes them as it takes the quantized ones.
//
// QuantMatMulAddRMSNorm: QuantMatMul followed by AddRMSNorm (add_rms_norm.cc) of its output in one node, for a
// projection whose only reader is the residual add and norm after it (plugins/rms_norm.py: o_proj and down_proj of
// a layer). Inputs 0-1 as QuantMatMul's, 2 residual float [T, N], 3 weight float [N]; out 0 the norm, out 1 the
// total y + residual (y the projection, written into out 1 and added to in place); attribute epsilon besides
// QuantMatMul's. One node fewer a norm: ~3 us a node of ORT dispatch at a SmolLM2 decode step (bench/NOTES.md 42).
//
// QuantMLP: a gated MLP's two projections in one node, gate|up (swiglu=1) then down, the [T, N / 2] between them
// in a buffer of the calling thread's: inputs x, the gate|up weights, the down weights; attributes QuantMatMul's
// for gate|up and down_N, down_bits, down_group_size, down_offsets for down. QuantMLPAddRMSNorm adds the residual
// and norm after it as QuantMatMulAddRMSNorm does (inputs 3, 4). Each is the unfused nodes' arithmetic exactly.
// On the vector code the SwiGLU tiles also round the [T, N / 2] to down's int8 blocks as they write them (when an
// item's columns are whole blocks of down's), so down reads them at once: one pass over the hidden rows and one
// parallel loop fewer (a 16 x 128 prefill 1.012-1.014x, bench/NOTES.md entry 44).
//
// QuantGather (below) reads rows of the same blocks: a tied embedding and a quantized lm_head share one table.
//
// The tiles' vector code (AVX-512 VNNI, AVX2) is in quant_tiles.h; rows 16 at a time on AMX's int8 tiles in
// quant_amx.h. Items (a chunk of rows x a chunk of tiles) run on ORT's intra-op threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "add_rms_norm.h"
#include "float_tiles.h"
#include "ort_abi.h"
#include "quant_bf16.h"
#include "quant_project.h"
#include "swiglu.h"

namespace engine_kernels {
namespace {

using namespace quant;  // NOLINT: the tiles' job, layout constants and helpers

constexpr const char* kName = "QuantMatMul";

struct QuantKernel {
  Api api;
  Projection first;
  bool mlp = false;  // QuantMLP*: `down` projects first's output (gate|up with swiglu) on
  Projection down{};
  bool add_norm = false;  // *AddRMSNorm
  float epsilon = 0;
  int64_t out_n() const { return mlp ? down.out_n() : first.out_n(); }
};

// sum(qa) of each 16 and each 32 values of block `at` (the K-quant tiles read them).
inline void half_sums(const int8_t* qb, int64_t group, Activations& a, size_t at) {
  for (int64_t h = 0; h < group / 16; ++h) {
    int32_t sum = 0;
    for (int64_t e = 0; e < 16; ++e) sum += qb[16 * h + e];
    a.sum16[at * group / 16 + h] = static_cast<int16_t>(sum);
  }
  for (int64_t s = 0; s < group / 32; ++s)
    a.sum32[at * group / 32 + s] =
        static_cast<int16_t>(a.sum16[at * group / 16 + 2 * s] + a.sum16[at * group / 16 + 2 * s + 1]);
}

// One block of `group` values xb -> its int8 values qb, their scale da and sum, da * sum and zero * sum (the shifts
// of blocks with offsets and without, zero the weights' zero point), at `at` of a's per-block arrays.
void quantize_block(const float* xb, int64_t group, int8_t* qb, Activations& a, size_t at, int32_t zero) {
  float amax = 0;
  int32_t sum = 0;
  int64_t e = 0;
#ifdef ENGINE_KERNELS_VNNI
  __m512 m = _mm512_setzero_ps();
  for (; e < group; e += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + e)));
  amax = _mm512_reduce_max_ps(m);
  const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  for (e = 0; e < group; e += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + e), inv));  // nearest, ties even
    const int32_t half = _mm512_reduce_add_epi32(v);
    a.sum16[at * group / 16 + e / 16] = static_cast<int16_t>(half);
    if (e % 32 == 16)
      a.sum32[at * group / 32 + e / 32] = static_cast<int16_t>(a.sum16[at * group / 16 + e / 16 - 1] + half);
    sum += half;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + e), _mm512_cvtepi32_epi8(v));
  }
#elif defined(ENGINE_KERNELS_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (; e < group; e += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + e)));
  for (int lane = 0; lane < 8; ++lane) amax = std::max(amax, m[lane]);
  const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  __m256i total = _mm256_setzero_si256();
  for (e = 0; e < group; e += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + e), inv));  // nearest, ties even
    total = _mm256_add_epi32(total, v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(qb + e), _mm_packs_epi16(w, w));
  }
  int32_t lanes[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), total);
  for (int lane = 0; lane < 8; ++lane) sum += lanes[lane];
  half_sums(qb, group, a, at);
#else
  for (; e < group; ++e) amax = std::max(amax, std::fabs(xb[e]));
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  for (e = 0; e < group; ++e) {
    qb[e] = static_cast<int8_t>(std::nearbyint(xb[e] * inv));
    sum += qb[e];
  }
  half_sums(qb, group, a, at);
#endif
  a.d[at] = amax / 127.0f;
  a.sum[at] = sum;
  a.dasum[at] = amax / 127.0f * static_cast<float>(sum);
  a.zero_sum[at] = zero * sum;
}

// a's arrays sized for `tokens` rows of k values in blocks of `group`.
void sized_for(Activations& a, int64_t tokens, int64_t k, int64_t group) {
  a.q.resize(static_cast<size_t>(tokens * k));
  a.d.resize(static_cast<size_t>(tokens * k / group));
  a.sum.resize(a.d.size());
  a.dasum.resize(a.d.size());
  a.zero_sum.resize(a.d.size());
  a.sum16.resize(static_cast<size_t>(tokens * k / 16));
  a.sum32.resize(static_cast<size_t>(tokens * k / 32));
}

// Row t of x -> its int8 values, scales and sums, one block at a time.
void quantize_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const QuantJob*>(opaque);
  const int64_t row = static_cast<int64_t>(t), group = j.group, blocks = j.k / group;
  for (int64_t b = 0; b < blocks; ++b)
    quantize_block(j.x + row * j.k + b * group, group, j.a->q.data() + row * j.k + b * group, *j.a,
                   static_cast<size_t>(row * blocks + b), zero_point(j.bits, j.offsets));
}

// Rows t0 .. t1 - 1 of gate tiles first .. last - 1 (< tiles / 2) of a swiglu job and of their up tiles (+ tiles
// / 2), each into a buffer of this thread's, then silu(gate) * up into out [T, N / 2] (swiglu.h): the [T, N]
// projection is never stored (a [2048, 3072] one was 25 MB a prefill step to write and read back, bench/NOTES.md 43).
void swiglu_tiles(const QuantJob& j, int64_t t0, int64_t t1, int64_t first, int64_t last) {
  thread_local std::vector<float> gate, up;
  gate.resize(static_cast<size_t>((t1 - t0) * kLanes));
  up.resize(gate.size());
  const int64_t width = j.n / 2;
  for (int64_t tl = first; tl < last; ++tl) {
    const int64_t tiles[2] = {tl, tl + j.tiles / 2}, cols[2] = {kLanes, kLanes};
    const TileOut outs[2] = {TileOut{gate.data(), kLanes, t0}, TileOut{up.data(), kLanes, t0}};
    tile_pair(j, tiles, t0, t1, cols, outs);
    for (int64_t t = t0; t < t1; ++t)
      swiglu_span(gate.data() + (t - t0) * kLanes, up.data() + (t - t0) * kLanes, j.out + t * width + tl * kLanes,
                  kLanes);
  }
  if (j.next == nullptr) return;
  // the item's columns are whole blocks of the next projection (project() checks): quantize them while in cache
  const int64_t g = j.next_group, blocks = width / g;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = first * kLanes / g; b < last * kLanes / g; ++b)
      quantize_block(j.out + t * width + b * g, g, j.next->q.data() + t * width + b * g, *j.next,
                     static_cast<size_t>(t * blocks + b), j.next_zero);
}

// Item i: rows [row_chunk * (i / tile_items), +row_chunk) x tiles [tile_chunk * (i % tile_items), +tile_chunk) (of
// the gate tiles, with swiglu).
void matmul_item(void* opaque, size_t i) {
  const auto& j = *static_cast<const QuantJob*>(opaque);
  const int64_t t0 = static_cast<int64_t>(i) / j.tile_items * j.row_chunk;
  const int64_t t1 = std::min(j.tokens, t0 + j.row_chunk);
  const int64_t first = static_cast<int64_t>(i) % j.tile_items * j.tile_chunk;
  const int64_t last = std::min(j.item_tiles(), first + j.tile_chunk);
  if (j.swiglu) return swiglu_tiles(j, t0, t1, first, last);
  if (j.bits != kFloatBits && amx_tiles(j, t0, t1, first, last)) return;
  auto cols = [&](int64_t tl) { return std::min(kLanes, j.n - tl * kLanes); };
  for (int64_t tl = first; tl < last; tl += 2) {
    if (tl + 1 == last) return tile(j, tl, t0, t1, cols(tl), job_out(j, tl));
    const int64_t tiles[2] = {tl, tl + 1}, widths[2] = {cols(tl), cols(tl + 1)};
    const TileOut outs[2] = {job_out(j, tl), job_out(j, tl + 1)};
    tile_pair(j, tiles, t0, t1, widths, outs);
  }
}

}  // namespace

void check_weights(const Projection& p, int64_t k, const Tensor& w, const char* op) {
  require(k % p.group == 0, op, "K must be a multiple of group_size");
  const int64_t tiles = (p.n + kLanes - 1) / kLanes;
  require(w.shape == std::vector<int64_t>{tiles, k / p.group, block_bytes(p.bits, p.group, p.scales)}, op,
          p.bits == kFloatBits ? "float32 weights must be [ceil(N / 16), K / group_size, group_size * 64]"
          : p.scales ? "K-quant weights must be [ceil(N / 16), K / 256, 64 + 256 + 256 * 16 * bits / 8]"
                     : "weights must be [ceil(N / 16), K / group_size, 64 + group_size * 16 * bits / 8]");
}

bool project(const Api& api, OrtKernelContext* context, const Projection& p, const Tensor& x, const Tensor& w,
             float* out, const Quantized& quantized) {
  const int64_t tokens = x.shape[0], k = x.shape[1], tiles = (p.n + kLanes - 1) / kLanes;
  if (tokens == 0) return false;
  // Float32 tiles take every call on the vector code, x as it is. With the SwiGLU epilogue the bfloat16 and the
  // vector tiles write silu(gate) * up themselves (their items take a gate tile with its up tile); the AMX int8
  // tiles write the projection [T, N] here first.
  const bool floats = p.bits == kFloatBits, tiled = plain_blocks(p.bits, p.scales) && !p.float_x;
  const bool bf16 = tiled && bf16_rows(tokens), amx = tiled && amx_rows(tokens), staged = p.swiglu && !bf16 && amx;
  thread_local std::vector<float> projection;
  if (staged) projection.resize(static_cast<size_t>(tokens * p.n));
  thread_local Activations own;
  Activations& a = quantized.x ? *quantized.x : own;
  QuantJob job{static_cast<const float*>(x.data), static_cast<const uint8_t*>(w.data),
               staged ? projection.data() : out, &a, tokens, k, p.n, p.bits, p.group,
               k / p.group, block_bytes(p.bits, p.group, p.scales), tiles, 0, 0, p.offsets, p.swiglu && !staged};
  job.scales = p.scales;
  job.float_x = p.float_x;
  if (p.float_x) job.row_chunk = tokens;
  // A lone row is spread over ~8 items of tiles, or ~32 of float32 tiles (4-8x the bytes of 8- and 4-bit ones), so
  // the threads end a 576-column projection within one 36 KB tile of each other (a float32 decode step 1.01-1.02x;
  // the 4-bit one took 0.98x from the finer cut: bench/NOTES.md entry 50). Many rows take whole row chunks of up to
  // 4 tiles, fewer where that would cut the call into under kShareItems items (the AMX tiles keep 4): two threads
  // sharing 9 items run 5 and 4, and a 32-decode step's o_proj, down and q|k|v projections had 9, 9 and 15 (entry
  // 48). The SwiGLU items keep whole blocks of the next projection, which they quantize.
  const bool quantizes_next = quantized.after != nullptr && quantized.after->bits != kFloatBits;
  const int64_t row_chunks = (tokens + job.row_chunk - 1) / job.row_chunk;
  const int64_t g = quantizes_next ? quantized.after->group : 0;
  job.tile_chunk = tokens == 1 ? std::clamp<int64_t>(job.item_tiles() / (floats ? 32 : 8), 1, 4) : 4;
  // float32 items keep pairs of tiles, whose rows share x's broadcasts (float_tiles.h float_pair)
  const int64_t least = job.swiglu && g >= kLanes && g % kLanes == 0 ? std::min<int64_t>(4, g / kLanes)
                        : floats && !job.swiglu ? 2 : 1;
  if (tokens > 1 && !amx)
    while (job.tile_chunk / 2 >= least &&
           row_chunks * ((job.item_tiles() + job.tile_chunk - 1) / job.tile_chunk) < kShareItems)
      job.tile_chunk /= 2;
  job.tile_items = (job.item_tiles() + job.tile_chunk - 1) / job.tile_chunk;
  if (bf16) {
    size_bf16_rows(job);
    parallel_for(api, context, static_cast<size_t>(bf16_groups(tokens)), pack_bf16, &job);
    trace(kCallBytes, static_cast<uint64_t>(tiles * job.groups * job.block_bytes));
    parallel_for(api, context, bf16_item_count(job), bf16_items, &job);
    return false;
  }
  if (quantized.x == nullptr && !floats && !p.float_x) {
    sized_for(a, tokens, k, p.group);
    if (tokens == 1) quantize_row(&job, 0);
    else parallel_for(api, context, static_cast<size_t>(tokens), quantize_row, &job);
  }
  // The SwiGLU tiles quantize their output for the next projection when their items' columns are its whole blocks
  const int64_t width = p.n / 2;
  if (quantized.next && quantizes_next && !quantized.after->float_x && job.swiglu && width % g == 0 &&
      job.tile_chunk * kLanes % g == 0) {
    sized_for(*quantized.next, tokens, width, g);
    job.next = quantized.next;
    job.next_group = g;
    job.next_zero = zero_point(quantized.after->bits, quantized.after->offsets);
  }
  if (amx) {
    size_packed_rows(job);
    parallel_for(api, context, static_cast<size_t>(tokens / kAmxRows), pack_rows, &job);
  }
  trace(kCallBytes, static_cast<uint64_t>(tiles * job.groups * job.block_bytes));  // the weights the call streams
  parallel_for(api, context, static_cast<size_t>(row_chunks * job.tile_items), matmul_item, &job);
  if (!staged) return job.next != nullptr;
  SwigluRows rows{projection.data(), out, p.n / 2};
  parallel_for(api, context, static_cast<size_t>(tokens), swiglu_row, &rows);
  return false;
}

Projection projection_of(const Api& api, const OrtKernelInfo* info, const std::string& prefix, bool sized) {
  int64_t n = 1, bits = 0, group = 0, offsets = 0;
  if (sized) api.check(api->KernelInfoGetAttribute_int64(info, (prefix + "N").c_str(), &n));
  api.check(api->KernelInfoGetAttribute_int64(info, (prefix + "bits").c_str(), &bits));
  api.check(api->KernelInfoGetAttribute_int64(info, (prefix + "group_size").c_str(), &group));
  api.check(api->KernelInfoGetAttribute_int64(info, (prefix + "offsets").c_str(), &offsets));
  const int64_t scales = api.optional_int(info, (prefix + "scales").c_str(), kScalesBlock);
  require(n > 0, kName, "N must be positive");
  require(bits == 4 || bits == 5 || bits == 6 || bits == 8 || bits == kFloatBits, kName,
          "bits must be 4, 5, 6, 8 or 32 (float32 tiles)");
  require(group > 0 && (bits == kFloatBits || group % kSub == 0), kName,
          "group_size must be a positive multiple of 32");
  // the GGUF formats: Q5_0 / Q5_1 (5 bits, offsets), Q4_K / Q5_K (kScalesMin), Q6_K (kScales16)
  require(scales == kScalesBlock || scales == kScalesMin || scales == kScales16, kName, "scales must be 0, 1 or 2");
  require(bits != 5 || offsets, kName, "5-bit weights have offsets");
  require(bits != 6 || scales == kScales16, kName, "6-bit weights have scales=2");
  require(scales != kScalesMin || ((bits == 4 || bits == 5) && offsets && group == 256), kName,
          "scales=1 takes 4 or 5 bits with offsets in blocks of 256");
  require(scales != kScales16 || (bits == 6 && !offsets && group == 256), kName,
          "scales=2 takes 6 bits without offsets in blocks of 256");
  const bool swiglu = sized && api.optional_int(info, (prefix + "swiglu").c_str(), 0) != 0;
  require(!swiglu || n % (2 * kLanes) == 0, kName, "with swiglu=1, N / 2 must be a multiple of 16");
  const bool float_x = api.optional_int(info, (prefix + "float_x").c_str(), 0) != 0;
  return {n, bits, group, offsets != 0, swiglu, scales, float_x};
}

namespace {

// The *AddRMSNorm epilogue: total (holding the projection) += residual, normed = its norm.
void add_norm(const QuantKernel& kernel, OrtKernelContext* context, const Tensor& residual, const Tensor& weight,
              int64_t tokens, float* normed, float* total) {
  NormJob job{total, static_cast<const float*>(residual.data), static_cast<const float*>(weight.data), normed, total,
              kernel.out_n(), kernel.epsilon};
  if (tokens == 1) norm_row(&job, 0);  // a decode row: not worth waking the other threads
  else parallel_for(kernel.api, context, static_cast<size_t>(tokens), norm_row, &job);
}

// Inputs x, weights[, down weights][, residual, norm weight]; outputs y, or normed and total.
void compute(void* opaque, OrtKernelContext* context) {
  const auto& kernel = *static_cast<QuantKernel*>(opaque);
  const TracedOp traced(kernel.mlp ? (kernel.add_norm ? kTraceQuantMLPAddRMSNorm : kTraceQuantMLP)
                                   : (kernel.add_norm ? kTraceQuantMatMulAddRMSNorm : kTraceQuantMatMul));
  const std::vector<Tensor> in = inputs(kernel.api, context, 2 + kernel.mlp + 2 * kernel.add_norm);
  const auto &x = in[0], &w = in[1];
  require(x.shape.size() == 2, kName, "x must be [T, K]");
  const int64_t tokens = x.shape[0], n = kernel.out_n();
  check_weights(kernel.first, x.shape[1], w, kName);
  if (kernel.mlp) check_weights(kernel.down, kernel.first.out_n(), in[2], kName);
  float* normed = nullptr;
  if (kernel.add_norm) {
    const auto &residual = in[2 + kernel.mlp], &weight = in[3 + kernel.mlp];
    require(residual.shape == std::vector<int64_t>{tokens, n}, kName, "residual must be [T, N]");
    require(weight.shape == std::vector<int64_t>{n}, kName, "the norm weight must be [N]");
    normed = output<float>(kernel.api, context, 0, {tokens, n});
  }
  float* y = output<float>(kernel.api, context, kernel.add_norm ? 1 : 0, {tokens, n});
  if (kernel.mlp) {  // gate|up with SwiGLU into a buffer of this thread's, then down from it
    thread_local std::vector<float> hidden;
    thread_local Activations hidden_q;  // its int8 rows, when gate|up's SwiGLU tiles quantize them
    hidden.resize(static_cast<size_t>(tokens * kernel.first.out_n()));
    const bool quantized = project(kernel.api, context, kernel.first, x, w, hidden.data(),
                                   {nullptr, &hidden_q, &kernel.down});
    project(kernel.api, context, kernel.down, Tensor{hidden.data(), {tokens, kernel.first.out_n()}}, in[2], y,
            {quantized ? &hidden_q : nullptr});
  } else {
    project(kernel.api, context, kernel.first, x, w, y);
  }
  if (kernel.add_norm) add_norm(kernel, context, in[2 + kernel.mlp], in[3 + kernel.mlp], tokens, normed, y);
}

// QuantGather: rows `ids` of the weight QuantMatMul's blocks hold, dequantized (a tied embedding reading the
// quantized lm_head's table): inputs 0 blocks uint8 [V/16, H/group, bytes] as QuantMatMul's, 1 ids int64 [T];
// out float [T, H] = (q - zero_point) * d, or d * q + m with offsets (bits=32: the stored floats). Attributes: bits,
// group_size, offsets.
struct GatherJob {
  const uint8_t* w;
  const int64_t* ids;
  float* out;
  int64_t hidden, bits, group, groups, block_bytes;
  bool offsets;
  int64_t scales;
};

void gather_row(void* opaque, size_t t) {
  const auto& j = *static_cast<const GatherJob*>(opaque);
  const int64_t id = j.ids[t], c = id % kLanes, subs = j.group / kSub;
  const uint8_t* p = j.w + id / kLanes * j.groups * j.block_bytes;
  float* out = j.out + static_cast<int64_t>(t) * j.hidden;
  if (j.bits == kFloatBits) {  // the tile's [H][16] values: column c every 16th
    const float* w = reinterpret_cast<const float*>(p);
    for (int64_t k = 0; k < j.hidden; ++k) out[k] = w[k * kLanes + c];
    return;
  }
  if (!plain_blocks(j.bits, j.scales)) {  // the GGUF formats: exactly gguf's values
    for (int64_t b = 0; b < j.groups; ++b, p += j.block_bytes)
      for (int64_t kk = 0; kk < j.group; ++kk)
        out[b * j.group + kk] = dequantized(p, j.bits, j.offsets, j.scales, c, kk);
    return;
  }
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
  const TracedOp traced(kTraceQuantGather);
  const auto& kernel = *static_cast<QuantKernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 2);
  const auto &w = in[0], &ids = in[1];
  const Projection& p = kernel.first;
  const int64_t bytes = block_bytes(p.bits, p.group, p.scales);
  require(w.shape.size() == 3 && w.shape[2] == bytes, kName,
          "QuantGather's table must be [V / 16, H / group_size, 64 + group_size * 16 * bits / 8] (group_size * 64 "
          "for float32)");
  require(ids.shape.size() == 1, kName, "QuantGather's ids must be [T]");
  const int64_t rows = w.shape[0] * kLanes, tokens = ids.shape[0];
  const auto* id = static_cast<const int64_t*>(ids.data);
  for (int64_t t = 0; t < tokens; ++t)
    require(id[t] >= 0 && id[t] < rows, kName, "QuantGather: an id is outside the table");
  GatherJob job{static_cast<const uint8_t*>(w.data), id, nullptr, w.shape[1] * p.group, p.bits, p.group, w.shape[1],
                bytes, p.offsets, p.scales};
  job.out = output<float>(kernel.api, context, 0, {tokens, job.hidden});
  parallel_for(kernel.api, context, static_cast<size_t>(tokens), gather_row, &job);
}

void* create_kernel(const OrtKernelInfo* info, bool gather, bool mlp, bool add_norm) {
  Api api(info);
  QuantKernel kernel{api, projection_of(api, info, "", !gather)};
  kernel.mlp = mlp;
  if (mlp) {
    require(kernel.first.swiglu, kName, "QuantMLP's first projection must have swiglu=1");
    kernel.down = projection_of(api, info, "down_", true);
  }
  kernel.add_norm = add_norm;
  if (add_norm) {
    require(!(mlp ? kernel.down.swiglu : kernel.first.swiglu), kName, "an *AddRMSNorm op's output has no SwiGLU");
    api.check(api->KernelInfoGetAttribute_float(info, "epsilon", &kernel.epsilon));
    require(kernel.epsilon >= 0, kName, "epsilon must not be negative");
  }
  return new QuantKernel(kernel);
}

template <bool Mlp, bool AddNorm>
void* create_matmul(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  return create_kernel(info, false, Mlp, AddNorm);
}

KernelOp kOp = kernel_op(kName, {kFloat, kUint8}, kFloat, 1, create_matmul<false, false>, compute,
                         destroy_kernel<QuantKernel>);
KernelOp kNormOp = kernel_op("QuantMatMulAddRMSNorm", {kFloat, kUint8, kFloat, kFloat}, kFloat, 2,
                             create_matmul<false, true>, compute, destroy_kernel<QuantKernel>);
KernelOp kMlpOp = kernel_op("QuantMLP", {kFloat, kUint8, kUint8}, kFloat, 1, create_matmul<true, false>, compute,
                            destroy_kernel<QuantKernel>);
KernelOp kMlpNormOp = kernel_op("QuantMLPAddRMSNorm", {kFloat, kUint8, kUint8, kFloat, kFloat}, kFloat, 2,
                                create_matmul<true, true>, compute, destroy_kernel<QuantKernel>);
void* create_gather(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  return create_kernel(info, true, false, false);
}

KernelOp kGatherOp = kernel_op("QuantGather", {kUint8, kInt64}, kFloat, 1, create_gather, gather_compute,
                               destroy_kernel<QuantKernel>);

}  // namespace

std::vector<OrtCustomOp*> quant_matmul_ops() { return {&kOp, &kNormOp, &kMlpOp, &kMlpNormOp, &kGatherOp}; }

}  // namespace engine_kernels

// Whether QuantMatMul runs rows 16 at a time on AMX in this process (the tests ask, through ctypes).
extern "C" __attribute__((visibility("default"))) int EngineQuantMatMulAmx() {
  return engine_kernels::quant::amx_ready() ? 1 : 0;
}
// The fewest rows a QuantMatMul call takes through the bfloat16 tiles (quant_bf16.h); 0 where it never does.
extern "C" __attribute__((visibility("default"))) int EngineQuantMatMulBf16Rows() {
  return engine_kernels::quant::bf16_rows(engine_kernels::quant::kBf16Rows)
             ? static_cast<int>(engine_kernels::quant::kBf16Rows) : 0;
}
