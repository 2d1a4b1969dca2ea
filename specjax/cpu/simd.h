// SIMD vectors (AVX-512, else AVX2 + FMA, chosen at compile time) and a task loop over XLA's
// intra-op threads, shared by specjax's CPU kernels.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace specjax_cpu {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float a) { return _mm512_set1_ps(a); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vhmax(Vec v) { return _mm512_reduce_max_ps(v); }
// kLanes IEEE half-precision values widened to float32 (exact).
inline Vec vload(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// kLanes int8 values widened to float32 (exact).
inline Vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vload(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline Vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float vhmax(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#error "specjax's CPU kernels need AVX2, FMA and F16C, or AVX-512"
#endif

#if defined(__AVX512F__)
// y where x >= bound, else 0.
inline Vec vkeep_at_least(Vec y, Vec x, float bound) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), _CMP_GE_OQ), y);
}

inline Vec vexp2i(__m512i n) {  // 2^n for integer n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}
inline __m512i vround_int(Vec x) { return _mm512_cvtps_epi32(_mm512_roundscale_ps(x, 0)); }
inline Vec vfloat(__m512i n) { return _mm512_cvtepi32_ps(n); }
// Whether some lane of x is above bound.
inline bool vany_above(Vec x, float bound) {
  return _mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), _CMP_GT_OQ) != 0;
}
#else
inline Vec vkeep_at_least(Vec y, Vec x, float bound) {
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(bound), _CMP_GE_OQ), y);
}

inline Vec vexp2i(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
inline __m256i vround_int(Vec x) {
  return _mm256_cvtps_epi32(_mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline Vec vfloat(__m256i n) { return _mm256_cvtepi32_ps(n); }
inline bool vany_above(Vec x, float bound) {
  return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(bound), _CMP_GT_OQ)) != 0;
}
#endif

// e^x for x <= 0 (a softmax's shifted scores): 2^n * p(r), r = x - n ln 2, |r| <= ln 2 / 2,
// p the degree-6 Taylor polynomial (relative error < 2e-7); exactly 0 below -87 (and for -inf).
inline Vec vexp(Vec x) {
  Vec xc = vmax(x, vset1(-87.0f));
  Vec n = vfloat(vround_int(vmul(xc, vset1(1.44269504088896341f))));
  Vec r = vfma(n, vset1(-0.693145751953125f), xc);
  r = vfma(n, vset1(-1.428606765330187e-06f), r);
  Vec p = vset1(1.0f / 720);
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return vkeep_at_least(vmul(p, vexp2i(vround_int(n))), x, -87.0f);
}

template <typename T>
inline void prefetch(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// The same into L2 only, for streams read a while later (a weight's next block).
template <typename T>
inline void prefetch_l2(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// body(task) for every task in [0, tasks), on the calling thread and on as many of the pool's
// threads as there are tasks; returns once every task is done. A helper that starts after the
// tasks ran out returns at once, so `body` must keep what it reads alive (capture shared_ptrs).
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t tasks, Body body) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, tasks, body] {
    for (int64_t c; (c = counters->next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      body(c);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < tasks) _mm_pause();
}

}  // namespace specjax_cpu
