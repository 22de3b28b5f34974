// The contract between the optimizer-agnostic queue (queue.cpp) and the per-optimizer math
// (math.cpp): an element-wise optimizer is a struct with its moment and scalar counts and a
// per-element `step`, registered by name with FO_ELEMENTWISE(name, Struct).
//
//   struct MyOp {
//     static constexpr int kMoments = 1, kScalars = 3;
//     static inline float step(float p, float g, float& m0, float& m1, const float* s);
//   };
//   FO_ELEMENTWISE(my_op, MyOp)
//
// `step` returns the new value. `p` is the fp32 value being optimized, `g` the grad as fp32,
// `m0`, `m1` the moments as fp32 (read and written in place; those past kMoments are unused),
// `s` the scalars the Python side computed (in double, handed over as fp32).
#pragma once
#include <ATen/ATen.h>
#include <cstdint>
#include <string>

#include "elements.h"

namespace fo {

constexpr int kMaxMoments = 2;
constexpr int kMaxScalars = 16;

// One block of one piece, pointers at its first element.
struct Block {
  float* value;  // or, for a split master, its high halves (uint16) and `remainder` (int16)
  int16_t* remainder;
  const void* grad;
  void* moments[kMaxMoments];
  void* out;  // the param in the grad's dtype, or nullptr
  int64_t n;
  const float* scalars;
};

using BlockFn = void (*)(const Block&);

// Per op: [grad dtype: f32, bf16, f16][moment dtype: f32, bf16][value: fp32 without out, fp32
// writing out, split master].
struct Op {
  int moments = 0;
  int scalars = 0;
  BlockFn fn[3][2][3] = {};
};

// A split master's fp32 value from its high half and remainder, and back (ties away from zero):
// integer arithmetic mod 2^16 (kernels/remainder.py).
inline float join_value(uint16_t hi, int16_t lo) {
  const uint32_t u = (uint32_t(uint16_t(hi - uint16_t(lo < 0))) << 16) | uint16_t(lo);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void split_value(float v, uint16_t& hi, int16_t& lo) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  lo = int16_t(uint16_t(u));
  hi = uint16_t((u >> 16) + uint32_t(lo < 0));
}

void register_op(const std::string& name, const Op& op);
const Op& find_op(const std::string& name);

// OUT: 0 the value in place, 1 also the param in the grad's dtype to `out`, 2 a split master
// (high half and remainder in place; `out`, if given, gets the high half).
template <class O, class G, class M, int OUT>
__attribute__((noinline)) void run_block(const Block& b) {
  // noinline: compiled on its own the loop vectorizes (inlined into a caller GCC once kept the
  // bf16 store scalar, 10x slower). Scalars are copied so the compiler knows they do not alias.
  float s[O::kScalars > 0 ? O::kScalars : 1];
  for (int k = 0; k < O::kScalars; ++k) s[k] = b.scalars[k];
  float* __restrict p = b.value;
  uint16_t* __restrict hi = reinterpret_cast<uint16_t*>(b.value);
  int16_t* __restrict lo = b.remainder;
  const typename G::T* __restrict g = static_cast<const typename G::T*>(b.grad);
  typename M::T* __restrict m0 = static_cast<typename M::T*>(b.moments[0]);
  typename M::T* __restrict m1 = static_cast<typename M::T*>(b.moments[1]);
  typename G::T* __restrict o = static_cast<typename G::T*>(b.out);
  const int64_t n = b.n;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float a = O::kMoments > 0 ? M::ld(m0[i]) : 0.f;
    float b = O::kMoments > 1 ? M::ld(m1[i]) : 0.f;
    const float pi = O::step(OUT == 2 ? join_value(hi[i], lo[i]) : p[i], G::ld(g[i]), a, b, s);
    if (O::kMoments > 0) m0[i] = M::st(a);
    if (O::kMoments > 1) m1[i] = M::st(b);
    if (OUT == 2) {
      uint16_t h;
      int16_t l;
      split_value(pi, h, l);
      hi[i] = h;
      lo[i] = l;
      if (o != nullptr) reinterpret_cast<uint16_t*>(o)[i] = h;
    } else {
      p[i] = pi;
    }
    if (OUT == 1) o[i] = G::st(pi);
  }
}

template <class O, class G, class M>
void fill_out(Op& op, int gi, int mi) {
  op.fn[gi][mi][0] = &run_block<O, G, M, 0>;
  op.fn[gi][mi][1] = &run_block<O, G, M, 1>;
  op.fn[gi][mi][2] = &run_block<O, G, M, 2>;
}

template <class O, class G>
void fill_moments(Op& op, int gi) {
  fill_out<O, G, F32>(op, gi, 0);
  fill_out<O, G, BF16>(op, gi, 1);
}

template <class O>
Op make_op() {
  static_assert(O::kMoments <= kMaxMoments && O::kScalars <= kMaxScalars, "too many moments/scalars");
  Op op;
  op.moments = O::kMoments;
  op.scalars = O::kScalars;
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
