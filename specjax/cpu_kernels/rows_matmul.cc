// y[m, n] = sum_k x[m, k] * w[n, k] for the few rows m of a decode, verify or draft pass.
//
// Such passes are bound by streaming the weight from memory once; XLA:CPU's GEMM packs the
// weight first and turns compute-bound from a few rows on. Here a block of R weight rows is
// loaded once per vector of k and multiplied into up to 8 input rows from registers, and the
// next block's rows are prefetched so the memory stream keeps going while the FMAs run.
//
// Every output element is computed by the same sequence of operations whatever M, the block
// or the thread split: a row's result does not depend on how many rows share the pass.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#error "rows_matmul needs AVX2 and FMA, or AVX-512"
#endif

// Rows [n0, n1) of y for M input rows, R weight rows per register block.
template <int M, int R>
void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0,
           int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    Vec acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = vzero();
    const float* wn = w + n * K;
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      Vec wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = vload(wn + r * K + k);
        _mm_prefetch(reinterpret_cast<const char*>(wn + (r + R) * K + k), _MM_HINT_T0);
      }
      for (int m = 0; m < M; ++m) {
        Vec xv = vload(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        float s = vsum(acc[r][m]);
        for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * wn[r * K + kk];
        y[m * N + n + r] = s;
      }
  }
  if (n < n1) block<M, 1>(x, w, y, K, N, n, n1);
}

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

// Register blocks chosen so R * M accumulators, R weight vectors and one x vector fit in the
// register file (16 registers with AVX2, 32 with AVX-512).
BlockFn pick(int64_t m) {
#if defined(__AVX512F__)
  static constexpr BlockFn fns[] = {block<1, 4>, block<2, 4>, block<3, 4>, block<4, 4>,
                                    block<5, 4>, block<6, 4>, block<7, 3>, block<8, 3>};
#else
  static constexpr BlockFn fns[] = {block<1, 4>, block<2, 4>, block<3, 3>, block<4, 2>,
                                    block<5, 2>, block<6, 2>, block<7, 1>, block<8, 1>};
#endif
  return fns[m - 1];
}

struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N, chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Output rows in chunks; input rows 8 at a time, the later groups reading the chunk's weight
  // rows from cache.
  void run() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        int64_t rows = std::min<int64_t>(8, M - m0);
        pick(rows)(x + m0 * K, w, y + m0 * N, K, N, n0, n1);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("rows_matmul: expected x [M, K] and w [N, K]");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->M = xd[0];
  job->K = xd[1];
  job->N = wd[0];
  if (job->M == 0 || job->N == 0) return ffi::Error::Success();
  job->chunk = 96;  // a multiple of every R above
  job->chunks = (job->N + job->chunk - 1) / job->chunk;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), job->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->run(); });
  job->run();
  while (job->done.load(std::memory_order_acquire) < job->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowsMatmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
