// Tree-masked attention of a few query rows over a paged KV cache, on CPU.
//
// out[b, t, h] = softmax(scale * q[b, t, h] . K^T) V over the keys mask[b, t] shows: the cache
// slots of sequence b's pages (block_tables[b]) followed by the Tn new rows of a pass that has not
// written them yet (k_new / v_new [B, Tn, KVH, D], Tn may be 0). Head h reads kv head h / G.
//
// XLA's version gathers every page into a copy, concatenates the new rows, masks, and runs the
// softmax over every slot; here the query rows of a kv head read the keys they see straight from
// the pages, a few rows per pass over the keys. A row's keys come in slot order, then the new
// rows in order, and its sums run over them in one fixed way, so its output is the same whatever
// the other rows: a one-token decode (its key already written) and a node of a verified tree
// (its ancestors' keys among the new rows) compute the same attention bit for bit.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_cpu;

#if defined(__AVX512F__)
// r[j] = the sum of a[j]'s lanes, the same pairing for every j.
inline Vec transpose_sum(Vec* a) {
  Vec b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  Vec e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // Lane 4q + k of e holds a[4k + q].
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

#else
inline Vec transpose_sum(Vec* a) {
  Vec b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  Vec e = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
  // Lane 4h + k of e holds a[2k + h] (h: 128-bit half).
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return _mm256_permutevar8x32_ps(e, order);
}

#endif

// Head vectors are taken 64 floats (kVecs registers) at a time; head_dim is a multiple of 64.
constexpr int kVecs = 64 / kLanes;
// Query rows per chunk: their kVecs accumulators each stay in registers.
#if defined(__AVX512F__)
constexpr int kChunkRows = 6;
#else
constexpr int kChunkRows = 1;
#endif
const float kZeroRow[256] = {};  // stands in for the missing keys of a last group

struct Job {
  const float *q, *k, *v, *k_new, *v_new;
  const bool* mask;
  const int32_t* table;
  float* out;
  int64_t B, T, H, D, KVH, P, ps, NP, Tn, S;  // S = NP * ps + Tn mask columns
  int64_t chunks;                             // per (sequence, kv head)
  float scale;

  // Per sequence b, the mask columns some query sees, in order (key_col[seq_start[b] ..
  // seq_start[b + 1]]), of which the first seq_common[b] every query sees; row_end[b * T + t]:
  // 1 + the index among them of the last one query row t sees (0: none). key_off / key_new:
  // where each such key sits in kv head 0's pool (or among the new rows, key_new), found once
  // per call rather than once per chunk.
  std::vector<int64_t> key_col, seq_start, seq_common, row_end, key_off;
  std::vector<uint8_t> key_new;

  void index();
  void chunk(int64_t task, std::vector<const float*>& keys, std::vector<const float*>& vals,
             std::vector<float>& sc) const;
};

void Job::index() {
  key_col.clear();
  key_off.clear();
  key_new.clear();
  seq_start.assign(1, 0);
  seq_common.clear();
  row_end.assign(B * T, 0);
  std::vector<uint8_t> any(S), all(S);
  std::vector<int64_t> key_of(S);
  for (int64_t b = 0; b < B; ++b) {
    const bool* m = mask + b * T * S;
    std::fill(any.begin(), any.end(), 0);
    std::fill(all.begin(), all.end(), 1);
    for (int64_t t = 0; t < T; ++t) {  // row by row: the mask is read in memory order
      const bool* row = m + t * S;
      for (int64_t col = 0; col < S; ++col) {
        any[col] |= row[col];
        all[col] &= row[col];
      }
    }
    int64_t common = 0, start = static_cast<int64_t>(key_col.size());
    for (int64_t col = 0; col < S; ++col) {
      if (!any[col]) continue;
      if (all[col] && common == static_cast<int64_t>(key_col.size()) - start) ++common;
      key_of[col] = static_cast<int64_t>(key_col.size()) - start;
      key_col.push_back(col);
      if (col < NP * ps) {
        int64_t page = std::min<int64_t>(std::max<int32_t>(table[b * NP + col / ps], 0), P - 1);
        key_off.push_back((page * ps + col % ps) * D);
        key_new.push_back(0);
      } else {
        key_off.push_back((b * Tn + (col - NP * ps)) * KVH * D);
        key_new.push_back(1);
      }
    }
    seq_start.push_back(static_cast<int64_t>(key_col.size()));
    seq_common.push_back(common);
    for (int64_t t = 0; t < T; ++t) {
      const bool* row = m + t * S;
      for (int64_t col = S - 1; col >= 0; --col)
        if (row[col]) {
          row_end[b * T + t] = key_of[col] + 1;
          break;
        }
    }
  }
}

// Query rows of one sequence and kv head are taken kChunkRows at a time (rows ordered (t, group
// member), so a chunk's rows share few distinct masks). The chunk's keys are those any of its
// rows sees, read once per chunk; a key a row does not see weighs exactly 0 in that row's sums,
// which run in key order (one FMA chain per row and vector, one scalar chain for the softmax
// denominator), so each row's result is the one it would get alone.
void Job::chunk(int64_t task, std::vector<const float*>& keys, std::vector<const float*>& vals,
                std::vector<float>& sc) const {
  const int64_t G = H / KVH, R = T * G;
  const int64_t c = task % chunks, rest = task / chunks;
  const int64_t kvh = rest % KVH, b = rest / KVH;
  const int64_t r0 = c * kChunkRows, rc = std::min<int64_t>(kChunkRows, R - r0);
  const bool* m = mask + b * T * S;

  // This sequence's keys (`index`), as pointers into this kv head's pages and new rows, up to
  // the last one a row of the chunk sees: the keys after it weigh 0 in every row's sums, so
  // leaving them out changes no result (a causal prefill's early rows read only their prefix).
  const int64_t lo = seq_start[b], common = seq_common[b];
  const int64_t* col_of = key_col.data() + lo;
  const int64_t* off_of = key_off.data() + lo;
  const uint8_t* new_of = key_new.data() + lo;
  int64_t n = common;
  for (int64_t rr = 0; rr < rc; ++rr) n = std::max(n, row_end[b * T + (r0 + rr) / G]);
  keys.resize(n);
  vals.resize(n);
  const int64_t pool = kvh * P * ps * D;
  const float *kp = k + pool, *vp = v + pool, *kn = k_new + kvh * D, *vn = v_new + kvh * D;
  for (int64_t j = 0; j < n; ++j) {
    keys[j] = (new_of[j] ? kn : kp) + off_of[j];
    vals[j] = (new_of[j] ? vn : vp) + off_of[j];
  }
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = n; j < padded; ++j) keys.push_back(kZeroRow);
  sc.resize(kChunkRows * padded);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Scores kLanes keys at a time, for every row of the chunk while the keys are in L1.
  const float* qrow[kChunkRows];
  for (int64_t rr = 0; rr < rc; ++rr) {
    const int64_t r = r0 + rr, t = r / G, h = kvh * G + r % G;
    qrow[rr] = q + ((b * T + t) * H + h) * D;
  }
  for (int64_t g = 0; g < padded; g += kLanes) {
    // The next group's keys stream in while this one's run (pages are scattered in memory).
    for (int64_t j = g + kLanes; j < std::min(g + 2 * kLanes, n); ++j)
      for (int64_t d = 0; d < D; d += 16) prefetch(keys[j] + d);
    for (int64_t rr = 0; rr < rc; ++rr) {
      Vec acc[kLanes];
      for (int j = 0; j < kLanes; ++j) acc[j] = vzero();
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        Vec qv[kVecs];
        for (int i = 0; i < kVecs; ++i) qv[i] = vload(qrow[rr] + d0 + i * kLanes);
        for (int j = 0; j < kLanes; ++j) {
          const float* kr = keys[g + j] + d0;
          for (int i = 0; i < kVecs; ++i) acc[j] = vfma(qv[i], vload(kr + i * kLanes), acc[j]);
        }
      }
      vstore(sc.data() + rr * padded + g, vmul(transpose_sum(acc), vset1(scale)));
    }
  }
  // Softmax weights; hidden keys score -inf, so their weight is exactly 0.
  bool seen[kChunkRows];
  for (int64_t rr = 0; rr < rc; ++rr) {
    const int64_t t = (r0 + rr) / G;
    float* s = sc.data() + rr * padded;
    const bool* mr = m + t * S;
    seen[rr] = common > 0;
    for (int64_t j = common; j < padded; ++j) {
      bool vis = j < n && mr[col_of[j]];
      if (!vis) s[j] = neg_inf;
      seen[rr] |= vis;
    }
    if (!seen[rr]) {  // a row that sees no key gets 0
      std::fill(s, s + padded, 0.0f);
      continue;
    }
    Vec mx = vset1(neg_inf);
    for (int64_t g = 0; g < padded; g += kLanes) mx = vmax(mx, vload(s + g));
    Vec top = vset1(vhmax(mx));
    for (int64_t g = 0; g < padded; g += kLanes) vstore(s + g, vexp(vsub(vload(s + g), top)));
  }

  // Weighted values, 64 floats of the head at a time: each value row is loaded once for all the
  // chunk's rows.
  float den[kChunkRows] = {};
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    Vec acc[kChunkRows][kVecs];
    for (int rr = 0; rr < kChunkRows; ++rr)
      for (int i = 0; i < kVecs; ++i) acc[rr][i] = vzero();
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = vals[j] + d0;
      if (j + 8 < n)
        for (int64_t d = 0; d < 64; d += 16) prefetch(vals[j + 8] + d0 + d);
      Vec vv[kVecs];
      for (int i = 0; i < kVecs; ++i) vv[i] = vload(vr + i * kLanes);
      for (int rr = 0; rr < kChunkRows; ++rr) {
        if (rr >= rc) break;
        const float p = sc[rr * padded + j];
        if (d0 == 0) den[rr] += p;
        const Vec pv = vset1(p);
        for (int i = 0; i < kVecs; ++i) acc[rr][i] = vfma(pv, vv[i], acc[rr][i]);
      }
    }
    for (int64_t rr = 0; rr < rc; ++rr) {
      const int64_t r = r0 + rr, t = r / G, h = kvh * G + r % G;
      float* o = out + ((b * T + t) * H + h) * D + d0;
      const Vec inv = vset1(seen[rr] ? 1.0f / den[rr] : 0.0f);
      for (int i = 0; i < kVecs; ++i) vstore(o + i * kLanes, vmul(acc[rr][i], inv));
    }
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                          ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::PRED> mask,
                          ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, float scale,
                          ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), td = block_tables.dimensions();
  auto md = mask.dimensions(), nd = k_new.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || md.size() != 3 || nd.size() != 4)
    return ffi::Error::InvalidArgument("paged_attention: bad ranks");
  auto job = std::make_shared<Job>();
  job->B = qd[0];
  job->T = qd[1];
  job->H = qd[2];
  job->D = qd[3];
  job->KVH = kd[0];
  job->P = kd[1];
  job->ps = kd[2];
  job->NP = td[1];
  job->Tn = nd[1];
  job->S = md[2];
  if (kd[3] != job->D || job->D % 64 != 0 || job->D > 256 || job->H % job->KVH != 0 ||
      job->S != job->NP * job->ps + job->Tn || md[0] != job->B || md[1] != job->T ||
      td[0] != job->B || nd[0] != job->B || nd[2] != job->KVH || nd[3] != job->D)
    return ffi::Error::InvalidArgument("paged_attention: shapes do not agree");
  job->q = q.typed_data();
  job->k = k_pages.typed_data();
  job->v = v_pages.typed_data();
  job->k_new = k_new.typed_data();
  job->v_new = v_new.typed_data();
  job->mask = mask.typed_data();
  job->table = block_tables.typed_data();
  job->out = out->typed_data();
  job->scale = scale;
  job->chunks = (job->T * (job->H / job->KVH) + kChunkRows - 1) / kChunkRows;
  const int64_t tasks = job->B * job->KVH * job->chunks;
  if (tasks == 0) return ffi::Error::Success();
  job->index();
  parallel_for(pool, tasks, [job](int64_t task) {
    thread_local std::vector<const float*> keys, vals;
    thread_local std::vector<float> sc;
    job->chunk(task, keys, vals, sc);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
