// What every AMX kernel needs: the tile registers' permission (Linux asks each process to request them) and a tile
// configuration of 16-row tiles.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace engine_kernels {

// Whether this process may use the tile registers: asked once (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool amx_permitted() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

// Palette 1 with tiles 0 .. count - 1 of 16 rows x 64 bytes (a C tile of 16 x 16 floats, an A or B tile of 16 x 32
// bfloat16 or 16 x 64 int8).
struct alignas(64) FullTiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit FullTiles(int count = 8) {
    for (int t = 0; t < count; ++t) rows[t] = 16, colsb[t] = 64;
  }
};

}  // namespace engine_kernels
#endif
