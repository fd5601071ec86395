// What every AMX kernel needs: Linux's permission to use the tile state, and one tile configuration
// (all eight tiles 16 rows x 64 bytes).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// GCC's _tile_loadd does not tell the compiler that it reads memory, so a buffer written just before it
// may be stale or its stores elided (a stack buffer of queries was). Every tile load goes through this,
// which adds a compiler barrier (no instruction).
#define TILE_LOAD(tile, base, stride)       \
  do {                                      \
    __asm__ volatile("" ::: "memory");      \
    _tile_loadd(tile, base, stride);        \
  } while (0)

namespace tokenmill_amx {

// Linux hands out AMX state only to processes that ask for it (arch_prctl ARCH_REQ_XCOMP_PERM); a tile
// instruction before that is an illegal instruction.
inline bool permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool has_tile = (edx >> 24) & 1, has_bf16 = (edx >> 22) & 1;
    return has_tile && has_bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace tokenmill_amx

#endif
