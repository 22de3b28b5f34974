// One-pass CPU optimizer kernels for host-resident state.
//
// Each element is read once and written once: the grad (fp32/bf16/fp16), the fp32 value being
// optimized (master or param) and the moments (fp32/bf16) are read; the value, the moments and,
// when the model param is a separate low-precision tensor, the param in the grad's dtype are
// written. Scalars arrive as doubles computed exactly as torch.optim computes them and are used
// in fp32, with the same operation order as torch's single-tensor code (see reference.py).
//
// The work of one executor run is a `Queue` of chunks (pieces of several leaves, laid end to end,
// cut into blocks of `block` elements per piece). Worker threads enter `Queue::work` once per
// run, GIL released, and stay in native code: they take the chunks in order, wait until the
// executor marks one ready (its grads have landed), claim its blocks one at a time with an atomic
// counter until none is left, and move on to the next. A thread slowed by others on its core
// claims fewer blocks; no thread returns to Python between chunks (per-chunk Python in 16
// threads serialised on the GIL cost ~2 ms per chunk). The loop over a block is vectorized.
#include <torch/extension.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
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

int64_t now_ns() {  // CLOCK_MONOTONIC, as Python's time.perf_counter_ns on Linux
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One chunk: per piece the fp32 value, the grad, the moments (Adam: mu, nu; SGD: momentum or an
// empty tensor), the param out (empty: none) and a row of scalars. Piece i has ceil(n_i / block)
// blocks, numbered after those of the pieces before it.
struct Chunk {
  bool adam;
  std::vector<at::Tensor> value, grad, mom1, mom2, out;
  at::Tensor scalars;
  int64_t block;
  std::vector<int64_t> sizes, first;  // elements per piece; first block of each piece, then the total
  std::atomic<int64_t> next{0};       // the next unclaimed block
  std::atomic<int64_t> finished{0};   // blocks computed (or skipped after an error)
  bool ready = false, done = false;   // under the queue's mutex
  std::string error;                  // under the queue's mutex; the first error wins

  int64_t total() const { return first.back(); }

  bool claim(size_t& piece, int64_t& start, int64_t& len) {
    const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
    if (j >= total()) return false;
    piece = size_t(std::upper_bound(first.begin(), first.end(), j) - first.begin() - 1);
    start = (j - first[piece]) * block;
    len = std::min(block, sizes[piece] - start);
    return true;
  }

  void compute(size_t i, int64_t a, int64_t len) const {
    const double* h = scalars.data_ptr<double>() + (adam ? 8 : 4) * i;
    const bool has_out = out[i].numel() != 0;
    dispatch_g(grad[i].scalar_type(), [&](auto gt) {
      using G = decltype(gt);
      float* p = value[i].data_ptr<float>() + a;
      auto* g = ptr<G>(grad[i]) + a;
      typename G::T* o = has_out ? ptr<G>(out[i]) + a : nullptr;
      if (adam) {  // decay, l2, w1, b2, w2, bc2_sqrt, eps, neg_step
        dispatch_m(mom1[i].scalar_type(), [&](auto mt) {
          using M = decltype(mt);
          auto* m = ptr<M>(mom1[i]) + a;
          auto* v = ptr<M>(mom2[i]) + a;
          if (o) adam_impl<G, M, true>(p, g, m, v, o, len, h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
          else adam_impl<G, M, false>(p, g, m, v, o, len, h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]);
        });
        return;
      }
      const float neg_lr = h[0], mom = h[1], wd = h[2], nest = h[3];  // SGD
      if (!mom1[i].numel()) {
        if (o) sgd_impl<G, F32, true, false>(p, g, nullptr, o, len, neg_lr, mom, wd, nest);
        else sgd_impl<G, F32, false, false>(p, g, nullptr, o, len, neg_lr, mom, wd, nest);
        return;
      }
      dispatch_m(mom1[i].scalar_type(), [&](auto mt) {
        using M = decltype(mt);
        auto* b = ptr<M>(mom1[i]) + a;
        if (o) sgd_impl<G, M, true, true>(p, g, b, o, len, neg_lr, mom, wd, nest);
        else sgd_impl<G, M, false, true>(p, g, b, o, len, neg_lr, mom, wd, nest);
      });
    });
  }
};

// Checks every argument (so that computing cannot fail) and numbers the blocks.
std::unique_ptr<Chunk> make_chunk(bool adam, std::vector<at::Tensor> value, std::vector<at::Tensor> grad,
                                  std::vector<at::Tensor> mom1, std::vector<at::Tensor> mom2,
                                  std::vector<at::Tensor> out, at::Tensor scalars, int64_t block) {
  const size_t k = value.size();
  const int64_t nscalars = adam ? 8 : 4;
  TORCH_CHECK(block > 0, "block must be > 0");
  TORCH_CHECK(grad.size() == k && out.size() == k && mom1.size() == k && (!adam || mom2.size() == k),
              "value, grad, moment and out lists differ in length");
  TORCH_CHECK(scalars.device().is_cpu() && scalars.scalar_type() == at::kDouble &&
              scalars.is_contiguous() && scalars.dim() == 2 && scalars.size(0) == int64_t(k) &&
              scalars.size(1) == nscalars, "scalars must be a contiguous float64 [pieces, ", nscalars, "] tensor");
  auto c = std::make_unique<Chunk>();
  c->first.push_back(0);
  for (size_t i = 0; i < k; ++i) {
    const int64_t n = value[i].numel();
    TORCH_CHECK(value[i].scalar_type() == at::kFloat, "value must be fp32");
    check(value[i], "value", n);
    check(grad[i], "grad", n);
    dispatch_g(grad[i].scalar_type(), [](auto) {});
    if (out[i].numel()) {  // an empty tensor: no separate param to write
      check(out[i], "out", n);
      TORCH_CHECK(out[i].scalar_type() == grad[i].scalar_type(), "out dtype must be the grad dtype");
    }
    if (adam) {
      check(mom1[i], "mu", n); check(mom2[i], "nu", n);
      TORCH_CHECK(mom1[i].scalar_type() == mom2[i].scalar_type(), "mu and nu must share a dtype");
    } else if (mom1[i].numel()) {  // empty: SGD without momentum
      check(mom1[i], "momentum", n);
    }
    if (mom1[i].numel()) dispatch_m(mom1[i].scalar_type(), [](auto) {});
    c->sizes.push_back(n);
    c->first.push_back(c->first.back() + (n + block - 1) / block);
  }
  c->adam = adam;
  c->value = std::move(value); c->grad = std::move(grad); c->mom1 = std::move(mom1);
  c->mom2 = std::move(mom2); c->out = std::move(out); c->scalars = std::move(scalars);
  c->block = block;
  return c;
}

// The chunks of one run, in order (see the top of the file). `add_*` (GIL held) returns the
// chunk's index; `ready(k)` lets workers start on it; `wait(k)` (GIL released) blocks until its
// last block is computed and returns its error ("" for none); `close()` lets workers return
// after the chunks added so far, `cancel()` at once. With `record`, workers log their spans
// (kernel, and waits over 100 us) for the executor's timeline.
struct Queue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Chunk>> chunks;
  bool closed = false, cancelled = false;
  bool record;
  std::vector<std::tuple<int64_t, int64_t, bool, int64_t, int64_t>> log;  // worker, chunk, wait?, start, end

  explicit Queue(bool record_) : record(record_) {}

  int64_t add(std::unique_ptr<Chunk> c) {
    std::lock_guard<std::mutex> l(m);
    TORCH_CHECK(!closed, "queue is closed");
    if (c->total() == 0) c->done = true;
    chunks.push_back(std::move(c));
    return int64_t(chunks.size()) - 1;
  }

  Chunk& at(int64_t k) {  // under m
    TORCH_CHECK(k >= 0 && k < int64_t(chunks.size()), "no chunk ", k);
    return *chunks[size_t(k)];
  }

  void ready(int64_t k) {
    std::lock_guard<std::mutex> l(m);
    at(k).ready = true;
    cv.notify_all();
  }

  std::string wait(int64_t k) {
    std::unique_lock<std::mutex> l(m);
    Chunk& c = at(k);
    cv.wait(l, [&] { return c.done || cancelled; });
    return c.done ? c.error : std::string("cancelled");
  }

  void close() { std::lock_guard<std::mutex> l(m); closed = true; cv.notify_all(); }
  void cancel() { std::lock_guard<std::mutex> l(m); closed = cancelled = true; cv.notify_all(); }

  void work(int64_t worker) {
    for (size_t k = 0;; ++k) {
      Chunk* c;
      {
        std::unique_lock<std::mutex> l(m);
        const int64_t t0 = record ? now_ns() : 0;
        cv.wait(l, [&] { return cancelled || (k < chunks.size() && chunks[k]->ready) || (closed && k >= chunks.size()); });
        if (cancelled || k >= chunks.size()) return;
        c = chunks[k].get();
        if (record) {
          const int64_t t1 = now_ns();
          if (t1 - t0 > 100000) log.emplace_back(worker, int64_t(k), true, t0, t1);
        }
      }
      const int64_t t0 = record ? now_ns() : 0;
      int64_t mine = 0;
      size_t i; int64_t a, len;
      while (c->claim(i, a, len)) {
        std::string failed;
        try {
          c->compute(i, a, len);
        } catch (const std::exception& e) {
          failed = e.what();
        }
        ++mine;
        int64_t count = 1;
        if (!failed.empty()) {  // skip the rest: the blocks nobody claimed yet are counted here
          const int64_t prev = c->next.exchange(c->total());
          count += std::max<int64_t>(0, c->total() - prev);
        }
        const bool last = c->finished.fetch_add(count, std::memory_order_acq_rel) + count == c->total();
        if (!failed.empty() || last) {
          std::lock_guard<std::mutex> l(m);
          if (!failed.empty() && c->error.empty()) c->error = failed;
          if (last) { c->done = true; cv.notify_all(); }
        }
      }
      if (record && mine) {
        std::lock_guard<std::mutex> l(m);
        log.emplace_back(worker, int64_t(k), false, t0, now_ns());
      }
    }
  }

  std::vector<std::tuple<int64_t, int64_t, bool, int64_t, int64_t>> spans() {
    std::lock_guard<std::mutex> l(m);
    auto out = std::move(log);
    log.clear();
    return out;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  py::class_<Queue>(mod, "Queue")
      .def(py::init<bool>(), py::arg("record") = false)
      .def("add_adam", [](Queue& q, std::vector<at::Tensor> value, std::vector<at::Tensor> grad,
                          std::vector<at::Tensor> mu, std::vector<at::Tensor> nu, std::vector<at::Tensor> out,
                          at::Tensor scalars, int64_t block) {
        return q.add(make_chunk(true, value, grad, mu, nu, out, scalars, block));
      })
      .def("add_sgd", [](Queue& q, std::vector<at::Tensor> value, std::vector<at::Tensor> grad,
                         std::vector<at::Tensor> buf, std::vector<at::Tensor> out, at::Tensor scalars,
                         int64_t block) {
        return q.add(make_chunk(false, value, grad, buf, {}, out, scalars, block));
      })
      .def("ready", &Queue::ready)
      .def("wait", &Queue::wait, py::call_guard<py::gil_scoped_release>())
      .def("close", &Queue::close)
      .def("cancel", &Queue::cancel)
      .def("work", &Queue::work, py::call_guard<py::gil_scoped_release>())
      .def("spans", &Queue::spans);
}
