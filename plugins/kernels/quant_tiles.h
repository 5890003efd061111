// The tiles of QuantMatMul (quant_matmul.cc, whose header comment lays out the blocks): out rows t0 .. t1 - 1 of
// one tile of 16 columns, in the vector code of the CPU the library is compiled for.
//
// AVX-512 VNNI: each block's dot products are vpdpbusd of the unsigned weights against broadcast groups of 4
// activations, a tile's columns in the 16 lanes.
// AVX2: the same registers read as two halves of 8 columns: one or two rows take both halves in one pass over the
// blocks, prefetching the weight stream as AVX-512 does; more rows one half after the other (16 registers; the
// second reads the tile from L1; bench/NOTES.md entry 39). 4-bit: vpmaddubsw of the unsigned weights (0..15)
// against the activations (-127..127) cannot saturate (2 * 15 * 127), so a sub-block's 8 products add up in 16
// bits (8 * 3810 < 32768) before one vpmaddwd widens them.
// 8-bit: vpmaddubsw of |q - 128| against the activations given the sign of q - 128 (|q - 128| <= 128: each pair
// <= 2 * 128 * 127, no saturation), widened at once; that computes (q - 128) . qa, the zero point taken off.
// Up to 4 rows share each unpacked weight register. Without either: plain loops with the same arithmetic.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ENGINE_KERNELS_VNNI 1
#endif

namespace engine_kernels {
namespace quant {

constexpr int64_t kLanes = 16;     // columns per tile
constexpr int64_t kSub = 32;       // K values per sub-block
constexpr int64_t kHeader = 64;    // bytes of a block's scales
constexpr int64_t kRowChunk = 64;  // rows per work item (their A tiles stay in L1 on AMX)
constexpr int64_t kShareItems = 32;  // the fewest items a call of many rows is cut into, where tiles allow
constexpr int64_t kFloatBits = 32;  // QuantMatMul's bits for float32 tiles (float_tiles.h)
// rows sharing each unpacked weight register: 10 in AVX-512's 32 registers (one dot-product chain each; 8 rows of
// two chains ran 1.5-6% slower on a Zen 5, bench/NOTES.md entry 44), 4 in AVX2's 16
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kRows = 10;
#else
constexpr int kRows = 4;
#endif

struct Activations {
  std::vector<int8_t> q;     // [T, K]
  std::vector<float> d;      // [T, K / group]: da
  std::vector<int32_t> sum;  // [T, K / group]: sum(qa)
  std::vector<float> dasum;  // [T, K / group]: da * sum(qa), the shift of blocks with offsets (shift_at)
  std::vector<int32_t> zero_sum;  // [T, K / group]: zero_point * sum(qa), the shift of blocks without (0 with)
  // sum(qa) of each 16 and each 32 values as int16 (|sum| <= 32 * 127), the pairs vpdpwssd reads against a K-quant
  // super-block's Q6_K scales (a scale per 16) or Q4_K / Q5_K mins (a min per 32)
  std::vector<int16_t> sum16;  // [T, K / 16]
  std::vector<int16_t> sum32;  // [T, K / 32]
  // The same rows in groups of 16 as AMX reads them (quant_amx.h): [T / 16, K / kc, 16, kc] A tiles, and per
  // group, block and row the scale da and the shift (shift_at below)
  std::vector<int8_t> tiles;
  std::vector<float> da16, dasum16;  // [T / 16, K / group, 16]; dasum16 with offsets
  std::vector<int32_t> zero16;       // [T / 16, K / group, 16]; without offsets
  std::vector<uint16_t> bf16;        // many rows' bfloat16 A tiles (quant_bf16.h): [ceil(T / 16), K / 32, 16, 32]
};

struct QuantJob {
  const float* x;
  const uint8_t* w;
  float* out;
  Activations* a;
  int64_t tokens, k, n, bits, group, groups, block_bytes, tiles, tile_chunk, tile_items;
  bool offsets;
  bool swiglu = false;  // out [T, N / 2] = silu(columns < N / 2) * (columns >= N / 2), where the tiles write it
  Activations* next = nullptr;  // with swiglu: the SwiGLU tiles also quantize out into it, in blocks of next_group
  int64_t next_group = 0;
  int32_t next_zero = 0;  // the zero point of the next projection's weights (0 with offsets)
  int64_t scales = 0;     // kScales* below: how a block's header scales its sub-blocks
  bool float_x = false;   // x stays float32: each tile is dequantized and run as float32 tiles (float_tiles.h)
  int64_t row_chunk = kRowChunk;  // rows per work item: with float_x all of them, so a tile is dequantized once
  // The tiles the vector tiles' items are cut from: with swiglu the gate tiles, each taken with its up tile
  int64_t item_tiles() const { return swiglu ? tiles / 2 : tiles; }
};

// Where a tile's outputs go: column c of row t at at[(t - first_row) * ld + c].
struct TileOut {
  float* at;
  int64_t ld;
  int64_t first_row = 0;
  float* row(int64_t t) const { return at + (t - first_row) * ld; }
};

// The tile's columns of the job's own output [T, N].
inline TileOut job_out(const QuantJob& j, int64_t tile) { return {j.out + tile * kLanes, j.n}; }

// The first element of v on a cache line (v holds 64 bytes to spare): tile loads and aligned stores want one.
template <typename T>
inline T* aligned64(std::vector<T>& v) {
  const auto misaligned = reinterpret_cast<uintptr_t>(v.data()) % 64;
  return v.data() + (64 - misaligned) % 64 / sizeof(T);
}

// Bytes of a sub-block of 32 K values: 4 bits a value, then for 5 and 6 bits one or two 64-byte planes of the
// high bits (load_sub), or 8 bits a value.
inline int64_t sub_bytes(int64_t bits) { return kSub * kLanes * bits / 8; }

// How a block's header scales its sub-blocks (QuantMatMul's `scales` attribute; quant_matmul.cc draws the layouts):
// one d (and m) per block and column, or GGUF's K-quant super-blocks of 256 whose sub-blocks each have their own
// 6-bit scale and min (Q4_K, Q5_K) or whose halves of 16 each have an int8 scale (Q6_K).
constexpr int64_t kScalesBlock = 0, kScalesMin = 1, kScales16 = 2;
constexpr int64_t kSubScaleBytes = 256;  // the K-quant header's sub-block scales (and mins) of a tile

// Bytes of a tile's block of `group` K values: the header of scales, then the values (bits=32: float32 tiles,
// float_tiles.h, no header).
inline int64_t block_bytes(int64_t bits, int64_t group, int64_t scales = kScalesBlock) {
  return (bits == kFloatBits ? 0 : kHeader) + (scales ? kSubScaleBytes : 0) + group * kLanes * bits / 8;
}

// Whether the AMX and bfloat16 tiles (quant_amx.h, quant_bf16.h) read these weights: 4 or 8 bits, one scale a block.
inline bool plain_blocks(int64_t bits, int64_t scales) { return (bits == 4 || bits == 8) && !scales; }

// The zero point blocks without offsets take off (2^(bits - 1)); 0 with offsets.
inline int32_t zero_point(int64_t bits, bool offsets) { return offsets ? 0 : 1 << (bits - 1); }

// What a row's block adds beside d * da * dots: m * da * sum(qa) with offsets, else -zero_point * sum(qa) inside the
// integers; shift holds da * sum(qa) or zero_point * sum(qa).
template <bool Offsets>
using Shift = std::conditional_t<Offsets, float, int32_t>;

// The shift of row t's block b as quantize stored it (every tile and the AMX packing read it there): a load the VNNI
// tile's vpsubd reads as a broadcast. Computing zero_point * sum in the tile took a shift, a vpbroadcastd from a
// general register and the vpsubd a row and block, ~10% of the 8-bit tile's speed on a Zen 5 (bench/NOTES.md 44).
template <bool Offsets>
inline Shift<Offsets> shift_at(const QuantJob& j, int64_t t, int64_t b) {
  if constexpr (Offsets) return j.a->dasum[t * j.groups + b];
  else return j.a->zero_sum[t * j.groups + b];
}

// f(bits, offsets) with both as compile-time constants (std::integral_constant) for the job's weight kind.
// 5 bits come with offsets only (GGUF Q5_0 / Q5_1: projection_of checks).
template <class F>
inline void by_kind(const QuantJob& j, F&& f) {
  using Four = std::integral_constant<int, 4>;
  using Five = std::integral_constant<int, 5>;
  using Eight = std::integral_constant<int, 8>;
  if (j.bits == 4) j.offsets ? f(Four{}, std::true_type{}) : f(Four{}, std::false_type{});
  else if (j.bits == 5) f(Five{}, std::true_type{});
  else j.offsets ? f(Eight{}, std::true_type{}) : f(Eight{}, std::false_type{});
}

// The weight stream prefetched kPrefetchBlocks blocks (5-9 KB) ahead of its reads. On a Sapphire Rapids VM the
// hardware prefetchers alone left one row's projections at ~1/3 of the memory bandwidth: an int4 + lm_head int4
// decode step 6.4 -> 4.9-5.7 ms with it, int8 9.2 -> 8.7-9.1 (bench/NOTES.md entry 28); on a Zen 4 prefetching had
// changed nothing (entry 26). A prefetch never faults, so reading ahead past the last tile is harmless.
// Hint: 0 (prefetchnta) for the AVX-512 VNNI tiles, as a lone float32 row's (float_tiles.h): on a Zen 5 a batch-1
// decode step of the int4 engine ran 1.03-1.18x and of the int8 one 1.04-1.07x faster than with prefetcht0, their
// 32-decode steps 1.00-1.07x, their prefills unchanged (bench/NOTES.md entry 52). 3 (prefetcht0) elsewhere: the
// AMX tiles of a prefill read each weight tile again for every chunk of rows, and neither they nor the AVX2 tiles
// could be measured with the hint (no AMX on that machine, and its AVX-512 path runs).
constexpr int64_t kPrefetchBlocks = 16;

// The K-quant tiles (GGUF's super-blocks of 2-3 KB) prefetch each sub-block's lines as they reach it, kKQuantLead
// bytes ahead, into L2 (prefetcht1): whole blocks 16 ahead, as above, were 37-54 KB ahead with prefetchnta, past
// what L1 keeps, and the 1.5B Q4_K_M decode step streamed at 0.7x of the bandwidth; this way it ran 1.5-1.7x
// faster on a Zen 5 (prefetchnta at 5 KB 1.3-1.5x, prefetcht0 the same; bench/NOTES.md 56).
constexpr int64_t kKQuantLead = 8192;

// The `bytes` after `at` prefetched `lead` bytes ahead, a line at a time; Hint as __builtin_prefetch's locality.
template <int Hint>
inline void prefetch_ahead(const uint8_t* at, int64_t bytes, int64_t lead) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(at) + static_cast<uintptr_t>(lead);
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(ahead + static_cast<uintptr_t>(line)), 0, Hint);
}

template <int Hint = 3>
inline void prefetch_block(const uint8_t* block, int64_t block_bytes) {
  prefetch_ahead<Hint>(block, block_bytes, kPrefetchBlocks * block_bytes);
}

// q of column c (0..15) at k = kk (0..31) of one sub-block's bytes, as quant_matmul.cc's header comment lays them out.
// 5 and 6 bits: the low 4 as 4-bit values, bit 4 (and 5) from the planes after them: register i = kk / 4 (the
// 8-bit layout's) has its high bits at byte 4 c + kk % 4 of plane i / 4 (6 bits: bits 2 (i % 4), +1; 5 bits: one plane,
// bit i).
inline int32_t weight_at(const uint8_t* p, int64_t bits, int64_t c, int64_t kk) {
  if (bits == 8) return p[64 * (kk / 4) + 4 * c + kk % 4];
  const uint8_t v = p[64 * ((kk % 16) / 4) + 4 * c + kk % 4];
  const int32_t low = kk < 16 ? v & 0x0F : v >> 4;
  const int64_t i = kk / 4, at = 256 + 4 * c + kk % 4;
  if (bits == 5) return low | ((p[at] >> i) & 1) << 4;
  if (bits == 6) return low | ((p[at + 64 * (i / 4)] >> (2 * (i % 4))) & 3) << 4;
  return low;
}

inline float half_to_float(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8;
  const float magnitude = (h & 0x7C00) ? std::ldexp(static_cast<float>((h & 0x3FF) | 0x400), ((h >> 10) & 0x1F) - 25)
                                       : std::ldexp(static_cast<float>(h & 0x3FF), -24);
  return (h & 0x8000) ? -magnitude : magnitude;
}

#ifdef ENGINE_KERNELS_VNNI
// The 8 registers of one sub-block: register i holds the 4 values k = 4 i .. 4 i + 3 of each column.
// 5 and 6 bits add bit 4 (and 5) from the planes after the nibbles (weight_at): shifted into place in 16-bit lanes,
// where no bit that the mask keeps crosses a byte, and or-ed in with vpternlogd.
template <int Shift>
inline __m512i shifted(__m512i v) {
  if constexpr (Shift > 0) return _mm512_slli_epi16(v, Shift);
  else if constexpr (Shift < 0) return _mm512_srli_epi16(v, -Shift);
  else return v;
}

template <int I, int Bits>
inline __m512i with_high_bits(__m512i w, const __m512i* planes) {
  if constexpr (Bits == 5) {
    return _mm512_ternarylogic_epi32(w, shifted<4 - I>(planes[0]), _mm512_set1_epi8(0x10), 0xF8);  // w | (h & m)
  } else {
    return _mm512_ternarylogic_epi32(w, shifted<4 - 2 * (I % 4)>(planes[I / 4]), _mm512_set1_epi8(0x30), 0xF8);
  }
}

template <int Bits>
inline void load_sub(const uint8_t* p, __m512i w[8]) {
  if constexpr (Bits == 8) {
    ENGINE_UNROLL
    for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(p + 64 * i);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    ENGINE_UNROLL
    for (int l = 0; l < 4; ++l) {
      const __m512i v = _mm512_loadu_si512(p + 64 * l);
      w[l] = _mm512_and_si512(v, low);
      w[l + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (Bits == 5 || Bits == 6) {
      const __m512i planes[2] = {_mm512_loadu_si512(p + 256), Bits == 6 ? _mm512_loadu_si512(p + 320) : low};
      w[0] = with_high_bits<0, Bits>(w[0], planes);
      w[1] = with_high_bits<1, Bits>(w[1], planes);
      w[2] = with_high_bits<2, Bits>(w[2], planes);
      w[3] = with_high_bits<3, Bits>(w[3], planes);
      w[4] = with_high_bits<4, Bits>(w[4], planes);
      w[5] = with_high_bits<5, Bits>(w[5], planes);
      w[6] = with_high_bits<6, Bits>(w[6], planes);
      w[7] = with_high_bits<7, Bits>(w[7], planes);
    }
  }
}

// acc + the dot products of w's bytes with the 4 activations at a, broadcast to every lane: vpdpbusd reading them
// as an embedded broadcast, one micro-fused load, where GCC emits a vpbroadcastd beside each vpdpbusd for
// _mm512_set1_epi32 (the tile issues one a vpdpbusd). On a Zen 5 the tile (8 rows then) gained 1.5-5% in a harness,
// one thread, 9 turns of 9 (bench/NOTES.md entry 44). The same sums: integer arithmetic.
inline __m512i dot_broadcast(__m512i acc, __m512i w, const int32_t* a) {
  asm("vpdpbusd {%2%{1to16%}, %1, %0|%0, %1, %2%{1to16%}}" : "+v"(acc) : "v"(w), "m"(*a));
  return acc;
}

// d (and m) of a block's 16 columns, from its header.
template <bool Offsets>
struct BlockScales {
  __m512 d, m;
  explicit BlockScales(const uint8_t* header) {
    if constexpr (Offsets) {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header + 32)));
    } else {
      d = _mm512_loadu_ps(reinterpret_cast<const float*>(header));
      m = _mm512_setzero_ps();
    }
  }
};

// acc plus one row's block: dots = q . qa_b, da = da_b (the header comment's formula).
template <bool Offsets>
inline __m512 add_block(__m512 acc, __m512i dots, const BlockScales<Offsets>& s, float da, Shift<Offsets> shift) {
  if constexpr (Offsets) {
    acc = _mm512_fmadd_ps(s.m, _mm512_set1_ps(shift), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(s.d, _mm512_set1_ps(da)), acc);
  } else {
    const __m512 centred = _mm512_cvtepi32_ps(_mm512_sub_epi32(dots, _mm512_set1_epi32(shift)));
    return _mm512_fmadd_ps(centred, _mm512_mul_ps(s.d, _mm512_set1_ps(da)), acc);
  }
}

// Output rows t0 .. t0 + R - 1 of one tile: out[r, 0 .. cols) (cols <= 16). Subs: sub-blocks a block, 0 when
// only known at run time (a compile-time 1, the blocks of 32 of GGUF's Q4_1 and Q8_0, lets the compiler keep the
// sums in registers across blocks instead of copying them around a loop of one iteration). `stream`: the tile's
// blocks come from memory (the first rows of an item) and are prefetched; later rows read them from L1, where the
// prefetches only cost (a Zen 5, 8 rows from L1: 284 -> 306-322 G MAC/s a core without them, bench/NOTES.md 43).
template <int Bits, bool Offsets, int R, int Subs>
void tile_rows(const QuantJob& j, int64_t tile, int64_t t0, int64_t cols, const TileOut& o, bool stream) {
  const int64_t subs = Subs ? Subs : j.group / kSub;
  // Enough independent dot-product chains that vpdpbusd's latency does not bound the rows: a Zen 5 issues two a
  // cycle, 4-5 cycles each, so 8 rows with one chain each left 8% of the tile's speed (263 -> 284 G MAC/s a core,
  // bench/NOTES.md 43); fewer than 10 rows take two a row
  constexpr int kChains = R >= 10 ? 1 : 2;
  const uint8_t* p = j.w + tile * j.groups * j.block_bytes;
  const int8_t* qa = j.a->q.data() + t0 * j.k;
  const float* da = j.a->d.data() + t0 * j.groups;
  __m512 acc[R];
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.groups; ++b) {
    const uint8_t* header = p;
    if (stream) prefetch_block<0>(header, j.block_bytes);
    p += kHeader;
    __m512i dot[R][kChains];
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r)
      ENGINE_UNROLL
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int64_t s = 0; s < subs; ++s, p += sub_bytes(Bits)) {
      __m512i w[8];
      load_sub<Bits>(p, w);
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) {
        const int32_t* a = reinterpret_cast<const int32_t*>(qa + r * j.k + b * j.group + s * kSub);
        ENGINE_UNROLL
        for (int i = 0; i < 8; ++i)
          dot[r][i % kChains] = dot_broadcast(dot[r][i % kChains], w[i], a + i);
      }
    }
    const BlockScales<Offsets> scales(header);
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512i dots = kChains == 1 ? dot[r][0] : _mm512_add_epi32(dot[r][0], dot[r][kChains - 1]);
      acc[r] = add_block<Offsets>(acc[r], dots, scales, da[r * j.groups + b], shift_at<Offsets>(j, t0 + r, b));
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(o.row(t0 + r), keep, acc[r]);
}

// 16 bytes at p widened to 16 floats: unsigned (the 6-bit scales and mins of Q4_K / Q5_K) or signed (Q6_K's).
template <bool Signed>
inline __m512 bytes_ps(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// acc + the int16 pairs of `pairs` times the pair of int16 at a, broadcast to every lane (vpdpwssd), as
// dot_broadcast: a K-quant super-block's mins (or Q6_K's scales) against a row's sums.
inline __m512i pairs_broadcast(__m512i acc, __m512i pairs, const int16_t* a) {
  asm("vpdpwssd {%2%{1to16%}, %1, %0|%0, %1, %2%{1to16%}}"
      : "+v"(acc)
      : "v"(pairs), "m"(*reinterpret_cast<const int32_t*>(a)));
  return acc;
}

// The 16 columns' int16 pairs (v[2 p][c], v[2 p + 1][c]) of two rows of 16 bytes at p: Q4_K / Q5_K's unsigned
// mins, Q6_K's signed scales.
template <bool Signed>
inline __m512i byte_pairs(const uint8_t* p) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  const __m512i first = Signed ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
  const __m512i second = _mm512_slli_epi32(Signed ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi), 16);
  return _mm512_ternarylogic_epi32(second, first, _mm512_set1_epi32(0xFFFF), 0xF8);  // second | (first & 0xFFFF)
}

// Output rows t0 .. t0 + R - 1 of one tile of K-quant super-blocks (scales kScalesMin or kScales16), with the
// activations in blocks of 256, one da a super-block (llama.cpp's Q8_K): each sub-block's integer dot products
// take its integer scale (vpmulld) into one int32 sum a super-block, and the mins (or Q6_K's zero point 32) one
// vpdpwssd of the super-block's int16 pairs against the row's sums of 32 (or 16) per pair; then one float multiply:
//   kScalesMin: d * da * sum_s sc_s (q_s . qa_s) - dmin * da * sum_s mn_s sum_s(qa)
//   kScales16:  d * da * (sum_h sc_h (q_h . qa_h) - 32 sum_h sc_h sum_h(qa))        (h: the halves of 16)
// |sum| < 2^31: Q6_K's 16 halves of 16 * 63 * 127 times |sc| <= 128 is 2.7e8. Float rounding moves from each
// sub-block to each super-block; the values are the same.
template <int Bits, int Scales, int R>
void ktile_rows(const QuantJob& j, int64_t tile, int64_t t0, int64_t cols, const TileOut& o, bool stream) {
  constexpr bool kHalves = Scales == kScales16;                 // a dot product per half of 16, else per 32
  constexpr int kChains = kHalves ? 1 : (R >= 8 ? 1 : 2);       // chains of vpdpbusd a row and dot product
  const int64_t per_row = kHalves ? j.k / 16 : j.k / 32;        // the rows' sums of 16 (or 32)
  const uint8_t* p = j.w + tile * j.groups * j.block_bytes;
  const int8_t* qa = j.a->q.data() + t0 * j.k;
  const float* da = j.a->d.data() + t0 * j.groups;
  const int16_t* sums = (kHalves ? j.a->sum16.data() : j.a->sum32.data()) + t0 * per_row;
  __m512 acc[R];
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < j.groups; ++b) {
    const uint8_t* header = p;
    if (stream) prefetch_ahead<2>(header, kHeader + kSubScaleBytes, kKQuantLead);
    const uint8_t* sub_scales = header + kHeader;
    p += kHeader + kSubScaleBytes;
    __m512i sum[R];
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
    for (int64_t s = 0; s < j.group / kSub; ++s, p += sub_bytes(Bits)) {
      if (stream) prefetch_ahead<2>(p, sub_bytes(Bits), kKQuantLead);
      __m512i w[8];
      load_sub<Bits>(p, w);
      ENGINE_UNROLL
      for (int h = 0; h < (kHalves ? 2 : 1); ++h) {
        const __m128i sc_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
            sub_scales + (kHalves ? 32 * s + 16 * h : 16 * s)));
        const __m512i sc = kHalves ? _mm512_cvtepi8_epi32(sc_bytes) : _mm512_cvtepu8_epi32(sc_bytes);
        constexpr int kCount = kHalves ? 4 : 8;  // the registers of a dot product
        ENGINE_UNROLL
        for (int r = 0; r < R; ++r) {
          const int32_t* a = reinterpret_cast<const int32_t*>(qa + r * j.k + b * j.group + s * kSub) + 4 * h;
          __m512i dot[kChains];
          ENGINE_UNROLL
          for (int c = 0; c < kChains; ++c) dot[c] = _mm512_setzero_si512();
          ENGINE_UNROLL
          for (int i = 0; i < kCount; ++i)
            dot[i * kChains / kCount] = dot_broadcast(dot[i * kChains / kCount], w[4 * h + i], a + i);
          const __m512i dots = kChains == 1 ? dot[0] : _mm512_add_epi32(dot[0], dot[kChains - 1]);
          sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(dots, sc));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header)));
    constexpr int kPairs = kHalves ? 8 : 4;
    __m512i pairs[kPairs];  // kScalesMin: the mins; kScales16: the scales
    ENGINE_UNROLL
    for (int q = 0; q < kPairs; ++q) pairs[q] = byte_pairs<kHalves>(sub_scales + (kHalves ? 0 : 128) + 32 * q);
    const __m512 dmin =
        kHalves ? d : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(header + 32)));
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) {
      const int16_t* row_sums = sums + r * per_row + b * 2 * kPairs;
      __m512i shift = _mm512_setzero_si512();
      ENGINE_UNROLL
      for (int q = 0; q < kPairs; ++q) shift = pairs_broadcast(shift, pairs[q], row_sums + 2 * q);
      const __m512 rd = _mm512_set1_ps(da[r * j.groups + b]);
      if constexpr (kHalves) {
        const __m512i centred = _mm512_sub_epi32(sum[r], _mm512_slli_epi32(shift, 5));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(d, rd), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(d, rd), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(shift), _mm512_mul_ps(dmin, rd), acc[r]);
      }
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(o.row(t0 + r), keep, acc[r]);
}

template <int Bits, int Scales>
void ktile(const QuantJob& j, int64_t tile, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  int64_t t = t0;  // the first rows stream the tile's blocks from memory, the others find them in L1
  for (; t + 8 <= t1; t += 8) ktile_rows<Bits, Scales, 8>(j, tile, t, cols, o, t == t0);
  if (t + 4 <= t1) {
    ktile_rows<Bits, Scales, 4>(j, tile, t, cols, o, t == t0);
    t += 4;
  }
  switch (t1 - t) {
    case 3: ktile_rows<Bits, Scales, 3>(j, tile, t, cols, o, t == t0); break;
    case 2: ktile_rows<Bits, Scales, 2>(j, tile, t, cols, o, t == t0); break;
    case 1: ktile_rows<Bits, Scales, 1>(j, tile, t, cols, o, t == t0); break;
    default: break;
  }
}

#endif

#if defined(ENGINE_KERNELS_AVX2) && !defined(ENGINE_KERNELS_VNNI)
// Keeps x's additions in the order written: GCC reassociates a row's sums into a tree and spills them (NOTES 39).
inline void in_order(__m256i& x) { asm("" : "+x"(x)); }

template <int Shift>
inline __m256i shifted(__m256i v) {
  if constexpr (Shift > 0) return _mm256_slli_epi16(v, Shift);
  else if constexpr (Shift < 0) return _mm256_srli_epi16(v, -Shift);
  else return v;
}

// Register I's bit 4 (5 bits) or bits 4-5 (6 bits) from the half's high-bit planes, as the AVX-512 load_sub takes them.
template <int I, int Bits>
inline __m256i with_high_bits(__m256i w, const __m256i* planes) {
  if constexpr (Bits == 5)
    return _mm256_or_si256(w, _mm256_and_si256(shifted<4 - I>(planes[0]), _mm256_set1_epi8(0x10)));
  else
    return _mm256_or_si256(w, _mm256_and_si256(shifted<4 - 2 * (I % 4)>(planes[I / 4]), _mm256_set1_epi8(0x30)));
}

// The 8 registers of half `half` (8 columns) of one sub-block of 4, 5 or 6 bits: register i holds k = 4 i .. 4 i + 3.
template <int Bits>
inline void load_half(const uint8_t* p, int half, __m256i w[8]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  ENGINE_UNROLL
  for (int l = 0; l < 4; ++l) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * l + 32 * half));
    w[l] = _mm256_and_si256(v, low);
    w[l + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
  if constexpr (Bits == 5 || Bits == 6) {
    const __m256i planes[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 + 32 * half)),
                               Bits == 6 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 320 + 32 * half))
                                         : low};
    w[0] = with_high_bits<0, Bits>(w[0], planes);
    w[1] = with_high_bits<1, Bits>(w[1], planes);
    w[2] = with_high_bits<2, Bits>(w[2], planes);
    w[3] = with_high_bits<3, Bits>(w[3], planes);
    w[4] = with_high_bits<4, Bits>(w[4], planes);
    w[5] = with_high_bits<5, Bits>(w[5], planes);
    w[6] = with_high_bits<6, Bits>(w[6], planes);
    w[7] = with_high_bits<7, Bits>(w[7], planes);
  }
}

// sum over registers First .. First + 3 of w . a, each pair of products times `scale` (int16 pairs: a K-quant
// sub-block's integer scale in both halves): unsigned values up to 63 against int8 activations keep a pair under
// 2 * 63 * 127 in vpmaddubsw's 16 bits, and vpmaddwd widens each register's pairs at once.
template <int First>
inline __m256i quarter_dots(const __m256i w[8], const int32_t* a, __m256i scale) {
  __m256i dot = _mm256_setzero_si256();
  ENGINE_UNROLL
  for (int i = First; i < First + 4; ++i)
    dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], _mm256_set1_epi32(a[i])), scale));
  return dot;
}

// The 8 columns' int16 pairs (v[2 p][c], v[2 p + 1][c]) of two rows of 16 bytes at p (half `half`'s 8 of each),
// as the AVX-512 byte_pairs; and one row's 8 bytes in both halves of each lane (v[c] * 0x10001).
template <bool Signed>
inline __m256i bytes_epi32(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

template <bool Signed>
inline __m256i byte_pairs(const uint8_t* p) {
  const __m256i second = _mm256_slli_epi32(bytes_epi32<Signed>(p + 16), 16);
  return _mm256_or_si256(second, _mm256_and_si256(bytes_epi32<Signed>(p), _mm256_set1_epi32(0xFFFF)));
}

template <bool Signed>
inline __m256i doubled(const uint8_t* p) {
  const __m256i v = _mm256_and_si256(bytes_epi32<Signed>(p), _mm256_set1_epi32(0xFFFF));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

// Sub-block products of R rows against half `half` (8 columns) of one sub-block at p, added to dot[R] (int32).
template <int Bits, int R>
inline void sub_dots(const uint8_t* p, int half, const int32_t* const* a, __m256i dot[R]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 5) {  // a pair of products <= 2 * 31 * 127: four registers' pairs add up in 16 bits
    __m256i w[8];
    load_half<5>(p, half, w);
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) {
      __m256i sums = _mm256_setzero_si256();
      ENGINE_UNROLL
      for (int i = 0; i < 8; ++i) {
        sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(w[i], _mm256_set1_epi32(a[r][i])));
        if (i == 3) {
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(sums, ones));
          sums = _mm256_setzero_si256();
        }
      }
      dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(sums, ones));
    }
  } else if constexpr (Bits == 4) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i lows[R], highs[R];  // two chains of 16-bit sums a row: half the latency of one
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) lows[r] = highs[r] = _mm256_setzero_si256();
    ENGINE_UNROLL
    for (int l = 0; l < 4; ++l) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * l + 32 * half));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) {
        lows[r] = _mm256_add_epi16(lows[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a[r][l])));
        highs[r] = _mm256_add_epi16(highs[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a[r][l + 4])));
        in_order(lows[r]), in_order(highs[r]);
      }
    }
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r)
      dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_add_epi16(lows[r], highs[r]), ones));
  } else {
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    ENGINE_UNROLL
    for (int i = 0; i < 8; ++i) {
      const __m256i w = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * i + 32 * half)), bias);   // q - 128
      const __m256i magnitude = _mm256_abs_epi8(w);
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256i signed_a = _mm256_sign_epi8(_mm256_set1_epi32(a[r][i]), w);
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_a), ones));
        in_order(dot[r]);
      }
    }
  }
}

// Half `half` (8 columns) of output rows t0 .. t0 + R - 1 of one tile of K-quant super-blocks: ktile_rows'
// arithmetic in AVX2's 8 lanes, the sub-block scales taken by vpmaddwd (in place of its ones) instead of vpmulld.
template <int Bits, int Scales, int R>
void ktile_half(const QuantJob& j, int64_t tile, int64_t t0, int64_t cols, const TileOut& o, int half) {
  constexpr bool kHalves = Scales == kScales16;
  constexpr int kPairs = kHalves ? 8 : 4;
  const int64_t per_row = kHalves ? j.k / 16 : j.k / 32;
  const uint8_t* p = j.w + tile * j.groups * j.block_bytes;
  const int8_t* qa = j.a->q.data() + t0 * j.k;
  const float* da = j.a->d.data() + t0 * j.groups;
  const int16_t* sums = (kHalves ? j.a->sum16.data() : j.a->sum32.data()) + t0 * per_row;
  __m256 acc[R];
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < j.groups; ++b) {
    const uint8_t* header = p;
    if (half == 0) prefetch_ahead<2>(header, kHeader + kSubScaleBytes, kKQuantLead);
    const uint8_t* sub_scales = header + kHeader + 8 * half;
    p += kHeader + kSubScaleBytes;
    __m256i sum[R];
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int64_t s = 0; s < j.group / kSub; ++s, p += sub_bytes(Bits)) {
      if (half == 0) prefetch_ahead<2>(p, sub_bytes(Bits), kKQuantLead);
      __m256i w[8];
      load_half<Bits>(p, half, w);
      const __m256i low_scale = doubled<kHalves>(sub_scales + (kHalves ? 32 * s : 16 * s));
      const __m256i high_scale = kHalves ? doubled<true>(sub_scales + 32 * s + 16) : low_scale;
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) {
        const int32_t* a = reinterpret_cast<const int32_t*>(qa + r * j.k + b * j.group + s * kSub);
        sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(quarter_dots<0>(w, a, low_scale),
                                                           quarter_dots<4>(w, a, high_scale)));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 16 * half)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 32 + 16 * half)));
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) {
      const int16_t* row_sums = sums + r * per_row + b * 2 * kPairs;
      __m256i shift = _mm256_setzero_si256();
      ENGINE_UNROLL
      for (int q = 0; q < kPairs; ++q) {
        int32_t pair;
        std::memcpy(&pair, row_sums + 2 * q, sizeof pair);
        const __m256i pairs = byte_pairs<kHalves>(sub_scales + (kHalves ? 0 : 128) + 32 * q);
        shift = _mm256_add_epi32(shift, _mm256_madd_epi16(pairs, _mm256_set1_epi32(pair)));
      }
      const __m256 rd = _mm256_set1_ps(da[r * j.groups + b]);
      if constexpr (kHalves) {
        const __m256i centred = _mm256_sub_epi32(sum[r], _mm256_slli_epi32(shift, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(d, rd), acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_mul_ps(d, rd), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(shift), _mm256_mul_ps(dmin, rd), acc[r]);
      }
    }
  }
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols - 8 * half)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  ENGINE_UNROLL
  for (int r = 0; r < R; ++r) _mm256_maskstore_ps(o.row(t0 + r) + 8 * half, keep, acc[r]);
}

template <int Bits, int Scales>
void ktile(const QuantJob& j, int64_t tile, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  for (int half = 0; half < 2 && 8 * half < cols; ++half) {
    int64_t t = t0;
    for (; t + 4 <= t1; t += 4) ktile_half<Bits, Scales, 4>(j, tile, t, cols, o, half);
    for (; t + 2 <= t1; t += 2) ktile_half<Bits, Scales, 2>(j, tile, t, cols, o, half);
    if (t < t1) ktile_half<Bits, Scales, 1>(j, tile, t, cols, o, half);
  }
}

// Halves h0 .. h0 + H - 1 (8 columns each) of output rows t0 .. t0 + R - 1 of one tile, in one pass over its
// blocks; Subs as in the AVX-512 tile_rows.
template <int Bits, bool Offsets, int R, int Subs, int H>
void tile_halves(const QuantJob& j, int64_t tile, int64_t t0, int64_t cols, const TileOut& o, int h0) {
  const int64_t subs = Subs ? Subs : j.group / kSub;
  const float *da = j.a->d.data() + t0 * j.groups, *dasum = j.a->dasum.data() + t0 * j.groups;
  const int32_t* sum = j.a->sum.data() + t0 * j.groups;
  const uint8_t* p = j.w + tile * j.groups * j.block_bytes;
  __m256 acc[H][R];
  ENGINE_UNROLL
  for (int h = 0; h < H; ++h)
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < j.groups; ++b) {
    const uint8_t* header = p;
    if constexpr (H == 2) prefetch_block(header, j.block_bytes);  // few rows: bound by the weight stream
    p += kHeader;
    __m256i dot[H][R];
    ENGINE_UNROLL
    for (int h = 0; h < H; ++h)
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) dot[h][r] = _mm256_setzero_si256();
    for (int64_t s = 0; s < subs; ++s, p += sub_bytes(Bits)) {
      const int32_t* a[R];
      ENGINE_UNROLL
      for (int r = 0; r < R; ++r) a[r] = reinterpret_cast<const int32_t*>(j.a->q.data() + (t0 + r) * j.k +
                                                                           b * j.group + s * kSub);
      ENGINE_UNROLL
      for (int h = 0; h < H; ++h) sub_dots<Bits, R>(p, h0 + h, a, dot[h]);
    }
    // dot holds q . qa for 4 bits, (q - 128) . qa for 8 bits
    ENGINE_UNROLL
    for (int h = 0; h < H; ++h) {
      const int half = h0 + h;
      if constexpr (Offsets) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 16 * half)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(header + 32 + 16 * half)));
        ENGINE_UNROLL
        for (int r = 0; r < R; ++r) {
          const float scale = da[r * j.groups + b];
          const __m256i unsigned_dot =
              Bits == 8 ? _mm256_add_epi32(dot[h][r], _mm256_set1_epi32(128 * sum[r * j.groups + b])) : dot[h][r];
          acc[h][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dasum[r * j.groups + b]), acc[h][r]);
          acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(unsigned_dot), _mm256_mul_ps(d, _mm256_set1_ps(scale)),
                                      acc[h][r]);
        }
      } else {
        const __m256 d = _mm256_loadu_ps(reinterpret_cast<const float*>(header) + 8 * half);
        ENGINE_UNROLL
        for (int r = 0; r < R; ++r) {
          // 8 bits: the dots are (q - 128) . qa already (sub_dots)
          const __m256i zero = _mm256_set1_epi32(Bits == 4 ? shift_at<false>(j, t0 + r, b) : 0);
          const __m256 dots = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot[h][r], zero));
          acc[h][r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_set1_ps(da[r * j.groups + b])), acc[h][r]);
        }
      }
    }
  }
  ENGINE_UNROLL
  for (int h = 0; h < H; ++h) {
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(cols - 8 * (h0 + h))),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    ENGINE_UNROLL
    for (int r = 0; r < R; ++r)
      _mm256_maskstore_ps(o.row(t0 + r) + 8 * (h0 + h), keep, acc[h][r]);
  }
}

// Output rows t0 .. t0 + R - 1 of one tile: out[r, 0 .. cols) (cols <= 16), in one pass or a pass per half (which
// prefetches the weights when it takes both halves of few rows, whatever `stream` says).
template <int Bits, bool Offsets, int R, int Subs>
void tile_rows(const QuantJob& j, int64_t tile, int64_t t0, int64_t cols, const TileOut& o, bool /*stream*/) {
  if constexpr (R <= 2) {
    if (cols > 8) return tile_halves<Bits, Offsets, R, Subs, 2>(j, tile, t0, cols, o, 0);
  }
  for (int half = 0; half < 2 && 8 * half < cols; ++half)
    tile_halves<Bits, Offsets, R, Subs, 1>(j, tile, t0, cols, o, half);
}
#endif

inline void plain_tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  const int64_t subs = j.group / kSub;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t* p = j.w + tl * j.groups * j.block_bytes;
      float acc = 0;
      for (int64_t b = 0; b < j.groups; ++b, p += j.block_bytes) {
        int32_t dot = 0;
        for (int64_t s = 0; s < subs; ++s)
          for (int64_t kk = 0; kk < kSub; ++kk)
            dot += weight_at(p + kHeader + s * sub_bytes(j.bits), j.bits, c, kk) *
                   j.a->q[static_cast<size_t>(t * j.k + b * j.group + s * kSub + kk)];
        const float scale = j.a->d[static_cast<size_t>(t * j.groups + b)];
        if (j.offsets) {
          acc = std::fma(half_to_float(p + 32 + 2 * c), shift_at<true>(j, t, b), acc);
          acc = std::fma(static_cast<float>(dot), half_to_float(p + 2 * c) * scale, acc);
        } else {
          float d;
          std::memcpy(&d, p + 4 * c, sizeof d);
          acc = std::fma(static_cast<float>(dot - shift_at<false>(j, t, b)), d * scale, acc);
        }
      }
      o.row(t)[c] = acc;
    }
}

// The weight of column c at K value kk of a block, as (scale, minimum) of the value q there: w = scale * q + minimum,
// from the header of the job's format (quant_matmul.cc's header comment). The plain loops and QuantGather read it.
struct ValueScale {
  float scale, minimum;
};

inline ValueScale value_scale(const uint8_t* block, int64_t bits, bool offsets, int64_t scales, int64_t c,
                              int64_t kk) {
  const uint8_t* sub_scales = block + kHeader;
  if (scales == kScalesMin) {
    const int64_t s = kk / kSub;
    return {half_to_float(block + 2 * c) * static_cast<float>(sub_scales[16 * s + c]),
            -(half_to_float(block + 32 + 2 * c) * static_cast<float>(sub_scales[128 + 16 * s + c]))};
  }
  if (scales == kScales16) {
    const auto sc = static_cast<int8_t>(sub_scales[16 * (kk / 16) + c]);
    const float d = half_to_float(block + 2 * c) * static_cast<float>(sc);
    return {d, -32 * d};
  }
  if (offsets) return {half_to_float(block + 2 * c), half_to_float(block + 32 + 2 * c)};
  float d;
  std::memcpy(&d, block + 4 * c, sizeof d);
  return {d, -static_cast<float>(1 << (bits - 1)) * d};
}

// The bytes of sub-block s of a block: after the header (and the K-quant sub-block scales).
inline const uint8_t* sub_block(const uint8_t* block, int64_t bits, int64_t scales, int64_t s) {
  return block + kHeader + (scales ? kSubScaleBytes : 0) + s * sub_bytes(bits);
}

// Column c's weight at K value kk of a block, scale * q + minimum in one rounding: for GGUF's kinds exactly what
// gguf dequantizes (scale * q is exact), for RTN weights within a rounding of (q - zero_point) * d.
inline float dequantized(const uint8_t* block, int64_t bits, bool offsets, int64_t scales, int64_t c, int64_t kk) {
  const ValueScale v = value_scale(block, bits, offsets, scales, c, kk);
  const int32_t q = weight_at(sub_block(block, bits, scales, kk / kSub), bits, c, kk % kSub);
  return std::fma(static_cast<float>(q), v.scale, v.minimum);
}

// Rows t0 .. t1 - 1 of a tile whose weights the vector tiles do not take here, in plain loops: every half block of
// 16 values adds scale * da * (q . qa) + minimum * da * sum(qa), the formula of every format.
inline void plain_any_tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t* p = j.w + tl * j.groups * j.block_bytes;
      float acc = 0;
      for (int64_t b = 0; b < j.groups; ++b, p += j.block_bytes)
        for (int64_t kk = 0; kk < j.group; kk += 16) {
          const int64_t at = t * j.k + b * j.group + kk;
          int32_t dot = 0, sum = 0;
          for (int64_t e = kk; e < kk + 16; ++e) {
            const int32_t qa = j.a->q[static_cast<size_t>(t * j.k + b * j.group + e)];
            dot += weight_at(sub_block(p, j.bits, j.scales, e / kSub), j.bits, c, e % kSub) * qa;
            sum += qa;
          }
          const ValueScale v = value_scale(p, j.bits, j.offsets, j.scales, c, kk);
          const float da = j.a->d[static_cast<size_t>(at / j.group)];
          acc = std::fma(static_cast<float>(dot), v.scale * da, acc);
          acc = std::fma(static_cast<float>(sum), v.minimum * da, acc);
        }
      o.row(t)[c] = acc;
    }
}

#ifdef ENGINE_KERNELS_VNNI
// The 16 columns' (scale, minimum) of sub-block s of a block (value_scale's, vectorized), for each half of 16
// values: w = scale * q + minimum.
inline void sub_scales(const uint8_t* block, const QuantJob& j, int64_t s, __m512 scale[2], __m512 minimum[2]) {
  const __m512 d = j.offsets || j.scales ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)))
                                         : _mm512_loadu_ps(reinterpret_cast<const float*>(block));
  const uint8_t* sub = block + kHeader;
  if (j.scales == kScales16) {
    for (int h = 0; h < 2; ++h) {
      scale[h] = _mm512_mul_ps(d, bytes_ps<true>(sub + 32 * s + 16 * h));
      minimum[h] = _mm512_mul_ps(_mm512_set1_ps(-32.0f), scale[h]);
    }
    return;
  }
  const __m512 m = j.offsets ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)))
                             : _mm512_setzero_ps();
  if (j.scales == kScalesMin) {
    scale[0] = scale[1] = _mm512_mul_ps(d, bytes_ps<false>(sub + 16 * s));
    minimum[0] = minimum[1] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(m, bytes_ps<false>(sub + 128 + 16 * s)));
  } else {
    scale[0] = scale[1] = d;
    minimum[0] = minimum[1] = j.offsets ? m : _mm512_mul_ps(_mm512_set1_ps(-static_cast<float>(1 << (j.bits - 1))), d);
  }
}
#endif

// Tile tl's K x 16 weights as float32 in float_tiles.h's layout (out[k * 16 + c]), each value `dequantized`'s. The
// vector code takes the blocks a sub-block at a time: register i's 32-bit lane c holds
// column c's values k = 4 i .. 4 i + 3, byte e each.
inline void dequantize_tile(const QuantJob& j, int64_t tl, float* out) {
  const uint8_t* p = j.w + tl * j.groups * j.block_bytes;
  for (int64_t b = 0; b < j.groups; ++b, p += j.block_bytes) {
#ifdef ENGINE_KERNELS_VNNI
    for (int64_t s = 0; s < j.group / kSub; ++s) {
      __m512i w[8];
      const uint8_t* sub = sub_block(p, j.bits, j.scales, s);
      switch (j.bits) {
        case 4: load_sub<4>(sub, w); break;
        case 5: load_sub<5>(sub, w); break;
        case 6: load_sub<6>(sub, w); break;
        default: load_sub<8>(sub, w); break;
      }
      __m512 scale[2], minimum[2];
      sub_scales(p, j, s, scale, minimum);
      float* rows = out + (b * j.group + s * kSub) * kLanes;
      for (int i = 0; i < 8; ++i)
        for (int e = 0; e < 4; ++e) {
          const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(w[i], _mm512_set1_epi32(8 * e)),
                                             _mm512_set1_epi32(0xFF));
          _mm512_storeu_ps(rows + (4 * i + e) * kLanes,
                           _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale[i / 4], minimum[i / 4]));
        }
    }
#else
    for (int64_t kk = 0; kk < j.group; ++kk)
      for (int64_t c = 0; c < kLanes; ++c)
        out[(b * j.group + kk) * kLanes + c] = dequantized(p, j.bits, j.offsets, j.scales, c, kk);
#endif
  }
}

#if defined(ENGINE_KERNELS_VNNI) || defined(ENGINE_KERNELS_AVX2)
template <int Bits, bool Offsets, int Subs>
void tile_subs(const QuantJob& j, int64_t tile, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  int64_t t = t0;  // the first rows stream the tile's blocks from memory, the others find them in L1
  if constexpr (kRows > 8) {
    // as many kRows-row passes as leave the fewest rows beside the 8- and 4-row ones, whose passes are nearly as
    // fast: 16 rows as 8 + 8 (10 + 4 + 2 ran 7% slower), 12 as 8 + 4, 32 as 10 + 10 + 8 + 4
    const int64_t rows = t1 - t0;
    int64_t passes = 0;
    for (int64_t k = 1; k * kRows <= rows; ++k)
      if ((rows - k * kRows) % 4 <= (rows - passes * kRows) % 4) passes = k;
    for (; t < t0 + passes * kRows; t += kRows) tile_rows<Bits, Offsets, kRows, Subs>(j, tile, t, cols, o, t == t0);
    for (; t + 8 <= t1; t += 8) tile_rows<Bits, Offsets, 8, Subs>(j, tile, t, cols, o, t == t0);
  } else {
    for (; t + kRows <= t1; t += kRows) tile_rows<Bits, Offsets, kRows, Subs>(j, tile, t, cols, o, t == t0);
  }
  if (t + 4 <= t1) {
    tile_rows<Bits, Offsets, 4, Subs>(j, tile, t, cols, o, t == t0);
    t += 4;
  }
  switch (t1 - t) {
    case 3: tile_rows<Bits, Offsets, 3, Subs>(j, tile, t, cols, o, t == t0); break;
    case 2: tile_rows<Bits, Offsets, 2, Subs>(j, tile, t, cols, o, t == t0); break;
    case 1: tile_rows<Bits, Offsets, 1, Subs>(j, tile, t, cols, o, t == t0); break;
    default: break;
  }
}

template <int Bits, bool Offsets>
void tile(const QuantJob& j, int64_t tile, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  j.group == kSub ? tile_subs<Bits, Offsets, 1>(j, tile, t0, t1, cols, o)
                  : tile_subs<Bits, Offsets, 0>(j, tile, t0, t1, cols, o);
}

// Rows t0 .. t1 - 1 of quantized tile tl (cols <= 16 of its columns) into o (float_tiles.h's tile() picks): K-quant
// scales on ktile, the rest by kind. CPUs with neither AVX-512 VNNI nor AVX2 run every format in plain loops.
inline void int_tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  if (j.scales == kScalesMin) {   // ktile: AVX-512 VNNI's or AVX2's, whichever the library is compiled for
    return j.bits == 4 ? ktile<4, kScalesMin>(j, tl, t0, t1, cols, o) : ktile<5, kScalesMin>(j, tl, t0, t1, cols, o);
  }
  if (j.scales == kScales16) return ktile<6, kScales16>(j, tl, t0, t1, cols, o);
  by_kind(j, [&](auto bits, auto offsets) { tile<bits, offsets>(j, tl, t0, t1, cols, o); });
}
#else
inline void int_tile(const QuantJob& j, int64_t tl, int64_t t0, int64_t t1, int64_t cols, const TileOut& o) {
  if (!plain_blocks(j.bits, j.scales)) return plain_any_tile(j, tl, t0, t1, cols, o);
  plain_tile(j, tl, t0, t1, cols, o);
}
#endif

}  // namespace quant
}  // namespace engine_kernels
