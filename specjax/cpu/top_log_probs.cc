// The k largest entries of each row of x [R, V] and their log-softmax values: a draft's k best
// tokens and their log-probabilities (EAGLE's tree expansion), in one read of the row.
//
// XLA:CPU runs log_softmax as two library reductions and top_k as a sort-based custom call:
// ~28 us for 3 rows of a 4096-token draft vocabulary, five times per EAGLE-2 step. Here a row
// is read three times from L1 (max, sum of exponentials, the top k), ~2 us. Ties go to the lower
// index, as in lax.top_k; log-probabilities are (x - max) - log(sum exp(x - max)), as in
// jax.nn.log_softmax, with the exponential of `vexp` (relative error < 2e-7).
#include <cmath>
#include <limits>

#include "simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

void row_top(const float* x, int64_t V, int64_t k, float* logp, int32_t* ids) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t whole = V / kLanes * kLanes;
  Vec mv = vset1(neg_inf);
  for (int64_t j = 0; j < whole; j += kLanes) mv = vmax(mv, vload(x + j));
  float m = vhmax(mv);
  for (int64_t j = whole; j < V; ++j) m = std::max(m, x[j]);

  alignas(64) float lanes[kLanes];
  Vec sv = vzero();
  const Vec mb = vset1(m);
  for (int64_t j = 0; j < whole; j += kLanes) sv = vadd(sv, vexp(vsub(vload(x + j), mb)));
  vstore(lanes, sv);
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += lanes[i];
  for (int64_t j = whole; j < V; ++j) {
    vstore(lanes, vexp(vset1(x[j] - m)));
    sum += lanes[0];
  }

  // best[0 .. n) in descending order, an equal value after the earlier index.
  int64_t n = 0;
  auto offer = [&](float v, int64_t j) {
    if (n == k && !(v > logp[k - 1])) return;
    int64_t pos = n < k ? n++ : k - 1;
    for (; pos > 0 && v > logp[pos - 1]; --pos) {
      logp[pos] = logp[pos - 1];
      ids[pos] = ids[pos - 1];
    }
    logp[pos] = v;
    ids[pos] = static_cast<int32_t>(j);
  };
  for (int64_t j = 0; j < whole; j += kLanes) {
    if (n == k && !vany_above(vload(x + j), logp[k - 1])) continue;  // most blocks
    for (int64_t i = j; i < j + kLanes; ++i) offer(x[i], i);
  }
  for (int64_t j = whole; j < V; ++j) offer(x[j], j);
  const float log_sum = std::log(sum);
  for (int64_t i = 0; i < k; ++i) logp[i] = (logp[i] - m) - log_sum;
}

ffi::Error TopLogProbs(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> logp,
                       ffi::ResultBuffer<ffi::S32> ids) {
  auto xd = x.dimensions(), ld = logp->dimensions(), id = ids->dimensions();
  if (xd.size() != 2 || ld.size() != 2 || id.size() != 2 || ld[0] != xd[0] || id[0] != xd[0] ||
      ld[1] != id[1] || ld[1] < 1 || ld[1] > xd[1])
    return ffi::Error::InvalidArgument(
        "top_log_probs: expected x [R, V] and outputs [R, k] with 1 <= k <= V");
  const int64_t R = xd[0], V = xd[1], k = ld[1];
  for (int64_t r = 0; r < R; ++r)
    row_top(x.typed_data() + r * V, V, k, logp->typed_data() + r * k, ids->typed_data() + r * k);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxTopLogProbs, TopLogProbs,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
