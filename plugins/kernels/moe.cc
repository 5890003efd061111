// MoE: a mixture-of-experts MLP over packed tokens, each token through its top_k experts only (plugins/moe.py; its
// reference lowering in standard ONNX ops computes the same):
//
//   0 x        float [T, H]
//   1 router   float [E, H]
//   2 gate_up  uint8 [L, ...QuantMatMul's weights of the expert's gate|up projection, N = 2 I]
//   3 down     uint8 [L, ...QuantMatMul's weights of the expert's down projection, N = H]
//   out        float [T, H]
// The stacks hold experts first_expert .. first_expert + L - 1 (attribute, default 0; L = E but with expert
// parallelism, where the other ranks add the other experts' rows): routing is over all E, the sum over these.
//
//   p = softmax(x @ router^T) over the E experts; the top_k largest (the lower expert on a tie), divided by their
//   sum when normalize=1; out[t] = sum over its experts e, in ascending e, of p_e * down_e(silu(gate_e x) * up_e x)
//
// Tokens are grouped by expert, so each expert's weights are read once a call, for just the rows routed to it:
//
//   route (one token an item) ─▶ rows of expert 0 | rows of expert 1 | ...      (counting sort, tokens in order)
//   for each expert with rows: gather them ─▶ QuantMLP's two projections (quant_project.h) ─▶ out[t] += p * row
//
// The projections are QuantMatMul's (quant_matmul.cc): float32 tiles (bits=32) or int8 / int4 blocks, with its
// attributes N, bits, group_size, offsets, swiglu for gate|up and down_* for down, as QuantMLP takes them; swiglu=0
// (I not a multiple of 16) projects gate|up whole and applies SwiGLU after. Attributes of the routing: top_k,
// normalize. Each projection runs on the threads as QuantMatMul does; routing, gathering and the weighted sums are
// a few values a token beside them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ort_abi.h"
#include "quant_project.h"
#include "quant_tiles.h"
#include "swiglu.h"

namespace engine_kernels {
namespace {

constexpr const char* kName = "MoE";

struct MoeKernel {
  Api api;
  Projection gate_up, down;
  int64_t top_k = 0, first_expert = 0;
  bool normalize = false;
};

float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(ENGINE_KERNELS_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Token t's top_k experts and their weights, into chosen / weight [T, top_k].
struct RouteJob {
  const float *x, *router;
  int64_t hidden, experts, top_k;
  bool normalize;
  int64_t* chosen;
  float* weight;
};

void route_token(void* opaque, size_t t) {
  const auto& j = *static_cast<const RouteJob*>(opaque);
  thread_local std::vector<float> p;
  p.resize(static_cast<size_t>(j.experts));
  const float* x = j.x + static_cast<int64_t>(t) * j.hidden;
  float top = -INFINITY;
  for (int64_t e = 0; e < j.experts; ++e) top = std::max(top, p[e] = dot(x, j.router + e * j.hidden, j.hidden));
  float sum = 0;
  for (float& v : p) sum += v = std::exp(v - top);
  for (float& v : p) v /= sum;
  int64_t* chosen = j.chosen + static_cast<int64_t>(t) * j.top_k;
  float* weight = j.weight + static_cast<int64_t>(t) * j.top_k;
  thread_local std::vector<char> taken;
  taken.assign(p.size(), 0);
  float kept = 0;
  for (int64_t k = 0; k < j.top_k; ++k) {
    int64_t best = -1;
    for (int64_t e = 0; e < j.experts; ++e)
      if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
    chosen[k] = best;
    taken[best] = 1;
    kept += weight[k] = p[best];
  }
  if (j.normalize)
    for (int64_t k = 0; k < j.top_k; ++k) weight[k] /= kept;
}

// Expert e's slice of a stacked weight [E, ...]: the weights of one projection as QuantMatMul takes them.
Tensor expert_weights(const Tensor& stacked, int64_t e) {
  const std::vector<int64_t> shape(stacked.shape.begin() + 1, stacked.shape.end());
  int64_t bytes = 1;
  for (int64_t d : shape) bytes *= d;
  return Tensor{static_cast<uint8_t*>(stacked.data) + e * bytes, shape};
}

// rows [n, H] -> out [n, H]: the expert's gated MLP, as QuantMLP computes it (quant_matmul.cc).
void expert_mlp(const MoeKernel& kernel, OrtKernelContext* context, const Tensor& rows, const Tensor& gate_up,
                const Tensor& down, float* out) {
  const int64_t n = rows.shape[0], inter = kernel.gate_up.n / 2;
  thread_local std::vector<float> projected, hidden;
  thread_local quant::Activations hidden_q;  // its int8 rows, when gate|up's SwiGLU tiles quantize them
  hidden.resize(static_cast<size_t>(n * inter));
  bool quantized = false;
  if (kernel.gate_up.swiglu) {
    quantized = project(kernel.api, context, kernel.gate_up, rows, gate_up, hidden.data(),
                        {nullptr, &hidden_q, &kernel.down});
  } else {
    projected.resize(static_cast<size_t>(n * 2 * inter));
    project(kernel.api, context, kernel.gate_up, rows, gate_up, projected.data());
    SwigluRows job{projected.data(), hidden.data(), inter};
    for (int64_t r = 0; r < n; ++r) swiglu_row(&job, static_cast<size_t>(r));
  }
  project(kernel.api, context, kernel.down, Tensor{hidden.data(), {n, inter}}, down, out,
          {quantized ? &hidden_q : nullptr});
}

void compute(void* opaque, OrtKernelContext* context) {
  const auto& kernel = *static_cast<MoeKernel*>(opaque);
  const std::vector<Tensor> in = inputs(kernel.api, context, 4);
  const auto &x = in[0], &router = in[1], &gate_up = in[2], &down = in[3];
  require(x.shape.size() == 2, kName, "x must be [T, H]");
  const int64_t tokens = x.shape[0], hidden = x.shape[1];
  require(router.shape.size() == 2 && router.shape[1] == hidden, kName, "router must be [E, H]");
  const int64_t experts = router.shape[0], first = kernel.first_expert;
  require(kernel.top_k <= experts, kName, "top_k exceeds the number of experts");
  require(gate_up.shape.size() == 4 && down.shape.size() == 4 && gate_up.shape[0] == down.shape[0] &&
              first + gate_up.shape[0] <= experts, kName,
          "gate_up and down must be [L, tiles, blocks, bytes] of experts first_expert .. first_expert + L - 1");
  require(kernel.down.n == hidden, kName, "down_N must be H");
  check_weights(kernel.gate_up, hidden, expert_weights(gate_up, 0), kName);
  check_weights(kernel.down, kernel.gate_up.n / 2, expert_weights(down, 0), kName);
  float* y = output<float>(kernel.api, context, 0, {tokens, hidden});
  std::fill(y, y + tokens * hidden, 0.0f);
  if (tokens == 0) return;

  thread_local std::vector<int64_t> chosen, order, starts;
  thread_local std::vector<float> weight, rows, out;
  chosen.resize(static_cast<size_t>(tokens * kernel.top_k));
  weight.resize(chosen.size());
  RouteJob route{static_cast<const float*>(x.data), static_cast<const float*>(router.data), hidden, experts,
                 kernel.top_k, kernel.normalize, chosen.data(), weight.data()};
  if (tokens == 1) route_token(&route, 0);
  else parallel_for(kernel.api, context, static_cast<size_t>(tokens), route_token, &route);

  // counting sort of the (token, k) pairs by expert, tokens ascending within an expert
  starts.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t e : chosen) ++starts[e + 1];
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  order.resize(chosen.size());
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (size_t pair = 0; pair < chosen.size(); ++pair) order[next[chosen[pair]]++] = static_cast<int64_t>(pair);

  const auto* xs = static_cast<const float*>(x.data);
  for (int64_t e = first; e < first + gate_up.shape[0]; ++e) {
    const int64_t start = starts[e], n = starts[e + 1] - start;
    if (n == 0) continue;  // an expert no token chose: its weights are not read
    rows.resize(static_cast<size_t>(n * hidden));
    out.resize(rows.size());
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = order[start + r] / kernel.top_k;
      std::memcpy(rows.data() + r * hidden, xs + t * hidden, static_cast<size_t>(hidden) * sizeof(float));
    }
    expert_mlp(kernel, context, Tensor{rows.data(), {n, hidden}}, expert_weights(gate_up, e - first),
               expert_weights(down, e - first), out.data());
    for (int64_t r = 0; r < n; ++r) {
      const int64_t pair = order[start + r], t = pair / kernel.top_k;
      const float p = weight[pair];
      float* to = y + t * hidden;
      const float* from = out.data() + r * hidden;
      for (int64_t c = 0; c < hidden; ++c) to[c] += from[c] * p;
    }
  }
}

void* create(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) {
  Api api(info);
  MoeKernel kernel{api, projection_of(api, info, "", true), projection_of(api, info, "down_", true)};
  api.check(api->KernelInfoGetAttribute_int64(info, "top_k", &kernel.top_k));
  kernel.normalize = api.optional_int(info, "normalize", 0) != 0;
  kernel.first_expert = api.optional_int(info, "first_expert", 0);
  require(kernel.first_expert >= 0, kName, "first_expert must not be negative");
  require(kernel.top_k >= 1, kName, "top_k must be at least 1");
  require(kernel.gate_up.n % 2 == 0, kName, "N (gate|up) must be even");
  require(!kernel.down.swiglu, kName, "down has no SwiGLU");
  return new MoeKernel(kernel);
}

KernelOp kOp = kernel_op(kName, {kFloat, kFloat, kUint8, kUint8}, kFloat, 1, create, compute,
                         destroy_kernel<MoeKernel>);

}  // namespace

std::vector<OrtCustomOp*> moe_ops() { return {&kOp}; }

}  // namespace engine_kernels
