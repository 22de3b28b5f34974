// The native queue of one executor run: chunks of element-wise work for worker threads that stay
// in native code, and the Python bindings. Knows no optimizer: each chunk names a registered op
// (math.cpp) whose per-element step it runs.
//
// A chunk holds pieces (1-D runs of leaves, laid end to end), cut into blocks of `block` elements
// per piece. Worker threads enter `Queue::work` once per run, GIL released: they take the chunks
// in order, wait until the executor marks one ready (its grads have landed), claim its blocks one
// at a time with an atomic counter until none is left, and move on. A thread slowed by others on
// its core claims fewer blocks; no thread returns to Python between chunks. `start` puts workers
// in the loop on threads of a process-wide native pool, kept across runs: starting and joining
// them never takes the GIL, so the first chunk starts while the caller's thread still cuts the
// next ones, and a worker costs a wake-up, not a Python thread's turn at the interpreter.
//
// Per piece, optionally: `targets` (the new value and moments go there instead of in place: the
// old state stays intact until the caller commits), an `ema` of the value updated in the same
// pass, and `out` (the param in the grad's dtype). A split master (kernels/remainder.py) comes
// as two int16 state tensors, its high half and its remainder, before the moments: the op's
// loop joins each fp32 value from them and splits it back after the step, and `out` (bf16)
// then gets the new high half. With `ahead` (the op's look-ahead, ops.h), `out` gets the
// look-ahead's base and `ahead` its second value, both in the grad's dtype, instead of the
// param, and for bf16 grads `residual` (int8) the byte of the base below its bf16 (ops.h). A
// block-wise 8-bit moment (uint8: per 256 elements their codes, then their absmax) is addressed
// by its blocks; a piece's blocks start on them; its maps' tables are built once per chunk. A
// block with an EMA is processed in sub-blocks (kSub) small enough to stay in cache, so the EMA
// rereads nothing from memory; one without, in one loop. A sub-block with targets is
// computed in a per-thread scratch and streamed to them with non-temporal stores: a plain store
// reads each line of the target before writing it, a third more memory traffic than in place.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ops.h"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace fo {

std::unordered_map<std::string, Op>& registry() {
  static std::unordered_map<std::string, Op> ops;
  return ops;
}

void register_op(const std::string& name, const Op& op) { registry()[name] = op; }

const Op& find_op(const std::string& name) {
  auto it = registry().find(name);
  TORCH_CHECK(it != registry().end(), "no native op named '", name, "'");
  return it->second;
}

namespace {

// Elements per sub-block where the step's results are read again (an EMA) or copied (targets):
// they stay in cache. A shorter loop runs slower (one thread of an AMD EPYC: fp32 moments 1.2x
// slower at 4,096 in place, and 1.3x with targets at 1,024, whose copies in are then too short
// to run at memory's rate); without either, a block is one loop.
constexpr int64_t kSub = 16384;

int grad_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "unsupported grad dtype ", t); return -1;
  }
}

int moment_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kByte: return 2;  // block-wise 8-bit
    default: TORCH_CHECK(false, "unsupported moment dtype ", t); return -1;
  }
}

// Byte offset of element `i` (a block's first, for 8-bit moments) in a state tensor, and the
// bytes of `n` elements from there.
int64_t offset_of(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kByte ? i / kQBlock * kQRow : i * t.element_size();
}

int64_t bytes_of(const at::Tensor& t, int64_t n) {
  return t.scalar_type() == at::kByte ? q_bytes(n) : n * t.element_size();
}

void check(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  const int64_t want = t.scalar_type() == at::kByte ? q_bytes(n) : n;  // 8-bit: its bytes
  TORCH_CHECK(t.numel() == want, name, " has ", t.numel(), " elements, expected ", want);
}

// `bytes` from `src` to `dst` with non-temporal stores where the CPU has them (the caller fences
// before publishing the result to other threads).
void stream_copy(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__SSE2__)
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= 16; bytes -= 16, d += 16, s += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
#endif
  std::memcpy(d, s, bytes);
}

void fence_streams() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

int64_t now_ns() {  // CLOCK_MONOTONIC, as Python's time.perf_counter_ns on Linux
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A split master's fp32 values from its high halves and remainders (for its EMA).
__attribute__((noinline)) void join(const uint16_t* __restrict hi, const int16_t* __restrict lo,
                                    float* __restrict v, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] = join_value(hi[i], lo[i]);
}

struct Piece {
  at::Tensor grad, out, ahead, residual, ema, ema_target;  // ema_target undefined: in place
  std::vector<at::Tensor> state, targets;  // (value, moments...); targets empty: in place
  bool split = false;  // state: (high half, remainder, moments...) of a split master
  BlockFn fn;
  std::vector<float> scalars;  // the op's, then its look-ahead's
  int ahead_at;  // where the look-ahead's scalars begin
  float ema_weight;  // 1 - decay
};

struct Chunk {
  std::vector<Piece> pieces;
  at::Tensor maps;  // float32 [kMaxMoments, kMapFloats]: the op's 8-bit maps, per moment
  std::vector<QMap> qmaps;  // built from them once (a build per block cost more than its math)
  int64_t block;
  std::vector<int64_t> first;        // first block of each piece, then the total
  std::atomic<int64_t> next{0};      // the next unclaimed block
  std::atomic<int64_t> finished{0};  // blocks computed (or skipped after an error)
  bool ready = false, done = false;  // under the queue's mutex
  std::string error;                 // under the queue's mutex; the first error wins

  int64_t total() const { return first.back(); }

  bool claim(size_t& piece, int64_t& start, int64_t& len) {
    const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
    if (j >= total()) return false;
    piece = size_t(std::upper_bound(first.begin(), first.end(), j) - first.begin() - 1);
    start = (j - first[piece]) * block;
    len = std::min(block, pieces[piece].grad.numel() - start);
    return true;
  }

  void compute(size_t i, int64_t a, int64_t len) const {
    const Piece& p = pieces[i];
    const size_t v0 = p.split ? 2 : 1;  // value tensors: (fp32 value) or (high half, remainder)
    const size_t nt = p.state.size();  // the value tensors, then the moments
    const int64_t gsize = p.grad.element_size();
    const bool staged = !p.targets.empty();  // computed in the scratch, streamed to the targets
    const int64_t sub = staged || p.ema.defined() ? kSub : len;
    thread_local std::vector<float> scratch(size_t(kSub) * (kMaxMoments + 3));
    float* joined = scratch.data() + (kMaxMoments + 2) * kSub;  // a split value, for the EMA
    void* where[kMaxMoments + 2];  // where the sub-block's state tensors are updated
    for (int64_t off = a; off < a + len; off += sub) {
      const int64_t n = std::min(sub, a + len - off);
      for (size_t j = 0; j < nt; ++j) {
        char* x = static_cast<char*>(p.state[j].data_ptr()) + offset_of(p.state[j], off);
        where[j] = staged ? static_cast<void*>(scratch.data() + j * sub) : static_cast<void*>(x);
        if (staged) std::memcpy(where[j], x, size_t(bytes_of(p.state[j], n)));
      }
      Block b;
      b.value = static_cast<float*>(where[0]);
      b.remainder = p.split ? static_cast<int16_t*>(where[1]) : nullptr;
      b.grad = static_cast<const char*>(p.grad.data_ptr()) + off * gsize;
      for (size_t j = 0; j < size_t(kMaxMoments); ++j) b.moments[j] = j + v0 < nt ? where[j + v0] : nullptr;
      b.out = p.out.defined() ? static_cast<char*>(p.out.data_ptr()) + off * p.out.element_size() : nullptr;
      b.ahead = p.ahead.defined() ? static_cast<char*>(p.ahead.data_ptr()) + off * p.ahead.element_size() : nullptr;
      b.residual = p.residual.defined() ? p.residual.data_ptr<int8_t>() + off : nullptr;
      b.n = n;
      b.scalars = p.scalars.data();
      b.ahead_scalars = p.scalars.data() + p.ahead_at;
      for (int j = 0; j < kMaxMoments; ++j) b.maps[j] = &qmaps[size_t(j)];
      p.fn(b);
      if (p.ema.defined()) {
        const float* e = p.ema.data_ptr<float>() + off;
        float* d = (p.ema_target.defined() ? p.ema_target : p.ema).data_ptr<float>() + off;
        if (p.split) join(static_cast<const uint16_t*>(where[0]), static_cast<const int16_t*>(where[1]), joined, n);
        const float* __restrict v = p.split ? joined : b.value;
        const float w = p.ema_weight;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) d[t] = lerp(e[t], v[t], w);
      }
      if (staged) {
        for (size_t j = 0; j < nt; ++j)
          stream_copy(static_cast<char*>(p.targets[j].data_ptr()) + offset_of(p.targets[j], off), where[j],
                      size_t(bytes_of(p.targets[j], n)));
      }
    }
    if (staged) fence_streams();
  }
};

// Checks every argument (so that computing cannot fail) and numbers the blocks.
std::unique_ptr<Chunk> make_chunk(const std::string& name, std::vector<at::Tensor> grads,
                                  std::vector<std::vector<at::Tensor>> states,
                                  std::vector<std::vector<at::Tensor>> targets,
                                  std::vector<at::Tensor> outs, std::vector<at::Tensor> aheads,
                                  std::vector<at::Tensor> residuals, std::vector<at::Tensor> emas,
                                  std::vector<at::Tensor> ema_targets,
                                  const at::Tensor& scalars, const at::Tensor& maps, int64_t block) {
  const Op& op = find_op(name);
  const size_t np = grads.size();
  TORCH_CHECK(block > 0, "block must be > 0");
  TORCH_CHECK(maps.device().is_cpu() && maps.scalar_type() == at::kFloat && maps.is_contiguous() &&
              maps.dim() == 2 && maps.size(0) == kMaxMoments && maps.size(1) == kMapFloats,
              "maps must be a contiguous float32 [", kMaxMoments, ", ", kMapFloats, "] tensor");
  TORCH_CHECK(states.size() == np && targets.size() == np && outs.size() == np && aheads.size() == np &&
              residuals.size() == np && emas.size() == np && ema_targets.size() == np,
              "grad, state, target, out, ahead, residual and ema lists differ in length");
  const int64_t row = op.scalars + op.ahead_scalars + 1;  // the op's, the look-ahead's, the EMA's decay
  TORCH_CHECK(scalars.device().is_cpu() && scalars.scalar_type() == at::kDouble && scalars.is_contiguous() &&
              scalars.dim() == 2 && scalars.size(0) == int64_t(np) && scalars.size(1) == row,
              "scalars must be a contiguous float64 [pieces, ", row, "] tensor for op '", name, "'");
  auto c = std::make_unique<Chunk>();
  c->block = block;
  c->maps = maps;
  c->qmaps.reserve(kMaxMoments);
  for (int j = 0; j < kMaxMoments; ++j) c->qmaps.emplace_back(maps.data_ptr<float>() + j * kMapFloats);
  c->first.push_back(0);
  const double* s = scalars.data_ptr<double>();
  for (size_t i = 0; i < np; ++i) {
    Piece p;
    p.grad = grads[i];
    const int64_t n = p.grad.numel();
    check(p.grad, "grad", n);
    const int gi = grad_index(p.grad.scalar_type());
    p.split = !states[i].empty() && states[i][0].scalar_type() == at::kShort;
    const size_t v0 = p.split ? 2 : 1;  // value tensors: (fp32 value) or (high half, remainder)
    TORCH_CHECK(states[i].size() == size_t(op.moments) + v0, "op '", name, "' takes a value and ",
                op.moments, " moments per piece, got ", states[i].size(), " state tensors");
    TORCH_CHECK(p.split || states[i][0].scalar_type() == at::kFloat, "value must be fp32 or split");
    TORCH_CHECK(!p.split || states[i][1].scalar_type() == at::kShort, "a remainder must be int16");
    int mi = 0;
    for (size_t j = 0; j < states[i].size(); ++j) {
      check(states[i][j], j >= v0 ? "moment" : "value", n);
      if (j >= v0) {
        TORCH_CHECK(states[i][j].scalar_type() == states[i][v0].scalar_type(), "moments must share a dtype");
        mi = moment_index(states[i][j].scalar_type());
      }
    }
    TORCH_CHECK(mi != 2 || block % kQBlock == 0, "with 8-bit moments block must be a multiple of ", kQBlock);
    if (!targets[i].empty()) {
      TORCH_CHECK(targets[i].size() == states[i].size(), "targets must mirror the state tensors");
      for (size_t j = 0; j < targets[i].size(); ++j) {
        check(targets[i][j], "target", n);
        TORCH_CHECK(targets[i][j].scalar_type() == states[i][j].scalar_type(), "target dtype must match the state's");
      }
    }
    const bool has_out = outs[i].numel() != 0;
    const bool ahead = aheads[i].numel() != 0;
    if (has_out) {
      check(outs[i], "out", n);
      TORCH_CHECK(outs[i].scalar_type() == (p.split && !ahead ? at::kBFloat16 : p.grad.scalar_type()),
                  p.split && !ahead ? "a split master's out must be bf16" : "out dtype must be the grad dtype");
      p.out = outs[i];
    }
    if (ahead) {
      TORCH_CHECK(op.ahead_scalars > 0, "op '", name, "' has no look-ahead");
      TORCH_CHECK(has_out, "a look-ahead needs an out for its base");
      check(aheads[i], "ahead", n);
      TORCH_CHECK(aheads[i].scalar_type() == p.grad.scalar_type(), "ahead dtype must be the grad dtype");
      p.ahead = aheads[i];
    }
    const bool residual = ahead && p.grad.scalar_type() == at::kBFloat16;  // (ops.h, store_value)
    TORCH_CHECK((residuals[i].numel() != 0) == residual,
                residual ? "a look-ahead with bf16 grads needs a residual"
                         : "a residual needs a bf16 look-ahead");
    if (residual) {
      check(residuals[i], "residual", n);
      TORCH_CHECK(residuals[i].scalar_type() == at::kChar, "residual must be int8");
      p.residual = residuals[i];
    }
    if (emas[i].numel() != 0) {
      check(emas[i], "ema", n);
      TORCH_CHECK(emas[i].scalar_type() == at::kFloat, "ema must be fp32");
      p.ema = emas[i];
      if (ema_targets[i].numel() != 0) {
        check(ema_targets[i], "ema target", n);
        TORCH_CHECK(ema_targets[i].scalar_type() == at::kFloat, "ema target must be fp32");
        p.ema_target = ema_targets[i];
      }
    }
    p.state = std::move(states[i]);
    p.targets = std::move(targets[i]);
    // a split master's out: its high half, or a look-ahead's base
    p.fn = op.fn[gi][mi][ahead ? (p.split ? 4 : 3) : p.split ? 2 : has_out ? 1 : 0];
    p.scalars.assign(s + i * row, s + i * row + row - 1);
    p.ahead_at = op.scalars;
    p.ema_weight = float(1.0 - s[i * row + row - 1]);
    c->first.push_back(c->first.back() + (n + block - 1) / block);
    c->pieces.push_back(std::move(p));
  }
  return c;
}

// The chunks of one run, in order. `add` (GIL held) returns the chunk's index; `ready(k)` lets
// workers start on it; `wait(k)` (GIL released) blocks until its last block is computed and
// returns its error ("" for none); `close()` lets workers return after the chunks added so far,
// `cancel()` at once. With `record`, workers log their spans (kernel, and waits over 100 us).
struct Queue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::unique_ptr<Chunk>> chunks;
  bool closed = false, cancelled = false;
  int64_t running = 0;  // workers started on the pool and not yet out of `work`
  bool record;
  std::vector<std::tuple<int64_t, int64_t, bool, int64_t, int64_t>> log;  // worker, chunk, wait?, start, end

  explicit Queue(bool record_) : record(record_) {}

  // Dropped without `join` (the caller failed between `start` and it): its pool workers leave
  // now, before its chunks go.
  ~Queue() {
    cancel();
    join();
  }

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

  void start(int64_t workers, const std::vector<int64_t>& cpus);  // below, after the pool

  // Blocks until every worker `start` put in the loop has left it.
  void join() {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return running == 0; });
  }

  void left() {  // a pool worker is out of `work` (the queue is not touched after this)
    std::lock_guard<std::mutex> l(m);
    if (--running == 0) cv.notify_all();
  }

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

// Threads that run queues' loops, kept for the process: each takes a task (a queue and a worker
// number), pins itself to the task's CPU (or back to the process's CPUs), runs the loop and waits
// for the next. The pool grows to the most workers ever running at once and never shrinks; its
// threads are detached and it is never destroyed (a thread still in it at exit is simply gone,
// as the process is). A child process forked from this one starts with an empty pool.
struct Pool {
  struct Task {
    Queue* queue;
    int64_t worker;
    int64_t cpu;  // -1: the process's CPUs
  };
  std::mutex m;
  std::condition_variable cv;
  std::deque<Task> tasks;
  int64_t idle = 0;  // threads waiting for a task

  static Pool*& instance() {
    static Pool* pool = [] {
#if defined(__linux__)
      // a forked child has none of the parent's threads: it starts an empty pool
      pthread_atfork(nullptr, nullptr, [] { instance() = new Pool(); });
#endif
      return new Pool();
    }();
    return pool;
  }

  // Queues `workers` tasks of `q`, counting them in `queued` as they go: a thread that cannot
  // be made (std::system_error) leaves its task and those after it unqueued.
  void submit(Queue* q, int64_t workers, const std::vector<int64_t>& cpus, int64_t& queued) {
    std::lock_guard<std::mutex> l(m);
    for (int64_t i = 0; i < workers; ++i) {
      if (idle > 0) {
        --idle;
        cv.notify_one();
      } else {
        std::thread([this] { loop(); }).detach();  // (it waits for `m` before taking a task)
      }
      tasks.push_back({q, i, cpus.empty() ? -1 : cpus[size_t(i) % cpus.size()]});
      ++queued;
    }
  }

  void loop() {
    bool pinned = false;
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> l(m);
        cv.wait(l, [&] { return !tasks.empty(); });
        t = tasks.front();
        tasks.pop_front();
      }
      pinned = pin(t.cpu, pinned);
      t.queue->work(t.worker);
      {
        std::lock_guard<std::mutex> l(m);
        ++idle;  // before the queue's join returns: a run right after it reuses this thread
      }
      t.queue->left();
    }
  }

  // This thread on `cpu`, or (-1) on the CPUs the process had when the pool began; returns
  // whether it is now pinned to one.
  static bool pin(int64_t cpu, bool pinned) {
#if defined(__linux__)
    static const cpu_set_t all = [] {
      cpu_set_t s;
      CPU_ZERO(&s);
      sched_getaffinity(0, sizeof(s), &s);
      return s;
    }();
    if (cpu < 0 && !pinned) return false;
    cpu_set_t s;
    if (cpu < 0) {
      s = all;
    } else {
      CPU_ZERO(&s);
      CPU_SET(int(cpu), &s);
    }
    pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
    return cpu >= 0;
#else
    return false;
#endif
  }
};

// Puts `workers` pool threads in this queue's loop, worker `i` on `cpus[i % len]` (none: the
// process's CPUs). `join` (or the queue's end) waits for them.
void Queue::start(int64_t workers, const std::vector<int64_t>& cpus) {
  TORCH_CHECK(workers >= 0, "workers must be >= 0");
  {
    std::lock_guard<std::mutex> l(m);
    running += workers;  // before any can leave
  }
  int64_t queued = 0;
  try {
    Pool::instance()->submit(this, workers, cpus, queued);
  } catch (...) {  // no thread for the rest (out of threads or memory): they never run
    std::lock_guard<std::mutex> l(m);
    running -= workers - queued;
    if (running == 0) cv.notify_all();
    throw;
  }
}

}  // namespace
}  // namespace fo

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  using fo::Queue;
  py::class_<Queue>(mod, "Queue")
      .def(py::init<bool>(), py::arg("record") = false)
      .def("add", [](Queue& q, const std::string& op, std::vector<at::Tensor> grads,
                     std::vector<std::vector<at::Tensor>> states, std::vector<std::vector<at::Tensor>> targets,
                     std::vector<at::Tensor> outs, std::vector<at::Tensor> aheads,
                     std::vector<at::Tensor> residuals, std::vector<at::Tensor> emas,
                     std::vector<at::Tensor> ema_targets, at::Tensor scalars, at::Tensor maps,
                     int64_t block) {
        return q.add(fo::make_chunk(op, std::move(grads), std::move(states), std::move(targets),
                                    std::move(outs), std::move(aheads), std::move(residuals),
                                    std::move(emas),
                                    std::move(ema_targets), scalars, maps, block));
      })
      .def("ready", &Queue::ready)
      .def("wait", &Queue::wait, py::call_guard<py::gil_scoped_release>())
      .def("close", &Queue::close)
      .def("cancel", &Queue::cancel)
      .def("work", &Queue::work, py::call_guard<py::gil_scoped_release>())
      .def("start", &Queue::start, py::arg("workers"), py::arg("cpus"))
      .def("join", &Queue::join, py::call_guard<py::gil_scoped_release>())
      .def("spans", &Queue::spans);
  mod.def("ops", [] {
    std::vector<std::tuple<std::string, int, int, int>> out;
    for (const auto& kv : fo::registry())
      out.emplace_back(kv.first, kv.second.moments, kv.second.scalars, kv.second.ahead_scalars);
    return out;
  }, "(name, moments, scalars, look-ahead scalars) of every registered element-wise op");
}
