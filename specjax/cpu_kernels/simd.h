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
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(Vec v) { return _mm512_reduce_max_ps(v); }
// kLanes IEEE half-precision values widened to float32 (exact).
inline Vec vload(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// out[j] = vsum(v[j]) for 16 vectors at once (AVX-512 only), bit for bit: the same pairing of
// lanes as _mm512_reduce_add_ps (i + i+8, then i + i+4, i + i+2, 0 + 1), but each level's adds
// serve several vectors, about a third of the instructions of 16 separate reductions.
inline void vsum16(const Vec* v, float* out) {
  Vec h[8], q[4], p[2];
  for (int j = 0; j < 8; ++j)  // [v2j lanes i + i+8 | v2j+1 lanes i + i+8]
    h[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int j = 0; j < 4; ++j)  // 128-bit quarter c: vector 4j+c's four partial sums
    q[j] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * j], h[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(h[2 * j], h[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int j = 0; j < 2; ++j)  // quarter c: two sums each of vectors 8j+c and 8j+4+c
    p[j] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * j], q[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_ps(q[2 * j], q[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  alignas(64) float t[16];  // quarter c: the sums of vectors c, 4+c, 8+c, 12+c
  _mm512_store_ps(t, _mm512_add_ps(_mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)),
                                   _mm512_shuffle_ps(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0))));
  for (int c = 0; c < 4; ++c)
    for (int g = 0; g < 4; ++g) out[4 * g + c] = t[4 * c + g];
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
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec vload(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
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

inline float to_float(float a) { return a; }
inline float to_float(uint16_t a) { return _cvtsh_ss(a); }  // IEEE half -> float32, exact

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
