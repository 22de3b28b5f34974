// The element-wise math of each optimizer, one struct per native op (see ops.h for the contract).
// Each mirrors its torch reference (the optimizer's `reference` in Python) operation for
// operation, with the scalars torch computes in double handed over as fp32.
#include <cmath>

#include "ops.h"

namespace fo {

// The L2 weight-decay term g + wd*p as torch's CPU `grad.add(param, alpha=wd)` computes it:
// rounded once (a fused multiply-add; the build contracts nothing itself) where the CPU has an
// FMA unit, as torch's vectorized kernels do, rounded twice where it has none (as torch's
// DEFAULT kernels do; std::fma would be a library call per element there), and not at all where
// wd is 0, as torch skips it (0 * inf would make an infinite param's moments NaN).
static inline float l2(float g, float p, float wd) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return wd != 0.f ? std::fma(wd, p, g) : g;
#else
  return wd != 0.f ? g + wd * p : g;
#endif
}

// Adam and AdamW. Scalars: decay (1 - lr*wd for AdamW, 1 for Adam), l2 (wd for Adam, 0 for
// AdamW), 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2^t), eps, -lr / (1 - beta1^t).
// Look-ahead scalars (of step t+1, primed): decay', b1', eps', -lr'/(1 - b1'^(t+1)),
// b2'/(1 - b2'^(t+1)): the base is the next step for a zero grad with the denominator as it is
// now; the second value is the next step's bias-corrected second moment but for its grad's part,
// which the device adds (adam.land_ahead).
struct Adam {
  static constexpr int kMoments = 2, kScalars = 8, kAheadScalars = 5;
  static inline float step(float p, float g, float& m, float& v, const float* s) {
    p = p * s[0];                               // AdamW: p *= 1 - lr*wd
    g = l2(g, p, s[1]);                         // Adam:  g += wd*p
    m = lerp(m, g, s[2]);                       // m = lerp(m, g, 1 - b1)
    v = v * s[3] + s[4] * g * g;                // v = b2*v + (1 - b2)*g*g
    const float denom = std::sqrt(v) / s[5] + s[6];
    return p + s[7] * (m / denom);              // p -= lr/bc1 * m/denom
  }
  static inline void ahead(float p, float m, float v, const float* s, const float* a,
                           float& base, float& rate) {
    const float denom = std::sqrt(v) / s[5] + a[2];
    base = p * a[0] + a[3] * ((m * a[1]) / denom);  // decay'*p - lr'/bc1' * b1'*m/denom
    rate = v * a[4];                                // b2'*v/bc2'
  }
};
FO_ELEMENTWISE(adam, Adam)

// SGD without momentum. Scalars: -lr, weight decay. Look-ahead: -lr', wd', lr' (the next step is
// base - lr' * g).
struct Sgd {
  static constexpr int kMoments = 0, kScalars = 2, kAheadScalars = 3;
  static inline float step(float p, float g, float&, float&, const float* s) {
    return p + s[0] * l2(g, p, s[1]);
  }
  static inline void ahead(float p, float, float, const float*, const float* a, float& base,
                           float& rate) {
    base = a[1] != 0.f ? p + a[0] * (a[1] * p) : p;  // (wd' 0: no 0 * inf)
    rate = a[2];
  }
};
FO_ELEMENTWISE(sgd, Sgd)

// SGD with momentum (buffer b, no dampening). Scalars: -lr, weight decay, momentum, nesterov.
// Look-ahead: -lr', then mu' and wd' (nesterov: mu'^2 and (1 + mu')*wd'), then the rate lr'
// (nesterov: (1 + mu')*lr'): the next step is base - rate * g.
struct SgdMomentum {
  static constexpr int kMoments = 1, kScalars = 4, kAheadScalars = 4;
  static inline float step(float p, float g, float& b, float&, const float* s) {
    g = l2(g, p, s[1]);
    b = b * s[2] + g;                           // b = mu*b + g
    g = s[3] != 0.f ? g + s[2] * b : b;         // nesterov: g + mu*b
    return p + s[0] * g;
  }
  static inline void ahead(float p, float b, float, const float*, const float* a, float& base,
                           float& rate) {
    base = p + a[0] * (a[2] != 0.f ? a[1] * b + a[2] * p : a[1] * b);  // (wd' 0: no 0 * inf)
    rate = a[3];
  }
};
FO_ELEMENTWISE(sgd_momentum, SgdMomentum)

// Lion. Scalars: 1 - lr*wd, beta1, 1 - beta1, beta2, 1 - beta2, -lr. Look-ahead: 1 - lr'*wd',
// beta1': the base is the decayed value, the second value beta1'*m (the next step is base -
// lr' * sign(that + (1 - beta1')*g), as `step` computes it).
struct Lion {
  static constexpr int kMoments = 1, kScalars = 6, kAheadScalars = 2;
  static inline void ahead(float p, float m, float, const float*, const float* a, float& base,
                           float& second) {
    base = p * a[0];
    second = m * a[1];
  }
  static inline float step(float p, float g, float& m, float&, const float* s) {
    p = p * s[0];                               // p *= 1 - lr*wd
    const float c = m * s[1] + g * s[2];        // c = b1*m + (1 - b1)*g
    const float sign = float(c > 0.f) - float(c < 0.f);
    m = m * s[3] + g * s[4];                    // m = b2*m + (1 - b2)*g
    return p + s[5] * sign;                     // p -= lr * sign(c)
  }
};
FO_ELEMENTWISE(lion, Lion)

}  // namespace fo
