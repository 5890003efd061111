// The attention math shared by plugins/kernels/paged_attention.cc's work items: the pools' element types (float,
// float16, int8, e4m3 codes) and how rows are stored into them, the shapes of a step, and the vector helpers of
// attention_decode.h (a token at a time: decodes, short rows) and attention_tiles.h (rows of several tokens).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
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

// A float stored into a pool of P: as is; float16 rounded to nearest even and saturated to +-65504 (so a pool never
// holds an infinity; NaN stays NaN); int8 rounded half to even and saturated (QuantizeLinear); fp8 its code.
inline void store(float x, float* to) { *to = x; }
inline void store(float x, _Float16* to) { *to = static_cast<_Float16>(std::clamp(x, -65504.0f, 65504.0f)); }
inline void store(float x, int8_t* to) { *to = static_cast<int8_t>(std::clamp(std::nearbyint(x), -128.0f, 127.0f)); }
inline void store(float x, uint8_t* to) { *to = e4m3_code(x); }

// Row x [n] into pool row `to`, divided by `scale` channel-wise first when the pool is quantized (scale not null).
template <typename P>
inline void write_row(const float* x, const float* scale, int64_t n, P* to) {
  for (int64_t c = 0; c < n; ++c) store(scale ? x[c] / scale[c] : x[c], to + c);
}

#if defined(ENGINE_KERNELS_AVX2) && defined(__F16C__)
// The same into a float16 pool, 8 values a vcvtps2ph: the instruction the scalar store compiles to, so the same bits
// (max(lo, x) then min(hi, .) keep a NaN, as clamp does). The scalar loop's 192 two-byte stores a row filled the
// store queue behind the row's cache misses (the step's slots are not in cache): 16 x 128 prefill 1.008-1.025x.
inline void write_row(const float* x, const float* scale, int64_t n, _Float16* to) {
  int64_t c = 0;
  if (!scale) {
    const __m256 lo = _mm256_set1_ps(-65504.0f), hi = _mm256_set1_ps(65504.0f);
    for (; c + 8 <= n; c += 8) {
      const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(x + c)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(to + c), _mm256_cvtps_ph(v, _MM_FROUND_CUR_DIRECTION));
    }
  }
  write_row<_Float16>(x + c, scale ? scale + c : nullptr, n - c, to + c);  // the tail, or a scaled row
}
#endif

inline float widen(float x) { return x; }
inline float widen(_Float16 x) { return static_cast<float>(x); }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(uint8_t code) { return kE4m3.value[code]; }

struct Shapes {
  int64_t tokens, rows, qmax, lmax, slots, heads, kv_heads, hd;
  int64_t group() const { return heads / kv_heads; }
};

// f(NH, r) for rows r .. r + NH - 1 of [0, count) in runs of up to Max (3 or 6) that never cross a multiple of
// `group` (the query heads of one KV head), NH an integral_constant: the register-blocked loops are instantiated
// for 1-Max rows.
template <int Max = 3, typename F>
inline void runs_of(int64_t count, int64_t group, F&& f) {
  for (int64_t r = 0, nh; r < count; r += nh) {
    nh = std::min<int64_t>(Max, group - r % group);
    switch (nh) {
      case 6: if constexpr (Max >= 6) f(std::integral_constant<int, 6>{}, r); break;
      case 5: if constexpr (Max >= 5) f(std::integral_constant<int, 5>{}, r); break;
      case 4: if constexpr (Max >= 4) f(std::integral_constant<int, 4>{}, r); break;
      case 3: f(std::integral_constant<int, 3>{}, r); break;
      case 2: f(std::integral_constant<int, 2>{}, r); break;
      default: f(std::integral_constant<int, 1>{}, r);
    }
  }
}

#ifdef ENGINE_KERNELS_AVX2
namespace simd {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const _Float16* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float x[8];
  for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(x);
#endif
}
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
// kExpMin = -87.3, where every weight beside the maximum's exp(0) = 1 is negligible. The 8- and 16-lane versions
// take their constants from here, so they give the same floats.
constexpr float kExpMin = -87.33654f, kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f,
                kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                              1.6666665459e-1f, 5.0000001201e-1f};

inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
// The same exp in 16 lanes: lane by lane the same operations (a native 16-lane pass, not two 8-lane halves).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

// out[j] = the sum of a[j]'s lanes, j < J <= 4: two rounds of pairwise sums instead of a horizontal sum per vector.
// Vectors past J count as zeros, so each sum is added in the same order whatever J is.
template <int J>
inline void sums_of(const __m256* a, float* out) {
  static_assert(J >= 1 && J <= 4, "sums_of folds 1 to 4 vectors");
  const auto at = [a](int j) { return j < J ? a[j] : _mm256_setzero_ps(); };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(at(0), at(1)), _mm256_hadd_ps(at(2), at(3)));
  float sums[4];
  _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  std::memcpy(out, sums, J * sizeof(float));
}

// The loops over heads and keys are written once over a vector type: V8 (AVX2 + FMA, 8 lanes) or, where the
// library is compiled with AVX-512F, V16 (16 lanes; head sizes that are a multiple of 16). fold() adds a vector's
// lanes down to 8.
struct V8 {
  using T = __m256;
  static constexpr int N = 8;
  template <typename P>
  static T load(const P* p) { return load8(p); }
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T zero_where(T value, T x, T ref) { return _mm256_andnot_ps(_mm256_cmp_ps(x, ref, _CMP_EQ_OQ), value); }
  static __m256 fold(T x) { return x; }
};

#ifdef __AVX512F__
struct V16 {
  using T = __m512;
  static constexpr int N = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static T load(const _Float16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static T load(const uint8_t* p) {
    const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(load8(p)));
    return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(load8(p + 8)), 1));
  }
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T zero_where(T value, T x, T ref) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ref, _CMP_NEQ_UQ), value); }
  static __m256 fold(T x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
};
#endif

// out_u[0, N W) (+)= sum_i p[u * pu + i * pi] * v_i[0, N W) for NH rows u (query heads of a token, or a tile's
// rows), v_i = v + keys[i], N = V::N: each value chunk is read once for all rows, into NH * W independent
// accumulators. Add: the sums are added to what out holds (a decode's later key chunks), else they replace it.
template <class V, int NH, int W, bool Add, typename P>
inline void weighted_chunk(const float* p, int64_t pu, int64_t pi, const int64_t* keys, int64_t n, const P* v,
                           float* const* out) {
  typename V::T acc[NH][W];
  ENGINE_UNROLL
  for (int u = 0; u < NH; ++u)
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) acc[u][w] = Add ? V::load(out[u] + V::N * w) : V::zero();
  for (int64_t i = 0; i < n; ++i) {
    const P* row = v + keys[i];
    typename V::T vv[W];
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) vv[w] = V::load(row + V::N * w);
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) {
      const typename V::T pw = V::set1(p[u * pu + i * pi]);
      ENGINE_UNROLL
      for (int w = 0; w < W; ++w) acc[u][w] = V::fmadd(pw, vv[w], acc[u][w]);
    }
  }
  ENGINE_UNROLL
  for (int u = 0; u < NH; ++u)
    ENGINE_UNROLL
    for (int w = 0; w < W; ++w) V::store(out[u] + V::N * w, acc[u][w]);
}

// Vector registers of the target: AVX2's 16, AVX-512's 32 (for 8 lanes too).
#ifdef __AVX512F__
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

// weighted_chunk over the head size (a multiple of V::N), up to 4 vectors of channels at a time: as many as keep
// the NH * W accumulators, W value vectors and the broadcast weight in registers. On AVX2, 3 rows at 4 vectors
// spilled an accumulator, whose store and reload then sat in every key's chain (bench/NOTES.md entry 40).
template <class V, int NH, bool Add, typename P>
void weighted_rows(const float* p, int64_t pu, int64_t pi, const int64_t* keys, int64_t n, const P* v, int64_t hd,
                   float* const* out) {
  constexpr int kW = std::min(4, (kVectorRegisters - 1) / (NH + 1));
  for (int64_t c = 0; c < hd; c += kW * V::N) {
    float* o[NH];
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) o[u] = out[u] + c;
    switch (std::min<int64_t>(kW, (hd - c) / V::N)) {
      case 4: if constexpr (kW >= 4) weighted_chunk<V, NH, 4, Add>(p, pu, pi, keys, n, v + c, o); break;
      case 3: if constexpr (kW >= 3) weighted_chunk<V, NH, 3, Add>(p, pu, pi, keys, n, v + c, o); break;
      case 2: weighted_chunk<V, NH, 2, Add>(p, pu, pi, keys, n, v + c, o); break;
      default: weighted_chunk<V, NH, 1, Add>(p, pu, pi, keys, n, v + c, o);
    }
  }
}

}  // namespace simd
#endif

}  // namespace engine_kernels
