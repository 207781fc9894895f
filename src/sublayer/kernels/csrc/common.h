// Shared by every translation unit of the extension (torch.ops.sublayer_kernels): element types, argument checks,
// dropout's parameters, the deterministic row chunking, and the functions that one file defines and another calls.
// Everything is in namespace sublayer; each .cpp keeps its own helpers in an unnamed namespace inside it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "act_norm.h"

namespace sublayer {

// A kernel-path switch (tests turn a fast path off to check the other on the same machine): sets `on` unless
// flag < 0 and returns its previous value; where the path is not compiled in (!compiled), false, setting nothing.
inline bool set_switch(std::atomic<bool>& on, int64_t flag, bool compiled = true) {
  if (!compiled) return false;
  const bool was = on.load();
  if (flag >= 0) on.store(flag != 0);
  return was;
}

// An op's CPU kernel, registered with its schema in one statement: m.def("op(...) -> ...", cpu_kernel(&op)).
template <typename F> torch::CppFunction cpu_kernel(F* f) { return torch::dispatch(c10::DispatchKey::CPU, f); }

using at::Tensor;

// ------------------------------------------------------------------ element types
inline float bf16_to_f(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(r);
}
#if defined(__AVX512F__)
// f_to_bf16 on 16 lanes: their bfloat16 bits in the low halves of 16 32-bit lanes (nearest even, NaN -> 0x7fc0).
inline __m512i f_to_bf16_x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}
// 16 bfloat16 values (bits) widened to float32, exactly.
inline __m512 bf16_to_f_x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
struct BF16 {};  // tag: bfloat16 stored as uint16_t

template <typename T> struct Elt {  // float and double: stored and accumulated as themselves
  using store = T;
  using acc = T;
  static T ld(T v) { return v; }
  static T st(T v) { return v; }
};
template <> struct Elt<BF16> {
  using store = uint16_t;
  using acc = float;
  static float ld(uint16_t v) { return bf16_to_f(v); }
  static uint16_t st(float v) { return f_to_bf16(v); }
};

template <typename T> typename Elt<T>::store* ptr(const Tensor& t) {
  return static_cast<typename Elt<T>::store*>(t.data_ptr());
}

// keep iff draw >= thr, thr = round(p * 2^16): the keep probability is 1 - p rounded to a multiple of 2^-16, and
// kept values are scaled by 1 / that probability (not 1/(1-p): near p = 1 the two differ a lot, and only the real
// keep probability leaves the mean unbiased). Python rejects p whose threshold would round to 0 or 2^16.
struct Drop {
  bool on;
  uint32_t thr;
  double scale;
  uint64_t seed;
  Drop(double p, int64_t s) : on(p > 0), thr(0), scale(1.0), seed(uint64_t(s)) {
    if (on) {
      const double t = std::nearbyint(p * 65536.0);
      thr = t >= 65535.0 ? 65535u : uint32_t(std::max(t, 1.0));
      scale = 65536.0 / (65536.0 - double(thr));
    }
  }
};

// Grain of a loop over rows of `row_elems` elements: rows per chunk, so that each chunk holds at least
// kGrainElems elements (torch's at::internal::GRAIN_SIZE: a fused kernel forks no more eagerly than the aten ops
// it replaces). A loop with less work than two chunks runs on the calling thread: no fork, and no wait for a
// thread that a busy neighbour process may keep off its core.
constexpr int64_t kGrainElems = 32768;
inline int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

// How long a thread waiting for another's chunk spins before it yields its CPU.
constexpr std::chrono::microseconds kJoinSpin{50};
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The threads of one parallel region kept for a sequence of parallel loops (a decoding step's linears and
// attentions): the calling thread runs the sequence and posts each loop's chunks (run); the others help with
// them and, between loops, wait by spinning for at most kIdleSpin, then sleep until the next loop. Under passive
// OpenMP waits, a parallel region per loop would wake a sleeping thread each time (tens of microseconds).
class StepTeam {
 public:
  static constexpr std::chrono::microseconds kIdleSpin{100};
  // Chunks [0, n) handed out from a shared counter, the caller taking its share; returns when all are done.
  void run(int64_t n, const std::function<void(int64_t)>& chunk) {
    Job job{chunk, n, ++ids_};
    cur_.store(&job);
    posted_.store(job.id);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    job.work();
    wait_for([&] { return job.done.load(std::memory_order_acquire) == n; });  // a helper's chunk in flight
    cur_.store(nullptr);
    wait_for([&] { return busy_.load() == 0; });  // no helper still holds the job
  }
  // A helper's loop, until stop: it reads posted_ while it waits (no write to a line the caller reads).
  void help() {
    uint64_t last = 0;  // the newest job this helper has seen: taken part in, or found done
    auto idle_since = std::chrono::steady_clock::now();
    for (int64_t spins = 0;; ++spins) {
      if (stop_.load(std::memory_order_acquire)) return;
      if (posted_.load() != last) {
        busy_.fetch_add(1);
        Job* job = cur_.load();
        if (job && job->id != last) {
          last = job->id;
          job->work();
        } else {
          last = posted_.load();  // done before this helper came
        }
        busy_.fetch_sub(1);
        idle_since = std::chrono::steady_clock::now();
        spins = 0;
        continue;
      }
      if ((spins & 63) || std::chrono::steady_clock::now() - idle_since < kIdleSpin) {
        spin_pause();
        continue;
      }
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lock, [&] { return stop_.load() || posted_.load() != last; });
      sleepers_.fetch_sub(1);
    }
  }
  void stop() {
    stop_.store(true);
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }

 private:
  // Spins until pred(), yielding the CPU after kJoinSpin (a thread the OS took off its core).
  template <typename P>
  static void wait_for(const P& pred) {
    const auto until = std::chrono::steady_clock::now() + kJoinSpin;
    for (int64_t i = 0; !pred(); ++i) {
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > until)
        std::this_thread::yield();
      else
        spin_pause();
    }
  }
  struct Job {
    const std::function<void(int64_t)>& chunk;
    const int64_t n;
    const uint64_t id;
    std::atomic<int64_t> next{0}, done{0};
    void work() {
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        chunk(c);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  std::atomic<Job*> cur_{nullptr};
  std::atomic<int> busy_{0}, sleepers_{0};
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> posted_{0};
  uint64_t ids_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

// The team whose loops this thread posts (set by with_step_team), or null.
inline StepTeam*& current_team() {
  static thread_local StepTeam* team = nullptr;
  return team;
}

// Runs f() on the calling thread with the other threads of one parallel region as its StepTeam's helpers: the
// parallel_chunks loops inside it fork no region of their own. Other parallel loops inside f run on the calling
// thread alone (for loops too small to split). One thread, or inside a parallel region: f() alone.
template <typename F>
void with_step_team(const F& f) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region()) return f();
  StepTeam team;
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t) {
    if (b != 0) return team.help();
    struct Reset {  // the helpers go on an error too
      StepTeam& t;
      ~Reset() {
        current_team() = nullptr;
        t.stop();
      }
    } reset{team};
    current_team() = &team;
    f();
  });
}

// Runs chunk(c) for each c in [0, n) on the threads of one parallel region (or of the current StepTeam), the
// chunks handed out from a shared counter: a thread that wakes late or is slowed down takes fewer. Under passive
// OpenMP waits a thread that reaches the region's end first sleeps there, and waking it costs tens of
// microseconds; so the calling thread, out of chunks, waits by spinning (at most kJoinSpin) for the chunks
// another thread is running, never for a thread that has taken none. Which thread runs a chunk changes no result.
template <typename F>
void parallel_chunks(int64_t n, const F& chunk) {
  if (StepTeam* team = current_team(); team && n > 1)
    return team->run(n, std::function<void(int64_t)>(std::cref(chunk)));
  const int64_t team = std::min<int64_t>(n, at::get_num_threads());
  if (team <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < n; ++c) chunk(c);
    return;
  }
  std::atomic<int64_t> next{0}, done{0};
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      chunk(c);
      done.fetch_add(1, std::memory_order_release);
    }
    if (at::get_thread_num() != 0) return;
    const auto until = std::chrono::steady_clock::now() + kJoinSpin;
    while (done.load(std::memory_order_acquire) < n && std::chrono::steady_clock::now() < until) spin_pause();
  });
}

// The rest after whole register tiles: f(std::integral_constant<int, r>()) for the remaining count r (0 < r <= R),
// nothing for r = 0 (row and block counts are template arguments of the tiles).
template <int R, typename F> inline void tile_rest(int64_t r, F&& f) {
  if constexpr (R > 0) {
    if (r == R) f(std::integral_constant<int, R>());
    else tile_rest<R - 1>(r, f);
  }
}

// Fixed row chunking for deterministic reductions: depends on the row count only (the chunks' partial sums are
// added in chunk order, whichever thread computed them).
inline int64_t n_chunks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(64, (rows + 63) / 64)); }

template <typename A>
void reduce_chunks(const std::vector<A>& part, int64_t nch, int64_t d, A* out) {
  for (int64_t j = 0; j < d; ++j) out[j] = 0;
  for (int64_t c = 0; c < nch; ++c) {
    const A* p = part.data() + c * d;
    for (int64_t j = 0; j < d; ++j) out[j] += p[j];
  }
}

inline at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline void check_float_contig(const Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A float32 (n,) parameter (name: "<op>: <parameter>"): its data; an optional one's null when absent.
inline const float* float_vec(const Tensor& t, const char* name, int64_t n) {
  check_float_contig(t, name, 1);
  TORCH_CHECK(t.size(0) == n, name, " must have ", n, " elements, got ", t.size(0));
  return t.data_ptr<float>();
}
inline const float* float_vec(const c10::optional<Tensor>& t, const char* name, int64_t n) {
  return t.has_value() && t->defined() ? float_vec(*t, name, n) : nullptr;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// ------------------------------------------------------------------ defined in one file, called from another
// ffn.cpp: dropout draws (16 bits per element) of elements [start, start + n) of the Philox stream `seed`.
void philox_fill(uint64_t start, int64_t n, uint64_t seed, uint32_t* out);
// ffn.cpp: keep bits (draw >= thr) of the 64-element blocks [blk, blk + nblk) of that stream, one uint64 a block.
void philox_keep_bits(uint64_t blk, int64_t nblk, uint64_t seed, uint32_t thr, uint64_t* bits);
// packed_linear.cpp: y = act(x @ W^T * scale + bias) on packed panels.
Tensor skinny_linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias, int64_t n,
                     int64_t act, const c10::optional<Tensor>& scale);
// packed_linear.cpp: y = act((u - zp) @ Q^T * sx * scale + bias), x quantized per row to uint8 (int8 activations),
// or with bits = 24 to 24-bit integers (weight-only precision).
Tensor int8_linear(const Tensor& x, const Tensor& packed, const Tensor& colsum, const Tensor& scale,
                   const c10::optional<Tensor>& bias, int64_t n, int64_t act, const c10::optional<Tensor>& inv_smooth,
                   int64_t bits = 8);
// attention.cpp: one query per row against a static key/value cache.
Tensor decode_attention(const Tensor& q, const Tensor& kc, const Tensor& vc, const c10::optional<Tensor>& mask,
                        int64_t length, double scale, const c10::optional<Tensor>& new_k,
                        const c10::optional<Tensor>& new_v, const c10::optional<Tensor>& rows);

}  // namespace sublayer

namespace sublayer_cache {  // buffer_cache.cpp: big buffers kept for reuse (no fresh-page faults step after step)
at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
}  // namespace sublayer_cache
