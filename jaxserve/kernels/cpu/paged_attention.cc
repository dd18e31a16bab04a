// Ragged paged attention on CPU, as an XLA FFI handler (see cpu/paged_attention.py).
//
// Each (request, KV head)'s pages are read straight from the paged cache, for a tile of its
// query rows (the G query heads of the group times up to kTileRows rows: a decode, a decode
// verifying its drafts, a slice of a prefill chunk): first every key page for the rows'
// scores, then one softmax per row over all of them, then every value page. XLA:CPU ran a
// decode's small batched dots at ~1 GB/s of KV, and xla_attention's query tiles of a prefill
// took 2.9-3.7x as long as this (stories260K's and dummy-30m's shapes, 182-500 rows). With a head
// dim of 8 a vector along it would hold two keys' dims, so scores are taken the other way: 16
// keys transposed once into lanes serve every row (KeyChunkScores8).
// Same semantics as xla_attention.ragged_paged_attention: each row masked to its own causal end
// (and window); padding rows of the output are zero.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMaskValue = -1e30f;  // the running max before any visible position

// A page of the cache as floats: f32 pages are read in place, bf16 ones widened into `buf`.
inline const float* PageAsFloat(const float* page, int64_t, std::vector<float>&) { return page; }
inline const float* PageAsFloat(const uint16_t* page, int64_t size, std::vector<float>& buf) {
  buf.resize(size);
  for (int64_t j = 0; j < size; ++j) {  // bfloat16 is the high half of a float
    const uint32_t bits = static_cast<uint32_t>(page[j]) << 16;
    std::memcpy(&buf[j], &bits, sizeof(float));
  }
  return buf.data();
}

struct Shape {
  int64_t T, Hq, D, Hkv, NB, BS, R, P, G;
};

struct Params {
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;  // 0: none
  int32_t layer;
};

// kRows rows' scores (row r's query at q + r * D, its scores at out + r * stride) of the 16
// keys from row c of a page whose head dim is whole vectors: each dot is a vector along the head
// dim, and 16 of them are summed across lanes at once. Each key vector is loaded once for all
// the rows. Lanes from `count` on hold kMaskValue.
template <int kD, int kRows>
void VectorScores(const float* q, const float* page, int64_t c, int32_t count, float* out,
                  int64_t stride) {
  using jaxserve::kLanes;
  using jaxserve::Vec;
  const jaxserve::IntVec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Vec qv[kRows][kD / kLanes], dots[kRows][kLanes];
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kD / kLanes; ++j) qv[r][j] = jaxserve::Load(q + r * kD + j * kLanes);
  }
  for (int t = 0; t < kLanes; ++t) {
    const float* k = page + (c + t) * kD;
    for (int r = 0; r < kRows; ++r) dots[r][t] = Vec{};
    for (int j = 0; j < kD / kLanes; ++j) {
      const Vec kv = jaxserve::Load(k + j * kLanes);
      for (int r = 0; r < kRows; ++r) dots[r][t] += qv[r][j] * kv;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    jaxserve::Store(out + r * stride + c,
                    lane < count ? jaxserve::LaneSums(dots[r]) : Vec{} + kMaskValue);
  }
}

// Row q's scores (q . k for key rows [c, end) of the page, end - c <= 16) in a vector's first
// lanes, kMaskValue in the rest, one dot at a time: where neither VectorScores nor
// KeyChunkScores8 applies.
template <int kD>
jaxserve::Vec Scores(const float* q, const float* page, int64_t D, int64_t c, int64_t end) {
  using jaxserve::kLanes;
  const int32_t count = static_cast<int32_t>(end - c);
  const int64_t dim = kD > 0 ? kD : D;
  float scores[kLanes];
  for (int32_t t = 0; t < kLanes; ++t) {
    float dot = kMaskValue;
    if (t < count) {
      const float* k = page + (c + t) * dim;
      dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[d];
    }
    scores[t] = dot;
  }
  return jaxserve::Load(scores);
}

// `rows` (1 or 2) rows' scores of key rows [c, end) of the page, as VectorScores lays them out.
template <int kD>
void ScoreRows(int64_t rows, const float* q, const float* page, int64_t D, int64_t c,
               int64_t end, int64_t BS, float* out, int64_t stride) {
  using jaxserve::kLanes;
  if constexpr (kD > 0 && kD % kLanes == 0) {
    if (c + kLanes <= BS) {
      const int32_t count = static_cast<int32_t>(end - c);
      return rows == 2 ? VectorScores<kD, 2>(q, page, c, count, out, stride)
                       : VectorScores<kD, 1>(q, page, c, count, out, stride);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    jaxserve::Store(out + r * stride + c, Scores<kD>(q + r * D, page, D, c, end));
  }
}

// Bit `vb` of the vector index exchanged with bit `lb` of the lane index, across 8 vectors:
// a stage of a transpose. Output vector a (bit vb clear) takes the lanes whose bit lb is clear
// from each pair's vectors, b = a | 1 << vb the lanes whose bit is set.
constexpr int SwapLane(int lb, int lane, int high) {
  return (lane >> lb & 1) * jaxserve::kLanes + ((lane & ~(1 << lb)) | high << lb);
}

template <int vb, int lb>
void SwapBits(jaxserve::Vec (&v)[8]) {
  using jaxserve::Vec;
#define JAXSERVE_SWAP(h)                                                                    \
  SwapLane(lb, 0, h), SwapLane(lb, 1, h), SwapLane(lb, 2, h), SwapLane(lb, 3, h),          \
      SwapLane(lb, 4, h), SwapLane(lb, 5, h), SwapLane(lb, 6, h), SwapLane(lb, 7, h),      \
      SwapLane(lb, 8, h), SwapLane(lb, 9, h), SwapLane(lb, 10, h), SwapLane(lb, 11, h),    \
      SwapLane(lb, 12, h), SwapLane(lb, 13, h), SwapLane(lb, 14, h), SwapLane(lb, 15, h)
  for (int a = 0; a < 8; ++a) {
    if (a & 1 << vb) continue;
    const Vec x = v[a], y = v[a | 1 << vb];
    v[a] = __builtin_shufflevector(x, y, JAXSERVE_SWAP(0));
    v[a | 1 << vb] = __builtin_shufflevector(x, y, JAXSERVE_SWAP(1));
  }
#undef JAXSERVE_SWAP
}

// After SwapBits<2, 2> and <1, 1> on 16 keys of 8 dims (vector j: keys 2j, 2j + 1), vector
// (d2 d1 t1) holds key t = (t3 t2 t1 t0), dim d = (d2 d1 d0) in lane (t0 t3 t2 d0); this gathers
// dim d of the 16 keys in key order from vectors x = (d2 d1 0) and y = (d2 d1 1).
constexpr int KeyLane(int t, int d0) {
  return (t >> 1 & 1) * jaxserve::kLanes +
         ((t & 1) << 3 | (t >> 3 & 1) << 2 | (t >> 2 & 1) << 1 | d0);
}

template <int d0>
jaxserve::Vec KeysOfDim(jaxserve::Vec x, jaxserve::Vec y) {
  return __builtin_shufflevector(x, y, KeyLane(0, d0), KeyLane(1, d0), KeyLane(2, d0),
                                 KeyLane(3, d0), KeyLane(4, d0), KeyLane(5, d0), KeyLane(6, d0),
                                 KeyLane(7, d0), KeyLane(8, d0), KeyLane(9, d0), KeyLane(10, d0),
                                 KeyLane(11, d0), KeyLane(12, d0), KeyLane(13, d0),
                                 KeyLane(14, d0), KeyLane(15, d0));
}

// Scores of the 16 keys of `keys` (head dim 8, at positions pos .. pos + 15) for rows [0, n)
// (query i at q + 8 i, its scores at out + i * stride): the keys are transposed once, so that
// a row's 16 scores are 8 multiply-adds of its query's dims over them, whatever the number of
// rows. A row's lanes outside [lo[i], hi[i]) hold kMaskValue; a row that sees none of the keys
// is not written.
void KeyChunkScores8(const float* q, int64_t n, const float* keys, int64_t pos,
                     const int64_t* lo, const int64_t* hi, float* out, int64_t stride) {
  using jaxserve::kLanes;
  using jaxserve::Vec;
  Vec v[8], kt[8];
  for (int j = 0; j < 8; ++j) v[j] = jaxserve::Load(keys + j * kLanes);
  SwapBits<2, 2>(v);
  SwapBits<1, 1>(v);
  for (int d = 0; d < 8; d += 2) {
    kt[d] = KeysOfDim<0>(v[d], v[d + 1]);
    kt[d + 1] = KeysOfDim<1>(v[d], v[d + 1]);
  }
  const jaxserve::IntVec lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const jaxserve::IntVec at = lane + static_cast<int32_t>(pos);
  for (int64_t i = 0; i < n; ++i) {
    if (hi[i] <= pos || lo[i] >= pos + kLanes) continue;
    Vec s = kt[0] * q[i * 8];
    for (int d = 1; d < 8; ++d) s += kt[d] * q[i * 8 + d];
    const jaxserve::IntVec seen =
        at >= static_cast<int32_t>(lo[i]) & at < static_cast<int32_t>(hi[i]);
    jaxserve::Store(out + i * stride, seen ? s : Vec{} + kMaskValue);
  }
}

// For each of kRows rows r: acc + r * kD += the sum over key rows t in [t0, t1) of
// weights[r * stride + t] * the page's v[t], the head dim whole vectors. Each value vector is
// loaded once for all the rows.
template <int kD, int kRows>
void VectorValues(float* acc, const float* weights, int64_t stride, const float* page,
                  int64_t t0, int64_t t1) {
  using jaxserve::kLanes;
  using jaxserve::Vec;
  Vec a[kRows][kD / kLanes];  // in registers across t
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kD / kLanes; ++j) a[r][j] = jaxserve::Load(acc + r * kD + j * kLanes);
  }
  for (int64_t t = t0; t < t1; ++t) {
    Vec w[kRows];
    for (int r = 0; r < kRows; ++r) w[r] = Vec{} + weights[r * stride + t];
    const float* v = page + t * kD;
    for (int j = 0; j < kD / kLanes; ++j) {
      const Vec vv = jaxserve::Load(v + j * kLanes);
      for (int r = 0; r < kRows; ++r) a[r][j] += w[r] * vv;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kD / kLanes; ++j) jaxserve::Store(acc + r * kD + j * kLanes, a[r][j]);
  }
}

// Lanes 0-7: w[2j], lanes 8-15: w[2j + 1] (the weights of keys 2j and 2j + 1 of a head dim 8).
template <int j>
jaxserve::Vec WeightPair(jaxserve::Vec w) {
  constexpr int a = 2 * j, b = 2 * j + 1;
  return __builtin_shufflevector(w, w, a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
}

// acc += the sum over key rows t in [t0, t1) of weights[t] * the page's v[t], when
// VectorValues does not apply.
template <int kD>
void AccumulateValues(float* acc, const float* weights, const float* page, int64_t D,
                      int64_t t0, int64_t t1) {
  using jaxserve::kLanes;
  using jaxserve::Vec;
  if constexpr (kD == 8) {  // two keys a vector; the halves are added at the end
    Vec a{};
    int64_t t = t0;
    for (; t + kLanes <= t1; t += kLanes) {  // 16 weights loaded at once, spread by pairs
      const Vec w = jaxserve::Load(weights + t);
      a += WeightPair<0>(w) * jaxserve::Load(page + t * 8);
      a += WeightPair<1>(w) * jaxserve::Load(page + (t + 2) * 8);
      a += WeightPair<2>(w) * jaxserve::Load(page + (t + 4) * 8);
      a += WeightPair<3>(w) * jaxserve::Load(page + (t + 6) * 8);
      a += WeightPair<4>(w) * jaxserve::Load(page + (t + 8) * 8);
      a += WeightPair<5>(w) * jaxserve::Load(page + (t + 10) * 8);
      a += WeightPair<6>(w) * jaxserve::Load(page + (t + 12) * 8);
      a += WeightPair<7>(w) * jaxserve::Load(page + (t + 14) * 8);
    }
    for (; t + 1 < t1; t += 2) {
      a += jaxserve::Halves(Vec{} + weights[t], Vec{} + weights[t + 1])
           * jaxserve::Load(page + t * 8);
    }
    float sums[kLanes];
    jaxserve::Store(sums, a);
    for (int d = 0; d < 8; ++d) {
      acc[d] += sums[d] + sums[d + 8] + (t < t1 ? weights[t] * page[t * 8 + d] : 0.f);
    }
  } else {
    const int64_t dim = kD > 0 ? kD : D;
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t d = 0; d < dim; ++d) acc[d] += weights[t] * page[t * dim + d];
    }
  }
}

// `rows` (1 or 2) rows' values: acc and weights laid out as in VectorValues.
template <int kD>
void AccumulateRows(int64_t rows, float* acc, const float* weights, int64_t stride,
                    const float* page, int64_t D, int64_t t0, int64_t t1) {
  if constexpr (kD > 0 && kD % jaxserve::kLanes == 0) {
    return rows == 2 ? VectorValues<kD, 2>(acc, weights, stride, page, t0, t1)
                     : VectorValues<kD, 1>(acc, weights, stride, page, t0, t1);
  }
  for (int64_t r = 0; r < rows; ++r) {
    AccumulateValues<kD>(acc + r * D, weights + r * stride, page, D, t0, t1);
  }
}

// Query rows [row0, row1) of request r, whose q_len rows start at row `start` of q: a work item
// with each of its KV heads.
struct Tile {
  int64_t r, start, q_len, row0, row1;
};

// A tile's query rows: at most kTileRows, and few enough that its scores (rows x G x the
// request's KV) stay within kTileScoreFloats, the working buffer of each thread.
constexpr int64_t kTileRows = 32;
constexpr int64_t kTileScoreFloats = int64_t{1} << 20;

// One (tile, KV head): rows n = (row1 - row0) * G, row i = (query row row0 + i / G of the
// request, head h * G + i % G).
// kD > 0: the head dim fixed at compile time, so the loops over it unroll (and run as vectors,
// see ScoreRows); 0: any head dim.
template <typename KV, int kD>
void AttendItem(const Shape& s, const Params& p, const float* q, const KV* k_cache,
                const KV* v_cache, const int32_t* seq_lens, const int32_t* block_tables,
                const Tile& tile, int64_t h, float* out) {
  using jaxserve::kLanes;
  using jaxserve::Vec;
  const int64_t D = kD > 0 ? kD : s.D, BS = s.BS, G = s.G;
  const int64_t r = tile.r, q_len = tile.q_len;
  const int64_t q_start = tile.start + tile.row0;  // the tile's first row in q
  const int64_t n = (tile.row1 - tile.row0) * G;
  // Per thread, reused by its items: a decode's work is too small to pay for allocations.
  thread_local std::vector<float> qv, acc, sums, scores, k_buf, v_buf;
  thread_local std::vector<int64_t> hi, lo;
  qv.resize(n * D);
  acc.assign(n * D, 0.f);
  sums.resize(n);
  hi.resize(n);
  lo.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = i / G;
    const float* src = q + ((q_start + row) * s.Hq + h * G + i % G) * D;
    for (int64_t d = 0; d < D; ++d) qv[i * D + d] = src[d] * p.sm_scale;
    // The KV this row sees ends here (exclusive): the request's rows are its last q_len.
    hi[i] = seq_lens[r] - q_len + 1 + tile.row0 + row;
    lo[i] = p.window > 0 ? std::max<int64_t>(hi[i] - p.window, 0) : 0;
  }
  const int64_t first_page = *std::min_element(lo.begin(), lo.end()) / BS;
  // Indices are clamped into range as XLA's gathers clamp them: bad metadata reads the wrong
  // KV, never outside the cache.
  const int64_t last = std::min(*std::max_element(hi.begin(), hi.end()), s.P * BS);
  const int64_t head_base = (static_cast<int64_t>(p.layer) * s.Hkv + h) * s.NB;
  const auto block_of = [&](int64_t page) {
    return std::clamp<int64_t>(block_tables[r * s.P + page], 0, s.NB - 1);
  };
  // Pages two ahead are read into L2 while this one is worked on, consecutive blocks too: the
  // hardware's prefetcher stops at each 4 KiB page, and with it alone a context of 540 tokens
  // in consecutive blocks streamed at 25-31 GB/s, against 31-42 with these prefetches.
  const auto page_of = [&](const KV* cache, int64_t page, std::vector<float>& buf) {
    if ((page + 2) * BS < last) {
      const auto* ahead = reinterpret_cast<const char*>(cache + (head_base + block_of(page + 2))
                                                        * BS * D);
      for (int64_t j = 0; j < BS * D * static_cast<int64_t>(sizeof(KV)); j += 64) {
        __builtin_prefetch(ahead + j, 0, 2);
      }
    }
    return PageAsFloat(cache + (head_base + block_of(page)) * BS * D, BS * D, buf);
  };
  // The positions [t0, t1) of the page starting at pos0 that row i sees.
  const auto seen_in_page = [&](int64_t i, int64_t pos0) {
    return std::pair<int64_t, int64_t>(std::max<int64_t>(lo[i] - pos0, 0),
                                       std::min<int64_t>(hi[i] - pos0, BS));
  };
  // Rows go two at a time where both see the same positions (the G heads of a query row), so
  // that each key and value vector is read from the page once for both.
  const auto rows_at = [&](int64_t i) -> int64_t {
    return i + 1 < n && lo[i] == lo[i + 1] && hi[i] == hi[i + 1] ? 2 : 1;
  };
  // Row i's scores of positions [first_page * BS, last) in whole vectors; positions it does not
  // see (before its window, from its end on) hold kMaskValue, so the softmax gives them 0.
  const int64_t base = first_page * BS;
  // Bad metadata can put every row's window past the table's end: no positions, no scores.
  const int64_t width = (std::max<int64_t>(last - base, 0) + 2 * kLanes - 1) / kLanes * kLanes;
  scores.assign(n * width, kMaskValue);
  for (int64_t page = first_page; page * BS < last; ++page) {
    const float* kp = page_of(k_cache, page, k_buf);
    const int64_t pos0 = page * BS;
    if (kD == 8 && BS % kLanes == 0) {
      for (int64_t c = 0; c < BS && pos0 + c < last; c += kLanes) {
        KeyChunkScores8(qv.data(), n, kp + c * 8, pos0 + c, lo.data(), hi.data(),
                        &scores[pos0 + c - base], width);
      }
    } else {
      for (int64_t i = 0, rows; i < n; i += rows) {
        rows = rows_at(i);
        // Nothing of the page but [t0, t1) is used (Scores may read past t1, and masks it), so
        // slots past seq_len and outside the window may hold anything. A vector that runs past
        // the page masks the next page's first positions, which that page then writes.
        const auto [t0, t1] = seen_in_page(i, pos0);
        for (int64_t c = t0; c < t1; c += kLanes) {
          ScoreRows<kD>(rows, &qv[i * D], kp, D, c, std::min(t1, c + kLanes), BS,
                        &scores[i * width + pos0 - base], width);
        }
      }
    }
    if (p.soft_cap > 0.f) {
      for (int64_t i = 0; i < n; ++i) {
        const auto [t0, t1] = seen_in_page(i, pos0);
        float* si = &scores[i * width + pos0 - base];
        for (int64_t t = t0; t < t1; ++t) si[t] = p.soft_cap * std::tanh(si[t] / p.soft_cap);
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {  // scores -> exp(score - the row's max), and their sum
    float* si = &scores[i * width];
    const int64_t seen = std::clamp<int64_t>(std::min(hi[i], last) - base, 0, width);
    const int64_t end = (seen + kLanes - 1) / kLanes * kLanes;
    Vec row_max = Vec{} + kMaskValue;
    for (int64_t c = 0; c < end; c += kLanes) {
      row_max = jaxserve::Max(row_max, jaxserve::Load(si + c));
    }
    const float m = jaxserve::LaneMax(row_max);
    Vec total{};
    for (int64_t c = 0; c < end; c += kLanes) {
      const Vec e = jaxserve::ExpNonPositive(jaxserve::Load(si + c) - m);
      jaxserve::Store(si + c, e);
      total += e;
    }
    sums[i] = jaxserve::LaneSum(total);
  }
  for (int64_t page = first_page; page * BS < last; ++page) {
    const float* vp = page_of(v_cache, page, v_buf);
    const int64_t pos0 = page * BS;
    for (int64_t i = 0, rows; i < n; i += rows) {
      rows = rows_at(i);
      const auto [t0, t1] = seen_in_page(i, pos0);
      if (t0 < t1) {
        AccumulateRows<kD>(rows, &acc[i * D], &scores[i * width + pos0 - base], width, vp,
                           D, t0, t1);
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    float* dst = out + ((q_start + i / G) * s.Hq + h * G + i % G) * D;
    // A row that sees nothing (its KV ends before its window starts, bad metadata) has no
    // scores: sum 0, output 0.
    const float inv = sums[i] > 0.f ? 1.f / sums[i] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv;
  }
}

template <typename KV>
void Attend(const Shape& s, const Params& p, const float* q, const void* k_cache,
            const void* v_cache, const int32_t* seq_lens, const int32_t* block_tables,
            const int32_t* query_start_loc, float* out, ffi::ThreadPool& pool) {
  std::memset(out, 0, sizeof(float) * s.T * s.Hq * s.D);
  std::vector<Tile> tiles;
  // One thread's time: the larger of the pages' reads (about 8 bytes a ns) and the dot
  // products (about 16 flops a ns), summed over the tiles.
  double nanos = 0;
  for (int64_t r = 0; r < s.R; ++r) {
    // Rows outside q (bad metadata) are not attended: the output stays within its buffer.
    const int64_t start = std::clamp<int64_t>(query_start_loc[r], 0, s.T);
    const int64_t q_len = std::clamp<int64_t>(query_start_loc[r + 1], start, s.T) - start;
    const int64_t kv_len = std::max<int64_t>(seq_lens[r], 1);
    const int64_t rows = std::clamp<int64_t>(kTileScoreFloats / (s.G * kv_len), 1, kTileRows);
    const double kv_values = 2.0 * kv_len * s.Hkv * s.D;
    for (int64_t row0 = 0; row0 < q_len; row0 += rows) {
      const int64_t row1 = std::min(q_len, row0 + rows);
      tiles.push_back({r, start, q_len, row0, row1});
      nanos += std::max(kv_values * sizeof(KV) / 8, kv_values * 2 * (row1 - row0) * s.G / 16);
    }
  }
  const int64_t count = static_cast<int64_t>(tiles.size()) * s.Hkv;
  if (count == 0) return;
  const auto* k = static_cast<const KV*>(k_cache);
  const auto* v = static_cast<const KV*>(v_cache);
  const auto item_fn = s.D == 8 ? AttendItem<KV, 8> : s.D == 16 ? AttendItem<KV, 16>
                     : s.D == 32 ? AttendItem<KV, 32> : s.D == 64 ? AttendItem<KV, 64>
                     : s.D == 128 ? AttendItem<KV, 128> : AttendItem<KV, 0>;
  jaxserve::ParallelFor(pool, count, nanos, [&](int64_t item) {
    item_fn(s, p, q, k, v, seq_lens, block_tables, tiles[item / s.Hkv], item % s.Hkv, out);
  });
}

// "[2, 3]": a buffer's dimensions, for the errors below.
std::string DimsText(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// What is wrong with the buffers' shapes and dtypes, naming the buffer ("" when nothing): the
// kernel indexes every buffer by q's, the caches' and block_tables' dims without looking again,
// so a mis-shaped call would read and write outside them.
std::string ShapeError(const ffi::Buffer<ffi::F32>& q, const ffi::AnyBuffer& k_cache,
                       const ffi::AnyBuffer& v_cache, const ffi::Buffer<ffi::S32>& layer,
                       const ffi::Buffer<ffi::S32>& seq_lens,
                       const ffi::Buffer<ffi::S32>& block_tables,
                       const ffi::Buffer<ffi::S32>& query_start_loc,
                       ffi::Span<const int64_t> out_dims) {
  using std::to_string;
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  const auto ld = seq_lens.dimensions(), sd = query_start_loc.dimensions();
  if (qd.size() != 3) return "q must be [T, Hq, D], got " + DimsText(qd);
  if (kd.size() != 5 || *std::min_element(kd.begin(), kd.end()) < 1 || kd[4] != qd[2]) {
    return "k_cache must be [L, Hkv, NB, BS, D], each at least 1 and D q's " +
           to_string(qd[2]) + ", got " + DimsText(kd);
  }
  if (qd[1] < kd[1] || qd[1] % kd[1] != 0) {
    return "q's heads (" + to_string(qd[1]) + ") must be a multiple of k_cache's KV heads (" +
           to_string(kd[1]) + ")";
  }
  if (!(v_cache.dimensions() == kd) || v_cache.element_type() != k_cache.element_type()) {
    return "v_cache must have k_cache's shape " + DimsText(kd) + " and dtype, got " +
           DimsText(v_cache.dimensions());
  }
  if (k_cache.element_type() != ffi::F32 && k_cache.element_type() != ffi::BF16) {
    return "k_cache and v_cache must be f32 or bf16";
  }
  if (layer.element_count() != 1) {
    return "layer must be one index, got " + DimsText(layer.dimensions());
  }
  if (td.size() != 2) return "block_tables must be [R, P], got " + DimsText(td);
  if (ld.size() != 1 || ld[0] != td[0]) {
    return "seq_lens must be [R], R = block_tables' " + to_string(td[0]) + ", got " +
           DimsText(ld);
  }
  if (sd.size() != 1 || sd[0] != td[0] + 1) {
    return "query_start_loc must be [R + 1], R = block_tables' " + to_string(td[0]) +
           ", got " + DimsText(sd);
  }
  if (!(out_dims == qd)) {
    return "out must have q's shape " + DimsText(qd) + ", got " + DimsText(out_dims);
  }
  return "";
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> query_start_loc,
                          ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                          int64_t window) {
  const std::string error = ShapeError(q, k_cache, v_cache, layer, seq_lens, block_tables,
                                       query_start_loc, out->dimensions());
  if (!error.empty()) return ffi::Error::InvalidArgument("paged attention: " + error);
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = block_tables.dimensions();
  Shape s{qd[0], qd[1], qd[2], kd[1], kd[2], kd[3], td[0], td[1], qd[1] / kd[1]};
  const int32_t layer_index = std::clamp<int32_t>(layer.typed_data()[0], 0, kd[0] - 1);
  Params p{sm_scale, soft_cap, window, layer_index};
  const auto* lens = seq_lens.typed_data();
  const auto* tables = block_tables.typed_data();
  const auto* starts = query_start_loc.typed_data();
  if (k_cache.element_type() == ffi::F32) {
    Attend<float>(s, p, q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(), lens,
                  tables, starts, out->typed_data(), pool);
  } else {
    Attend<uint16_t>(s, p, q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(), lens,
                     tables, starts, out->typed_data(), pool);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()          // k_cache [L, Hkv, NB, BS, D]
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens [R]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [R, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc [R + 1]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, Hq, D]
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window"));
