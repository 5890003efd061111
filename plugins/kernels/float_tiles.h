// QuantMatMul's float32 weights (bits=32; quant_matmul.cc's header lays them out): a tile of 16 columns is its K x 16
// values in order, one cache line a k, so a projection is one stream of bytes as the quantized tiles are. A decode
// step of SmolLM2 in float32 reads ~540 MB of them, which MLAS's MatMul over [K, N] read at ~84% of a plain read's
// rate and these tiles at its rate, in a harness on two threads (bench/NOTES.md entries 48, 49).
//
// Rows share each loaded weight line: out[r] += x[r, k] * w[k] over k, 16 columns in the lanes, x[r, k] broadcast
// from memory. Few rows keep several chains of sums a row, so the FMAs' latency does not bound them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_tiles.h"

namespace engine_kernels {
namespace quant {

// How far ahead of its reads a tile's weight stream is prefetched, in k (cache lines): 8 KB, as the quantized tiles
constexpr int64_t kFloatAhead = 128;
// A lone row's stream: 4 KB ahead, non-temporal (bench/NOTES.md entry 52).
constexpr int64_t kLoneAhead = 64;

// 16 float32 lanes: one AVX-512 register, two AVX2 ones, or plain floats.
#if defined(__AVX512F__)
struct Lanes {
  static constexpr int kRegisters = 1;
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void fma(const Lanes& w, const float* x) { v = _mm512_fmadd_ps(w.v, _mm512_set1_ps(*x), v); }
  static Lanes broadcast(const float* x) { return {_mm512_set1_ps(*x)}; }
  void fma(const Lanes& w, const Lanes& x) { v = _mm512_fmadd_ps(w.v, x.v, v); }
  void add(const Lanes& o) { v = _mm512_add_ps(v, o.v); }
  void store(float* p, int64_t cols) const {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << cols) - 1), v);
  }
};
#elif defined(ENGINE_KERNELS_AVX2)
struct Lanes {
  static constexpr int kRegisters = 2;
  __m256 lo, hi;
  static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void fma(const Lanes& w, const float* x) {
    const __m256 b = _mm256_broadcast_ss(x);
    lo = _mm256_fmadd_ps(w.lo, b, lo);
    hi = _mm256_fmadd_ps(w.hi, b, hi);
  }
  void add(const Lanes& o) { lo = _mm256_add_ps(lo, o.lo), hi = _mm256_add_ps(hi, o.hi); }
  void store(float* p, int64_t cols) const {
    alignas(32) float all[16];
    _mm256_store_ps(all, lo);
    _mm256_store_ps(all + 8, hi);
    std::copy(all, all + cols, p);
  }
};
#else
struct Lanes {
  static constexpr int kRegisters = 16;
  float v[16];
  static Lanes zero() { return {}; }
  static Lanes load(const float* p) {
    Lanes l;
    std::copy(p, p + 16, l.v);
    return l;
  }
  void fma(const Lanes& w, const float* x) {
    for (int c = 0; c < 16; ++c) v[c] += w.v[c] * *x;
  }
  void add(const Lanes& o) {
    for (int c = 0; c < 16; ++c) v[c] += o.v[c];
  }
  void store(float* p, int64_t cols) const { std::copy(v, v + cols, p); }
};
#endif

// Rows a pass shares each weight line with: as many as the registers hold beside it (10 of AVX-512's 32, as the int8
// tiles; 4 of AVX2's 16, each row two registers).
constexpr int kFloatRows = Lanes::kRegisters == 1 ? 10 : 4;

// Independent chains of sums a row: 8 accumulator registers in all for few rows, at most 4 a row.
template <int R>
constexpr int float_chains() {
  return std::clamp(8 / (R * std::min(Lanes::kRegisters, 2)), 1, 4);
}

// Output rows t0 .. t0 + R - 1 of one tile: out[r, 0 .. cols). `stream`: the tile comes from memory (the first rows
// of an item) and is prefetched; later rows read it from cache. On a Zen 5 prefetching took a 32-decode step of
// SmolLM2 from 37.4 to 30.6 ms (bench/NOTES.md entry 49). A lone row (a batch-1 decode) prefetches with the
// non-temporal hint instead, 4 KB ahead: the float32 step ran 1.04x faster, at ~80 GB/s and at ~50, and the parts
// bench/step_trace.py sees beside the weight streams (attention's KV reads, Python between steps) sped up with
// them, as if the ~540 MB a step no longer evicted their data (entry 52). prefetcht0 4 KB ahead took the step
// 0.92x, and NTA 16 KB ahead 0.95x.
template <int R>
void float_rows(const QuantJob& j, int64_t tile, int64_t t0, int64_t cols, const TileOut& o, bool stream) {
  constexpr int kChains = float_chains<R>();
  const float* w = reinterpret_cast<const float*>(j.w) + tile * j.k * kLanes;
  const float* x = j.x + t0 * j.k;
  Lanes acc[R][kChains];
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r)
    ENGINE_UNROLL
    for (int c = 0; c < kChains; ++c) acc[r][c] = Lanes::zero();
  int64_t k = 0;
  for (; k + kChains <= j.k; k += kChains) {
    ENGINE_UNROLL
    for (int c = 0; c < kChains; ++c) {
      if (R > 1 && stream) __builtin_prefetch(w + (k + c + kFloatAhead) * kLanes, 0, 3);
      if (R == 1 && stream) __builtin_prefetch(w + (k + c + kLoneAhead) * kLanes, 0, 0);
      const Lanes wk = Lanes::load(w + (k + c) * kLanes);
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) acc[r][c].fma(wk, x + r * j.k + k + c);
    }
  }
  for (; k < j.k; ++k) {
    const Lanes wk = Lanes::load(w + k * kLanes);
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0].fma(wk, x + r * j.k + k);
  }
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) {
    ENGINE_UNROLL
    for (int c = 1; c < kChains; ++c) acc[r][0].add(acc[r][c]);
    acc[r][0].store(o.row(t0 + r), cols);
  }
}

// Rows t0 .. t1 - 1 of float tile tl (cols <= 16 of its columns) into o: kFloatRows-row passes, then 4-row ones,
// then 3, 2 or 1.
inline void float_tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  int64_t t = t0;  // the first pass streams the tile from memory, the others find it in cache
  for (; t + kFloatRows <= t1; t += kFloatRows) float_rows<kFloatRows>(j, tl, t, cols, o, t == t0);
  for (; t + 4 <= t1; t += 4) float_rows<4>(j, tl, t, cols, o, t == t0);
  switch (t1 - t) {
    case 3: float_rows<3>(j, tl, t, cols, o, t == t0); break;
    case 2: float_rows<2>(j, tl, t, cols, o, t == t0); break;
    case 1: float_rows<1>(j, tl, t, cols, o, t == t0); break;
    default: break;
  }
}

// Rows sharing each broadcast of x between two tiles' lines (float_pair): 12 x 2 accumulators of AVX-512's 32
// registers, a broadcast and two weight loads for 24 FMAs where a tile alone takes 10 broadcasts and a load for 10;
// none on AVX2, whose 16 registers hold no more than one tile's rows.
constexpr int kPairRows = Lanes::kRegisters == 1 ? 12 : 0;

#if defined(__AVX512F__)
// Output rows t0 .. t0 + R - 1 of tiles a and b: each row's x[r, k] broadcast once for both tiles' FMAs.
template <int R>
void float_pair_rows(const QuantJob& j, const int64_t tile[2], int64_t t0, const int64_t cols[2],
                     const TileOut out[2], bool stream) {
  const float* w[2] = {reinterpret_cast<const float*>(j.w) + tile[0] * j.k * kLanes,
                       reinterpret_cast<const float*>(j.w) + tile[1] * j.k * kLanes};
  const float* x = j.x + t0 * j.k;
  Lanes acc[R][2];
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Lanes::zero();
  for (int64_t k = 0; k < j.k; ++k) {
    if (stream) {
      __builtin_prefetch(w[0] + (k + kFloatAhead) * kLanes, 0, 3);
      __builtin_prefetch(w[1] + (k + kFloatAhead) * kLanes, 0, 3);
    }
    const Lanes wa = Lanes::load(w[0] + k * kLanes), wb = Lanes::load(w[1] + k * kLanes);
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) {
      const Lanes xr = Lanes::broadcast(x + r * j.k + k);
      acc[r][0].fma(wa, xr);
      acc[r][1].fma(wb, xr);
    }
  }
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) {
    acc[r][0].store(out[0].row(t0 + r), cols[0]);
    acc[r][1].store(out[1].row(t0 + r), cols[1]);
  }
}
#endif

// Rows t0 .. t1 - 1 of float tiles a and b (a gate tile and its up tile, or neighbours) into their outputs: passes of
// kPairRows rows then 4 sharing x's broadcasts, the rest (and all of them without AVX-512) a tile at a time.
inline void float_pair(const QuantJob& j, const int64_t tile[2], int64_t t0, int64_t t1, const int64_t cols[2],
                       const TileOut out[2]) {
  int64_t t = t0;
#if defined(__AVX512F__)
  for (; t + kPairRows <= t1; t += kPairRows) float_pair_rows<kPairRows>(j, tile, t, cols, out, t == t0);
  for (; t + 4 <= t1; t += 4) float_pair_rows<4>(j, tile, t, cols, out, t == t0);
#endif
  if (t == t1) return;
  float_tile(j, tile[0], t, t1, cols[0], out[0]);
  float_tile(j, tile[1], t, t1, cols[1], out[1]);
}

// Rows t0 .. t1 - 1 of tile tl (cols <= 16 of its columns) into o, for the job's weights: float32 or quantized.
// A quantized tile with float32 activations (QuantJob::float_x): its weights dequantized into a buffer of this
// thread's, then the float tiles over it: x @ W^T in float32 on the very weights the tile holds.
inline void float_x_tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  thread_local std::vector<float> weights;
  weights.resize(static_cast<size_t>(j.k * kLanes));
  dequantize_tile(j, tl, weights.data());
  QuantJob view = j;
  view.w = reinterpret_cast<const uint8_t*>(weights.data());
  float_tile(view, 0, t0, t1, cols, o);
}

inline void tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  if (j.bits == kFloatBits) float_tile(j, tl, t0, t1, cols, o);
  else if (j.float_x) float_x_tile(j, tl, t0, t1, cols, o);
  else int_tile(j, tl, t0, t1, cols, o);
}

// Rows t0 .. t1 - 1 of two tiles into their outputs: float32 tiles share x's broadcasts (float_pair), quantized ones
// run one after the other.
inline void tile_pair(const QuantJob& j, const int64_t tiles[2], int64_t t0, int64_t t1, const int64_t cols[2],
                      const TileOut out[2]) {
  if (j.bits == kFloatBits) return float_pair(j, tiles, t0, t1, cols, out);
  tile(j, tiles[0], t0, t1, cols[0], out[0]);
  tile(j, tiles[1], t0, t1, cols[1], out[1]);
}

}  // namespace quant
}  // namespace engine_kernels
