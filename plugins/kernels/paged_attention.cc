// The engine's ONNX Runtime CPU kernels: custom ops of domain "engine", compiled on first use by plugins/native.py
// and registered with SessionOptions.register_custom_ops_library.
//
// PagedAttention{,Fp16,Int8,Fp8}: attention of each packed token over its row's context, read from the paged K/V pools
// in place through the row's slot list (the plain lowering gathers every row's context into a copy first, which was
// half of a decode step's non-matmul time: bench/NOTES.md entries 10 and 23). Inputs and semantics are those of
// plugins/attention.py's paged_attention:
//
//   0 q          float [T, heads*hd]          rotary applied; for quantized pools already scaled by k_scale
//   1 kcache     P     [num_slots, kv*hd]     P = float (PagedAttention), float16 (Fp16), int8 (Int8), e4m3
//                                             codes in uint8 (Fp8)
//   2 vcache     P     [num_slots, kv*hd]
//   3 q_index    int64 [B, Qmax]              packed token of query j of row b
//   4 kv_slots   int64 [B, Lmax]              pool slot of context token l of row b
//   5 mask       bool  [B, 1, Qmax, Lmax]     query j of row b may see key l
//   6 out_index  int64 [T]                    the row b * Qmax + j of packed token t
//   out          float [T, heads*hd]          softmax(scale * q.k, softcapped) . v, GQA: head h reads h / group
// QuantRotaryPagedAttention{,Fp16,Int8,Fp8} (below): RotaryPagedAttention* whose q|k|v is QuantMatMul's projection
// of input 0 by the weights of its last input (quant_project.h), done inside the op: one node fewer a layer.
// Attributes: num_heads, num_kv_heads (int), scale, softcap (float, 0 = none). Only the T selected rows are
// computed (padded rows of the plain lowering are never selected); a row that sees no key gets zeros (a real token
// always sees itself). The math is attention_decode.h (tokens one at a time) and attention_tiles.h (rows of several
// tokens, a prefill's), over attention_math.h; ORT's C API, ort_abi.h; registration, register.cc.
#include <type_traits>

#include "attention_decode.h"
#include "attention_tiles.h"
#include "ort_abi.h"
#include "quant_project.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "PagedAttention";
// In an op's input type table: the pool's type, which depends on the op.
constexpr ONNXTensorElementDataType kPool = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;

struct Kernel {
  Api api;
  int64_t heads, kv_heads;
  float scale, softcap;
  ONNXTensorElementDataType pool_type;
  bool rotary;
  bool quant = false;  // QuantRotaryPagedAttention*: input 0 is x, projected to q|k|v by the last input's weights
  Projection qkv{};
};

template <typename P>
struct Job {
  Shapes s;
  float scale, softcap;
  const float* q;
  const P *kc, *vc;
  const int64_t *slots, *rows, *queries;
  const bool* mask;
  float* out;
  std::vector<Tile> tiles;       // rows with several tokens, in tiles (attention_tiles.h)
  std::vector<int64_t> tiled;    // the tiles' js, q rows and output rows: three arrays, an entry per tiled token
  std::vector<int64_t> singles;  // the other packed tokens, attended one at a time in `parts` shares
  std::vector<int64_t> seen;     // the keys each single sees (its mask row's count), counted once a step
  int64_t parts;                 // > 1: each single's keys in shares of whole segments, an item each
  int64_t per_item;              // parts == 1: consecutive singles an item takes (each prefetches the next's K)
  int64_t segs;                  // the most segments a single has (attention_decode.h)
  std::vector<float> partials;   // [singles, segs, partial_size]: a partial per segment
};

// Work item i: (tile, KV head) for the first tiles * kv_heads items, then (single token, part), or with one part
// per_item consecutive singles; run by ORT's intra-op threads.
template <typename P>
void run_item(void* opaque, size_t i) {
  auto& j = *static_cast<Job<P>*>(opaque);
  int64_t item = static_cast<int64_t>(i);
  const int64_t tile_items = static_cast<int64_t>(j.tiles.size()) * j.s.kv_heads;
#ifdef ENGINE_KERNELS_AVX2
  if (item < tile_items) {
    thread_local TileScratch scratch;
    attend_tile(j.s, j.scale, j.softcap, j.q, j.kc, j.vc, j.slots, j.mask, j.tiles[item / j.s.kv_heads],
                item % j.s.kv_heads, j.out, scratch);
    return;
  }
#endif
  item -= tile_items;
  // singles [first, last), share `part` of each (per_item is 1 when there are shares)
  const int64_t part = item % j.parts, first = item / j.parts * j.per_item;
  const int64_t last = std::min<int64_t>(first + j.per_item, j.singles.size());
  thread_local Scratch x;
  visible_keys(j.s, j.slots, j.mask, j.rows[j.singles[first]], j.seen[first], part, j.parts, x.next);
  for (int64_t i = first; i < last; ++i) {
    std::swap(x.visible, x.next);
    x.next.clear();
    if (i + 1 < last)
      visible_keys(j.s, j.slots, j.mask, j.rows[j.singles[i + 1]], j.seen[i + 1], part, j.parts, x.next);
    const int64_t seg = share_segments(j.seen[i], part, j.parts).first;
    if (seg >= segments(j.seen[i])) continue;   // a share of a short token's keys that holds none
    float* token = j.partials.data() + i * j.segs * partial_size(j.s);
    attend_part(j.s, j.scale, j.softcap, j.q + j.queries[j.rows[j.singles[i]]] * j.s.heads * j.s.hd, j.kc, j.vc,
                token + seg * partial_size(j.s), x);
    // a whole token's keys: its output is final here, not in attend()'s serial combine after the items
    if (j.parts == 1) combine(j.s, token, segments(j.seen[i]), j.out + j.singles[i] * j.s.heads * j.s.hd);
  }
}

// Rows with at least kMinTile tokens go in tiles of tile_tokens(s), when the tiles' vector code runs (AVX2 + FMA,
// a head size that is a multiple of 8); every other token is a single. Tokens in (row, query position) order.
constexpr int64_t kMinTile = 4;
constexpr int64_t kMinItems = 4;

template <typename P>
void plan(Job<P>& j) {
  const Shapes& s = j.s;
  std::vector<std::pair<int64_t, int64_t>> order;  // (row b * qmax + j, token)
  for (int64_t t = 0; t < s.tokens; ++t) order.emplace_back(j.rows[t], t);
  std::sort(order.begin(), order.end());
#ifdef ENGINE_KERNELS_AVX2
  const bool tiles = s.hd % 8 == 0;
  const int64_t per_tile = tile_tokens(s);
#else
  const bool tiles = false;
  const int64_t per_tile = 1;
#endif
  std::vector<std::pair<int64_t, int64_t>> cuts;  // [first, last) of each tile in `order`
  for (size_t a = 0, e = 0; a < order.size(); a = e) {
    const int64_t b = order[a].first / s.qmax;
    for (e = a; e < order.size() && order[e].first / s.qmax == b; ++e) {}
    if (tiles && static_cast<int64_t>(e - a) >= kMinTile) {
      for (size_t c = a; c < e; c += per_tile) cuts.emplace_back(c, std::min(e, c + per_tile));
    } else {
      for (size_t c = a; c < e; ++c) j.singles.push_back(order[c].second);
    }
  }
  const size_t count = order.size() - j.singles.size();
  j.tiled.resize(3 * count);
  int64_t *js = j.tiled.data(), *q_rows = js + count, *out_rows = q_rows + count, at = 0;
  for (auto [first, last] : cuts) {
    const int64_t b = order[first].first / s.qmax;
    j.tiles.push_back({b, last - first, js + at, q_rows + at, out_rows + at});
    for (int64_t c = first; c < last; ++c, ++at) {
      js[at] = order[c].first % s.qmax;
      q_rows[at] = j.queries[order[c].first];
      out_rows[at] = order[c].second;
    }
  }
}

// Attention of the step's T tokens (q [T, heads * hd]) over pools kc, vc [num_slots, kv * hd] already holding
// their K/V, the step's index inputs q_index, kv_slots, mask and out_index validated here; out [T, heads * hd].
template <typename P>
void attend(const Kernel& k, OrtKernelContext* context, Shapes s, const float* q, const P* kc, const P* vc,
            const Tensor& q_index, const Tensor& kv_slots, const Tensor& mask, const Tensor& out_index, float* out) {
  require(q_index.shape.size() == 2 && kv_slots.shape.size() == 2 && kv_slots.shape[0] == q_index.shape[0], kName,
          "q_index must be [B, Qmax] and kv_slots [B, Lmax]");
  s.rows = q_index.shape[0], s.qmax = q_index.shape[1], s.lmax = kv_slots.shape[1];
  require(mask.shape == std::vector<int64_t>{s.rows, 1, s.qmax, s.lmax}, kName, "mask must be [B, 1, Qmax, Lmax]");
  require(out_index.shape == std::vector<int64_t>{s.tokens}, kName, "out_index must be [T]");
  const auto* slots = static_cast<const int64_t*>(kv_slots.data);
  const auto* rows = static_cast<const int64_t*>(out_index.data);
  const auto* queries = static_cast<const int64_t*>(q_index.data);
  for (int64_t i = 0; i < s.rows * s.lmax; ++i)
    require(slots[i] >= 0 && slots[i] < s.slots, kName, "kv_slots holds a slot outside the pool");
  for (int64_t t = 0; t < s.tokens; ++t)
    require(rows[t] >= 0 && rows[t] < s.rows * s.qmax && queries[rows[t]] >= 0 && queries[rows[t]] < s.tokens,
            kName, "out_index or q_index holds an index outside the step");

  Job<P> job{s, k.scale, k.softcap, q, kc, vc, slots, rows, queries, static_cast<const bool*>(mask.data), out,
             {}, {}, {}, {}, 1, 1, {}};
  plan(job);
  for (const int64_t t : job.singles) {
    const bool* m = job.mask + rows[t] * s.lmax;
    job.seen.push_back(std::count(m, m + s.lmax, true));
  }
  // Split each single token's keys in shares when a step has fewer items than ORT's two-thread pool can share
  // evenly (a lone decode): flash-decoding's split, a share at least one segment (fewer keys cost more to hand
  // out and combine than they save: NOTES 38). With many singles, an item takes several in a row (at least
  // kMinItems * 2 items remain for the pool to balance), so each can prefetch the next one's keys.
  const int64_t tile_items = static_cast<int64_t>(job.tiles.size()) * s.kv_heads,
                singles = static_cast<int64_t>(job.singles.size());
  job.parts = 1;
  if (tile_items + singles < kMinItems && singles > 0) {
    const int64_t longest = *std::max_element(job.seen.begin(), job.seen.end());
    job.parts = std::clamp<int64_t>(longest / kSegment, 1, (kMinItems + singles - 1) / singles);
  }
  job.per_item = job.parts > 1 ? 1 : std::max<int64_t>(1, singles / (2 * kMinItems));
  const int64_t single_items = (singles + job.per_item - 1) / job.per_item * job.parts;
  job.segs = singles ? segments(*std::max_element(job.seen.begin(), job.seen.end())) : 0;
  job.partials.resize(static_cast<size_t>(singles * job.segs * partial_size(s)));
  parallel_for(k.api, context, static_cast<size_t>(tile_items + single_items), run_item<P>, &job);
  if (job.parts == 1) return;  // the items wrote each token's output
  for (int64_t i = 0; i < singles; ++i)
    combine(s, job.partials.data() + i * job.segs * partial_size(s), segments(job.seen[static_cast<size_t>(i)]),
            out + job.singles[static_cast<size_t>(i)] * s.heads * s.hd);
}

template <typename P>
void compute(const Kernel& k, OrtKernelContext* context) {
  const std::vector<Tensor> in = inputs(k.api, context, 7);
  const auto &q = in[0], &kc = in[1], &vc = in[2];
  require(q.shape.size() == 2 && q.shape[1] % k.heads == 0, kName, "q must be [T, num_heads * head_dim]");
  Shapes s{q.shape[0], 0, 0, 0, 0, k.heads, k.kv_heads, q.shape[1] / k.heads};
  require(kc.shape.size() == 2 && kc.shape == vc.shape && kc.shape[1] == s.kv_heads * s.hd, kName,
          "kcache and vcache must both be [num_slots, num_kv_heads * head_dim]");
  s.slots = kc.shape[0];
  float* out = output<float>(k.api, context, 0, {s.tokens, s.heads * s.hd});
  attend<P>(k, context, s, static_cast<const float*>(q.data), static_cast<const P*>(kc.data),
            static_cast<const P*>(vc.data), in[3], in[4], in[5], in[6], out);
}

// RotaryPagedAttention{,Fp16,Int8,Fp8}: the q/k rotary, the write of the step's K/V into the pools and
// PagedAttention in one op (plugins/attention.py, rotary_paged_attention).
//   0 qkv           float [T, (heads + 2 kv) * hd]   q | k | v of each packed token, before rotary
//   1 positions     int64 [T]
//   2 cos, 3 sin    float [max_positions, hd / 2]    rotate_half (plugins/rotary.py): [x1 c - x2 s | x2 c + x1 s]
//   4 kcache        P     [num_slots, kv * hd]       as PagedAttention's
//   5 vcache        P     [num_slots, kv * hd]
//   6 slot_mapping  int64 [T]                        pool slot of each token's K/V
//   7-10            q_index, kv_slots, mask, out_index, as PagedAttention's 3-6
//   11 k_scale, 12 v_scale  float [kv * hd]          int8 / fp8 pools only: rows are stored as x / scale, int8
//                                                    rounded half to even and saturated, fp8 as e4m3_code; q is
//                                                    scaled by k_scale and the output by v_scale per query head
//   out 0           float [T, heads * hd]            as PagedAttention's
//   out 1, 2        the pools with the step's rows written. The runtime binds them to the buffers of inputs 4 and
//                   5, so the rows are written in place; an output elsewhere gets a copy of the pool first (the
//                   semantics of ScatterND, which this replaces).
template <typename P>
struct RotaryJob {
  const float *qkv, *cos, *sin, *k_scale, *v_scale;  // the scales: null for float pools
  const int64_t *positions, *slot_mapping;
  float* q;
  P *kc, *vc;
  int64_t heads, kv_heads, hd;
};

// x [heads, hd] rotated by angles (c, s) [hd / 2] into y.
inline void rotate(const float* x, const float* c, const float* s, int64_t heads, int64_t hd, float* y) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < heads; ++h, x += hd, y += hd)
    for (int64_t i = 0; i < half; ++i) {
      y[i] = x[i] * c[i] - x[i + half] * s[i];
      y[i + half] = x[i + half] * c[i] + x[i] * s[i];
    }
}

// Channel c of query head h reads KV channel (h / group) * hd + c % hd: `scale` [kv * hd] applied to x [heads * hd].
inline void scale_per_query_head(float* x, const float* scale, int64_t heads, int64_t kv_heads, int64_t hd) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < hd; ++c) x[h * hd + c] *= scale[h / (heads / kv_heads) * hd + c];
}

template <typename P>
void rotary_item(void* opaque, size_t i) {
  const auto& j = *static_cast<const RotaryJob<P>*>(opaque);
  const int64_t t = static_cast<int64_t>(i), kv = j.kv_heads * j.hd, width = j.heads * j.hd + 2 * kv;
  const float* x = j.qkv + t * width;
  const float *c = j.cos + j.positions[t] * (j.hd / 2), *s = j.sin + j.positions[t] * (j.hd / 2);
  float* q = j.q + t * j.heads * j.hd;
  rotate(x, c, s, j.heads, j.hd, q);
  if (j.k_scale) scale_per_query_head(q, j.k_scale, j.heads, j.kv_heads, j.hd);
  thread_local std::vector<float> k;
  k.resize(static_cast<size_t>(kv));
  rotate(x + j.heads * j.hd, c, s, j.kv_heads, j.hd, k.data());
  write_row(k.data(), j.k_scale, kv, j.kc + j.slot_mapping[t] * kv);
  write_row(x + j.heads * j.hd + kv, j.v_scale, kv, j.vc + j.slot_mapping[t] * kv);
}

template <typename P>
void compute_rotary(const Kernel& k, OrtKernelContext* context) {
  constexpr const char* name = "RotaryPagedAttention";
  const bool quantized = std::is_same_v<P, int8_t> || std::is_same_v<P, uint8_t>;  // scaled pools
  std::vector<Tensor> in = inputs(k.api, context, (quantized ? 13 : 11) + k.quant);
  if (k.quant) {  // x [T, H] -> q|k|v [T, N] in a buffer of this thread's, then as RotaryPagedAttention*
    require(in[0].shape.size() == 2, name, "x must be [T, hidden]");
    check_weights(k.qkv, in[0].shape[1], in.back(), name);
    thread_local std::vector<float> projected;
    projected.resize(static_cast<size_t>(in[0].shape[0] * k.qkv.n));
    project(k.api, context, k.qkv, in[0], in.back(), projected.data());
    in[0] = Tensor{projected.data(), {in[0].shape[0], k.qkv.n}};
  }
  const auto &qkv = in[0], &positions = in[1], &cos = in[2], &sin = in[3], &kc = in[4], &vc = in[5],
             &slot_mapping = in[6];
  const int64_t width = k.heads + 2 * k.kv_heads;
  require(qkv.shape.size() == 2 && qkv.shape[1] % (2 * width) == 0, name,
          "qkv must be [T, (num_heads + 2 num_kv_heads) * head_dim] with an even head_dim");
  Shapes s{qkv.shape[0], 0, 0, 0, 0, k.heads, k.kv_heads, qkv.shape[1] / width};
  const int64_t kv = s.kv_heads * s.hd;
  require(kc.shape.size() == 2 && kc.shape == vc.shape && kc.shape[1] == kv, name,
          "kcache and vcache must both be [num_slots, num_kv_heads * head_dim]");
  s.slots = kc.shape[0];
  require(cos.shape.size() == 2 && cos.shape == sin.shape && cos.shape[1] == s.hd / 2, name,
          "cos and sin must be [max_positions, head_dim / 2]");
  const std::vector<int64_t> per_token{s.tokens};
  require(positions.shape == per_token && slot_mapping.shape == per_token, name,
          "positions and slot_mapping must be [T]");
  require(!quantized || (in[11].shape == std::vector<int64_t>{kv} && in[12].shape == in[11].shape), name,
          "k_scale and v_scale must be [num_kv_heads * head_dim]");
  const auto* pos = static_cast<const int64_t*>(positions.data);
  const auto* slots = static_cast<const int64_t*>(slot_mapping.data);
  for (int64_t t = 0; t < s.tokens; ++t) {
    require(pos[t] >= 0 && pos[t] < cos.shape[0], name, "a position is beyond the rotary tables (max_seq_len)");
    require(slots[t] >= 0 && slots[t] < s.slots, name, "slot_mapping holds a slot outside the pool");
  }
  float* out = output<float>(k.api, context, 0, {s.tokens, s.heads * s.hd});
  P* kout = output<P>(k.api, context, 1, kc.shape);
  P* vout = output<P>(k.api, context, 2, vc.shape);
  const size_t pool = static_cast<size_t>(s.slots * kv);
  if (kout != kc.data) std::copy_n(static_cast<const P*>(kc.data), pool, kout);
  if (vout != vc.data) std::copy_n(static_cast<const P*>(vc.data), pool, vout);
  const float* k_scale = quantized ? static_cast<const float*>(in[11].data) : nullptr;
  const float* v_scale = quantized ? static_cast<const float*>(in[12].data) : nullptr;
  std::vector<float> q(static_cast<size_t>(s.tokens * s.heads * s.hd));
  RotaryJob<P> job{static_cast<const float*>(qkv.data), static_cast<const float*>(cos.data),
                   static_cast<const float*>(sin.data), k_scale, v_scale, pos, slots, q.data(), kout, vout,
                   s.heads, s.kv_heads, s.hd};
  parallel_for(k.api, context, static_cast<size_t>(s.tokens), rotary_item<P>, &job);
  attend<P>(k, context, s, q.data(), kout, vout, in[7], in[8], in[9], in[10], out);
  if (v_scale)
    for (int64_t t = 0; t < s.tokens; ++t)
      scale_per_query_head(out + t * s.heads * s.hd, v_scale, s.heads, s.kv_heads, s.hd);
}

struct PagedAttentionOp : OrtCustomOp {
  const char* name;
  ONNXTensorElementDataType pool_type;
  bool rotary;  // RotaryPagedAttention*
  bool quant;   // QuantRotaryPagedAttention*
};

void* create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info) {
  Api api(info);
  const auto* described = static_cast<const PagedAttentionOp*>(op);
  Kernel kernel{api, 0, 0, 0.0f, 0.0f, described->pool_type, described->rotary};
  kernel.quant = described->quant;
  if (kernel.quant) kernel.qkv = projection_of(api, info, "", true);
  api.check(api->KernelInfoGetAttribute_int64(info, "num_heads", &kernel.heads));
  api.check(api->KernelInfoGetAttribute_int64(info, "num_kv_heads", &kernel.kv_heads));
  api.check(api->KernelInfoGetAttribute_float(info, "scale", &kernel.scale));
  api.check(api->KernelInfoGetAttribute_float(info, "softcap", &kernel.softcap));
  require(kernel.heads > 0 && kernel.kv_heads > 0 && kernel.heads % kernel.kv_heads == 0, kName,
          "num_heads must be a positive multiple of num_kv_heads");
  return new Kernel(kernel);
}

template <typename P>
void compute_op(const Kernel& k, OrtKernelContext* context) {
  k.rotary ? compute_rotary<P>(k, context) : compute<P>(k, context);
}

void kernel_compute(void* opaque, OrtKernelContext* context) {
  const TracedOp traced(kTraceAttention);
  const auto& k = *static_cast<Kernel*>(opaque);
  if (k.pool_type == kFloat) compute_op<float>(k, context);
  else if (k.pool_type == kFloat16) compute_op<_Float16>(k, context);
  else if (k.pool_type == kInt8) compute_op<int8_t>(k, context);
  else compute_op<uint8_t>(k, context);
}

PagedAttentionOp make_op(const char* name, ONNXTensorElementDataType pool_type) {
  PagedAttentionOp op{custom_op_base(), name, pool_type, false, false};
  op.CreateKernel = create_kernel;
  op.GetName = [](const OrtCustomOp* o) { return static_cast<const PagedAttentionOp*>(o)->name; };
  op.GetInputType = [](const OrtCustomOp* o, size_t i) {
    static const ONNXTensorElementDataType types[7] = {kFloat, kPool, kPool, kInt64, kInt64, kBool, kInt64};
    return i == 1 || i == 2 ? static_cast<const PagedAttentionOp*>(o)->pool_type : types[i];
  };
  op.GetInputTypeCount = [](const OrtCustomOp*) { return size_t{7}; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return kFloat; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{1}; };
  op.KernelCompute = kernel_compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  return op;
}

// Inputs of a RotaryPagedAttention* op: + k_scale, v_scale for scaled pools; + the q|k|v weights for Quant*.
size_t rotary_inputs(const PagedAttentionOp& op) {
  return (op.pool_type == kInt8 || op.pool_type == kUint8 ? 13u : 11u) + (op.quant ? 1u : 0u);
}

PagedAttentionOp make_rotary_op(const char* name, ONNXTensorElementDataType pool_type, bool quant = false) {
  PagedAttentionOp op = make_op(name, pool_type);
  op.rotary = true;
  op.quant = quant;
  op.GetInputType = [](const OrtCustomOp* o, size_t i) {
    static const ONNXTensorElementDataType types[13] = {kFloat, kInt64, kFloat, kFloat, kPool, kPool, kInt64, kInt64,
                                                        kInt64, kBool, kInt64, kFloat, kFloat};
    const auto& op = *static_cast<const PagedAttentionOp*>(o);
    if (op.quant && i + 1 == rotary_inputs(op)) return kUint8;
    return i == 4 || i == 5 ? op.pool_type : types[i];
  };
  op.GetInputTypeCount = [](const OrtCustomOp* o) { return rotary_inputs(*static_cast<const PagedAttentionOp*>(o)); };
  op.GetOutputType = [](const OrtCustomOp* o, size_t i) {
    return i == 0 ? kFloat : static_cast<const PagedAttentionOp*>(o)->pool_type;
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{3}; };
  return op;
}

// The rotary op whose input 0 is x, projected to q|k|v by QuantMatMul's weights as its last input (uint8; with
// QuantMatMul's attributes N, bits, group_size, offsets): plugins/attention.py folds the q|k|v projection in.
PagedAttentionOp make_quant_op(const char* name, ONNXTensorElementDataType pool_type) {
  return make_rotary_op(name, pool_type, true);
}

PagedAttentionOp kOps[12] = {make_op("PagedAttention", kFloat), make_op("PagedAttentionFp16", kFloat16),
                             make_op("PagedAttentionInt8", kInt8), make_op("PagedAttentionFp8", kUint8),
                             make_rotary_op("RotaryPagedAttention", kFloat),
                             make_rotary_op("RotaryPagedAttentionFp16", kFloat16),
                             make_rotary_op("RotaryPagedAttentionInt8", kInt8),
                             make_rotary_op("RotaryPagedAttentionFp8", kUint8),
                             make_quant_op("QuantRotaryPagedAttention", kFloat),
                             make_quant_op("QuantRotaryPagedAttentionFp16", kFloat16),
                             make_quant_op("QuantRotaryPagedAttentionInt8", kInt8),
                             make_quant_op("QuantRotaryPagedAttentionFp8", kUint8)};

}  // namespace

std::vector<OrtCustomOp*> paged_attention_ops() {
  std::vector<OrtCustomOp*> ops;
  for (PagedAttentionOp& op : kOps) ops.push_back(&op);
  return ops;
}

}  // namespace engine_kernels
