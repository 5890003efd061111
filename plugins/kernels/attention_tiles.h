// Prefill tiles of plugins/kernels/paged_attention.cc: the attention of several consecutive tokens of one row for
// one KV head in one work item, as small matrix products.
//
// attend_part (attention_decode.h) takes one token at a time: each item rescans its mask row, and the keys and
// values are reloaded for every token. A tile of m tokens makes
// R = m * group query rows that share their keys: the scores S [keys, R] come from one product with the rows held
// transposed (qt [hd, R]), so each key element is broadcast once into independent FMA chains of 8 rows (16 with
// AVX-512) and no score needs a horizontal sum; the softmax runs across rows in registers; the weighted sum reads
// each value row once for several query rows. The tile sees the union of its tokens' keys; a key some of its
// tokens may not see (a causal tile's last m - 1 keys, a sliding window's first) is masked per row to -inf and then
// to a weight of exactly 0.
// Union keys are the row's own context (its tokens' visible keys), so no stale pool row is ever read. AVX2 + FMA
// and a head size that is a multiple of 8 only; otherwise every token goes through attend_part.
#pragma once

#include <type_traits>

#include "attention_math.h"

namespace engine_kernels {

// A tile: m packed tokens of row b at its query positions js (ascending), their query rows in q (q_index's
// entries) and their output rows.
struct Tile {
  int64_t b, m;
  const int64_t *js, *q_rows, *out_rows;
};

#ifdef ENGINE_KERNELS_AVX2

// Query rows per tile: enough 8-lane chains to keep the FMA units busy, few enough that a tile of a causal
// prefill wastes little on keys its earlier tokens do not see. With AVX-512, 64: scores 4 vectors of rows at a
// time (SmolLM2 prefill of 512 tokens 2-4% faster than 32, bench/NOTES.md entry 29).
#ifdef __AVX512F__
constexpr int64_t kTileRows = 64;
#else
constexpr int64_t kTileRows = 32;
#endif

constexpr int64_t kValueChunk = 64;  // keys of the weighted sums per pass over the tile's rows

inline int64_t tile_tokens(const Shapes& s) { return std::max<int64_t>(1, kTileRows / s.group()); }

struct TileScratch {
  std::vector<int64_t> keys;     // per union key: its row offset in `base` (the pool, or kf/vf when widened)
  std::vector<int64_t> partial;  // union keys (index i, then context position l) some tile token does not see
  std::vector<float> kf, vf;     // quantized pools: the union's K and V rows widened to float [n, hd]
  std::vector<float> qt;         // [hd, rpad] scale * q of the tile's rows, transposed; rows >= R are zero
  std::vector<float> s;          // [n, rpad] scores, then weights
  std::vector<float> top, sum;   // [rpad]
};

namespace simd {

// s[j * rpad + N w + lane] = k_j . qt[:, N w + lane] for KB keys and W * N rows (N = V::N lanes).
template <class V, int KB, int W>
inline void score_tile(const float* qt, int64_t rpad, const float* const* k, int64_t hd, float* s) {
  typename V::T acc[KB][W];
  ENGINE_UNROLL
  for (int j = 0; j < KB; ++j)
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) acc[j][w] = V::zero();
  for (int64_t d = 0; d < hd; ++d) {
    typename V::T q[W];
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) q[w] = V::load(qt + d * rpad + V::N * w);
    ENGINE_UNROLL
    for (int j = 0; j < KB; ++j) {
      const typename V::T kd = V::set1(k[j][d]);
      ENGINE_UNROLL
      for (int w = 0; w < W; ++w) acc[j][w] = V::fmadd(kd, q[w], acc[j][w]);
    }
  }
  ENGINE_UNROLL
  for (int j = 0; j < KB; ++j)
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) V::store(s + j * rpad + V::N * w, acc[j][w]);
}

template <class V, int W>
inline void score_rows(const float* qt, int64_t rpad, const float* base, const int64_t* keys, int64_t n, int64_t hd,
                       float* s) {
  constexpr int KB = 6;
  int64_t i = 0;
  for (; i + KB <= n; i += KB) {
    const float* k[KB];
    ENGINE_UNROLL
    for (int j = 0; j < KB; ++j) k[j] = base + keys[i + j];
    score_tile<V, KB, W>(qt, rpad, k, hd, s + i * rpad);
  }
  for (; i < n; ++i) {
    const float* k[1] = {base + keys[i]};
    score_tile<V, 1, W>(qt, rpad, k, hd, s + i * rpad);
  }
}

// Per row r: top = max_i s[i, r] (0 when the row sees no key), s <- exp(s - top) with -inf scores to exactly 0,
// sum = sum_i s[i, r]; V::N rows at a time (rpad is a multiple of V::N), two chains of keys (even, odd) each for the
// max and the sum: one chain was bound by the latency of vmaxps (perf: the max loop 9% of a prefill tile).
template <class V>
inline void softmax_rows(float* s, int64_t n, int64_t rpad, float* top, float* sum) {
  using T = typename V::T;
  const T minus_inf = V::set1(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rpad; r += V::N) {
    T t[2] = {minus_inf, minus_inf};
    for (int64_t i = 0; i < n; ++i) t[i & 1] = V::max(t[i & 1], V::load(s + i * rpad + r));
    const T most = V::max(t[0], t[1]), top_r = V::zero_where(most, most, minus_inf);
    T acc[2] = {V::zero(), V::zero()};
    for (int64_t i = 0; i < n; ++i) {
      const T x = V::load(s + i * rpad + r);
      const T e = V::zero_where(exp_nonpositive(V::sub(x, top_r)), x, minus_inf);
      V::store(s + i * rpad + r, e);
      acc[i & 1] = V::add(acc[i & 1], e);
    }
    V::store(top + r, top_r);
    V::store(sum + r, V::add(acc[0], acc[1]));
  }
}

}  // namespace simd


// Tile `t` for KV head g: the output rows of its query heads written directly into out [T, heads * hd]. q
// [T, heads * hd] is scaled by `scale` here; pools kc, vc. V: the scores' rows in V::N lanes, and the values'
// channels when the head size is a multiple of V::N (else 8 lanes).
template <class V, typename P>
void attend_tile_v(const Shapes& s, float scale, float softcap, const float* q, const P* kc, const P* vc,
                 const int64_t* kv_slots, const bool* mask, const Tile& t, int64_t g, float* out, TileScratch& x) {
  const int64_t b = t.b, m = t.m;
  const int64_t* js = t.js;
  const int64_t group = s.group(), hd = s.hd, kv_width = s.kv_heads * hd, rows = m * group;
  const int64_t rpad = (rows + V::N - 1) / V::N * V::N;
  // The union of the tokens' keys, 32 positions at a time: any token sees it (OR), every token does (AND).
  x.keys.clear();
  x.partial.clear();
  for (int64_t l0 = 0; l0 < s.lmax; l0 += 32) {
    const int64_t width = std::min<int64_t>(32, s.lmax - l0);
    uint32_t any = 0, all = ~0u;
    for (int64_t u = 0; u < m; ++u) {
      const bool* row = mask + (b * s.qmax + js[u]) * s.lmax + l0;
      uint32_t bits = 0;
      if (width == 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        bits = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpgt_epi8(v, _mm256_setzero_si256())));
      } else {
        for (int64_t l = 0; l < width; ++l) bits |= static_cast<uint32_t>(row[l] != 0) << l;
      }
      any |= bits, all &= bits;
    }
    for (uint32_t rest = any; rest; rest &= rest - 1) {
      const int64_t l = l0 + __builtin_ctz(rest);
      if (!(all >> (l - l0) & 1)) x.partial.insert(x.partial.end(), {static_cast<int64_t>(x.keys.size()), l});
      x.keys.push_back(kv_slots[b * s.lmax + l] * kv_width + g * hd);
    }
  }
  const int64_t n = static_cast<int64_t>(x.keys.size());
  const float *kbase = nullptr, *vbase = nullptr;
  if constexpr (std::is_same_v<P, float>) {
    kbase = kc, vbase = vc;
  } else {  // widen the union's rows once for all R query rows
    x.kf.resize(static_cast<size_t>(n * hd));
    x.vf.resize(static_cast<size_t>(n * hd));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < hd; d += 8) {
        _mm256_storeu_ps(x.kf.data() + i * hd + d, simd::load8(kc + x.keys[i] + d));
        _mm256_storeu_ps(x.vf.data() + i * hd + d, simd::load8(vc + x.keys[i] + d));
      }
      x.keys[i] = i * hd;
    }
    kbase = x.kf.data(), vbase = x.vf.data();
  }
  // Row r = u * group + h is query head g * group + h of token u.
  x.qt.assign(static_cast<size_t>(hd * rpad), 0.0f);
  for (int64_t u = 0; u < m; ++u)
    for (int64_t h = 0; h < group; ++h) {
      const float* qr = q + t.q_rows[u] * s.heads * hd + (g * group + h) * hd;
      for (int64_t d = 0; d < hd; ++d) x.qt[d * rpad + u * group + h] = scale * qr[d];
    }
  x.s.resize(static_cast<size_t>(std::max<int64_t>(n, 1) * rpad));
  float* sc = x.s.data();
  for (int64_t r = 0; r < rpad;) {
    if (V::N == 16 && rpad - r >= 4 * V::N) {
      simd::score_rows<V, 4>(x.qt.data() + r, rpad, kbase, x.keys.data(), n, hd, sc + r);
      r += 4 * V::N;
    } else if (rpad - r >= 2 * V::N) {
      simd::score_rows<V, 2>(x.qt.data() + r, rpad, kbase, x.keys.data(), n, hd, sc + r);
      r += 2 * V::N;
    } else {
      simd::score_rows<V, 1>(x.qt.data() + r, rpad, kbase, x.keys.data(), n, hd, sc + r);
      r += V::N;
    }
  }
  if (softcap > 0)
    for (int64_t e = 0; e < n * rpad; ++e) sc[e] = softcap * std::tanh(sc[e] / softcap);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (size_t p = 0; p < x.partial.size(); p += 2) {
    const int64_t i = x.partial[p], l = x.partial[p + 1];
    for (int64_t u = 0; u < m; ++u)
      if (!mask[(b * s.qmax + js[u]) * s.lmax + l]) std::fill_n(sc + i * rpad + u * group, group, minus_inf);
  }
  x.top.resize(static_cast<size_t>(rpad));
  x.sum.resize(static_cast<size_t>(rpad));
  simd::softmax_rows<V>(sc, n, rpad, x.top.data(), x.sum.data());
  // The weighted sums kValueChunk keys at a time, every row run over one chunk before the next: a chunk's value
  // rows (16 KB at hd 64, float) stay in L1 for all the tile's runs of rows, where the whole union (up to MBs)
  // came from L2 for each run.
  auto row_out = [&](int64_t row) {
    return out + t.out_rows[row / group] * s.heads * hd + (g * group + row % group) * hd;
  };
  constexpr int kRun = V::N == 16 ? 6 : 3;  // rows per pass: 6 x 4 accumulators fit AVX-512's 32 registers
  for (int64_t i0 = 0; i0 < std::max<int64_t>(n, 1); i0 += kValueChunk) {
    const int64_t chunk = std::min(kValueChunk, n - i0);
    runs_of<kRun>(rows, rows, [&](auto nh, int64_t r) {   // the tile's rows, kRun at a time
      constexpr int NH = decltype(nh)::value;
      float* o[NH];
      for (int u = 0; u < NH; ++u) o[u] = row_out(r + u);
      const float* p = sc + i0 * rpad + r;
      const int64_t* keys = x.keys.data() + i0;
      if (hd % V::N == 0) {
        if (i0 == 0) simd::weighted_rows<V, NH, false>(p, 1, rpad, keys, chunk, vbase, hd, o);
        else simd::weighted_rows<V, NH, true>(p, 1, rpad, keys, chunk, vbase, hd, o);
      } else {
        if (i0 == 0) simd::weighted_rows<simd::V8, NH, false>(p, 1, rpad, keys, chunk, vbase, hd, o);
        else simd::weighted_rows<simd::V8, NH, true>(p, 1, rpad, keys, chunk, vbase, hd, o);
      }
    });
  }
  for (int64_t row = 0; row < rows; ++row) {
    const float total = x.sum[static_cast<size_t>(row)];
    const float inv = total > 0 ? 1.0f / total : 0.0f;  // a row that sees no key: zeros
    float* o = row_out(row);
    for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
  }
}

template <typename P>
void attend_tile(const Shapes& s, float scale, float softcap, const float* q, const P* kc, const P* vc,
                 const int64_t* kv_slots, const bool* mask, const Tile& t, int64_t g, float* out, TileScratch& x) {
#ifdef __AVX512F__
  attend_tile_v<simd::V16>(s, scale, softcap, q, kc, vc, kv_slots, mask, t, g, out, x);
#else
  attend_tile_v<simd::V8>(s, scale, softcap, q, kc, vc, kv_slots, mask, t, g, out, x);
#endif
}

#endif
}  // namespace engine_kernels
