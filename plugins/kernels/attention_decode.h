// Decode items of plugins/kernels/paged_attention.cc: one token's attention over a share of the keys its mask row
// lets it see, every head at once (attention_tiles.h takes rows of several tokens).
//
// A token's keys are cut in segments of kSegment; each segment leaves, per query head, its score maximum m, its sum
// of exp(score - m) and the unnormalized output sum_i exp(score_i - m) v_i, and combine() merges the segments in
// order. An item takes a share of whole segments (flash-decoding's split of the keys, which keeps both cores busy
// when a step has fewer tokens than threads), so a token's result depends on its keys alone, never on how a step
// shares them out: a lone decode (split over the threads) and the same token in a batch or a speculative
// verification (not split) give the same floats, which keeps speculative greedy decoding token-identical.
// Scores are (scale * q_h) . k_i, softcapped.
//
// Memory (bench/NOTES.md entries 27 and 35): a pool row holds every KV head of its slot, so an item that takes all
// heads reads whole rows. The keys go in chunks of kChunk: a chunk's K rows are first read in by plain loads in
// address order (a stream the hardware prefetcher follows), then scored from the cache; likewise its V rows for the
// weighted sum; the chunks merge online (running maximum, sums rescaled). Loads interleaved with the arithmetic,
// under software prefetch or not, left most of the memory latency exposed: ~2x the time of a plain read. So the
// prefetches ride on those reads instead: reading a chunk's K rows prefetches its V rows (they arrive while the K
// rows are scored), and reading a chunk's V rows prefetches the next chunk's K rows, or at the last chunk the K
// rows of the next token of the same work item (they arrive during the weighted sum). 32 decodes over 192 keys, 30
// layers of float16 KV (142 MB), in a C++ harness on a Zen 4: 10.6 -> 7.4 ms, where a plain read of the bytes takes
// 5.2 and the arithmetic alone 4.6. Chunks of 32 keys rather than 256 (NOTES 38): a lone decode's share is one
// chunk of 256, so nothing was on its way while its first K rows were read.
// Vector code: 16 lanes (AVX-512F, head size a multiple of 16), else 8 (AVX2 + FMA, a multiple of 8), else plain
// loops.
#pragma once

#include <unistd.h>

#include <cstring>

#include "attention_math.h"

namespace engine_kernels {

constexpr int64_t kChunk = 32;  // keys: small, so the next chunk's K rows are on their way early (NOTES 38)
constexpr int64_t kSegment = 64;  // keys a partial covers: the unit of a lone decode's split (2 chunks)

// Segments of a token that sees `seen` keys (one at least: no key gives a partial of zeros).
inline int64_t segments(int64_t seen) { return std::max<int64_t>(1, (seen + kSegment - 1) / kSegment); }

// The segments [first, last) of share `part` of `parts` of a token's `seen` keys.
inline std::pair<int64_t, int64_t> share_segments(int64_t seen, int64_t part, int64_t parts) {
  const int64_t n = segments(seen);
  return {n * part / parts, n * (part + 1) / parts};
}

struct Scratch {
  std::vector<int64_t> visible;  // pool offsets (slot * kv_width) of the share's keys
  std::vector<int64_t> next;     // the same of the work item's next token, whose K rows are prefetched
  std::vector<float> scores;     // [heads, kChunk]
  std::vector<float> q;          // scale * q of the token's heads
};

// One item's result per query head: [m, l, out[hd]].
inline int64_t partial_size(const Shapes& s) { return s.heads * (s.hd + 2); }

// The rows base + keys[i] (`bytes` each) read into the cache, a load per 64-byte line in address order, while the
// rows ahead + ahead_keys[i], i < ahead_n, are prefetched into L1 (a prefetch never faults). A chunk's rows (12 KB of
// float16 K or V for SmolLM2) fit beside the other's in L1; prefetched into L2 only (prefetcht2), the 32-decode step
// ran 2-4% slower on a Zen 5, the staging loads then waiting on L2 (bench/NOTES.md entry 45). With nta the prefetch
// is non-temporal (into L1, not kept in the outer caches when evicted): a float32 batch-1 decode step, ~27 MB of KV
// at 576 keys, ran 1.01-1.03x faster than with prefetcht0, and the 32-decode steps no slower (entry 52). That only
// holds while the two chunks fit L1 (nta_fits): a prefetched row evicted before its use is read from memory again.
template <typename P>
inline void stage(bool nta, const P* base, const int64_t* keys, int64_t n, int64_t bytes, const P* ahead = nullptr,
                  const int64_t* ahead_keys = nullptr, int64_t ahead_n = 0) {
  for (int64_t i = 0; i < n; ++i) {
    if (i < ahead_n) {
      const char* row = reinterpret_cast<const char*>(ahead + ahead_keys[i]);
      if (nta)
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 0);
      else
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
    }
    const volatile char* row = reinterpret_cast<const volatile char*>(base + keys[i]);
    for (int64_t b = 0; b < bytes; b += 64) (void)row[b];
  }
}

#ifdef ENGINE_KERNELS_AVX2
namespace simd {

// scores[u * stride + i] = q_u . k_i for NH query heads q_u = q + u * hd of one KV head, k_i = k + keys[i]: four
// keys at a time (three where 4 NH accumulators, 4 keys and q would not fit the registers: AVX2 and 3 heads,
// bench/NOTES.md entry 40), each key vector loaded once for all heads, the sums of a head folded together (sums_of).
template <class V, int NH, typename P>
void score_keys(const float* q, const P* k, const int64_t* keys, int64_t n, int64_t hd, float* scores,
                int64_t stride) {
  using T = typename V::T;
  constexpr int kKeys = 4 * NH + 5 <= kVectorRegisters ? 4 : 3;
  int64_t i = 0;
  for (; i + kKeys <= n; i += kKeys) {
    T acc[NH][kKeys];
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u)
      ENGINE_UNROLL
      for (int j = 0; j < kKeys; ++j) acc[u][j] = V::zero();
    for (int64_t d = 0; d < hd; d += V::N) {
      T kv[kKeys];
      ENGINE_UNROLL
      for (int j = 0; j < kKeys; ++j) kv[j] = V::load(k + keys[i + j] + d);
      ENGINE_UNROLL
      for (int u = 0; u < NH; ++u) {
        const T qv = V::load(q + u * hd + d);
        ENGINE_UNROLL
        for (int j = 0; j < kKeys; ++j) acc[u][j] = V::fmadd(qv, kv[j], acc[u][j]);
      }
    }
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) {
      __m256 folded[kKeys];
      ENGINE_UNROLL
      for (int j = 0; j < kKeys; ++j) folded[j] = V::fold(acc[u][j]);
      sums_of<kKeys>(folded, scores + u * stride + i);
    }
  }
  for (; i < n; ++i) {
    T acc[NH];
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) acc[u] = V::zero();
    for (int64_t d = 0; d < hd; d += V::N) {
      const T kv = V::load(k + keys[i] + d);
      ENGINE_UNROLL
      for (int u = 0; u < NH; ++u) acc[u] = V::fmadd(V::load(q + u * hd + d), kv, acc[u]);
    }
    ENGINE_UNROLL
    for (int u = 0; u < NH; ++u) {  // summed in the groups' order
      const __m256 folded = V::fold(acc[u]);
      sums_of<1>(&folded, scores + u * stride + i);
    }
  }
}

}  // namespace simd
#endif

// p[h * kChunk + i] = q_h . k_i over the chunk's n keys for every head (q already scaled), and the weighted sums
// out_h += sum_i p[h * kChunk + i] v_i into the partial's rows, at `lanes` vector lanes (0: plain loops).
template <class V, typename P>
void chunk_scores(const Shapes& s, const float* q, const P* kc, const int64_t* keys, int64_t n, float* p) {
#ifdef ENGINE_KERNELS_AVX2
  if constexpr (!std::is_void_v<V>) {
    runs_of(s.heads, s.group(), [&](auto nh, int64_t h) {
      simd::score_keys<V, decltype(nh)::value>(q + h * s.hd, kc + h / s.group() * s.hd, keys, n, s.hd,
                                               p + h * kChunk, kChunk);
    });
    return;
  }
#endif
  for (int64_t h = 0; h < s.heads; ++h)
    for (int64_t i = 0; i < n; ++i) {
      float acc = 0;
      for (int64_t d = 0; d < s.hd; ++d) acc += q[h * s.hd + d] * widen(kc[keys[i] + h / s.group() * s.hd + d]);
      p[h * kChunk + i] = acc;
    }
}

template <class V, typename P>
void chunk_values(const Shapes& s, const float* p, const P* vc, const int64_t* keys, int64_t n, float* partial) {
  const int64_t stride = s.hd + 2;
#ifdef ENGINE_KERNELS_AVX2
  if constexpr (!std::is_void_v<V>) {
    runs_of(s.heads, s.group(), [&](auto nh, int64_t h) {
      constexpr int NH = decltype(nh)::value;
      float* o[NH];
      for (int u = 0; u < NH; ++u) o[u] = partial + (h + u) * stride + 2;
      simd::weighted_rows<V, NH, true>(p + h * kChunk, kChunk, 1, keys, n, vc + h / s.group() * s.hd, s.hd, o);
    });
    return;
  }
#endif
  for (int64_t h = 0; h < s.heads; ++h) {
    float* o = partial + h * stride + 2;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < s.hd; ++d) o[d] += p[h * kChunk + i] * widen(vc[keys[i] + h / s.group() * s.hd + d]);
  }
}

// The largest of p[0, n).
inline float max_score(const float* p, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef __AVX512F__
  if (n >= 16) {  // sixteen running maxima, folded by a shuffle tree (the maximum is exact in any order)
    __m512 t = _mm512_loadu_ps(p);
    for (i = 16; i + 16 <= n; i += 16) t = _mm512_max_ps(t, _mm512_loadu_ps(p + i));
    top = _mm512_reduce_max_ps(t);
  }
#endif
#ifdef ENGINE_KERNELS_AVX2
  __m256 t = _mm256_set1_ps(top);  // eight running maxima: a scalar max is one long latency chain
  for (; i + 8 <= n; i += 8) t = _mm256_max_ps(t, _mm256_loadu_ps(p + i));
  for (int lane = 0; lane < 8; ++lane) top = std::max(top, t[lane]);
#endif
  for (; i < n; ++i) top = std::max(top, p[i]);
  return top;
}

// p[0, n) <- exp(p - top) (top >= every p); returns their sum.
inline float exp_sum(float* p, int64_t n, float top) {
  float sum = 0;
  int64_t i = 0;
#ifdef ENGINE_KERNELS_AVX2
  const __m256 t = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
#ifdef __AVX512F__
  // Sixteen exps at a time (lane by lane the 8-lane exp's operations), summed in the 8-lane loop's order: the
  // same floats, and half the exp passes over a chunk's scores.
  for (const __m512 t16 = _mm512_set1_ps(top); i + 16 <= n; i += 16) {
    const __m512 e = simd::exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + i), t16));
    _mm512_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 e = simd::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + i), t));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = simd::hsum(acc);
#endif
  for (; i < n; ++i) sum += (p[i] = std::exp(p[i] - top));
  return sum;
}

// The chunk's scores p[0, n) of one head (softcap applied here) folded into its running [m, l, out[hd]].
inline void merge_chunk(float* p, int64_t n, float softcap, int64_t hd, float* running) {
  if (softcap > 0)
    for (int64_t i = 0; i < n; ++i) p[i] = softcap * std::tanh(p[i] / softcap);
  const float top = std::max(running[0], max_score(p, n));
  if (top > running[0] && running[0] != -std::numeric_limits<float>::infinity()) {
    const float rescale = std::exp(running[0] - top);
    for (int64_t c = 1; c < hd + 2; ++c) running[c] *= rescale;
  }
  running[0] = top;
  running[1] += exp_sum(p, n, top);
}

// Whether a chunk of K rows and one of V rows of `row_bytes` each fit this CPU's L1 data cache together.
inline bool nta_fits(int64_t row_bytes) {
  static const int64_t l1 = [] {
    const long bytes = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return bytes > 0 ? static_cast<int64_t>(bytes) : int64_t{32} << 10;
  }();
  return 2 * kChunk * row_bytes <= l1;
}

// keys: the pool offsets of a segment's n keys; next: the next_n keys read after them, whose first chunk's K rows
// are prefetched.
template <class V, typename P>
void attend_keys(const Shapes& s, float softcap, const float* q, const P* kc, const P* vc, const int64_t* keys,
                 int64_t n, const int64_t* next, int64_t next_n, float* partial, float* p) {
  const int64_t row_bytes = s.kv_heads * s.hd * static_cast<int64_t>(sizeof(P));
  const bool nta = nta_fits(row_bytes);
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t count = std::min(kChunk, n - c);
    stage(nta, kc, keys + c, count, row_bytes, vc, keys + c, count);
    chunk_scores<V>(s, q, kc, keys + c, count, p);
    for (int64_t h = 0; h < s.heads; ++h) merge_chunk(p + h * kChunk, count, softcap, s.hd, partial + h * (s.hd + 2));
    // Reading the chunk's V rows prefetches the next chunk's K rows, or after the last chunk the next token's.
    if (c + kChunk < n)
      stage(nta, vc, keys + c, count, row_bytes, kc, keys + c + kChunk, std::min(kChunk, n - c - kChunk));
    else
      stage(nta, vc, keys + c, count, row_bytes, kc, next, std::min(kChunk, next_n));
    chunk_values<V>(s, p, vc, keys + c, count, partial);
  }
}

// The pool offsets of the keys in share `part` of `parts` of the `seen` keys token row `row` sees, into `out`.
inline void visible_keys(const Shapes& s, const int64_t* kv_slots, const bool* mask, int64_t row, int64_t seen,
                         int64_t part, int64_t parts, std::vector<int64_t>& out) {
  const int64_t b = row / s.qmax, kv_width = s.kv_heads * s.hd;
  const bool* m = mask + row * s.lmax;
  const int64_t* slots = kv_slots + b * s.lmax;
  const auto [from, to] = share_segments(seen, part, parts);
  const int64_t first = std::min(from * kSegment, seen), last = std::min(to * kSegment, seen);
  out.resize(static_cast<size_t>(last - first));
  int64_t* o = out.data();
  // A decode's row is usually a run of visible keys from position 0 (no window, no padding inside): its share is
  // then positions [first, last) themselves, a loop without branches; else the visible positions are counted off.
  const auto* run_end = static_cast<const bool*>(std::memchr(m, 0, static_cast<size_t>(s.lmax)));
  if ((run_end ? run_end - m : s.lmax) == seen) {
    for (int64_t l = first; l < last; ++l) o[l - first] = slots[l] * kv_width;
    return;
  }
  for (int64_t l = 0, i = 0; l < s.lmax && i < last; ++l)
    if (m[l] && i++ >= first) *o++ = slots[l] * kv_width;
}

// One segment of keys into partial [heads, hd + 2], at the CPU's vector width.
template <typename P>
void attend_segment(const Shapes& s, float softcap, const float* q, const P* kc, const P* vc, const int64_t* keys,
                    int64_t n, const int64_t* next, int64_t next_n, float* partial, float* p) {
  const int64_t stride = s.hd + 2;
  for (int64_t h = 0; h < s.heads; ++h) {
    partial[h * stride] = -std::numeric_limits<float>::infinity();
    std::fill(partial + h * stride + 1, partial + (h + 1) * stride, 0.0f);
  }
#ifdef __AVX512F__
  if (s.hd % 16 == 0) return attend_keys<simd::V16>(s, softcap, q, kc, vc, keys, n, next, next_n, partial, p);
#endif
#ifdef ENGINE_KERNELS_AVX2
  if (s.hd % 8 == 0) return attend_keys<simd::V8>(s, softcap, q, kc, vc, keys, n, next, next_n, partial, p);
#endif
  attend_keys<void>(s, softcap, q, kc, vc, keys, n, next, next_n, partial, p);
}

// One token (query q) over the keys x.visible (visible_keys: whole segments) into a partial a segment,
// partials [segments, heads, hd + 2]; the K rows of x.next are prefetched after the last one (empty: none).
template <typename P>
void attend_part(const Shapes& s, float scale, float softcap, const float* q, const P* kc, const P* vc,
                 float* partials, Scratch& x) {
  x.q.assign(q, q + s.heads * s.hd);
  for (float& e : x.q) e *= scale;
  x.scores.resize(static_cast<size_t>(s.heads * kChunk));
  const int64_t n = static_cast<int64_t>(x.visible.size());
  const int64_t* keys = x.visible.data();
  for (int64_t c = 0; c < n || c == 0; c += kSegment, partials += partial_size(s)) {
    const int64_t count = std::min(kSegment, n - c);
    const bool last = c + kSegment >= n;
    attend_segment(s, softcap, x.q.data(), kc, vc, keys + c, count, last ? x.next.data() : keys + c + kSegment,
                   last ? static_cast<int64_t>(x.next.size()) : n - c - kSegment, partials, x.scores.data());
  }
}

// out[heads * hd] of one token from its `parts` partials (segments, in order): rescaled to the common maximum.
inline void combine(const Shapes& s, const float* partials, int64_t parts, float* out) {
  const int64_t hd = s.hd, stride = hd + 2, size = partial_size(s);
  for (int64_t u = 0; u < s.heads; ++u) {
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
