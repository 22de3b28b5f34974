// The element-wise math of each optimizer, one struct per native op (see ops.h for the contract).
// Each mirrors its torch reference (the optimizer's `reference` in Python) operation for
// operation, with the scalars torch computes in double handed over as fp32.
#include <cmath>

#include "ops.h"

namespace fo {

// Adam and AdamW. Scalars: decay (1 - lr*wd for AdamW, 1 for Adam), l2 (wd for Adam, 0 for
// AdamW), 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2^t), eps, -lr / (1 - beta1^t).
struct Adam {
  static constexpr int kMoments = 2, kScalars = 8;
  static inline float step(float p, float g, float& m, float& v, const float* s) {
    p = p * s[0];                               // AdamW: p *= 1 - lr*wd
    g = g + s[1] * p;                           // Adam:  g += wd*p
    m = lerp(m, g, s[2]);                       // m = lerp(m, g, 1 - b1)
    v = v * s[3] + s[4] * g * g;                // v = b2*v + (1 - b2)*g*g
    const float denom = std::sqrt(v) / s[5] + s[6];
    return p + s[7] * (m / denom);              // p -= lr/bc1 * m/denom
  }
};
FO_ELEMENTWISE(adam, Adam)

// SGD without momentum. Scalars: -lr, weight decay.
struct Sgd {
  static constexpr int kMoments = 0, kScalars = 2;
  static inline float step(float p, float g, float&, float&, const float* s) {
    return p + s[0] * (g + s[1] * p);
  }
};
FO_ELEMENTWISE(sgd, Sgd)

// SGD with momentum (buffer b, no dampening). Scalars: -lr, weight decay, momentum, nesterov.
struct SgdMomentum {
  static constexpr int kMoments = 1, kScalars = 4;
  static inline float step(float p, float g, float& b, float&, const float* s) {
    g = g + s[1] * p;
    b = b * s[2] + g;                           // b = mu*b + g
    g = s[3] != 0.f ? g + s[2] * b : b;         // nesterov: g + mu*b
    return p + s[0] * g;
  }
};
FO_ELEMENTWISE(sgd_momentum, SgdMomentum)

// Lion. Scalars: 1 - lr*wd, beta1, 1 - beta1, beta2, 1 - beta2, -lr.
struct Lion {
  static constexpr int kMoments = 1, kScalars = 6;
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
