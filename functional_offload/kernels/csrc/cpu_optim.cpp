// One-pass CPU optimizer kernels for host-resident state.
//
// Each element is read once and written once: the grad (fp32/bf16/fp16), the fp32 value being
// optimized (master or param) and the moments (fp32/bf16) are read; the value, the moments and,
// when the model param is a separate low-precision tensor, the param in the grad's dtype are
// written. Scalars arrive as doubles computed exactly as torch.optim computes them and are used
// in fp32, with the same operation order as torch's single-tensor code (see reference.py).
// Single-threaded and vectorized; callers split work across threads (the GIL is released).
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// Element codecs: storage type plus load/store through fp32. bf16 is converted with plain bit
// operations (round to nearest even, NaN kept quiet) so that the loops vectorize.
struct F32 {
  using T = float;
  static float ld(T x) { return x; }
  static T st(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  static float ld(T x) {
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static T st(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? T((u >> 16) | 0x40u) : T(rounded);
  }
};
struct F16 {
  using T = at::Half;
  static float ld(T x) { return static_cast<float>(x); }
  static T st(float x) { return static_cast<T>(x); }
};

template <typename C>
typename C::T* ptr(const at::Tensor& t) { return reinterpret_cast<typename C::T*>(t.data_ptr()); }

template <typename G, typename M, bool OUT>
void adam_impl(float* __restrict p, const typename G::T* __restrict g, typename M::T* __restrict m,
               typename M::T* __restrict v, typename G::T* __restrict out, int64_t n, float decay, float l2, float w1, float b2, float w2,
               float bc2_sqrt, float eps, float neg_step) {
  const bool lerp_low = w1 < 0.5f;  // torch's lerp: two formulas around weight 0.5
  const float w1c = 1.f - w1;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i] * decay;                 // AdamW: p *= 1 - lr*wd   (decay = 1 for Adam)
    float gi = G::ld(g[i]);
    gi = gi + l2 * pi;                       // Adam: g += wd*p          (l2 = 0 for AdamW)
    float mi = M::ld(m[i]);
    mi = lerp_low ? mi + w1 * (gi - mi) : gi - (gi - mi) * w1c;   // m = lerp(m, g, 1-b1)
    float vi = M::ld(v[i]);
    vi = vi * b2 + w2 * gi * gi;             // v = b2*v + (1-b2)*g*g
    float denom = std::sqrt(vi) / bc2_sqrt + eps;
    pi = pi + neg_step * (mi / denom);       // p -= lr/bc1 * m/denom
    p[i] = pi;
    m[i] = M::st(mi);
    v[i] = M::st(vi);
    if (OUT) out[i] = G::st(pi);
  }
}

template <typename G, typename M, bool OUT, bool MOM>
void sgd_impl(float* __restrict p, const typename G::T* __restrict g, typename M::T* __restrict buf,
              typename G::T* __restrict out,
              int64_t n, float neg_lr, float momentum, float wd, float nesterov) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i];
    float gi = G::ld(g[i]) + wd * pi;
    if (MOM) {
      float bi = M::ld(buf[i]) * momentum + gi;
      buf[i] = M::st(bi);
      gi = nesterov != 0.f ? gi + momentum * bi : bi;
    }
    pi = pi + neg_lr * gi;
    p[i] = pi;
    if (OUT) out[i] = G::st(pi);
  }
}

void check(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
}

template <typename F>
void dispatch_g(at::ScalarType st, F f) {
  switch (st) {
    case at::kFloat: f(F32{}); break;
    case at::kBFloat16: f(BF16{}); break;
    case at::kHalf: f(F16{}); break;
    default: TORCH_CHECK(false, "unsupported grad dtype ", st);
  }
}

template <typename F>
void dispatch_m(at::ScalarType st, F f) {
  switch (st) {
    case at::kFloat: f(F32{}); break;
    case at::kBFloat16: f(BF16{}); break;
    default: TORCH_CHECK(false, "unsupported moment dtype ", st);
  }
}

void adam_step(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, c10::optional<at::Tensor> out,
               double decay, double l2, double w1, double b2, double w2, double bc2_sqrt,
               double eps, double neg_step) {
  const int64_t n = p.numel();
  TORCH_CHECK(p.scalar_type() == at::kFloat, "value must be fp32");
  check(p, "value", n); check(g, "grad", n); check(m, "mu", n); check(v, "nu", n);
  TORCH_CHECK(m.scalar_type() == v.scalar_type(), "mu and nu must share a dtype");
  if (out) { check(*out, "out", n); TORCH_CHECK(out->scalar_type() == g.scalar_type(), "out dtype"); }
  dispatch_g(g.scalar_type(), [&](auto gt) {
    using G = decltype(gt);
    dispatch_m(m.scalar_type(), [&](auto mt) {
      using M = decltype(mt);
      if (out) {
        adam_impl<G, M, true>(p.data_ptr<float>(), ptr<G>(g), ptr<M>(m), ptr<M>(v), ptr<G>(*out), n,
                              decay, l2, w1, b2, w2, bc2_sqrt, eps, neg_step);
      } else {
        adam_impl<G, M, false>(p.data_ptr<float>(), ptr<G>(g), ptr<M>(m), ptr<M>(v), nullptr, n,
                               decay, l2, w1, b2, w2, bc2_sqrt, eps, neg_step);
      }
    });
  });
}

void sgd_step(at::Tensor p, at::Tensor g, c10::optional<at::Tensor> buf, c10::optional<at::Tensor> out,
              double neg_lr, double momentum, double wd, bool nesterov) {
  const int64_t n = p.numel();
  TORCH_CHECK(p.scalar_type() == at::kFloat, "value must be fp32");
  check(p, "value", n); check(g, "grad", n);
  if (buf) check(*buf, "momentum", n);
  if (out) { check(*out, "out", n); TORCH_CHECK(out->scalar_type() == g.scalar_type(), "out dtype"); }
  const float nest = nesterov ? 1.f : 0.f;
  dispatch_g(g.scalar_type(), [&](auto gt) {
    using G = decltype(gt);
    typename G::T* o = out ? ptr<G>(*out) : nullptr;
    float* pp = p.data_ptr<float>();
    if (!buf) {
      if (o) sgd_impl<G, F32, true, false>(pp, ptr<G>(g), nullptr, o, n, neg_lr, momentum, wd, nest);
      else sgd_impl<G, F32, false, false>(pp, ptr<G>(g), nullptr, o, n, neg_lr, momentum, wd, nest);
      return;
    }
    dispatch_m(buf->scalar_type(), [&](auto mt) {
      using M = decltype(mt);
      if (o) sgd_impl<G, M, true, true>(pp, ptr<G>(g), ptr<M>(*buf), o, n, neg_lr, momentum, wd, nest);
      else sgd_impl<G, M, false, true>(pp, ptr<G>(g), ptr<M>(*buf), o, n, neg_lr, momentum, wd, nest);
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>());
  mod.def("sgd_step", &sgd_step, py::call_guard<py::gil_scoped_release>());
}
