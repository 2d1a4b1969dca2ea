// y[m, n] = sum_k x[m, k] * w[n, k] for the few rows m of a decode, verify or draft pass.
//
// Such passes are bound by streaming the weight from memory once; XLA:CPU's GEMM packs the
// weight first and turns compute-bound from a few rows on. Here a block of R weight rows is
// loaded once per vector of k and multiplied into up to 14 input rows (8 with AVX2) from
// registers, and the next block's rows are prefetched so the memory stream keeps going while
// the FMAs run. The prefetch fills L2, not L1: a core has few L1 miss buffers, and prefetches
// that wait for them stall the loop, so compute and streaming took turns (with L1 prefetch a
// decode step's MLPs streamed at ~27 GB/s and 5 rows cost 1.3x one row; into L2, ~34 GB/s and
// 1.1x on the AMD EPYC, README "What one verify pass costs").
//
// Every output element is computed by the same sequence of operations whatever M, the block
// or the thread split: a row's result does not depend on how many rows share the pass. The
// weight is float32 or IEEE half (W = uint16_t), widened exactly in registers: half the bytes to
// stream, and the same result as the float32 kernel given the widened weight.
#include "simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

// Rows [n0, n1) of y for M input rows, R weight rows per register block.
template <typename W, int M, int R>
void block(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0,
           int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    Vec acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = vzero();
    const W* wn = w + n * K;
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      Vec wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = vload(wn + r * K + k);
        prefetch_l2(wn + (r + R) * K + k);
      }
      for (int m = 0; m < M; ++m) {
        Vec xv = vload(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
      }
    }
    // The R * M lane sums; with AVX-512 16 at a time where there are at least 8 (a last group
    // padded with zeros), which cuts the instructions of a many-row block's sums by about 2/3.
    constexpr int kSums = R * M, kPadded = (kSums + 15) / 16 * 16;
    Vec all[kPadded];
    alignas(64) float sums[kPadded];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) all[r * M + m] = acc[r][m];
    int i = 0;
#if defined(__AVX512F__)
    for (int j = kSums; j < kPadded; ++j) all[j] = vzero();
    for (; i + 8 <= kSums; i += 16) vsum16(all + i, sums + i);
#endif
    for (; i < kSums; ++i) sums[i] = vsum(all[i]);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        float s = sums[r * M + m];
        for (int64_t kk = k; kk < K; ++kk)
          s = std::fma(x[m * K + kk], to_float(wn[r * K + kk]), s);
        y[m * N + n + r] = s;
      }
  }
  if (n < n1) block<W, M, 1>(x, w, y, K, N, n, n1);
}

template <typename W>
using BlockFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t);

// Register blocks chosen so R * M accumulators, R weight vectors and one x vector fit in the
// register file (16 registers with AVX2, 32 with AVX-512): up to kPassRows input rows share one
// pass over the weight, so a verify of up to that many rows streams it once. (With 15 or 16 rows
// a one-register block waits on its loads; two passes of 8 rows are faster.)
#if defined(__AVX512F__)
constexpr int64_t kPassRows = 14;
#else
constexpr int64_t kPassRows = 8;
#endif

template <typename W>
BlockFn<W> pick(int64_t m) {
#if defined(__AVX512F__)
  static constexpr BlockFn<W> fns[] = {
      block<W, 1, 4>,  block<W, 2, 4>,  block<W, 3, 4>,  block<W, 4, 4>,
      block<W, 5, 4>,  block<W, 6, 4>,  block<W, 7, 3>,  block<W, 8, 3>,
      block<W, 9, 2>,  block<W, 10, 2>, block<W, 11, 2>, block<W, 12, 2>,
      block<W, 13, 2>, block<W, 14, 2>};
#else
  static constexpr BlockFn<W> fns[] = {block<W, 1, 4>, block<W, 2, 4>, block<W, 3, 3>,
                                       block<W, 4, 2>, block<W, 5, 2>, block<W, 6, 2>,
                                       block<W, 7, 1>, block<W, 8, 1>};
#endif
  return fns[m - 1];
}

// Output rows in chunks of 96 (a multiple of every R above); input rows in as few passes of at
// most kPassRows as possible, of equal size, the later passes reading the chunk's weight rows
// from cache.
template <ffi::DataType WT>
ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  using W = ffi::NativeType<WT>;
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("rows_matmul: expected x [M, K] and w [N, K]");
  const float* xp = x.typed_data();
  const W* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t M = xd[0], K = xd[1], N = wd[0], chunk = 96;
  if (M == 0 || N == 0) return ffi::Error::Success();
  parallel_for(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    const int64_t passes = (M + kPassRows - 1) / kPassRows;
    for (int64_t p = 0, m0 = 0; p < passes; ++p) {
      int64_t rows = (M - m0) / (passes - p);  // what is left, shared by the passes left
      pick<W>(rows)(xp + m0 * K, wp, yp + m0 * N, K, N, n0, n1);
      m0 += rows;
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowsMatmul, RowsMatmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowsMatmulF16, RowsMatmul<ffi::F16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
