// One-pass CPU optimizer kernels for host-resident state.
//
// Each element is read once and written once: the grad (fp32/bf16/fp16), the fp32 value being
// optimized (master or param) and the moments (fp32/bf16) are read; the value, the moments and,
// when the model param is a separate low-precision tensor, the param in the grad's dtype are
// written. Scalars arrive as doubles computed exactly as torch.optim computes them and are used
// in fp32, with the same operation order as torch's single-tensor code (see reference.py).
//
// One call updates the blocks of one chunk (pieces of several leaves, laid end to end, cut into
// blocks of `block` elements per piece). Several threads call it on the same chunk at once, GIL
// released; each claims the next unclaimed block by atomically incrementing `counter[0]` until
// none is left, so a thread slowed by others on its core simply claims fewer blocks. The loop
// over a block is vectorized.
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

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

// noinline: compiled on its own the loop vectorizes; inlined into the claim loop, GCC kept the
// bf16 store scalar (10x slower).
template <typename G, typename M, bool OUT>
__attribute__((noinline)) void adam_impl(float* __restrict p, const typename G::T* __restrict g, typename M::T* __restrict m,
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
__attribute__((noinline)) void sgd_impl(float* __restrict p, const typename G::T* __restrict g, typename M::T* __restrict buf,
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

// The blocks of the pieces: piece i has ceil(n_i / block) blocks, numbered after those of the
// pieces before it. `claim` hands out (piece, start, stop) until every block was taken.
struct Blocks {
  std::vector<int64_t> first;  // first block number of each piece, plus the total at the end
  std::vector<int64_t> sizes;
  int64_t block;
  int64_t* counter;

  Blocks(const std::vector<int64_t>& n, int64_t block_, const at::Tensor& counter_t)
      : sizes(n), block(block_) {
    TORCH_CHECK(block > 0, "block must be > 0");
    TORCH_CHECK(counter_t.device().is_cpu() && counter_t.scalar_type() == at::kLong &&
                counter_t.numel() == 1, "counter must be a one-element int64 CPU tensor");
    counter = counter_t.data_ptr<int64_t>();
    first.push_back(0);
    for (int64_t x : n) first.push_back(first.back() + (x + block - 1) / block);
  }

  bool claim(size_t& piece, int64_t& start, int64_t& len) {
    const int64_t j = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    if (j >= first.back()) return false;
    piece = size_t(std::upper_bound(first.begin(), first.end(), j) - first.begin() - 1);
    start = (j - first[piece]) * block;
    len = std::min(block, sizes[piece] - start);
    return true;
  }
};

std::vector<int64_t> piece_sizes(const std::vector<at::Tensor>& value, const std::vector<at::Tensor>& grad,
                                 const std::vector<at::Tensor>& out, const at::Tensor& scalars,
                                 int64_t nscalars) {
  const size_t k = value.size();
  TORCH_CHECK(grad.size() == k && out.size() == k, "value, grad and out lists differ in length");
  TORCH_CHECK(scalars.device().is_cpu() && scalars.scalar_type() == at::kDouble &&
              scalars.is_contiguous() && scalars.dim() == 2 && scalars.size(0) == int64_t(k) &&
              scalars.size(1) == nscalars, "scalars must be a contiguous float64 [pieces, ", nscalars, "] tensor");
  std::vector<int64_t> n(k);
  for (size_t i = 0; i < k; ++i) {
    n[i] = value[i].numel();
    TORCH_CHECK(value[i].scalar_type() == at::kFloat, "value must be fp32");
    check(value[i], "value", n[i]);
    check(grad[i], "grad", n[i]);
    if (out[i].numel()) {  // an empty tensor: no separate param to write
      check(out[i], "out", n[i]);
      TORCH_CHECK(out[i].scalar_type() == grad[i].scalar_type(), "out dtype must be the grad dtype");
    }
  }
  return n;
}

void adam_chunk(std::vector<at::Tensor> value, std::vector<at::Tensor> grad, std::vector<at::Tensor> mu,
                std::vector<at::Tensor> nu, std::vector<at::Tensor> out, at::Tensor scalars,
                at::Tensor counter, int64_t block) {
  const auto n = piece_sizes(value, grad, out, scalars, 8);
  TORCH_CHECK(mu.size() == n.size() && nu.size() == n.size(), "mu and nu lists differ in length");
  for (size_t i = 0; i < n.size(); ++i) {
    check(mu[i], "mu", n[i]); check(nu[i], "nu", n[i]);
    TORCH_CHECK(mu[i].scalar_type() == nu[i].scalar_type(), "mu and nu must share a dtype");
  }
  Blocks blocks(n, block, counter);
  const double* sc = scalars.data_ptr<double>();
  size_t i; int64_t a, len;
  while (blocks.claim(i, a, len)) {
    const double* h = sc + 8 * i;  // decay, l2, w1, b2, w2, bc2_sqrt, eps, neg_step
    const bool has_out = out[i].numel() != 0;
    dispatch_g(grad[i].scalar_type(), [&](auto gt) {
      using G = decltype(gt);
      dispatch_m(mu[i].scalar_type(), [&](auto mt) {
        using M = decltype(mt);
        float* p = value[i].data_ptr<float>() + a;
        auto* g = ptr<G>(grad[i]) + a;
        auto* m = ptr<M>(mu[i]) + a;
        auto* v = ptr<M>(nu[i]) + a;
        if (has_out) {
          adam_impl<G, M, true>(p, g, m, v, ptr<G>(out[i]) + a, len, h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
        } else {
          adam_impl<G, M, false>(p, g, m, v, nullptr, len, h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
        }
      });
    });
  }
}

void sgd_chunk(std::vector<at::Tensor> value, std::vector<at::Tensor> grad, std::vector<at::Tensor> buf,
               std::vector<at::Tensor> out, at::Tensor scalars, at::Tensor counter, int64_t block) {
  const auto n = piece_sizes(value, grad, out, scalars, 4);
  TORCH_CHECK(buf.size() == n.size(), "momentum list differs in length");
  for (size_t i = 0; i < n.size(); ++i)
    if (buf[i].numel()) check(buf[i], "momentum", n[i]);  // empty: no momentum
  Blocks blocks(n, block, counter);
  const double* sc = scalars.data_ptr<double>();
  size_t i; int64_t a, len;
  while (blocks.claim(i, a, len)) {
    const double* h = sc + 4 * i;  // neg_lr, momentum, wd, nesterov (0 or 1)
    const float neg_lr = h[0], mom = h[1], wd = h[2], nest = h[3];
    const bool has_out = out[i].numel() != 0;
    dispatch_g(grad[i].scalar_type(), [&](auto gt) {
      using G = decltype(gt);
      float* p = value[i].data_ptr<float>() + a;
      auto* g = ptr<G>(grad[i]) + a;
      typename G::T* o = has_out ? ptr<G>(out[i]) + a : nullptr;
      if (!buf[i].numel()) {
        if (o) sgd_impl<G, F32, true, false>(p, g, nullptr, o, len, neg_lr, mom, wd, nest);
        else sgd_impl<G, F32, false, false>(p, g, nullptr, o, len, neg_lr, mom, wd, nest);
        return;
      }
      dispatch_m(buf[i].scalar_type(), [&](auto mt) {
        using M = decltype(mt);
        auto* b = ptr<M>(buf[i]) + a;
        if (o) sgd_impl<G, M, true, true>(p, g, b, o, len, neg_lr, mom, wd, nest);
        else sgd_impl<G, M, false, true>(p, g, b, o, len, neg_lr, mom, wd, nest);
      });
    });
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("adam_chunk", &adam_chunk, py::call_guard<py::gil_scoped_release>());
  mod.def("sgd_chunk", &sgd_chunk, py::call_guard<py::gil_scoped_release>());
}
