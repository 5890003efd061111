// QuantMatMul's rows 16 at a time on AMX (Intel Sapphire Rapids and later): each block's dot products as tile
// matrix products, scaled as quant_tiles.h's VNNI code scales them (add_block), so both give the same floats.
//
// One block of `group` K values, 16 rows x one tile of 16 columns, is group / kc TDPBSUDs:
//
//   A  int8  [16 rows, kc]       the rows' int8 activations, packed once a call by pack_rows: per group of 16 rows
//                                [K / kc][16][kc], so each A tile is one contiguous run
//   B  uint8 [kc / 4, 64]        the tile's weights as they are stored for 8 bits (byte 64 i + 4 j + e = q[column
//                                j, k = 4 i + e], the sub-blocks one after the other); 4-bit sub-blocks are first
//                                unpacked to that layout, once per tile and item
//   C  int32 [16 rows, 16 cols]  q . qa of the block, stored to L1 and added into 16 float accumulators
//
// kc = 64 where the group is a multiple of 64, else 32. Two C tiles alternate: the tile unit computes one block while
// the vector units scale the last. Rows left over (under 16) take the VNNI code. The tile registers need the
// kernel's permission (arch_prctl, once per process); where it is refused the VNNI code runs every row.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_tiles.h"

#include "amx.h"

#if defined(ENGINE_KERNELS_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define ENGINE_KERNELS_AMX 1
#endif

namespace engine_kernels {
namespace quant {

constexpr int64_t kAmxRows = 16;  // rows of an A and a C tile

inline int64_t amx_kc(int64_t group) { return group % 64 == 0 ? 64 : 32; }

#ifdef ENGINE_KERNELS_AMX
inline bool amx_ready() { return amx_permitted(); }

// Whether a call's rows go through AMX (then pack_rows runs before the items).
inline bool amx_rows(int64_t tokens) { return tokens >= kAmxRows && amx_ready(); }

// The A tiles start on a cache line (a row of a tile load must not straddle two).
inline int8_t* packed_tiles(Activations& a) { return aligned64(a.tiles); }

// The per-row shifts (shift_at) of the packed groups: da * sum(qa) with offsets, zero_point * sum(qa) without.
template <bool Offsets>
std::vector<Shift<Offsets>>& shift_table(Activations& a) {
  if constexpr (Offsets) return a.dasum16;
  else return a.zero16;
}

// Group g of 16 rows: its A tiles and per-block scalars (the Activations' AMX fields, sized by the caller).
template <int Bits, bool Offsets>
void pack_group(const QuantJob& j, int64_t g) {
  Activations& a = *j.a;
  const int64_t kc = amx_kc(j.group);
  int8_t* tiles = packed_tiles(a) + g * kAmxRows * j.k;
  for (int64_t r = 0; r < kAmxRows; ++r) {
    const int64_t t = g * kAmxRows + r;
    for (int64_t c = 0; c < j.k; c += kc) {
      int8_t* dst = tiles + c * kAmxRows + r * kc;
      if (kc == 64) std::memcpy(dst, a.q.data() + t * j.k + c, 64);
      else std::memcpy(dst, a.q.data() + t * j.k + c, 32);
    }
    for (int64_t b = 0; b < j.groups; ++b) {
      const size_t at = static_cast<size_t>((g * j.groups + b) * kAmxRows + r);
      const float da = a.d[static_cast<size_t>(t * j.groups + b)];
      a.da16[at] = da;
      shift_table<Offsets>(a)[at] = shift_at<Offsets>(j, t, b);
    }
  }
}

inline void pack_rows(void* opaque, size_t g) {
  const auto& j = *static_cast<const QuantJob*>(opaque);
  const auto group = static_cast<int64_t>(g);
  by_kind(j, [&](auto bits, auto offsets) { pack_group<bits, offsets>(j, group); });
}

inline void size_packed_rows(const QuantJob& j) {
  const auto groups16 = static_cast<size_t>(j.tokens / kAmxRows);
  j.a->tiles.resize(groups16 * static_cast<size_t>(kAmxRows * j.k) + 64);
  j.a->da16.resize(groups16 * static_cast<size_t>(j.groups * kAmxRows));
  by_kind(j, [&](auto, auto offsets) { shift_table<offsets>(*j.a).resize(j.a->da16.size()); });
}

// Tiles 0-1: C, 2-3: A, 4-5: B (a set for each of the two blocks in flight).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t kc) {
    for (int t = 0; t < 6; ++t) {
      rows[t] = static_cast<uint8_t>(t >= 4 ? kc / 4 : kAmxRows);
      colsb[t] = static_cast<uint16_t>(t == 2 || t == 3 ? kc : 64);
    }
  }
};

// One block's q . qa into C tile TC: A chunks of 16 x kc bytes one after the other, B rows of 64 bytes.
// A macro: GCC's tile intrinsics take the tile numbers as literals.
#define ENGINE_BLOCK_DOTS(TC, TA, TB, a, b, group, kc) \
  do {                                                 \
    _tile_zero(TC);                                    \
    for (int64_t c = 0; c < (group); c += (kc)) {      \
      _tile_loadd(TA, (a) + c * kAmxRows, (kc));       \
      _tile_loadd(TB, (b) + c * kLanes, 64);           \
      _tile_dpbsud(TC, TA, TB);                        \
    }                                                  \
  } while (0)

// acc[r] += row r's share of one block, from the stored C tile `dots`.
template <bool Offsets>
__attribute__((always_inline)) inline void scale_block(__m512 (&acc)[kAmxRows], const int32_t* dots,
                                                       const uint8_t* header, const float* da,
                                                       const Shift<Offsets>* shift) {
  const BlockScales<Offsets> scales(header);
  ENGINE_UNROLL
  for (int r = 0; r < kAmxRows; ++r)
    acc[r] = add_block<Offsets>(acc[r], _mm512_load_si512(dots + r * kLanes), scales, da[r], shift[r]);
}

// Rows 16 g .. 16 g + 15 of one tile; body + b * stride is block b's weights in B's layout.
template <bool Offsets>
void amx_group(const QuantJob& j, int64_t tile, int64_t g, int64_t cols, const uint8_t* body, int64_t stride) {
  const int64_t kc = amx_kc(j.group), per_block = j.groups * kAmxRows;
  const uint8_t* headers = j.w + tile * j.groups * j.block_bytes;
  const int8_t* a = packed_tiles(*j.a) + g * kAmxRows * j.k;
  const float* da = j.a->da16.data() + g * per_block;
  const Shift<Offsets>* shift = shift_table<Offsets>(*j.a).data() + g * per_block;
  alignas(64) int32_t dots[2][kAmxRows * kLanes];
  __m512 acc[kAmxRows];
  ENGINE_UNROLL
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  // Block b + 1's products are queued before block b's are stored and scaled.
  auto dots_of = [&](int64_t b) { return a + b * j.group * kAmxRows; };
  auto weights_of = [&](int64_t b) { return body + b * stride; };
  ENGINE_BLOCK_DOTS(0, 2, 4, dots_of(0), weights_of(0), j.group, kc);
  for (int64_t b = 0; b < j.groups; b += 2) {
    const bool pair = b + 1 < j.groups;
    if (pair) ENGINE_BLOCK_DOTS(1, 3, 5, dots_of(b + 1), weights_of(b + 1), j.group, kc);
    _tile_stored(0, dots[0], 64);
    scale_block<Offsets>(acc, dots[0], headers + b * j.block_bytes, da + b * kAmxRows, shift + b * kAmxRows);
    if (!pair) break;
    if (b + 2 < j.groups) ENGINE_BLOCK_DOTS(0, 2, 4, dots_of(b + 2), weights_of(b + 2), j.group, kc);
    _tile_stored(1, dots[1], 64);
    scale_block<Offsets>(acc, dots[1], headers + (b + 1) * j.block_bytes, da + (b + 1) * kAmxRows,
                         shift + (b + 1) * kAmxRows);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  float* out = j.out + g * kAmxRows * j.n + tile * kLanes;
  ENGINE_UNROLL
  for (int r = 0; r < kAmxRows; ++r) _mm512_mask_storeu_ps(out + r * j.n, keep, acc[r]);
}

// 4-bit sub-blocks of one tile -> B's layout (load_sub's two nibble registers each), block after block, into one
// of two buffers: a tile is unpacked before the last one is computed, so its stores have long drained when the tile
// loads read them.
inline const uint8_t* unpacked_nibbles(const QuantJob& j, int64_t tile) {
  thread_local std::vector<uint8_t> scratch[2];
  std::vector<uint8_t>& buffer = scratch[tile % 2];
  buffer.resize(static_cast<size_t>(j.k * kLanes));
  const uint8_t* p = j.w + tile * j.groups * j.block_bytes;
  uint8_t* out = buffer.data();
  for (int64_t b = 0; b < j.groups; ++b, p += j.block_bytes) {
    prefetch_block(p, j.block_bytes);
    for (int64_t s = 0; s < j.group / kSub; ++s, out += kSub * kLanes) {
      __m512i w[8];
      load_sub<4>(p + kHeader + s * sub_bytes(4), w);
      ENGINE_UNROLL
      for (int i = 0; i < 8; ++i) _mm512_storeu_si512(out + 64 * i, w[i]);
    }
  }
  return buffer.data();
}

template <int Bits, bool Offsets>
void amx_item(const QuantJob& j, int64_t t0, int64_t t1, int64_t first, int64_t last) {
  const int64_t full = t0 + (t1 - t0) / kAmxRows * kAmxRows;
  const TileConfig config(amx_kc(j.group));
  _tile_loadconfig(&config);
  const uint8_t* next = Bits == 4 ? unpacked_nibbles(j, first) : nullptr;
  for (int64_t tl = first; tl < last; ++tl) {
    const int64_t cols = std::min(kLanes, j.n - tl * kLanes);
    const uint8_t* body = Bits == 4 ? next : j.w + tl * j.groups * j.block_bytes + kHeader;
    if (Bits == 4 && tl + 1 < last) next = unpacked_nibbles(j, tl + 1);
    const int64_t stride = Bits == 4 ? j.group * kLanes : j.block_bytes;
    for (int64_t t = t0; t < full; t += kAmxRows) amx_group<Offsets>(j, tl, t / kAmxRows, cols, body, stride);
    if (full < t1) tile<Bits, Offsets>(j, tl, full, t1, cols, job_out(j, tl));
  }
  _tile_release();
}

// Rows t0 .. t1 - 1 (t0 a multiple of 16) x tiles first .. last - 1 on the tile unit; false where AMX is not used.
inline bool amx_tiles(const QuantJob& j, int64_t t0, int64_t t1, int64_t first, int64_t last) {
  if (!amx_rows(j.tokens) || t1 - t0 < kAmxRows) return false;
  by_kind(j, [&](auto bits, auto offsets) { amx_item<bits, offsets>(j, t0, t1, first, last); });
  return true;
}
#else
inline bool amx_ready() { return false; }
inline bool amx_rows(int64_t) { return false; }
inline void pack_rows(void*, size_t) {}
inline void size_packed_rows(const QuantJob&) {}
inline bool amx_tiles(const QuantJob&, int64_t, int64_t, int64_t, int64_t) { return false; }
#endif

}  // namespace quant
}  // namespace engine_kernels
