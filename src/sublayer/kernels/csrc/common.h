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
// flag < 0 and returns its previous value.
inline bool set_switch(std::atomic<bool>& on, int64_t flag) {
  const bool was = on.load();
  if (flag >= 0) on.store(flag != 0);
  return was;
}

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
struct BF16 {};  // tag: bfloat16 stored as uint16_t

template <typename T> struct Elt;
template <> struct Elt<float> {
  using store = float;
  using acc = float;
  static float ld(float v) { return v; }
  static float st(float v) { return v; }
};
template <> struct Elt<double> {
  using store = double;
  using acc = double;
  static double ld(double v) { return v; }
  static double st(double v) { return v; }
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

// Runs chunk(c) for each c in [0, n) on the threads of one parallel region, the chunks handed out from a shared
// counter: a thread that wakes late or is slowed down takes fewer. Under passive OpenMP waits a thread that
// reaches the region's end first sleeps there, and waking it costs tens of microseconds; so the calling thread,
// out of chunks, waits by spinning (at most kJoinSpin) for the chunks another thread is running, never for a
// thread that has taken none. Which thread runs a chunk changes no result.
constexpr std::chrono::microseconds kJoinSpin{50};
template <typename F>
void parallel_chunks(int64_t n, const F& chunk) {
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
    while (done.load(std::memory_order_acquire) < n && std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  });
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
// packed_linear.cpp: y = act((u - zp) @ Q^T * sx * scale + bias), x quantized per row to uint8 (int8 activations).
Tensor int8_linear(const Tensor& x, const Tensor& packed, const Tensor& colsum, const Tensor& scale,
                   const c10::optional<Tensor>& bias, int64_t n, int64_t act, const c10::optional<Tensor>& inv_smooth);
// attention.cpp: one query per row against a static key/value cache.
Tensor decode_attention(const Tensor& q, const Tensor& kc, const Tensor& vc, const c10::optional<Tensor>& mask,
                        int64_t length, double scale, const c10::optional<Tensor>& new_k,
                        const c10::optional<Tensor>& new_v, const c10::optional<Tensor>& rows);

}  // namespace sublayer

namespace sublayer_cache {  // buffer_cache.cpp: big buffers kept for reuse (no fresh-page faults step after step)
at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
}  // namespace sublayer_cache
