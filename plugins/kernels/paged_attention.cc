// The engine's ONNX Runtime CPU kernels: custom ops of domain "engine", compiled on first use by plugins/native.py
// and registered with SessionOptions.register_custom_ops_library.
//
// PagedAttention{,Int8,Fp8}: attention of each packed token over its row's context, read from the paged K/V pools
// in place through the row's slot list (the plain lowering gathers every row's context into a copy first, which was
// half of a decode step's non-matmul time: bench/NOTES.md entries 10 and 23). Inputs and semantics are those of
// plugins/attention.py's paged_attention:
//
//   0 q          float [T, heads*hd]          rotary applied; for quantized pools already scaled by k_scale
//   1 kcache     P     [num_slots, kv*hd]     P = float (PagedAttention), int8 (Int8), e4m3 codes in uint8 (Fp8)
//   2 vcache     P     [num_slots, kv*hd]
//   3 q_index    int64 [B, Qmax]              packed token of query j of row b
//   4 kv_slots   int64 [B, Lmax]              pool slot of context token l of row b
//   5 mask       bool  [B, 1, Qmax, Lmax]     query j of row b may see key l
//   6 out_index  int64 [T]                    the row b * Qmax + j of packed token t
//   out          float [T, heads*hd]          softmax(scale * q.k, softcapped) . v, GQA: head h reads h / group
// Attributes: num_heads, num_kv_heads (int), scale, softcap (float, 0 = none). Only the T selected rows are
// computed (padded rows of the plain lowering are never selected); a row that sees no key gets zeros (a real token
// always sees itself). The math is attention_math.h; ORT's C ABI, ort_abi.h; registration, register.cc.
#include "attention_math.h"
#include "ort_abi.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "PagedAttention";

struct Kernel {
  Api api;
  int64_t heads, kv_heads;
  float scale, softcap;
  int pool_type;
};

template <typename P>
struct Job {
  Shapes s;
  float scale, softcap;
  const float* q;
  const P *kc, *vc;
  const int64_t *slots, *rows, *queries;
  const bool* mask;
  int64_t parts;
  std::vector<float> partials;  // [tokens, kv_heads, parts, partial_size]
};

// Work item i = (token, KV head, part), run by ORT's intra-op threads.
template <typename P>
void run_item(void* opaque, size_t i) {
  auto& j = *static_cast<Job<P>*>(opaque);
  const int64_t item = static_cast<int64_t>(i), part = item % j.parts, g = item / j.parts % j.s.kv_heads,
                t = item / j.parts / j.s.kv_heads;
  thread_local Scratch scratch;
  attend_part(j.s, j.scale, j.softcap, j.q + j.queries[j.rows[t]] * j.s.heads * j.s.hd, j.kc, j.vc, j.slots, j.mask,
              j.rows[t], g, part, j.parts, j.partials.data() + item * partial_size(j.s), scratch);
}

template <typename P>
void compute(const Kernel& k, OrtKernelContext* context) {
  const std::vector<Tensor> in = inputs(k.api, context, 7);
  const auto &q = in[0], &kc = in[1], &vc = in[2], &q_index = in[3], &kv_slots = in[4], &mask = in[5],
             &out_index = in[6];
  require(q.shape.size() == 2 && q.shape[1] % k.heads == 0, kName, "q must be [T, num_heads * head_dim]");
  Shapes s{q.shape[0], 0, 0, 0, 0, k.heads, k.kv_heads, q.shape[1] / k.heads};
  require(kc.shape.size() == 2 && kc.shape == vc.shape && kc.shape[1] == s.kv_heads * s.hd, kName,
          "kcache and vcache must both be [num_slots, num_kv_heads * head_dim]");
  require(q_index.shape.size() == 2 && kv_slots.shape.size() == 2 && kv_slots.shape[0] == q_index.shape[0], kName,
          "q_index must be [B, Qmax] and kv_slots [B, Lmax]");
  s.rows = q_index.shape[0], s.qmax = q_index.shape[1], s.lmax = kv_slots.shape[1], s.slots = kc.shape[0];
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

  const std::vector<int64_t> out_shape{s.tokens, s.heads * s.hd};
  float* out = output<float>(k.api, context, 0, out_shape);
  Job<P> job{s, k.scale, k.softcap, static_cast<const float*>(q.data), static_cast<const P*>(kc.data),
             static_cast<const P*>(vc.data), slots, rows, queries, static_cast<const bool*>(mask.data), 1, {}};
  // Split each token's keys in two when a step has fewer (token, KV head) items than ORT's two-thread pool can
  // share evenly (a single decode of a model with an odd number of KV heads).
  const int64_t pairs = s.tokens * s.kv_heads;
  job.parts = pairs < 4 ? 2 : 1;
  job.partials.resize(static_cast<size_t>(pairs * job.parts * partial_size(s)));
  const size_t items = static_cast<size_t>(pairs * job.parts);
  parallel_for(k.api, context, items, run_item<P>, &job);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t g = 0; g < s.kv_heads; ++g)
      combine(s, job.partials.data() + (t * s.kv_heads + g) * job.parts * partial_size(s), job.parts,
              out + t * out_shape[1] + g * s.group() * s.hd);
}

struct PagedAttentionOp : CustomOp {
  const char* name;
  int pool_type;
};

void* create_kernel(CustomOp* op, const void* table, const OrtKernelInfo* info) {
  using GetInt = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);
  using GetFloat = OrtStatus* (*)(const OrtKernelInfo*, const char*, float*);
  Api api(table);
  Kernel kernel{api, 0, 0, 0.0f, 0.0f, static_cast<PagedAttentionOp*>(op)->pool_type};
  api.call<GetInt>(kKernelInfoGetAttributeInt64, info, "num_heads", &kernel.heads);
  api.call<GetInt>(kKernelInfoGetAttributeInt64, info, "num_kv_heads", &kernel.kv_heads);
  api.call<GetFloat>(kKernelInfoGetAttributeFloat, info, "scale", &kernel.scale);
  api.call<GetFloat>(kKernelInfoGetAttributeFloat, info, "softcap", &kernel.softcap);
  require(kernel.heads > 0 && kernel.kv_heads > 0 && kernel.heads % kernel.kv_heads == 0, kName,
          "num_heads must be a positive multiple of num_kv_heads");
  return new Kernel(kernel);
}

void kernel_compute(void* opaque, OrtKernelContext* context) {
  const auto& k = *static_cast<Kernel*>(opaque);
  if (k.pool_type == kFloat) compute<float>(k, context);
  else if (k.pool_type == kInt8) compute<int8_t>(k, context);
  else compute<uint8_t>(k, context);
}

PagedAttentionOp make_op(const char* name, int pool_type) {
  PagedAttentionOp op{custom_op_base(), name, pool_type};
  op.CreateKernel = create_kernel;
  op.GetName = [](CustomOp* o) { return static_cast<PagedAttentionOp*>(o)->name; };
  op.GetInputType = [](CustomOp* o, size_t i) {
    static const int types[7] = {kFloat, 0, 0, kInt64, kInt64, kBool, kInt64};
    return i == 1 || i == 2 ? static_cast<PagedAttentionOp*>(o)->pool_type : types[i];
  };
  op.GetInputTypeCount = [](CustomOp*) { return size_t{7}; };
  op.GetOutputType = [](CustomOp*, size_t) { return static_cast<int>(kFloat); };
  op.GetOutputTypeCount = [](CustomOp*) { return size_t{1}; };
  op.KernelCompute = kernel_compute;
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  return op;
}

PagedAttentionOp kOps[3] = {make_op("PagedAttention", kFloat), make_op("PagedAttentionInt8", kInt8),
                            make_op("PagedAttentionFp8", kUint8)};

}  // namespace

std::vector<CustomOp*> paged_attention_ops() { return {&kOps[0], &kOps[1], &kOps[2]}; }

}  // namespace engine_kernels
