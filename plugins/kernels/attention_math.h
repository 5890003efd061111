// The attention math of plugins/kernels/paged_attention.cc, in work items that threads can share: here a token at a
// time (decodes, short rows); attention_tiles.h takes rows of several tokens.
//
// One item: packed token t, KV head g (its `group` query heads), and one share `part` of `parts` of the keys the
// token's mask row lets it see. It leaves, per query head, the share's score maximum m, its sum of exp(score - m)
// and the unnormalized output sum_i exp(score_i - m) v_i; combine() merges the shares (flash-decoding's split of
// the keys, which keeps both cores busy when a step has fewer (token, KV head) items than threads). Scores are
// (scale * q_h) . k_i, softcapped. With AVX2 + FMA and a head size that is a multiple of 8, the scores and the
// weighted sum run in 8-lane registers, every query head of a KV head sharing each key and value load; otherwise
// plain loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace engine_kernels {

// e4m3fn: sign, 4 exponent bits e (bias 7), 3 mantissa bits m: (8 + m) 2^(e - 10), or m 2^-9 when e = 0. Codes
// 0x7f and 0xff are NaN in e4m3fn; the engine's saturating encoder never writes them, and they read as +-480 here.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) {
      int e = (c >> 3) & 15, m = c & 7;
      float v = std::ldexp(static_cast<float>(e > 0 ? 8 + m : m), std::max(e, 1) - 10);
      value[c] = (c & 128) ? -v : v;
    }
  }
};
inline const E4m3Table kE4m3;

// The code of v: round to nearest even on the e4m3 grid, saturated to +-448 (QuantizeLinear to float8e4m3fn with
// saturate=1); NaN gives the NaN code 0x7f (+ sign).
inline uint8_t e4m3_code(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (std::isnan(a)) return sign | 0x7f;
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0.015625f)  // below the smallest normal 2^-6: subnormal steps of 2^-9 (rounding up to 2^-6 gives 0x08)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  int exponent = 0;
  const float fraction = std::frexp(a, &exponent);            // a = fraction * 2^exponent, fraction in [0.5, 1)
  int mantissa = static_cast<int>(std::nearbyint((fraction * 2.0f - 1.0f) * 8.0f));   // of 1.m, 0..8
  int biased = exponent - 1 + 7;
  if (mantissa == 8) mantissa = 0, ++biased;                   // rounded up into the next binade
  return sign | static_cast<uint8_t>(biased << 3 | mantissa);
}

// A float stored into a pool of P: as is; int8 rounded half to even and saturated (QuantizeLinear); fp8 its code.
inline void store(float x, float* to) { *to = x; }
inline void store(float x, int8_t* to) { *to = static_cast<int8_t>(std::clamp(std::nearbyint(x), -128.0f, 127.0f)); }
inline void store(float x, uint8_t* to) { *to = e4m3_code(x); }

// Row x [n] into pool row `to`, divided by `scale` channel-wise first when the pool is quantized (scale not null).
template <typename P>
inline void write_row(const float* x, const float* scale, int64_t n, P* to) {
  for (int64_t c = 0; c < n; ++c) store(scale ? x[c] / scale[c] : x[c], to + c);
}

inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(uint8_t code) { return kE4m3.value[code]; }

struct Shapes {
  int64_t tokens, rows, qmax, lmax, slots, heads, kv_heads, hd;
  int64_t group() const { return heads / kv_heads; }
};

struct Scratch {
  std::vector<int64_t> visible;  // pool offsets (slot * kv_width + g * hd) of the share's keys
  std::vector<float> scores;     // [group, keys]
  std::vector<float> q;          // scale * q of the group's heads
};

// One item's result per query head of its group: [m, l, out[hd]].
inline int64_t partial_size(const Shapes& s) { return s.group() * (s.hd + 2); }

#ifdef ENGINE_KERNELS_AVX2
namespace simd {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// e4m3 codes as E4m3Table computes them, in registers: (8 + m or m) times the power of two 2^(max(e, 1) - 10),
// built from its exponent bits (no subnormal float is formed, so a flush-to-zero mode cannot change the result).
inline __m256 load8(const uint8_t* p) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(c, 3), _mm256_set1_epi32(15));
  const __m256i normal = _mm256_and_si256(_mm256_cmpgt_epi32(e, _mm256_setzero_si256()), _mm256_set1_epi32(8));
  const __m256i mant = _mm256_or_si256(_mm256_and_si256(c, _mm256_set1_epi32(7)), normal);
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(1)),
                                                          _mm256_set1_epi32(127 - 10)), 23);
  const __m256 magnitude = _mm256_mul_ps(_mm256_cvtepi32_ps(mant), _mm256_castsi256_ps(pow2));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(magnitude, _mm256_castsi256_ps(sign));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// exp(x) for x <= 0 (Cephes expf: 2^n times a polynomial of the remainder, ~1 ulp), flushed to 2^-126 below
// -87.3, where every weight beside the maximum's exp(0) = 1 is negligible.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// scores[u * n + j] = q_u . k_j for NH consecutive query heads (q_u = q + u * hd) and KK keys: each key chunk is
// loaded once for all heads, and the NH * KK accumulators are independent FMA chains.
template <int NH, int KK, typename P>
inline void score_block(const float* q, const P* const* k, int64_t hd, float* scores, int64_t n) {
  __m256 acc[KK][NH];
  ENGINE_UNROLL
  for (int j = 0; j < KK; ++j)
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) acc[j][u] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8)
    ENGINE_UNROLL
    for (int j = 0; j < KK; ++j) {
      __m256 kv = load8(k[j] + d);
      ENGINE_UNROLL
      for (int u = 0; u < NH; ++u) acc[j][u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + u * hd + d), kv, acc[j][u]);
    }
  ENGINE_UNROLL
  for (int j = 0; j < KK; ++j)
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) scores[u * n + j] = hsum(acc[j][u]);
}

// Pool rows come from memory (a step reads each layer's context once): the keys AHEAD positions on are
// prefetched while the current ones compute, so the loads overlap the arithmetic.
constexpr int64_t AHEAD = 16;

template <typename P>
inline void prefetch(const P* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

template <int NH, typename P>
void score_heads(const float* q, const P* kc, const std::vector<int64_t>& visible, int64_t hd, float* scores) {
  const int64_t n = static_cast<int64_t>(visible.size()), bytes = hd * static_cast<int64_t>(sizeof(P));
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    if (i + AHEAD + 1 < n) {
      prefetch(kc + visible[i + AHEAD], bytes);
      prefetch(kc + visible[i + AHEAD + 1], bytes);
    }
    const P* k[2] = {kc + visible[i], kc + visible[i + 1]};
    score_block<NH, 2>(q, k, hd, scores + i, n);
  }
  if (i < n) {
    const P* k[1] = {kc + visible[i]};
    score_block<NH, 1>(q, k, hd, scores + i, n);
  }
}

// out_u[0, 8W) = sum_i p[u * pu + i * pi] * v_i[0, 8W) for NH rows u (query heads of a token, or a tile's rows),
// v_i = v + keys[i]: each value chunk is read once for all rows, into NH * W independent accumulators. Stream:
// the rows come from memory (a decode's pool rows), so they are prefetched AHEAD keys on.
template <int NH, int W, bool Stream, typename P>
inline void weighted_chunk(const float* p, int64_t pu, int64_t pi, const int64_t* keys, int64_t n, const P* v,
                           float* const* out) {
  __m256 acc[NH][W];
  ENGINE_UNROLL
  for (int u = 0; u < NH; ++u)
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) acc[u][w] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if (Stream && i + AHEAD < n) prefetch(v + keys[i + AHEAD], 32 * W * static_cast<int64_t>(sizeof(P)));
    const P* row = v + keys[i];
    __m256 vv[W];
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) vv[w] = load8(row + 8 * w);
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) {
      const __m256 pw = _mm256_broadcast_ss(p + u * pu + i * pi);
      ENGINE_UNROLL
      for (int w = 0; w < W; ++w) acc[u][w] = _mm256_fmadd_ps(pw, vv[w], acc[u][w]);
    }
  }
  ENGINE_UNROLL
  for (int u = 0; u < NH; ++u)
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(out[u] + 8 * w, acc[u][w]);
}

// weighted_chunk over the head size, 32 channels at a time.
template <int NH, bool Stream, typename P>
void weighted_rows(const float* p, int64_t pu, int64_t pi, const int64_t* keys, int64_t n, const P* v, int64_t hd,
                   float* const* out) {
  for (int64_t c = 0; c < hd; c += 32) {
    float* o[NH];
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) o[u] = out[u] + c;
    switch (std::min<int64_t>(4, (hd - c) / 8)) {
      case 4: weighted_chunk<NH, 4, Stream>(p, pu, pi, keys, n, v + c, o); break;
      case 3: weighted_chunk<NH, 3, Stream>(p, pu, pi, keys, n, v + c, o); break;
      case 2: weighted_chunk<NH, 2, Stream>(p, pu, pi, keys, n, v + c, o); break;
      default: weighted_chunk<NH, 1, Stream>(p, pu, pi, keys, n, v + c, o);
    }
  }
}

}  // namespace simd
#endif

// p[0, n) <- exp(p - m) after the softcap (none when 0); returns (m, sum).
inline std::pair<float, float> exp_scores(float* p, int64_t n, float softcap) {
  if (softcap > 0)
    for (int64_t i = 0; i < n; ++i) p[i] = softcap * std::tanh(p[i] / softcap);
  float top = -std::numeric_limits<float>::infinity(), sum = 0;
  int64_t i = 0;
#ifdef ENGINE_KERNELS_AVX2
  __m256 t = _mm256_set1_ps(top);  // eight running maxima: a scalar max is one long latency chain
  for (; i + 8 <= n; i += 8) t = _mm256_max_ps(t, _mm256_loadu_ps(p + i));
  for (int lane = 0; lane < 8; ++lane) top = std::max(top, t[lane]);
#endif
  for (; i < n; ++i) top = std::max(top, p[i]);
  i = 0;
#ifdef ENGINE_KERNELS_AVX2
  t = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = simd::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), t));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = simd::hsum(acc);
#endif
  for (; i < n; ++i) sum += (p[i] = std::exp(p[i] - top));
  return {top, sum};
}

// The item (token row `row` of query row q, KV head g, share `part` of `parts`) into partial [group, hd + 2].
template <typename P>
void attend_part(const Shapes& s, float scale, float softcap, const float* q, const P* kc, const P* vc,
                 const int64_t* kv_slots, const bool* mask, int64_t row, int64_t g, int64_t part, int64_t parts,
                 float* partial, Scratch& x) {
  const int64_t b = row / s.qmax, group = s.group(), kv_width = s.kv_heads * s.hd, hd = s.hd;
  const bool* m = mask + row * s.lmax;
  int64_t seen = 0;
  for (int64_t l = 0; l < s.lmax; ++l) seen += m[l];
  const int64_t first = seen * part / parts, last = seen * (part + 1) / parts;
  x.visible.clear();
  for (int64_t l = 0, i = 0; l < s.lmax && i < last; ++l)
    if (m[l] && i++ >= first) x.visible.push_back(kv_slots[b * s.lmax + l] * kv_width + g * hd);
  const int64_t n = static_cast<int64_t>(x.visible.size()), stride = hd + 2;
  if (n == 0) {
    for (int64_t u = 0; u < group; ++u) {
      partial[u * stride] = -std::numeric_limits<float>::infinity();
      std::fill(partial + u * stride + 1, partial + (u + 1) * stride, 0.0f);
    }
    return;
  }
  x.q.assign(q + g * group * hd, q + (g + 1) * group * hd);
  for (float& e : x.q) e *= scale;
  x.scores.resize(static_cast<size_t>(group * n));
  float* out = partial + 2;
#ifdef ENGINE_KERNELS_AVX2
  const bool vectorized = hd % 8 == 0;
#else
  const bool vectorized = false;
#endif
  for (int64_t h = 0; h < group; h += 3) {  // query heads in runs of up to 3
    const int64_t nh = std::min<int64_t>(3, group - h);
    float* p = x.scores.data() + h * n;
    if (vectorized) {
#ifdef ENGINE_KERNELS_AVX2
      if (nh == 3) simd::score_heads<3>(x.q.data() + h * hd, kc, x.visible, hd, p);
      else if (nh == 2) simd::score_heads<2>(x.q.data() + h * hd, kc, x.visible, hd, p);
      else simd::score_heads<1>(x.q.data() + h * hd, kc, x.visible, hd, p);
#endif
    } else {
      for (int64_t u = 0; u < nh; ++u)
        for (int64_t i = 0; i < n; ++i) {
          float acc = 0;
          for (int64_t d = 0; d < hd; ++d) acc += x.q[(h + u) * hd + d] * widen(kc[x.visible[i] + d]);
          p[u * n + i] = acc;
        }
    }
    for (int64_t u = 0; u < nh; ++u) {
      auto [top, sum] = exp_scores(p + u * n, n, softcap);
      partial[(h + u) * stride] = top;
      partial[(h + u) * stride + 1] = sum;
    }
    if (vectorized) {
#ifdef ENGINE_KERNELS_AVX2
      float* o[3];
      for (int64_t u = 0; u < nh; ++u) o[u] = out + (h + u) * stride;
      if (nh == 3) simd::weighted_rows<3, true>(p, n, 1, x.visible.data(), n, vc, hd, o);
      else if (nh == 2) simd::weighted_rows<2, true>(p, n, 1, x.visible.data(), n, vc, hd, o);
      else simd::weighted_rows<1, true>(p, n, 1, x.visible.data(), n, vc, hd, o);
#endif
    } else {
      for (int64_t u = 0; u < nh; ++u) {
        float* o = out + (h + u) * stride;
        std::fill(o, o + hd, 0.0f);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t d = 0; d < hd; ++d) o[d] += p[u * n + i] * widen(vc[x.visible[i] + d]);
      }
    }
  }
}

// out[group * hd] of one (token, KV head) from its `parts` partials: the shares rescaled to the common maximum.
inline void combine(const Shapes& s, const float* partials, int64_t parts, float* out) {
  const int64_t group = s.group(), hd = s.hd, stride = hd + 2, size = partial_size(s);
  for (int64_t u = 0; u < group; ++u) {
    float top = -std::numeric_limits<float>::infinity(), total = 0;
    for (int64_t j = 0; j < parts; ++j) top = std::max(top, partials[j * size + u * stride]);
    float* o = out + u * hd;
    std::fill(o, o + hd, 0.0f);
    if (top == -std::numeric_limits<float>::infinity()) continue;  // no visible key: zeros
    for (int64_t j = 0; j < parts; ++j) {
      const float* pj = partials + j * size + u * stride;
      if (pj[0] == -std::numeric_limits<float>::infinity()) continue;
      const float w = std::exp(pj[0] - top);
      total += w * pj[1];
      for (int64_t d = 0; d < hd; ++d) o[d] += w * pj[2 + d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < hd; ++d) o[d] *= inv;
  }
}

}  // namespace engine_kernels
