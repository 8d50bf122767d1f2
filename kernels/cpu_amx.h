// What the AMX kernels share (cpu_prefill.cpp, cpu_gemm.cpp): the tile configuration, Linux's
// permission to use the tiles, and a thread's tile state set up and put back around a kernel.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "cpu_vector.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && HALFMOON_VEC == 512
#define HALFMOON_AMX 1

namespace halfmoon {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process AMX's tile state only when asked (arch_prctl, ARCH_REQ_XCOMP_PERM).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}

// For one thread's part of a kernel: all eight tiles 16 rows of 64 bytes, then the thread's
// own configuration (oneDNN's, or none) put back, so that its GEMMs are unaffected.
class ThreadTiles {
 public:
  ThreadTiles() {
    _tile_storeconfig(saved_);
    TileConfig config;
    for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
  }
  ~ThreadTiles() {
    if (saved_[0] == 0) {
      _tile_release();
    } else {
      _tile_loadconfig(saved_);
    }
  }
  ThreadTiles(const ThreadTiles&) = delete;
  ThreadTiles& operator=(const ThreadTiles&) = delete;

 private:
  alignas(64) uint8_t saved_[64];
};

}  // namespace halfmoon
#endif

namespace halfmoon {

// 1 when a kernel of this build can use the tiles (AMX compiled in and granted), else 0.
inline int amx_usable() {
#if defined(HALFMOON_AMX)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

}  // namespace halfmoon
