// y[m, n] = sum_k x[m, k] * w[n, k] for the rows m of a decode, verify or draft pass (or more),
// the weight packed in panels of 32 rows: p[n / 32][k][n % 32] (specjax.cpu.matmul.pack_weight).
//
// Few-row passes are bound by streaming the weight from memory once. Each panel is one
// sequential stream; per k the kernel loads the panel's 32 weights (two AVX-512 vectors) and
// adds them times x[m, k], broadcast, into two accumulators per input row, for up to 14 rows
// from registers. Outputs accumulate in vector lanes, so there are no lane sums, and x comes in
// as broadcast loads: with the weight in cache the products ran at ~95% of the cores' FMA peak,
// where the row-major kernel this replaced (a dot product per weight row) ran at about half, and
// more of that arithmetic hides under the memory stream (README, "What one verify pass costs"). The
// stream is prefetched into L2 a few KB ahead (into L1 the prefetches wait on the core's few L1
// miss buffers).
//
// Every output is the sequential sum over k of fma(x[m, k], w[n, k], .), whatever M, the panel,
// the pass, the thread split or the instruction set: a row's result does not depend on how many
// rows share the pass. The weight is float32, IEEE half (W = uint16_t) or int8 with a float32
// scale per weight row (the sum times scale[n]), widened exactly in registers: a half or a
// quarter of the bytes to stream (draft networks' weights).
#include "simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

constexpr int64_t kPanel = 32;                     // weight rows per panel
constexpr int kGroup = 2;                          // vectors of a panel per pass over it
constexpr int kGroups = kPanel / kLanes / kGroup;  // 1 with AVX-512, 2 with AVX2
constexpr int64_t kAhead = 4096;                   // prefetch distance in the stream, bytes
// Rows per pass: 2 accumulators per row, 2 weight vectors and a broadcast in the register file
// (32 registers with AVX-512, 16 with AVX2).
#if defined(__AVX512F__)
constexpr int64_t kPassRows = 14;
#else
constexpr int64_t kPassRows = 6;
#endif

// Panels [q0, q1) of y for M input rows (times scale[n] if scale is not null).
template <typename W, int M>
void panels(const float* x, const W* p, const float* scale, float* y, int64_t K, int64_t N,
            int64_t q0, int64_t q1) {
  constexpr int64_t kBytes = kGroup * kLanes * sizeof(W);  // what one k reads of a group
  for (int64_t q = q0; q < q1; ++q) {
    for (int g = 0; g < kGroups; ++g) {
      Vec acc[kGroup][M];
      for (int j = 0; j < kGroup; ++j)
        for (int m = 0; m < M; ++m) acc[j][m] = vzero();
      const W* pw = p + q * K * kPanel + g * kGroup * kLanes;
      for (int64_t k = 0; k < K; ++k, pw += kPanel) {
        Vec w0 = vload(pw), w1 = vload(pw + kLanes);
        const char* ahead = reinterpret_cast<const char*>(pw) + kAhead;
        if (kBytes >= 64 || k % (64 / kBytes) == 0)  // a line per 64 bytes (int8: every other k)
          for (int64_t b = 0; b < std::max<int64_t>(kBytes, 64); b += 64) prefetch_l2(ahead + b);
        for (int m = 0; m < M; ++m) {
          Vec xv = vset1(x[m * K + k]);
          acc[0][m] = vfma(w0, xv, acc[0][m]);
          acc[1][m] = vfma(w1, xv, acc[1][m]);
        }
      }
      const int64_t n = q * kPanel + g * kGroup * kLanes;
      for (int j = 0; j < kGroup; ++j) {
        const int64_t nj = n + j * kLanes, valid = std::min<int64_t>(kLanes, N - nj);
        if (valid <= 0) break;
        if (scale != nullptr) {  // padded to whole panels
          const Vec sv = vload(scale + nj);
          for (int m = 0; m < M; ++m) acc[j][m] = vmul(acc[j][m], sv);
        }
        for (int m = 0; m < M; ++m) {
          if (valid == kLanes) {
            vstore(y + m * N + nj, acc[j][m]);
          } else {  // the padded last panel
            alignas(64) float t[kLanes];
            vstore(t, acc[j][m]);
            std::copy(t, t + valid, y + m * N + nj);
          }
        }
      }
    }
  }
}

template <typename W>
using PanelFn = void (*)(const float*, const W*, const float*, float*, int64_t, int64_t, int64_t,
                         int64_t);

template <typename W, int... Ms>
constexpr PanelFn<W> kFns[] = {panels<W, Ms>...};

template <typename W>
PanelFn<W> pick(int64_t m) {
#if defined(__AVX512F__)
  return kFns<W, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14>[m - 1];
#else
  return kFns<W, 1, 2, 3, 4, 5, 6>[m - 1];
#endif
}

// Outputs in chunks of 3 panels (96 rows) over the threads; input rows in as few passes of at
// most kPassRows as possible, of equal size, the later passes reading the chunk from cache.
template <ffi::DataType WT>
ffi::Error RowsMatmulScaled(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> p,
                            const float* scale, ffi::ResultBuffer<ffi::F32> y) {
  using W = ffi::NativeType<WT>;
  auto xd = x.dimensions(), pd = p.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[2] != kPanel || xd[1] != pd[1] ||
      yd[0] != xd[0] || yd[1] > pd[0] * kPanel || yd[1] <= (pd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "rows_matmul: expected x [M, K], panels [ceil(N / 32), K, 32] and y [M, N]");
  const float* xp = x.typed_data();
  const W* pp = p.typed_data();
  float* yp = y->typed_data();
  const int64_t M = xd[0], K = xd[1], N = yd[1], P = pd[0], chunk = 3;
  if (M == 0 || N == 0) return ffi::Error::Success();
  parallel_for(pool, (P + chunk - 1) / chunk, [=](int64_t c) {
    const int64_t q0 = c * chunk, q1 = std::min(P, q0 + chunk);
    const int64_t passes = (M + kPassRows - 1) / kPassRows;
    for (int64_t s = 0, m0 = 0; s < passes; ++s) {
      const int64_t rows = (M - m0) / (passes - s);  // what is left, shared by the passes left
      pick<W>(rows)(xp + m0 * K, pp, scale, yp + m0 * N, K, N, q0, q1);
      m0 += rows;
    }
  });
  return ffi::Error::Success();
}

template <ffi::DataType WT>
ffi::Error RowsMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> p,
                      ffi::ResultBuffer<ffi::F32> y) {
  return RowsMatmulScaled<WT>(pool, x, p, nullptr, y);
}

ffi::Error RowsMatmulS8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> p,
                        ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto sd = scale.dimensions(), pd = p.dimensions();
  if (sd.size() != 1 || pd.size() != 3 || sd[0] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("rows_matmul: expected scale [32 * panels]");
  return RowsMatmulScaled<ffi::S8>(pool, x, p, scale.typed_data(), y);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRowsMatmulS8, RowsMatmulS8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
