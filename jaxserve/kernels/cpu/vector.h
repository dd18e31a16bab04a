// One CPU vector of 16 floats and the few operations on it the native CPU kernels share,
// written with GCC/Clang vector extensions: -march=native maps Vec to one AVX-512 register,
// two AVX2 ones or four NEON ones.
#ifndef JAXSERVE_CPU_VECTOR_H_
#define JAXSERVE_CPU_VECTOR_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace jaxserve {

constexpr int kLanes = 16;
typedef float Vec __attribute__((vector_size(64)));
typedef int32_t IntVec __attribute__((vector_size(64)));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline Vec Max(Vec a, Vec b) { return a > b ? a : b; }

// v with each lane j exchanged with lane j ^ w: the steps of a reduction across lanes.
template <int w>
inline Vec SwapLanes(Vec v) {
  constexpr auto i = [](int j) { return j ^ w; };
  return __builtin_shufflevector(v, v, i(0), i(1), i(2), i(3), i(4), i(5), i(6), i(7), i(8),
                                 i(9), i(10), i(11), i(12), i(13), i(14), i(15));
}

inline float LaneSum(Vec v) {
  v += SwapLanes<8>(v);
  v += SwapLanes<4>(v);
  v += SwapLanes<2>(v);
  return v[0] + v[1];
}

inline float LaneMax(Vec v) {
  v = Max(v, SwapLanes<8>(v));
  v = Max(v, SwapLanes<4>(v));
  v = Max(v, SwapLanes<2>(v));
  return std::max(v[0], v[1]);
}

// Lane j of a fold: in blocks of 2c lanes, the first c lanes come from x, the last c from y,
// each the sum of lanes i and i + c of its block (second = 0: lane i, 1: lane i + c).
constexpr int FoldLane(int c, int j, int second) {
  return j / (2 * c) * 2 * c + j % c + second * c + (j % (2 * c) < c ? 0 : kLanes);
}

template <int c, int s>
inline Vec FoldHalf(Vec x, Vec y) {
  return __builtin_shufflevector(
      x, y, FoldLane(c, 0, s), FoldLane(c, 1, s), FoldLane(c, 2, s), FoldLane(c, 3, s),
      FoldLane(c, 4, s), FoldLane(c, 5, s), FoldLane(c, 6, s), FoldLane(c, 7, s),
      FoldLane(c, 8, s), FoldLane(c, 9, s), FoldLane(c, 10, s), FoldLane(c, 11, s),
      FoldLane(c, 12, s), FoldLane(c, 13, s), FoldLane(c, 14, s), FoldLane(c, 15, s));
}

template <int c>
inline Vec FoldPair(Vec x, Vec y) { return FoldHalf<c, 0>(x, y) + FoldHalf<c, 1>(x, y); }

// j with its 4 bits reversed: the lane the folds below leave the sum of input j in.
constexpr int kBitReversed[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// Lane j of the result is the sum of v[j]'s lanes: 16 horizontal sums in 15 adds and 30
// shuffles, where one at a time takes 4 adds and 4 shuffles each. The folds leave the sums in
// bit-reversed order, so the inputs are taken in that order.
inline Vec LaneSums(const Vec (&v)[kLanes]) {
  Vec h[8], q[4], e[2];
  for (int j = 0; j < 8; ++j) {
    h[j] = FoldPair<8>(v[kBitReversed[2 * j]], v[kBitReversed[2 * j + 1]]);
  }
  for (int j = 0; j < 4; ++j) q[j] = FoldPair<4>(h[2 * j], h[2 * j + 1]);
  for (int j = 0; j < 2; ++j) e[j] = FoldPair<2>(q[2 * j], q[2 * j + 1]);
  return FoldPair<1>(e[0], e[1]);
}

// Lanes 0-7 from a, lanes 8-15 from b.
inline Vec Halves(Vec a, Vec b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27, 28, 29, 30, 31);
}

// e^x for x <= 0, within 4 ulp of expf; 0 below -86 (where e^x nears the smallest normal float).
// Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, 2^n into
// the exponent bits.
inline Vec ExpNonPositive(Vec x) {
  const IntVec underflow = x < -86.f;
  x = x < -86.f ? Vec{} - 86.f : x;
  const IntVec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, IntVec);
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693359375f - nf * -2.12194440e-4f;
  Vec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  IntVec bits;
  std::memcpy(&bits, &p, sizeof p);
  bits += n << 23;
  std::memcpy(&p, &bits, sizeof p);
  return underflow ? Vec{} : p;
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_VECTOR_H_
