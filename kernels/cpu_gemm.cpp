// The linear layers' GEMMs for decode's few rows: out[M, N] = x[M, K] W^T, bf16 on AMX tiles
// (fp32 sums) and fp32 on AVX-512 FMA (below). Built and loaded by cpu_build.py, called by
// cpu_gemm.py; an entry point answers 1 (not served) where the build lacks the instructions,
// and oneDNN serves instead.
//
// Why: at decode's 1-64 rows a GEMM only streams its weight once, and oneDNN's (through
// torch's `_linear_pointwise`) spends ~18 us a call setting up before it does (a 16x16 GEMM
// takes 18.6 us), 7,600 calls in a `bench engine` turn; and at two threads the small GEMMs
// of this engine's layers (512 x 512, 512 x 1,024) ran only 1.3-1.6x faster than at one.
//
// Layout: W is packed once, at load (cpu_gemm.py), into AMX's B tiles: for each block of 16
// output columns, K/32 tiles of 16 rows of 16 column pairs (W[n][k], W[n][k + 1], k even),
// 1 KiB each, one block's tiles in a row. Groups of four blocks (64 columns) are shared evenly
// among the threads; a group's four weight tiles of a K step go with one tile of x.

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_vector.h"

namespace {

using namespace halfmoon;

// `each(std::integral_constant<int, B>{})` for the `blocks` (1-4) of 16 columns in a group of
// 64: the kernels take a group's block count at compile time.
template <typename Each>
inline void with_blocks(int64_t blocks, Each&& each) {
  switch (blocks) {
    case 1: each(std::integral_constant<int, 1>{}); break;
    case 2: each(std::integral_constant<int, 2>{}); break;
    case 3: each(std::integral_constant<int, 3>{}); break;
    default: each(std::integral_constant<int, 4>{}); break;
  }
}

#if defined(HALFMOON_AMX)
constexpr int64_t kTileWords = 16 * 16;  // a B tile: 16 rows of 16 bf16 pairs (32-bit words)

// The fp32 tile `acc` (16 x 16) as bf16 to `rows` rows of `out`, `n` apart.
inline void store_block(const float* acc, int64_t rows, int64_t n, uint16_t* out) {
  for (int64_t r = 0; r < rows; ++r) store16(out + r * n, _mm512_load_ps(acc + r * 16));
}

// Every row tile of x (16 rows each, `k` apart) times B blocks of 16 columns each (their
// weight tiles `block_words` apart), into tiles 0 .. B-1: each x tile (through tile 4) is
// loaded once for all B blocks; the weights through tiles 5, 6, 7 (and 5 again). The first
// row tile reads the blocks' weights from memory, the next ones from the core's cache.
template <int B>
void column_group(const uint16_t* x, int64_t m, int64_t k, const uint32_t* weights,
                  int64_t block_words, int64_t n, uint16_t* out) {
  const int64_t stride = k * 2;
  alignas(64) float acc[16 * 16];
  for (int64_t row0 = 0; row0 < m; row0 += 16) {
    const uint16_t* a = x + row0 * k;
    _tile_zero(0);
    if constexpr (B > 1) _tile_zero(1);
    if constexpr (B > 2) _tile_zero(2);
    if constexpr (B > 3) _tile_zero(3);
    for (int64_t step = 0; step < k / 32; ++step) {
      const uint32_t* w = weights + step * kTileWords;
      _tile_loadd(4, a + step * 32, stride);
      _tile_loadd(5, w, 64);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (B > 1) {
        _tile_loadd(6, w + block_words, 64);
        _tile_dpbf16ps(1, 4, 6);
      }
      if constexpr (B > 2) {
        _tile_loadd(7, w + 2 * block_words, 64);
        _tile_dpbf16ps(2, 4, 7);
      }
      if constexpr (B > 3) {
        _tile_loadd(5, w + 3 * block_words, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    const int64_t rows = std::min<int64_t>(16, m - row0);
    uint16_t* out_rows = out + row0 * n;
    _tile_stored(0, acc, 64);
    store_block(acc, rows, n, out_rows);
    if constexpr (B > 1) {
      _tile_stored(1, acc, 64);
      store_block(acc, rows, n, out_rows + 16);
    }
    if constexpr (B > 2) {
      _tile_stored(2, acc, 64);
      store_block(acc, rows, n, out_rows + 32);
    }
    if constexpr (B > 3) {
      _tile_stored(3, acc, 64);
      store_block(acc, rows, n, out_rows + 48);
    }
  }
}

void gemm(const uint16_t* x, int64_t m, int64_t k, const uint32_t* packed, int64_t n,
          int num_threads, uint16_t* out) {
  // Tiles read 16 rows: a last partial row tile reads from a zero-padded copy of x.
  std::vector<uint16_t> padded;
  if (m % 16 != 0) {
    padded.assign((m + 15) / 16 * 16 * k, 0);
    std::memcpy(padded.data(), x, m * k * sizeof(uint16_t));
    x = padded.data();
  }
  const int64_t blocks = n / 16, block_words = (k / 32) * kTileWords;
  const int64_t groups = (blocks + 3) / 4;  // of 4 blocks (64 columns), the last maybe fewer
#pragma omp parallel num_threads(num_threads)
  {
    const ThreadTiles tiles;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const uint32_t* weights = packed + 4 * g * block_words;
      uint16_t* out_group = out + 64 * g;
      with_blocks(std::min<int64_t>(4, blocks - 4 * g), [&](auto b) {
        column_group<decltype(b)::value>(x, m, k, weights, block_words, n, out_group);
      });
    }
  }
}
#endif

#if defined(__AVX512F__)
// fp32 on AVX-512 FMA: W packed at load into blocks of 16 output columns, each [K][16]
// (K * 16 floats, one block after the other). oneDNN's prepacked fp32 GEMM ran this engine's
// layers at 55-111 GFLOP/s at 16-64 rows, where it reaches ~196 at 2,048; this one is 1.1-1.3x
// faster at 1-64 rows. Threads share groups of up to four blocks, as above; a group is swept
// `kDepth` K steps at a time, so that its 32 KiB of weights for those steps, read from memory
// by the first tile of rows, stay in L1 for the next ones. Each row's sums run in K order
// whatever the row count: a row's result does not depend on the batch it came in.
constexpr int64_t kDepth = 128;
constexpr int kTileRows = 6;  // 6 rows x 4 blocks: 24 of the 32 vector registers hold sums

// Rows [0, R) of x (`k` apart) times blocks [0, B) over K steps [k0, k1), summed into `out`
// (`n` apart; set, not summed, when `first`).
template <int R, int B>
void f32_tile(const float* x, int64_t k, int64_t k0, int64_t k1, const float* w,
              int64_t block_floats, bool first, int64_t n, float* out) {
  __m512 acc[R][B];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b)
      acc[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * n + b * 16);
  for (int64_t step = k0; step < k1; ++step) {
    __m512 weights[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) weights[b] = _mm512_loadu_ps(w + b * block_floats + step * 16);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * k + step]);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(xr, weights[b], acc[r][b]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + r * n + b * 16, acc[r][b]);
}

template <int B>
void f32_group(const float* x, int64_t m, int64_t k, const float* w, int64_t n, float* out) {
  const int64_t block_floats = k * 16;
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t k1 = std::min(k, k0 + kDepth);
    for (int64_t row0 = 0; row0 < m; row0 += kTileRows) {
      const float* rows = x + row0 * k;
      float* out_rows = out + row0 * n;
      switch (std::min<int64_t>(kTileRows, m - row0)) {
#define HALFMOON_ROWS(R) \
  case R: f32_tile<R, B>(rows, k, k0, k1, w, block_floats, k0 == 0, n, out_rows); break;
        HALFMOON_ROWS(1) HALFMOON_ROWS(2) HALFMOON_ROWS(3) HALFMOON_ROWS(4) HALFMOON_ROWS(5)
        default: f32_tile<6, B>(rows, k, k0, k1, w, block_floats, k0 == 0, n, out_rows);
#undef HALFMOON_ROWS
      }
    }
  }
}

void gemm_f32(const float* x, int64_t m, int64_t k, const float* packed, int64_t n,
              int num_threads, float* out) {
  const int64_t blocks = n / 16, groups = (blocks + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t g = 0; g < groups; ++g) {
    const float* w = packed + 4 * g * k * 16;
    float* out_group = out + 64 * g;
    with_blocks(std::min<int64_t>(4, blocks - 4 * g),
                [&](auto b) { f32_group<decltype(b)::value>(x, m, k, w, n, out_group); });
  }
}
#endif

}  // namespace

extern "C" {

// 1 when this build can serve (AMX compiled in and granted by the kernel), else 0.
int amx_ready() { return halfmoon::amx_usable(); }

// out = x W^T for x [m, k] and W packed as above ([n / 16][k / 32][16][16][2]), all bf16,
// contiguous; k a multiple of 32, n of 16. 0 when done; 1 when not served (nothing written).
int gemm_bf16(const void* x, int64_t m, int64_t k, const void* packed, int64_t n,
              int num_threads, void* out) {
#if defined(HALFMOON_AMX)
  if (k % 32 != 0 || n % 16 != 0 || !amx_permitted()) return 1;
  gemm(static_cast<const uint16_t*>(x), m, k, static_cast<const uint32_t*>(packed), n,
       num_threads, static_cast<uint16_t*>(out));
  return 0;
#else
  return 1;
#endif
}

// 1 when this build has the fp32 GEMM (AVX-512), else 0.
int f32_ready() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// out = x W^T for x [m, k] and W packed as above ([n / 16][k][16]), all fp32, contiguous; n a
// multiple of 16. 0 when done; 1 when not served (nothing written).
int gemm_fp32(const void* x, int64_t m, int64_t k, const void* packed, int64_t n,
              int num_threads, void* out) {
#if defined(__AVX512F__)
  if (n % 16 != 0) return 1;
  gemm_f32(static_cast<const float*>(x), m, k, static_cast<const float*>(packed), n,
           num_threads, static_cast<float*>(out));
  return 0;
#else
  return 1;
#endif
}
}
