// y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m: streams w once (memory-bound verify passes).
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight row at a time against M input rows, U accumulators per row along K.
template <int M, int U>
void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * U <= K; k += 8 * U)
      for (int u = 0; u < U; ++u) {
        __m256 wv = _mm256_loadu_ps(wr + k + 8 * u);
        for (int m = 0; m < M; ++m)
          acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * u), acc[m][u]);
      }
    for (int m = 0; m < M; ++m) {
      __m256 t = acc[m][0];
      for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, acc[m][u]);
      float s = hsum(t);
      for (int64_t kk = k; kk < K; ++kk) s += x[m * K + kk] * wr[kk];
      y[m * N + n] = s;
    }
  }
}

using Fn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

Fn pick(int64_t m) {
  switch (m) {
    case 1: return block<1, 2>;
    case 2: return block<2, 2>;
    case 3: return block<3, 2>;
    case 4: return block<4, 2>;
    case 5: return block<5, 2>;
    case 6: return block<6, 2>;
    case 7: return block<7, 2>;
    case 8: return block<8, 2>;
    default: return nullptr;
  }
}

struct Work {
  Fn fn;
  const float* x;
  const float* w;
  float* y;
  int64_t K, N, chunk, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      fn(x, w, y, K, N, c * chunk, std::min(N, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("rows_matmul: x [M, K] and w [N, K] expected");
  Fn fn = pick(xd[0]);
  if (fn == nullptr) return ffi::Error::InvalidArgument("rows_matmul: 1 to 8 rows");
  auto work = std::make_shared<Work>();
  work->fn = fn;
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->K = xd[1];
  work->N = wd[0];
  work->chunk = 64;
  work->chunks = (work->N + work->chunk - 1) / work->chunk;
  int64_t helpers = std::min<int64_t>(pool.num_threads(), work->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowsMatmul, RowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
