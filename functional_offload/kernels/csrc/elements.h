// Element types of the native host kernels: a storage type plus load/store through fp32.
//
// bf16 is converted with plain bit operations (round to nearest even, NaN kept quiet) so that the
// loops over it vectorize; fp16 goes through at::Half.
#pragma once
#include <ATen/ATen.h>
#include <cstdint>
#include <cstring>

namespace fo {

struct F32 {
  using T = float;
  static inline float ld(T x) { return x; }
  static inline T st(float x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  static inline float ld(T x) {
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static inline T st(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = -uint32_t((u & 0x7fffffffu) > 0x7f800000u);  // all ones for a NaN
    return T((((u >> 16) | 0x40u) & nan) | (rounded & ~nan));  // no branch: the loop vectorizes
  }
};

struct F16 {
  using T = at::Half;
  static inline float ld(T x) { return static_cast<float>(x); }
  static inline T st(float x) { return static_cast<T>(x); }
};

// `c ? x : y` with bit masks: GCC if-converts only so many selects in a loop before it stops
// vectorizing it; this one is plain integer arithmetic.
inline float select(bool c, float x, float y) {
  uint32_t ux, uy;
  std::memcpy(&ux, &x, 4);
  std::memcpy(&uy, &y, 4);
  const uint32_t m = -uint32_t(c);
  const uint32_t r = (ux & m) | (uy & ~m);
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

// torch's lerp(a, b, w): two formulas around w = 0.5 (aten/src/ATen/native/Lerp.h). Both are
// computed and one is selected, with no branch, so that loops calling it vectorize.
inline float lerp(float a, float b, float w) {
  return select(w < 0.5f, a + w * (b - a), b - (b - a) * (1.f - w));
}

}  // namespace fo
