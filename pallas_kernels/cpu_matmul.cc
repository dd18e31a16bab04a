// y = x @ w on CPU, w packed in column panels at load time, as an XLA FFI handler (see
// cpu_matmul.py). y may take fewer columns than the panels hold: the first N.
//
// At decode batch sizes (a few to a few dozen rows) XLA:CPU's dots run at a third to two
// thirds of the CPU's matmul rate: they walk w [K, N] across rows N floats apart. Here w is
// stored as panels of 32 columns, [ceil(N / 32), K, 32], so one tile streams its panel
// front to back: 8 rows x 32 columns of accumulators in registers, one pass over k, each
// weight read once per 8 rows. Each output is one in-order sum over k, whatever the number
// of rows, so a row's result does not depend on the rest of the batch.
//
// Only a tile's first pass over a panel reads it from memory; while the later tiles compute
// from L2, they read the panel the thread will likely take next into L2. Without that, the
// weights' trip from DRAM and the FMAs took turns: over 111 MB of weights evicted from the
// caches, 32 rows took 7.7-8.3 ms against 6.2-7.4 with it (4.5 ms with the weights cached).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_parallel_for.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;      // columns per panel: two vectors of 16 floats
constexpr int64_t kTileRows = 8;    // rows per register tile: 8 x 2 accumulators
constexpr int64_t kBlockRows = 64;  // rows per work item: its x block stays in L2
constexpr int64_t kPrefetch = 16;   // k steps ahead (2 KB) in the panel
constexpr int64_t kLineFloats = 16;  // floats in a 64-byte cache line

using jaxserve::Load;
using jaxserve::Vec;

// y[r, 0:cols] = x[r, :] @ panel for r < kRows; cols < 32 only in the last panel. On the way,
// the `ahead_lines` (<= K) cache lines from `ahead` on are read into L2, one a k step.
template <int kRows>
void Tile(const float* x, int64_t K, const float* panel, float* y, int64_t N, int64_t cols,
          const float* ahead, int64_t ahead_lines) {
  Vec acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = Vec{};
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    __builtin_prefetch(w + kPrefetch * kPanel);
    __builtin_prefetch(w + kPrefetch * kPanel + 16);
    if (k < ahead_lines) __builtin_prefetch(ahead + k * kLineFloats, 0, 1);
    const Vec w0 = Load(w), w1 = Load(w + 16);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const float a = x[r * K + k];
      acc[r][0] += a * w0;
      acc[r][1] += a * w1;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float out[kPanel];
    std::memcpy(out, &acc[r][0], sizeof(Vec));
    std::memcpy(out + 16, &acc[r][1], sizeof(Vec));
    std::memcpy(y + r * N, out, sizeof(float) * cols);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t,
                       const float*, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, Tile<1>, Tile<2>, Tile<3>, Tile<4>,
                                         Tile<5>, Tile<6>, Tile<7>, Tile<8>};

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] ||
      wd[2] != kPanel || yd[0] != xd[0] || yd[1] > wd[0] * kPanel) {
    return ffi::Error::InvalidArgument("matmul: x [M, K], w [P, K, 32], y [M, N <= 32 P]");
  }
  const int64_t M = xd[0], K = xd[1], N = yd[1], panels = (N + kPanel - 1) / kPanel;
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* ys = y->typed_data();
  if (M == 0) return ffi::Error::Success();
  // One thread's time: the larger of its FMAs (about 32 flops a ns) and its weight reads
  // (about 8 bytes a ns).
  const double nanos = std::max(2.0 * M * K * N / 32, 4.0 * K * N / 8);
  const int64_t items = blocks * panels;
  // Threads take items in turn, so a thread's next item is most often `workers` on.
  const int64_t workers = jaxserve::Workers(pool, items, nanos);
  const int64_t panel_lines = K * kPanel / kLineFloats;
  jaxserve::ParallelFor(pool, items, nanos, [&](int64_t item) {
    const int64_t p = item % panels, m0 = item / panels * kBlockRows;
    const int64_t m1 = std::min(M, m0 + kBlockRows);
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    const int64_t next = item + workers;
    const float* next_panel = ws + next % panels * K * kPanel;
    for (int64_t m = m0, tile = 0; m < m1; m += kTileRows, ++tile) {
      // Tile t > 0 reads lines [(t - 1) K, t K) of the next panel.
      const int64_t first_line = std::max<int64_t>(tile - 1, 0) * K;
      const int64_t lines = tile == 0 || next >= items
                                ? 0 : std::clamp<int64_t>(panel_lines - first_line, 0, K);
      kTiles[std::min(kTileRows, m1 - m)](xs + m * K, K, ws + p * K * kPanel,
                                          ys + m * N + p * kPanel, N, cols,
                                          next_panel + first_line * kLineFloats, lines);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // w [P, K, 32], P >= N / 32
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
