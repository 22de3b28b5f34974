// The contract between the optimizer-agnostic queue (queue.cpp) and the per-optimizer math
// (math.cpp): an element-wise optimizer is a struct with its moment and scalar counts and a
// per-element `step`, registered by name with FO_ELEMENTWISE(name, Struct).
//
//   struct MyOp {
//     static constexpr int kMoments = 1, kScalars = 3, kAheadScalars = 0;
//     static inline float step(float p, float g, float& m0, float& m1, const float* s);
//   };
//   FO_ELEMENTWISE(my_op, MyOp)
//
// `step` returns the new value. `p` is the fp32 value being optimized, `g` the grad as fp32,
// `m0`, `m1` the moments as fp32 (read and written in place; those past kMoments are unused),
// `s` the scalars the Python side computed (in double, handed over as fp32).
//
// An op with a look-ahead (the delayed update's, optimizers/delay.py) has kAheadScalars > 0 and
//
//     static inline void ahead(float p, float m0, float m1, const float* s, const float* a,
//                              float& base, float& rate);
//
// from the new value and moments and the next step's scalars `a`: two values per element from
// which the spec's device side (`land_ahead`) makes the next step's value for that step's grad
// `g` without the state — for SGD `base - rate * g`; Adam's second value is the next step's
// second moment but for the grad's part, Lion's the momentum term (math.cpp).
//
// Moments are fp32, bf16 or block-wise 8-bit (kernels/blockwise.py: per block of kQBlock
// elements its codes, then its fp32 absmax): an 8-bit block is dequantized, stepped in fp32 (the
// value from the new fp32 moments) and quantized with its new absmax, in one pass over memory.
#pragma once
#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "elements.h"

namespace fo {

constexpr int kMaxMoments = 2;
constexpr int kMaxScalars = 16;
constexpr int64_t kQBlock = 256;  // elements per block of an 8-bit moment
constexpr int64_t kQRow = kQBlock + 4;  // its bytes: the codes, then the absmax
constexpr int kMapFloats = 2 * 256 + 1 + 129;  // a map (QMap below), in 4-byte words

// Bytes of an 8-bit moment of `n` elements.
inline int64_t q_bytes(int64_t n) { return (n + kQBlock - 1) / kQBlock * kQRow; }

// An 8-bit moment's map as the Python side hands it (kernels/blockwise.py, `table`): the values
// by stored byte, the sorted values' 255 midpoints and +inf, the sorted index of 0 (int32), the
// arithmetic search's tables (`_search`) and its margin. A block is dequantized before the step
// and quantized after it, both without gathers (a gather costs tens of cycles on CPUs with the
// gather-data-sampling fix): with AVX-512 (or AVX2: quantizing) by register permutes, else one
// element at a time.
struct QMap {
  const float* values;  // by stored byte: code = sorted index - zero (mod 256)
  const float* mids;
  uint32_t zero;
  // the search: per binary octave of |y| the classes below it and the class midpoint in it
  // (NaN if none); per class its slope and offset, the magnitude index of its first value, its
  // last step
  alignas(64) int32_t below[32];
  alignas(64) float inside[32];
  alignas(64) float slope[16];
  alignas(64) float offset[16];
  alignas(64) int32_t start[16];
  alignas(64) int32_t steps[16];
  float near;  // twice the margin: a lane whose fraction (plus the margin) is below it is searched
#if defined(__AVX512F__)
  alignas(64) uint32_t bound2[32];  // `inside`'s bits shifted left by one (into the sign's place)
  alignas(64) float table[256];  // the values, aligned for the permutes' loads
  alignas(64) uint8_t planes[4][256];  // byte k of each value (AVX512-VBMI's byte permutes)
#endif
  explicit QMap(const float* m) : values(m), mids(m + 256) {
    std::memcpy(&zero, m + 512, 4);
    const float* t = m + 513;
    std::memcpy(below, t, 128);
    std::memcpy(inside, t + 32, 128);
    std::memcpy(slope, t + 64, 64);
    std::memcpy(offset, t + 80, 64);
    std::memcpy(start, t + 96, 64);
    std::memcpy(steps, t + 112, 64);
    near = t[128];
#if defined(__AVX512F__)
    for (int o = 0; o < 32; ++o) bound2[o] = __builtin_bit_cast(uint32_t, inside[o]) << 1;
    std::memcpy(table, values, sizeof(table));
    for (int c = 0; c < 256; ++c)
      for (int k = 0; k < 4; ++k) planes[k][c] = reinterpret_cast<const uint8_t*>(values + c)[k];
#endif
  }
};

// One block of one piece, pointers at its first element.
struct Block {
  float* value;  // or, for a split master, its high halves (uint16) and `remainder` (int16)
  int16_t* remainder;
  const void* grad;
  void* moments[kMaxMoments];
  void* out;  // the param in the grad's dtype (with a look-ahead: its base), or nullptr
  void* ahead;  // a look-ahead's rate in the grad's dtype, or nullptr
  int8_t* residual;  // a bf16 look-ahead base's residual (the byte below it), or nullptr
  int64_t n;
  const float* scalars;
  const float* ahead_scalars;  // the next step's scalars of the look-ahead
  const QMap* maps[kMaxMoments];  // 8-bit moments: each one's map (built once per chunk)
};

using BlockFn = void (*)(const Block&);

// Per op: [grad dtype: f32, bf16, f16][moments: f32, bf16, 8-bit][value: fp32 without out, fp32
// writing out, split master, fp32 writing a look-ahead, split master writing a look-ahead].
struct Op {
  int moments = 0;
  int scalars = 0;
  int ahead_scalars = 0;
  BlockFn fn[3][3][5] = {};
};

// A split master's fp32 value from its high half and remainder, and back (ties away from zero):
// integer arithmetic mod 2^16 (kernels/remainder.py). A high half of +-0 never borrows (no split
// makes one with a negative remainder; a param zeroed in place would wrap to a NaN).
inline float join_value(uint16_t hi, int16_t lo) {
  const uint16_t borrow = uint16_t((lo < 0) & ((hi & 0x7fffu) != 0));
  const uint32_t u = (uint32_t(uint16_t(hi - borrow)) << 16) | uint16_t(lo);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void split_value(float v, uint16_t& hi, int16_t& lo) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t nan = 0u - uint32_t((u & 0x7fffffffu) > 0x7f800000u);  // all ones for a NaN
  const uint32_t low = u & 0xffffu & ~nan;  // a NaN: a quiet NaN of its top bits, remainder 0
  hi = uint16_t((((u >> 16) + (low >> 15)) & ~nan) | (((u >> 16) | 0x40u) & nan));
  lo = int16_t(uint16_t(low));
}

void register_op(const std::string& name, const Op& op);
const Op& find_op(const std::string& name);

// The new value `pi` of element `i` stored by OUT: 0 the value in place, 1 also the param in the
// grad's dtype to `o`, 2 a split master (high half and remainder in place; `o`, if given, gets the
// high half). AHEAD (with OUT 1 or 2): `o` gets the look-ahead's base and `r` its rate instead;
// a bf16 base is the high half of its fp32 bits and `e` gets their next byte, its *residual*:
// the device joins the two into the base but for the low byte and rounds its landing once
// (kernels/remainder.py, `join_base`).
template <class G, int OUT, bool AHEAD>
inline void store_value(float pi, float base, float rate, int64_t i, float* __restrict p,
                        uint16_t* __restrict hi, int16_t* __restrict lo,
                        typename G::T* __restrict o, typename G::T* __restrict r,
                        int8_t* __restrict e) {
  if (OUT == 2) {
    uint16_t h;
    int16_t l;
    split_value(pi, h, l);
    hi[i] = h;
    lo[i] = l;
    if (!AHEAD && o != nullptr) reinterpret_cast<uint16_t*>(o)[i] = h;
  } else {
    p[i] = pi;
  }
  if (OUT == 1 && !AHEAD) o[i] = G::st(pi);
  if constexpr (AHEAD) {
    if constexpr (std::is_same_v<G, BF16>) {
      uint32_t u;
      std::memcpy(&u, &base, 4);
      o[i] = uint16_t(u >> 16);
      e[i] = int8_t(uint8_t(u >> 8));
    } else {
      o[i] = G::st(base);
    }
    r[i] = G::st(rate);
  }
}

// OUT, AHEAD: as store_value's.
template <class O, class G, class M, int OUT, bool AHEAD>
__attribute__((noinline)) void run_block(const Block& b) {
  // noinline: compiled on its own the loop vectorizes (inlined into a caller GCC once kept the
  // bf16 store scalar, 10x slower). Scalars are copied so the compiler knows they do not alias.
  float s[O::kScalars > 0 ? O::kScalars : 1];
  for (int k = 0; k < O::kScalars; ++k) s[k] = b.scalars[k];
  float sa[O::kAheadScalars > 0 ? O::kAheadScalars : 1];
  for (int k = 0; k < O::kAheadScalars; ++k) sa[k] = AHEAD ? b.ahead_scalars[k] : 0.f;
  float* __restrict p = b.value;
  uint16_t* __restrict hi = reinterpret_cast<uint16_t*>(b.value);
  int16_t* __restrict lo = b.remainder;
  const typename G::T* __restrict g = static_cast<const typename G::T*>(b.grad);
  typename M::T* __restrict m0 = static_cast<typename M::T*>(b.moments[0]);
  typename M::T* __restrict m1 = static_cast<typename M::T*>(b.moments[1]);
  typename G::T* __restrict o = static_cast<typename G::T*>(b.out);
  typename G::T* __restrict r = static_cast<typename G::T*>(b.ahead);
  int8_t* __restrict e = b.residual;
  const int64_t n = b.n;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float a = O::kMoments > 0 ? M::ld(m0[i]) : 0.f;
    float b = O::kMoments > 1 ? M::ld(m1[i]) : 0.f;
    const float pi = O::step(OUT == 2 ? join_value(hi[i], lo[i]) : p[i], G::ld(g[i]), a, b, s);
    if (O::kMoments > 0) m0[i] = M::st(a);
    if (O::kMoments > 1) m1[i] = M::st(b);
    float base = 0.f, rate = 0.f;  // from the moments as stored (as the torch kernel reads them)
    if constexpr (AHEAD) O::ahead(pi, M::ld(M::st(a)), M::ld(M::st(b)), s, sa, base, rate);
    store_value<G, OUT, AHEAD>(pi, base, rate, i, p, hi, lo, o, r, e);
  }
}

// The sorted index of the value nearest `y` (a value over its block's absmax): the number of
// midpoints below it (a tie goes to the lower value; no comparison holds for a NaN: 0).
inline uint32_t q_index(const float* __restrict mids, float y) {
  uint32_t i = 0;
  for (uint32_t step = 128; step > 0; step >>= 1) i += mids[i + step - 1] < y ? step : 0;
  return i;
}

// The codes of the lanes `close` (bits) of `ys` into `c` by the midpoint search.
inline void q_search_lanes(const QMap& q, const float* ys, uint32_t close, uint8_t* c) {
  for (; close != 0; close &= close - 1) {
    const int lane = __builtin_ctz(close);
    c[lane] = uint8_t(q_index(q.mids, ys[lane]) - q.zero);
  }
}

// The code of `y` by the arithmetic search (as q_quantize's AVX-512 loop, one lane), plus 256 if
// `y` is near a midpoint (then the code is q_index's, to be looked up).
inline int32_t q_arith(const QMap& q, float y) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, y);
  const bool neg = bits >> 31;
  const uint32_t abits = bits & 0x7fffffffu;
  const float a = __builtin_bit_cast(float, abits);
  const int32_t octave = std::min(std::max(int32_t(abits >> 23) - 96, 0), 31);
  const float bound = q.inside[octave];
  const int32_t cls = q.below[octave] + int32_t((a > bound) | (neg & (a >= bound)));
  const float fx = std::fma(a, q.slope[cls], q.offset[cls]);
  const float x = fx == fx ? fx : 0.5f;  // NaN (y NaN or inf): any step, replaced below
  const int32_t t = int32_t(x);  // the floor: x > 0 in its class (from 0.2 up in a decade)
  const int32_t close = x - float(t) < q.near ? 256 : 0;
  const int32_t k = std::min(std::max(t, 0), q.steps[cls]);
  const int32_t mag = q.start[cls] + k;
  const int32_t code = y != y ? -int32_t(q.zero) : neg ? -std::min(mag, int32_t(q.zero)) : mag;
  return (code & 255) | close;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 words of a table of 8 << K words (K = 0..2) by the low bits of `idx`, by permutes.
template <int K>
inline __m256 lookup8(const float* t, __m256i idx) {
  if constexpr (K == 0) {
    return _mm256_permutevar8x32_ps(_mm256_loadu_ps(t), idx);
  } else {
    const __m256i hi = _mm256_slli_epi32(idx, 31 - (2 + K));  // bit 2 + K into the sign
    return _mm256_blendv_ps(lookup8<K - 1>(t, idx), lookup8<K - 1>(t + (4 << K), idx),
                            _mm256_castsi256_ps(hi));
  }
}

template <int K>
inline __m256i lookup8(const int32_t* t, __m256i idx) {
  return _mm256_castps_si256(lookup8<K>(reinterpret_cast<const float*>(t), idx));
}
#endif

#if defined(__AVX512F__)
// 16 floats of a table of 32 << K floats (K = 0..2) by the low bits of `idx`.
template <int K>
inline __m512 lookup(const float* t, __m512i idx) {
  const __m512 a = _mm512_permutex2var_ps(_mm512_load_ps(t), idx, _mm512_load_ps(t + 16));
  if constexpr (K == 0) {
    return a;
  } else {
    const __m512 b = lookup<K - 1>(t + (16 << K), idx);
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(16 << K)),
                                lookup<K - 1>(t, idx), b);
  }
}
#endif

#if defined(__AVX512F__)
// With AVX512-VBMI: 64 codes at a time, each byte of their values looked up in its plane by two
// byte permutes (128 entries each) and a blend on the code's top bit, the four bytes put
// together by unpacks. The unpacks interleave 128-bit lanes, so the codes are first permuted to
// the order they undo: output element 16 * k + 4 * L + w comes from input byte 16 * L + 4 * k + w.
__attribute__((target("avx512f,avx512bw,avx512vbmi")))
inline void q_dequantize_vbmi(const QMap& q, const uint8_t* __restrict c, int64_t n,
                              float* __restrict f, float a) {
  alignas(64) static const uint8_t order[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
      4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
      8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
      12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i perm = _mm512_load_si512(order);
  const __m512 scale = _mm512_set1_ps(a);
  __m512i lo[4], hi[4];
  for (int k = 0; k < 4; ++k) {
    lo[k] = _mm512_load_si512(q.planes[k]);
    hi[k] = _mm512_load_si512(q.planes[k] + 64);
  }
  __m512i lo2[4], hi2[4];
  for (int k = 0; k < 4; ++k) {
    lo2[k] = _mm512_load_si512(q.planes[k] + 128);
    hi2[k] = _mm512_load_si512(q.planes[k] + 192);
  }
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t left = n - j;
    const __mmask64 m = left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
    const __m512i idx = _mm512_permutexvar_epi8(perm, _mm512_maskz_loadu_epi8(m, c + j));
    const __mmask64 top = _mm512_movepi8_mask(idx);  // codes 128..255
    __m512i b[4];
    for (int k = 0; k < 4; ++k)
      b[k] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(lo[k], idx, hi[k]),
                                    _mm512_permutex2var_epi8(lo2[k], idx, hi2[k]));
    const __m512i b01l = _mm512_unpacklo_epi8(b[0], b[1]), b01h = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i b23l = _mm512_unpacklo_epi8(b[2], b[3]), b23h = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i w[4] = {_mm512_unpacklo_epi16(b01l, b23l), _mm512_unpackhi_epi16(b01l, b23l),
                          _mm512_unpacklo_epi16(b01h, b23h), _mm512_unpackhi_epi16(b01h, b23h)};
    for (int k = 0; k < 4; ++k) {
      const int64_t at = j + 16 * k;
      if (at >= n) break;
      const __mmask16 mk = n - at >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - at)) - 1);
      _mm512_mask_storeu_ps(f + at, mk, _mm512_mul_ps(_mm512_castsi512_ps(w[k]), scale));
    }
  }
}

inline bool has_vbmi() {
  static const bool yes = __builtin_cpu_supports("avx512vbmi");
  return yes;
}
#endif

// Block `c` (codes, then absmax) of `n` <= kQBlock elements into fp32 `f`.
inline void q_dequantize(const QMap& q, const uint8_t* __restrict c, int64_t n, float* __restrict f) {
  float a;
  std::memcpy(&a, c + kQBlock, 4);
#if defined(__AVX512F__)
  if (has_vbmi()) {
    q_dequantize_vbmi(q, c, n, f, a);
    return;
  }
  const __m512 scale = _mm512_set1_ps(a);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, c + j));
    const __m512 lo = lookup<2>(q.table, idx), hi = lookup<2>(q.table + 128, idx);
    const __m512 v = _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(128)), lo, hi);
    _mm512_mask_storeu_ps(f + j, m, _mm512_mul_ps(v, scale));
  }
#else
  for (int64_t j = 0; j < n; ++j) f[j] = q.values[c[j]] * a;
#endif
}

#if defined(__AVX512F__)
// 16 codes of finite `y` by |y|'s class (0, a decade, 1: one compare per binary octave) and,
// within a decade, a multiply-add, with the lanes near a midpoint, to be searched by the
// midpoints (kernels/blockwise.py, `_search`). The class test compares `key`, |y|'s bits shifted
// left by one with the sign in bit 0, with the class midpoint's bits shifted so (`bound2`, a
// NaN's above every key): greater is |y| > bound, or |y| >= bound for y < 0 (a tie goes to the
// lower value: below 0 the larger magnitude). x >= 0.2 in its class: its floor is its
// truncation, at least 0. A code is returned in its lane's low byte.
struct QSearch {
  __m512i below_lo, below_hi, bound_lo, bound_hi, start, steps, zero;
  __m512 slope, offset, near;
  explicit QSearch(const QMap& q)
      : below_lo(_mm512_load_si512(q.below)), below_hi(_mm512_load_si512(q.below + 16)),
        bound_lo(_mm512_load_si512(q.bound2)), bound_hi(_mm512_load_si512(q.bound2 + 16)),
        start(_mm512_load_si512(q.start)), steps(_mm512_load_si512(q.steps)),
        zero(_mm512_set1_epi32(int(q.zero))), slope(_mm512_load_ps(q.slope)),
        offset(_mm512_load_ps(q.offset)), near(_mm512_set1_ps(q.near)) {}

  inline __m512i codes(__m512 y, __mmask16 m, __mmask16& close) const {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i key = _mm512_rol_epi32(bits, 1);
    // the exponent less 96, at least 0, in each lane's low half (the permutes read its low 5
    // bits; |y| <= 1 + ulp: at most 31)
    const __m512i octave = _mm512_subs_epu16(_mm512_srli_epi32(key, 24), _mm512_set1_epi32(96));
    const __mmask16 up = _mm512_cmpgt_epu32_mask(key, _mm512_permutex2var_epi32(bound_lo, octave, bound_hi));
    const __m512i lower = _mm512_permutex2var_epi32(below_lo, octave, below_hi);
    const __m512i cls = _mm512_mask_add_epi32(lower, up, lower, _mm512_set1_epi32(1));
    const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)));
    const __m512 x = _mm512_fmadd_ps(a, _mm512_permutexvar_ps(cls, slope), _mm512_permutexvar_ps(cls, offset));
    close = _mm512_mask_cmp_ps_mask(m, _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                    near, _CMP_LT_OQ);
    const __m512i k = _mm512_min_epi32(_mm512_cvttps_epi32(x), _mm512_permutexvar_epi32(cls, steps));
    const __m512i mag = _mm512_add_epi32(_mm512_permutexvar_epi32(cls, start), k);
    return _mm512_mask_sub_epi32(mag, _mm512_movepi32_mask(bits), _mm512_setzero_si512(),
                                 _mm512_min_epi32(mag, zero));
  }
};
#endif

// The codes of `f` times `inv` into `c`, one element at a time.
inline void q_quantize_scalar(const QMap& q, const float* __restrict f, int64_t n, float inv,
                              uint8_t* __restrict c) {
  int32_t r[kQBlock];
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) r[j] = q_arith(q, f[j] * inv);
  for (int64_t j = 0; j < n; ++j)
    c[j] = uint8_t(r[j] < 256 ? r[j] : q_index(q.mids, f[j] * inv) - q.zero);
}

// The absmax of `n` fp32 `f` (NaN if one is NaN, as torch's amax), then their codes, into block
// `c`.
#if defined(__AVX512F__)
inline void q_quantize(const QMap& q, const float* __restrict f, int64_t n, uint8_t* __restrict c) {
  // the absmax by the bits' integer max (a NaN's are above every other's)
  __m512i most = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
    most = _mm512_max_epu32(most, _mm512_and_si512(_mm512_maskz_loadu_epi32(m, f + j),
                                                     _mm512_set1_epi32(0x7fffffff)));
  }
  const uint32_t top = _mm512_reduce_max_epu32(most);
  const float a = top > 0x7f800000u ? std::numeric_limits<float>::quiet_NaN()
                                    : __builtin_bit_cast(float, top);
  std::memcpy(c + kQBlock, &a, 4);
  const float inv = a != 0.f ? 1.f / a : 0.f;
  if (!std::isfinite(inv) || !std::isfinite(a)) {  // some y NaN or infinite: one by one
    q_quantize_scalar(q, f, n, inv, c);
    return;
  }
  // 64 codes at a time: four vectors of 16 (their low bytes) packed together, the packs'
  // 128-bit lanes put back in order
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i byte = _mm512_set1_epi32(255);
  const QSearch s(q);
  const __m512 scale = _mm512_set1_ps(inv);
  alignas(64) float ys[16];
  for (int64_t j = 0; j < n; j += 64) {
    __m512i v[4];
    __mmask16 close[4], ms[4];
    for (int k = 0; k < 4; ++k) {
      const int64_t at = j + 16 * k, left = n - at;
      ms[k] = left >= 16 ? __mmask16(0xffff) : left > 0 ? __mmask16((1u << left) - 1) : __mmask16(0);
      v[k] = _mm512_and_si512(
          s.codes(_mm512_mul_ps(_mm512_maskz_loadu_ps(ms[k], f + at), scale), ms[k], close[k]), byte);
    }
    const __m512i out = _mm512_permutexvar_epi32(order, _mm512_packus_epi16(
        _mm512_packus_epi32(v[0], v[1]), _mm512_packus_epi32(v[2], v[3])));
    const int64_t left = n - j;
    _mm512_mask_storeu_epi8(c + j, left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1, out);
    for (int k = 0; k < 4; ++k) {
      if (close[k]) {  // searched by the midpoints
        _mm512_store_ps(ys, _mm512_mul_ps(_mm512_maskz_loadu_ps(ms[k], f + j + 16 * k), scale));
        q_search_lanes(q, ys, close[k], c + j + 16 * k);
      }
    }
  }
}
#else
inline void q_quantize(const QMap& q, const float* __restrict f, int64_t n, uint8_t* __restrict c) {
  float a = 0.f;
  int nan = 0;
#pragma omp simd reduction(max : a) reduction(| : nan)
  for (int64_t j = 0; j < n; ++j) {
    a = std::max(a, std::fabs(f[j]));
    nan |= f[j] != f[j];
  }
  if (nan) a = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(c + kQBlock, &a, 4);
  const float inv = a != 0.f ? 1.f / a : 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  // As the AVX-512 loop, 8 lanes, the tables read by permutes.
  const __m256 scale = _mm256_set1_ps(inv), near = _mm256_set1_ps(q.near);
  const __m256 half = _mm256_set1_ps(0.5f);
  const __m256i zero = _mm256_set1_epi32(int(q.zero)), none = _mm256_setzero_si256();
  alignas(32) float ys[8];
  for (int64_t j = 0; j < n; j += 8) {
    const int len = int(std::min<int64_t>(8, n - j));
    const __m256i lanes =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(len), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 y = _mm256_mul_ps(_mm256_maskload_ps(f + j, lanes), scale);
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i neg = _mm256_srai_epi32(bits, 31);
    const __m256i abits = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256 a = _mm256_castsi256_ps(abits);
    const __m256i octave = _mm256_min_epi32(
        _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(abits, 23), _mm256_set1_epi32(96)), none),
        _mm256_set1_epi32(31));
    const __m256 bound = lookup8<2>(q.inside, octave);
    const __m256 ge = _mm256_and_ps(_mm256_cmp_ps(a, bound, _CMP_GE_OQ), _mm256_castsi256_ps(neg));
    const __m256 up = _mm256_or_ps(_mm256_cmp_ps(a, bound, _CMP_GT_OQ), ge);
    const __m256i cls = _mm256_sub_epi32(lookup8<2>(q.below, octave), _mm256_castps_si256(up));
    const __m256 fx = _mm256_fmadd_ps(a, lookup8<1>(q.slope, cls), lookup8<1>(q.offset, cls));
    const __m256 x = _mm256_blendv_ps(half, fx, _mm256_cmp_ps(fx, fx, _CMP_ORD_Q));  // x > 0
    const __m256i t = _mm256_cvttps_epi32(x);
    const __m256 frac = _mm256_sub_ps(x, _mm256_cvtepi32_ps(t));
    const int close = _mm256_movemask_ps(_mm256_cmp_ps(frac, near, _CMP_LT_OQ)) & ((1 << len) - 1);
    const __m256i k = _mm256_min_epi32(_mm256_max_epi32(t, none), lookup8<1>(q.steps, cls));
    const __m256i mag = _mm256_add_epi32(lookup8<1>(q.start, cls), k);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    __m256i code = _mm256_blendv_epi8(mag, _mm256_sub_epi32(none, _mm256_min_epi32(mag, zero)), neg);
    code = _mm256_blendv_epi8(code, _mm256_sub_epi32(none, zero), nan);
    code = _mm256_and_si256(code, _mm256_set1_epi32(255));
    const __m128i w =
        _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    const uint64_t packed = uint64_t(_mm_cvtsi128_si64(_mm_packus_epi16(w, w)));
    std::memcpy(c + j, &packed, size_t(len));
    if (close) {
      _mm256_store_ps(ys, y);
      q_search_lanes(q, ys, uint32_t(close), c + j);
    }
  }
#else
  q_quantize_scalar(q, f, n, inv, c);
#endif
}
#endif

// `run_block` for 8-bit moments: per block of kQBlock elements (a Block starts on one), the
// moments dequantized to fp32, the step as for fp32 moments, the new moments quantized.
template <class O, class G, int OUT, bool AHEAD>
__attribute__((noinline)) void run_block_q8(const Block& b) {
  float s[O::kScalars > 0 ? O::kScalars : 1];
  for (int k = 0; k < O::kScalars; ++k) s[k] = b.scalars[k];
  float sa[O::kAheadScalars > 0 ? O::kAheadScalars : 1];
  for (int k = 0; k < O::kAheadScalars; ++k) sa[k] = AHEAD ? b.ahead_scalars[k] : 0.f;
  float* __restrict p = b.value;
  uint16_t* __restrict hi = reinterpret_cast<uint16_t*>(b.value);
  int16_t* __restrict lo = b.remainder;
  const typename G::T* __restrict g = static_cast<const typename G::T*>(b.grad);
  typename G::T* __restrict o = static_cast<typename G::T*>(b.out);
  typename G::T* __restrict r = static_cast<typename G::T*>(b.ahead);
  int8_t* __restrict e = b.residual;
  const QMap& q0 = *b.maps[0];
  const QMap& q1 = *b.maps[1];
  alignas(64) float f0[kQBlock], f1[kQBlock];
  for (int64_t k0 = 0; k0 < b.n; k0 += kQBlock) {
    const int64_t len = std::min(kQBlock, b.n - k0);
    uint8_t* c0 = O::kMoments > 0 ? static_cast<uint8_t*>(b.moments[0]) + k0 / kQBlock * kQRow : nullptr;
    uint8_t* c1 = O::kMoments > 1 ? static_cast<uint8_t*>(b.moments[1]) + k0 / kQBlock * kQRow : nullptr;
    if (O::kMoments > 0) q_dequantize(q0, c0, len, f0);
    if (O::kMoments > 1) q_dequantize(q1, c1, len, f1);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = k0 + j;
      float m = O::kMoments > 0 ? f0[j] : 0.f;
      float v = O::kMoments > 1 ? f1[j] : 0.f;
      const float pi = O::step(OUT == 2 ? join_value(hi[i], lo[i]) : p[i], G::ld(g[i]), m, v, s);
      if (O::kMoments > 0) f0[j] = m;
      if (O::kMoments > 1) f1[j] = v;
      float base = 0.f, rate = 0.f;
      if constexpr (AHEAD) O::ahead(pi, m, v, s, sa, base, rate);
      store_value<G, OUT, AHEAD>(pi, base, rate, i, p, hi, lo, o, r, e);
    }
    if (O::kMoments > 0) q_quantize(q0, f0, len, c0);
    if (O::kMoments > 1) q_quantize(q1, f1, len, c1);
  }
}

template <class O, class G, class M>
void fill_out(Op& op, int gi, int mi) {
  op.fn[gi][mi][0] = &run_block<O, G, M, 0, false>;
  op.fn[gi][mi][1] = &run_block<O, G, M, 1, false>;
  op.fn[gi][mi][2] = &run_block<O, G, M, 2, false>;
  if constexpr (O::kAheadScalars > 0) {
    op.fn[gi][mi][3] = &run_block<O, G, M, 1, true>;
    op.fn[gi][mi][4] = &run_block<O, G, M, 2, true>;
  }
}

template <class O, class G>
void fill_moments(Op& op, int gi) {
  fill_out<O, G, F32>(op, gi, 0);
  fill_out<O, G, BF16>(op, gi, 1);
  op.fn[gi][2][0] = &run_block_q8<O, G, 0, false>;
  op.fn[gi][2][1] = &run_block_q8<O, G, 1, false>;
  op.fn[gi][2][2] = &run_block_q8<O, G, 2, false>;
  if constexpr (O::kAheadScalars > 0) {
    op.fn[gi][2][3] = &run_block_q8<O, G, 1, true>;
    op.fn[gi][2][4] = &run_block_q8<O, G, 2, true>;
  }
}

template <class O>
Op make_op() {
  static_assert(O::kMoments <= kMaxMoments && O::kScalars <= kMaxScalars &&
                O::kAheadScalars <= kMaxScalars, "too many moments/scalars");
  Op op;
  op.moments = O::kMoments;
  op.scalars = O::kScalars;
  op.ahead_scalars = O::kAheadScalars;
  fill_moments<O, F32>(op, 0);
  fill_moments<O, BF16>(op, 1);
  fill_moments<O, F16>(op, 2);
  return op;
}

struct Registration {
  Registration(const char* name, const Op& op) { register_op(name, op); }
};

#define FO_ELEMENTWISE(NAME, STRUCT) \
  static ::fo::Registration fo_registration_##NAME(#NAME, ::fo::make_op<STRUCT>());

}  // namespace fo
