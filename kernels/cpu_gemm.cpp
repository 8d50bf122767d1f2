// The linear layers' GEMMs for decode's few rows: out[M, N] = x[M, K] W^T, bf16 on AMX tiles
// (fp32 sums), and on vectors (AVX-512 or AVX2 FMA, below) fp32 and bf16 (widened to fp32 sums).
// Built and loaded by cpu_build.py, called by cpu_gemm.py; an entry point answers 1 (not
// served) where the build lacks the instructions, and oneDNN serves instead.
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
  for (int64_t r = 0; r < rows; ++r) vstore(out + r * n, _mm512_load_ps(acc + r * 16));
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

#if defined(HALFMOON_VEC)
// On vectors (AVX-512 or AVX2 FMA: cpu_vector.h), fp32 sums over a weight packed at load into
// blocks of 16 output columns, each [K][16] (K * 16 values, one block after the other), held in
// fp32 or in bf16 (widened as it is loaded: half the bytes a decode step streams). On AVX-512,
// oneDNN's prepacked fp32 GEMM ran this engine's layers at 55-111 GFLOP/s at 16-64 rows, where
// it reaches ~196 at 2,048; this one is 1.1-1.3x faster at 1-64 rows. Threads share groups of
// up to four blocks, as above; a group is swept `kDepth` K steps at a time (all of this engine's
// K), its weights for those steps (at most 512 KiB in fp32) read from memory by the first tile
// of rows and from L2 by the next ones: sweeps of 128 steps, to stay in L1, measured 1-20 %
// slower at 4-64 rows (Zen 4, AVX-512 and AVX2 alike). Each row's sums run in K order whatever
// the row count: a row's result does not depend on the batch it came in.
constexpr int64_t kDepth = 2048;
constexpr int kTileRows = 6;
constexpr int kBlockVectors = 16 / kLanes;  // vectors across a block's 16 columns: 1 or 2

// Rows [0, R) of x (`k` apart) times blocks [0, B) of W (fp32 or bf16, `block_values` apart)
// over K steps [k0, k1), summed into `out` (`ldo` apart; set, not summed, when `first`).
template <int R, int B, typename W>
void vec_tile(const float* x, int64_t k, int64_t k0, int64_t k1, const W* w,
              int64_t block_values, bool first, int64_t ldo, float* out) {
  constexpr int V = B * kBlockVectors;
  vfloat acc[R][V];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = first ? vzero() : vload(out + r * ldo + v * kLanes);
  for (int64_t step = k0; step < k1; ++step) {
    vfloat weights[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      weights[v] = vload(w + (v / kBlockVectors) * block_values + step * 16 +
                         (v % kBlockVectors) * kLanes);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const vfloat xr = vset(x[r * k + step]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = vfmadd(xr, weights[v], acc[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) vstore(out + r * ldo + v * kLanes, acc[r][v]);
}

// Blocks a tile of R rows sums at once: all B (up to 4) on AVX-512, 6 x 4 sums in its 32
// registers; on AVX2's 16, two blocks (four vectors) a row for one or two rows, else one.
template <int R, int B>
constexpr int tile_blocks() {
  if constexpr (HALFMOON_VEC == 512) return B;
  return std::min(B, R <= 2 ? 2 : 1);
}

// Rows [0, R) of x times the group's B blocks over K steps [k0, k1), `tile_blocks` at a time.
template <int R, int B, typename W>
inline void row_tile(const float* x, int64_t k, int64_t k0, int64_t k1, const W* w,
                     int64_t block_values, int64_t ldo, float* out) {
  constexpr int TB = tile_blocks<R, B>();
  int b0 = 0;
  for (; b0 + TB <= B; b0 += TB)
    vec_tile<R, TB>(x, k, k0, k1, w + b0 * block_values, block_values, k0 == 0, ldo,
                    out + b0 * 16);
  if constexpr (B % TB != 0)
    vec_tile<R, B % TB>(x, k, k0, k1, w + b0 * block_values, block_values, k0 == 0, ldo,
                        out + b0 * 16);
}

// x [m, k] (fp32) times a group's B blocks of W into out ([m][16 B], `ldo` apart), fp32.
template <int B, typename W>
void vec_group(const float* x, int64_t m, int64_t k, const W* w, int64_t ldo, float* out) {
  const int64_t block_values = k * 16;
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t k1 = std::min<int64_t>(k, k0 + kDepth);
    for (int64_t row0 = 0; row0 < m; row0 += kTileRows) {
      const float* rows = x + row0 * k;
      float* out_rows = out + row0 * ldo;
      switch (std::min<int64_t>(kTileRows, m - row0)) {
#define HALFMOON_ROWS(R) \
  case R: row_tile<R, B>(rows, k, k0, k1, w, block_values, ldo, out_rows); break;
        HALFMOON_ROWS(1) HALFMOON_ROWS(2) HALFMOON_ROWS(3) HALFMOON_ROWS(4) HALFMOON_ROWS(5)
        default: row_tile<6, B>(rows, k, k0, k1, w, block_values, ldo, out_rows);
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
                [&](auto b) { vec_group<decltype(b)::value>(x, m, k, w, n, out_group); });
  }
}

// bf16 x [m, k] times bf16 blocks: each thread widens `kChunkRows` rows of x at a time into
// fp32 (x is small beside W at decode's rows; at prefill's it is read once a chunk), sums its
// groups into fp32 and rounds each result once, as an fp32 matmul rounded to bf16.
constexpr int64_t kChunkRows = 240;

void gemm_bf16_vec(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                   int num_threads, uint16_t* out) {
  const int64_t blocks = n / 16, groups = (blocks + 3) / 4;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> rows(std::min(m, kChunkRows) * k), sums(std::min(m, kChunkRows) * 64);
    for (int64_t row0 = 0; row0 < m; row0 += kChunkRows) {
      const int64_t count = std::min(kChunkRows, m - row0);
      for (int64_t i = 0; i < count * k; ++i) rows[i] = bf16_to_float(x[row0 * k + i]);
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t width = std::min<int64_t>(4, blocks - 4 * g) * 16;
        with_blocks(width / 16, [&](auto b) {
          vec_group<decltype(b)::value>(rows.data(), count, k, packed + 4 * g * k * 16, 64,
                                        sums.data());
        });
        for (int64_t r = 0; r < count; ++r)
          for (int64_t c = 0; c < width; c += kLanes)
            vstore(out + (row0 + r) * n + 64 * g + c, vload(sums.data() + r * 64 + c));
      }
    }
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

// 1 when this build has the vector GEMMs (AVX-512 or AVX2 FMA: fp32, and bf16 widened), else 0.
int vec_ready() {
#if defined(HALFMOON_VEC)
  return 1;
#else
  return 0;
#endif
}

// out = x W^T for x [m, k] and W packed as above ([n / 16][k][16]), all fp32, contiguous; n a
// multiple of 16. 0 when done; 1 when not served (nothing written).
int gemm_fp32(const void* x, int64_t m, int64_t k, const void* packed, int64_t n,
              int num_threads, void* out) {
#if defined(HALFMOON_VEC)
  if (n % 16 != 0) return 1;
  gemm_f32(static_cast<const float*>(x), m, k, static_cast<const float*>(packed), n,
           num_threads, static_cast<float*>(out));
  return 0;
#else
  return 1;
#endif
}

// The same for bf16 x, W (packed as fp32's, [n / 16][k][16]) and out: fp32 sums, each result
// rounded once. 0 when done; 1 when not served (nothing written).
int gemm_bf16_blocks(const void* x, int64_t m, int64_t k, const void* packed, int64_t n,
                     int num_threads, void* out) {
#if defined(HALFMOON_VEC)
  if (n % 16 != 0) return 1;
  gemm_bf16_vec(static_cast<const uint16_t*>(x), m, k, static_cast<const uint16_t*>(packed), n,
                num_threads, static_cast<uint16_t*>(out));
  return 0;
#else
  return 1;
#endif
}
}
