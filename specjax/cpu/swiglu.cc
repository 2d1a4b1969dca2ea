// silu(gate) * up of rows h [M, 2F] (gate then up, as the fused gate/up product returns them)
// -> [M, F]: a Llama MLP's activation.
//
// XLA:CPU evaluates the fused sigmoid at ~1 ns per value (~14 us for a 10-row verify's 15360, 30
// times a pass); this runs 16 lanes at a time with `vexp`. sigmoid(g) is 1 / (1 + e) for g >= 0
// and e / (1 + e) below, e = exp(-|g|) <= 1, so no exponential overflows; each value is computed
// alone, so a row's result does not depend on the other rows.
#include "simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

#if defined(__AVX512F__)
inline Vec vabs(Vec x) { return _mm512_abs_ps(x); }
inline Vec vselect_nonneg(Vec g, Vec a, Vec b) {  // a where g >= 0, else b
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
#else
inline Vec vabs(Vec x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
inline Vec vselect_nonneg(Vec g, Vec a, Vec b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
#endif

inline Vec vswiglu(Vec g, Vec u) {
  const Vec e = vexp(vsub(vzero(), vabs(g)));
  const Vec sig = vdiv(vselect_nonneg(g, vset1(1.0f), e), vadd(vset1(1.0f), e));
  return vmul(vmul(g, sig), u);
}

void rows(const float* h, float* y, int64_t F, int64_t r0, int64_t r1) {
  alignas(64) float g[kLanes], u[kLanes], o[kLanes];
  for (int64_t r = r0; r < r1; ++r) {
    const float* gate = h + r * 2 * F;
    const float* up = gate + F;
    float* out = y + r * F;
    int64_t j = 0;
    for (; j + kLanes <= F; j += kLanes) vstore(out + j, vswiglu(vload(gate + j), vload(up + j)));
    if (j < F) {  // the tail through a zero-padded vector
      const int64_t n = F - j;
      std::fill(g, g + kLanes, 0.0f);
      std::fill(u, u + kLanes, 0.0f);
      std::copy(gate + j, gate + F, g);
      std::copy(up + j, up + F, u);
      vstore(o, vswiglu(vload(g), vload(u)));
      std::copy(o, o + n, out + j);
    }
  }
}

ffi::Error Swiglu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::ResultBuffer<ffi::F32> y) {
  auto hd = h.dimensions(), yd = y->dimensions();
  if (hd.size() != 2 || yd.size() != 2 || yd[0] != hd[0] || hd[1] != 2 * yd[1])
    return ffi::Error::InvalidArgument("swiglu: expected h [M, 2F] and y [M, F]");
  const int64_t M = hd[0], F = yd[1];
  const float* hp = h.typed_data();
  float* yp = y->typed_data();
  // Rows in tasks of ~16k values: a decode's single row stays on the calling thread.
  const int64_t per = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(F, 1));
  const int64_t tasks = (M + per - 1) / per;
  if (tasks <= 1) {
    rows(hp, yp, F, 0, M);
    return ffi::Error::Success();
  }
  parallel_for(pool, tasks,
               [=](int64_t t) { rows(hp, yp, F, t * per, std::min(M, (t + 1) * per)); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSwiglu, Swiglu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
