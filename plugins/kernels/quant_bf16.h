// QuantMatMul's calls of many rows (a prefill chunk) on AMX-BF16: the weights dequantized to bfloat16 once a call,
// the activations rounded to bfloat16, their products summed in float32 by the tile unit over the whole of K.
//
// The int8 code (quant_tiles.h, quant_amx.h) scales every block of 32 K values of every row on the vector units,
// and at many rows that epilogue, not the tile products, bounds it (bench/NOTES.md entry 28). Here a block's scales
// are applied once, to the weights, when a tile of 16 columns is dequantized: w = d * q + m, or d * (q - zero_point)
// without offsets, computed in float32 and rounded to bfloat16 (nearest, ties even), as are the activations. The
// per-row numbers differ from the int8 code's (bfloat16's 8-bit mantissa against int8 per block), so a call takes
// one way for all its rows: bf16_rows(tokens) decides, from the row count alone.
//
//   A  bf16 [16 rows, 32]      packed once a call by pack_bf16: per group of 16 rows [K / 32][16][32], rows past
//                              the last zero
//   B  bf16 [16, 16 cols x 2]  row i: column j's pair k = 2 i, 2 i + 1 of a chunk of 32 K, per tile [K / 32][16][32]
//   C  fp32 [16 rows, 16 cols] two groups of rows x two tiles of columns at a time, K in passes of kKBlock with the
//                              partial sums kept in the item's buffer between passes
//
// An item is two tiles x every row (neighbours, or with swiglu=1 gate tile i and its up tile i + tiles / 2), so each
// tile is dequantized once a call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_amx.h"
#include "swiglu.h"

#if defined(ENGINE_KERNELS_AMX) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define ENGINE_KERNELS_AMX_BF16 1
#endif

namespace engine_kernels {
namespace quant {

// Fewest rows a call takes through the bfloat16 tiles: below, the int8 code, whose rows are exact whatever the
// batch (a decode step of 32 sequences stays there). Measured crossover: bench/NOTES.md entry 29.
constexpr int64_t kBf16Rows = 64;
constexpr int64_t kChunk = 32;  // K values per A row, B tile
constexpr int64_t kKBlock = 256;  // K values per pass over the rows

#ifdef ENGINE_KERNELS_AMX_BF16
inline bool bf16_rows(int64_t tokens) { return tokens >= kBf16Rows && amx_ready(); }

inline int64_t bf16_groups(int64_t tokens) { return (tokens + kAmxRows - 1) / kAmxRows; }

inline void size_bf16_rows(const QuantJob& j) {
  j.a->bf16.resize(static_cast<size_t>(bf16_groups(j.tokens) * kAmxRows * j.k) + 32);
}

// Group g of 16 rows of x -> its A tiles.
inline void pack_bf16(void* opaque, size_t g) {
  const auto& j = *static_cast<const QuantJob*>(opaque);
  uint16_t* tiles = aligned64(j.a->bf16) + static_cast<int64_t>(g) * kAmxRows * j.k;
  for (int64_t r = 0; r < kAmxRows; ++r) {
    const int64_t t = static_cast<int64_t>(g) * kAmxRows + r;
    for (int64_t c = 0; c < j.k; c += kChunk) {
      __m512i row = _mm512_setzero_si512();
      if (t < j.tokens) {
        const float* x = j.x + t * j.k + c;
        row = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
      }
      _mm512_store_si512(tiles + c * kAmxRows + r * kChunk, row);
    }
  }
}

// Tile `tl`'s weights -> B tiles in `out` ([K / 32][16][32] bf16). A sub-block's register i holds k = 4 i .. 4 i + 3
// of each column (load_sub); its bytes 0-1 give B row 2 i, bytes 2-3 row 2 i + 1.
template <int Bits, bool Offsets>
void dequantize_tile(const QuantJob& j, int64_t tl, uint16_t* out) {
  const __m512i byte = _mm512_set1_epi32(0xFF), zero_point = _mm512_set1_epi32(1 << (Bits - 1));
  alignas(64) static const uint16_t kPairs[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i pairs = _mm512_load_si512(kPairs);
  const uint8_t* p = j.w + tl * j.groups * j.block_bytes;
  for (int64_t b = 0; b < j.groups; ++b, p += j.block_bytes) {
    prefetch_block(p, j.block_bytes);  // where a prefill's weights first come in from memory
    const BlockScales<Offsets> s(p);
    auto weight = [&](__m512i q) {  // w of each column for one k
      if constexpr (Offsets) return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s.d, s.m);
      else return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, zero_point)), s.d);
    };
    for (int64_t sub = 0; sub < j.group / kSub; ++sub, out += kChunk * kLanes) {
      __m512i w[8];
      load_sub<Bits>(p + kHeader + sub * sub_bytes(Bits), w);
      ENGINE_UNROLL
      for (int i = 0; i < 8; ++i) {
        const __m512 k0 = weight(_mm512_and_si512(w[i], byte));
        const __m512 k1 = weight(_mm512_and_si512(_mm512_srli_epi32(w[i], 8), byte));
        const __m512 k2 = weight(_mm512_and_si512(_mm512_srli_epi32(w[i], 16), byte));
        const __m512 k3 = weight(_mm512_srli_epi32(w[i], 24));
        _mm512_store_si512(out + 64 * i, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(k1, k0)));
        _mm512_store_si512(out + 64 * i + 32, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(k3, k2)));
      }
    }
  }
}

// A stored C tile (16 x 16 floats) -> out rows 16 g.., columns of tile tl.
inline void copy_c(const QuantJob& j, int64_t g, int64_t tl, const float* c) {
  const int64_t rows = std::min(kAmxRows, j.tokens - g * kAmxRows), cols = std::min(kLanes, j.n - tl * kLanes);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  float* out = j.out + g * kAmxRows * j.n + tl * kLanes;
  for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * j.n, keep, _mm512_load_ps(c + r * kLanes));
}

// Stored C tiles of gate tile tl and its up tile -> silu(gate) * up, out rows 16 g.., columns of tile tl (of N / 2).
inline void swiglu_c(const QuantJob& j, int64_t g, int64_t tl, const float* gate, const float* up) {
  const int64_t rows = std::min(kAmxRows, j.tokens - g * kAmxRows), width = j.n / 2;
  float* out = j.out + g * kAmxRows * width + tl * kLanes;
  for (int64_t r = 0; r < rows; ++r) swiglu_span(gate + r * kLanes, up + r * kLanes, out + r * width, kLanes);
}

// C tile for row group g (of the item's) and tile t (0, 1) in the item's buffer of partial sums.
inline float* partial_c(float* sums, int64_t g, int t) { return sums + (2 * g + t) * kAmxRows * kLanes; }

// K values [k0, k1) of two row groups (g, g + 1 when Groups == 2) x two tiles (tl, tl + 1 when Tiles == 2): the
// sums start at zero (k0 == 0) or from `sums`, and go to out (k1 == K) or back to `sums`.
template <int Groups, int Tiles>
void bf16_block(const QuantJob& j, int64_t g, int64_t tl, const uint16_t* b0, const uint16_t* b1, int64_t k0,
                int64_t k1, float* sums) {
  const uint16_t* a0 = aligned64(j.a->bf16) + g * kAmxRows * j.k;
  const uint16_t* a1 = a0 + kAmxRows * j.k;
  if (k0 == 0) {
    _tile_zero(0);
    if constexpr (Tiles == 2) _tile_zero(1);
    if constexpr (Groups == 2) _tile_zero(2);
    if constexpr (Groups == 2 && Tiles == 2) _tile_zero(3);
  } else {
    _tile_loadd(0, partial_c(sums, g, 0), 64);
    if constexpr (Tiles == 2) _tile_loadd(1, partial_c(sums, g, 1), 64);
    if constexpr (Groups == 2) _tile_loadd(2, partial_c(sums, g + 1, 0), 64);
    if constexpr (Groups == 2 && Tiles == 2) _tile_loadd(3, partial_c(sums, g + 1, 1), 64);
  }
  for (int64_t c = k0; c < k1; c += kChunk) {
    _tile_loadd(4, a0 + c * kAmxRows, 64);
    _tile_loadd(6, b0 + c * kLanes, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (Tiles == 2) {
      _tile_loadd(7, b1 + c * kLanes, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (Groups == 2) {
      _tile_loadd(5, a1 + c * kAmxRows, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (Tiles == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, partial_c(sums, g, 0), 64);
  if constexpr (Tiles == 2) _tile_stored(1, partial_c(sums, g, 1), 64);
  if constexpr (Groups == 2) _tile_stored(2, partial_c(sums, g + 1, 0), 64);
  if constexpr (Groups == 2 && Tiles == 2) _tile_stored(3, partial_c(sums, g + 1, 1), 64);
  if (k1 < j.k) return;
  for (int64_t group = g; group < g + Groups; ++group) {
    if (j.swiglu) swiglu_c(j, group, tl, partial_c(sums, group, 0), partial_c(sums, group, 1));
    else for (int t = 0; t < Tiles; ++t) copy_c(j, group, tl + t, partial_c(sums, group, t));
  }
}

// Every row of the item, K in blocks of kKBlock: a block of the item's B tiles (2 x 16 KB) stays in L1 while all
// the rows' A tiles of that block stream past.
template <int Tiles>
void bf16_rows_of(const QuantJob& j, int64_t tl, const uint16_t* b0, const uint16_t* b1) {
  const int64_t groups = bf16_groups(j.tokens);
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>((groups + 1) * 2 * kAmxRows * kLanes) + 16);
  float* sums = aligned64(buffer);
  for (int64_t k0 = 0; k0 < j.k; k0 += kKBlock) {
    const int64_t k1 = std::min(j.k, k0 + kKBlock);
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) bf16_block<2, Tiles>(j, g, tl, b0, b1, k0, k1, sums);
    if (g < groups) bf16_block<1, Tiles>(j, g, tl, b0, b1, k0, k1, sums);
  }
}

// Tile tl with its neighbour, or with its up tile (tl + tiles / 2) for the SwiGLU epilogue.
template <int Bits, bool Offsets>
void bf16_item(const QuantJob& j, int64_t tl) {
  thread_local std::vector<uint16_t> scratch;
  scratch.resize(static_cast<size_t>(2 * j.k * kLanes) + 32);
  uint16_t* b0 = aligned64(scratch);
  uint16_t* b1 = b0 + j.k * kLanes;
  const int64_t second = j.swiglu ? tl + j.tiles / 2 : tl + 1;
  const bool pair = second < j.tiles;
  dequantize_tile<Bits, Offsets>(j, tl, b0);
  if (pair) dequantize_tile<Bits, Offsets>(j, second, b1);
  const FullTiles config;  // 0-3: C (row group x column tile), 4-5: A, 6-7: B
  _tile_loadconfig(&config);
  if (pair) bf16_rows_of<2>(j, tl, b0, b1);
  else bf16_rows_of<1>(j, tl, b0, b1);
  _tile_release();
}

// Item i: tiles 2 i, 2 i + 1 (with the SwiGLU epilogue: gate tile i and its up tile) x every row.
inline size_t bf16_item_count(const QuantJob& j) {
  return static_cast<size_t>(j.swiglu ? j.tiles / 2 : (j.tiles + 1) / 2);
}

inline void bf16_items(void* opaque, size_t i) {
  const auto& j = *static_cast<const QuantJob*>(opaque);
  const int64_t tl = j.swiglu ? static_cast<int64_t>(i) : 2 * static_cast<int64_t>(i);
  by_kind(j, [&](auto bits, auto offsets) { bf16_item<bits, offsets>(j, tl); });
}
#else
inline bool bf16_rows(int64_t) { return false; }
inline int64_t bf16_groups(int64_t) { return 0; }
inline void size_bf16_rows(const QuantJob&) {}
inline void pack_bf16(void*, size_t) {}
inline size_t bf16_item_count(const QuantJob&) { return 0; }
inline void bf16_items(void*, size_t) {}
#endif

}  // namespace quant
}  // namespace engine_kernels
