// sublayer fused CPU kernels (registered as torch.ops.sublayer_kernels.*).
//
//  * add_norm_fwd / add_norm_bwd: dropout(y) + x -> LayerNorm/RMSNorm, one pass over each row forward and one
//    backward, statistics in float32 (float64 for float64), two-pass variance; dx and dy from the same pass;
//    forward saves the sum, mean, rstd and the dropout mask as bits for backward.
//  * act_fwd / act_bwd: bias + activation + dropout in one elementwise pass between the FFN's GEMMs, and its
//    backward (bias gradient reduced in the same pass). act 0 (identity) is "bias + dropout".
//  * glu_fwd / glu_bwd: the same for gated FFNs (SwiGLU, GeGLU, ReGLU): act(gate) * up from fc1's packed output.
//  * Dropout is a counter-based Philox4x32-10 stream: element e (row-major flat index) keeps iff its 16-bit draw
//    (see philox_fill) >= round(p * 2^16). The FFN regenerates the mask in backward from the seed; Add & Norm
//    saves it as 1 bit per element (pack_keep), which costs d/8 bytes a row and spares its backward the draws.
//
// Tensors come in contiguous and 2-D from Python (sublayer/functional/fused.py does the checks). Storage types:
// float, double and bfloat16 (as raw uint16 with round-to-nearest-even, written so the compiler vectorises it).
// Reductions over rows (weight/bias gradients) use a fixed chunking that depends on the row count only, so results
// are bitwise reproducible whatever the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>
#include "activations.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

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

// ------------------------------------------------------------------ Philox4x32-10
// Element e uses word k = (e / 8) % 4 of philox(counter = (e / 32) * 8 + e % 8, key = seed): a block of 32
// consecutive elements comes from 8 counters, so 8 lanes of AVX2 produce it without a transpose.
constexpr uint32_t PH_M0 = 0xD2511F53u, PH_M1 = 0xCD9E8D57u, PH_W0 = 0x9E3779B9u, PH_W1 = 0xBB67AE85u;

inline void philox_block_scalar(uint64_t blk, uint64_t seed, uint32_t* out32) {
  for (int l = 0; l < 8; ++l) {
    const uint64_t c = blk * 8 + l;
    uint32_t c0 = uint32_t(c), c1 = uint32_t(c >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const uint64_t p0 = uint64_t(PH_M0) * c0, p1 = uint64_t(PH_M1) * c2;
      const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
      c1 = uint32_t(p1);
      c3 = uint32_t(p0);
      c0 = n0;
      c2 = n2;
      k0 += PH_W0;
      k1 += PH_W1;
    }
    out32[l] = c0;
    out32[8 + l] = c1;
    out32[16 + l] = c2;
    out32[24 + l] = c3;
  }
}

#if defined(__AVX2__)
inline void philox_block(uint64_t blk, uint64_t seed, uint32_t* out32) {
  const uint64_t c = blk * 8;
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(c))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32(int(uint32_t(c >> 32)));  // 8 | c, so the low word never wraps inside a block
  __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
  __m256i k0 = _mm256_set1_epi32(int(uint32_t(seed))), k1 = _mm256_set1_epi32(int(uint32_t(seed >> 32)));
  const __m256i m0 = _mm256_set1_epi32(int(PH_M0)), m1 = _mm256_set1_epi32(int(PH_M1));
  const __m256i w0 = _mm256_set1_epi32(int(PH_W0)), w1 = _mm256_set1_epi32(int(PH_W1));
  for (int r = 0; r < 10; ++r) {
    const __m256i pe0 = _mm256_mul_epu32(c0, m0), po0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), m0);
    const __m256i pe1 = _mm256_mul_epu32(c2, m1), po1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), m1);
    const __m256i lo0 = _mm256_blend_epi32(pe0, _mm256_slli_epi64(po0, 32), 0xAA);
    const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(pe0, 32), po0, 0xAA);
    const __m256i lo1 = _mm256_blend_epi32(pe1, _mm256_slli_epi64(po1, 32), 0xAA);
    const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(pe1, 32), po1, 0xAA);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), k0);
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), k1);
    c1 = lo1;
    c3 = lo0;
    k0 = _mm256_add_epi32(k0, w0);
    k1 = _mm256_add_epi32(k1, w1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out32), c0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out32 + 8), c1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out32 + 16), c2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out32 + 24), c3);
}
// Two consecutive blocks (blk, blk + 1) with interleaved, independent dependency chains: the same words as two
// philox_block calls, about twice the throughput (one block alone is bound by the multiply latency).
inline void philox_block2(uint64_t blk, uint64_t seed, uint32_t* out64) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const uint64_t ca = blk * 8, cb = (blk + 1) * 8;
  __m256i a0 = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(ca))), lane);
  __m256i a1 = _mm256_set1_epi32(int(uint32_t(ca >> 32)));
  __m256i b0 = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(cb))), lane);
  __m256i b1 = _mm256_set1_epi32(int(uint32_t(cb >> 32)));
  __m256i a2 = _mm256_setzero_si256(), a3 = _mm256_setzero_si256();
  __m256i b2 = _mm256_setzero_si256(), b3 = _mm256_setzero_si256();
  __m256i k0 = _mm256_set1_epi32(int(uint32_t(seed))), k1 = _mm256_set1_epi32(int(uint32_t(seed >> 32)));
  const __m256i m0 = _mm256_set1_epi32(int(PH_M0)), m1 = _mm256_set1_epi32(int(PH_M1));
  const __m256i w0 = _mm256_set1_epi32(int(PH_W0)), w1 = _mm256_set1_epi32(int(PH_W1));
  for (int r = 0; r < 10; ++r) {
    const __m256i ape0 = _mm256_mul_epu32(a0, m0), apo0 = _mm256_mul_epu32(_mm256_srli_epi64(a0, 32), m0);
    const __m256i bpe0 = _mm256_mul_epu32(b0, m0), bpo0 = _mm256_mul_epu32(_mm256_srli_epi64(b0, 32), m0);
    const __m256i ape1 = _mm256_mul_epu32(a2, m1), apo1 = _mm256_mul_epu32(_mm256_srli_epi64(a2, 32), m1);
    const __m256i bpe1 = _mm256_mul_epu32(b2, m1), bpo1 = _mm256_mul_epu32(_mm256_srli_epi64(b2, 32), m1);
    const __m256i alo0 = _mm256_blend_epi32(ape0, _mm256_slli_epi64(apo0, 32), 0xAA);
    const __m256i ahi0 = _mm256_blend_epi32(_mm256_srli_epi64(ape0, 32), apo0, 0xAA);
    const __m256i alo1 = _mm256_blend_epi32(ape1, _mm256_slli_epi64(apo1, 32), 0xAA);
    const __m256i ahi1 = _mm256_blend_epi32(_mm256_srli_epi64(ape1, 32), apo1, 0xAA);
    const __m256i blo0 = _mm256_blend_epi32(bpe0, _mm256_slli_epi64(bpo0, 32), 0xAA);
    const __m256i bhi0 = _mm256_blend_epi32(_mm256_srli_epi64(bpe0, 32), bpo0, 0xAA);
    const __m256i blo1 = _mm256_blend_epi32(bpe1, _mm256_slli_epi64(bpo1, 32), 0xAA);
    const __m256i bhi1 = _mm256_blend_epi32(_mm256_srli_epi64(bpe1, 32), bpo1, 0xAA);
    a0 = _mm256_xor_si256(_mm256_xor_si256(ahi1, a1), k0);
    a2 = _mm256_xor_si256(_mm256_xor_si256(ahi0, a3), k1);
    a1 = alo1;
    a3 = alo0;
    b0 = _mm256_xor_si256(_mm256_xor_si256(bhi1, b1), k0);
    b2 = _mm256_xor_si256(_mm256_xor_si256(bhi0, b3), k1);
    b1 = blo1;
    b3 = blo0;
    k0 = _mm256_add_epi32(k0, w0);
    k1 = _mm256_add_epi32(k1, w1);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out64), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out64 + 8), a1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out64 + 16), a2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out64 + 24), a3);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out64 + 32), b0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out64 + 40), b1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out64 + 48), b2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out64 + 56), b3);
}
#else
inline void philox_block(uint64_t blk, uint64_t seed, uint32_t* out32) { philox_block_scalar(blk, seed, out32); }
inline void philox_block2(uint64_t blk, uint64_t seed, uint32_t* out64) {
  philox_block_scalar(blk, seed, out64);
  philox_block_scalar(blk + 1, seed, out64 + 32);
}
#endif

// Raw 32-bit words: out[i] = word (start + i) of the stream (word w of a block of 32 is word w / 8 of counter w % 8).
void philox_words_fill(uint64_t start, int64_t n, uint64_t seed, uint32_t* out) {
  if (n <= 0) return;
  const uint64_t end = start + uint64_t(n);
  alignas(32) uint32_t tmp[32];
  for (uint64_t blk = start / 32; blk * 32 < end; ++blk) {
    const uint64_t b0 = blk * 32;
    philox_block(blk, seed, tmp);
    const uint64_t lo = std::max(b0, start), hi = std::min(b0 + 32, end);
    for (uint64_t e = lo; e < hi; ++e) out[e - start] = tmp[e - b0];
  }
}

// Dropout draws: 16 bits per element. Element e uses block e / 64: its word (e % 64) % 32, low half for
// e % 64 < 32, high half otherwise. out[i] (0..65535) is the draw of element start + i, for i in [0, n).
void philox_fill(uint64_t start, int64_t n, uint64_t seed, uint32_t* out) {
  if (n <= 0) return;
  const uint64_t end = start + uint64_t(n);
  alignas(32) uint32_t w[32];
  uint64_t blk = start / 64;
  if (blk * 64 == start) {  // aligned start: whole blocks two at a time
    alignas(32) uint32_t w2[64];
    for (; (blk + 2) * 64 <= end; blk += 2) {
      philox_block2(blk, seed, w2);
      uint32_t* o = out + (blk * 64 - start);
#pragma omp simd
      for (int i = 0; i < 32; ++i) {
        o[i] = w2[i] & 0xffffu;
        o[32 + i] = w2[i] >> 16;
        o[64 + i] = w2[32 + i] & 0xffffu;
        o[96 + i] = w2[32 + i] >> 16;
      }
    }
  }
  for (; blk * 64 < end; ++blk) {
    const uint64_t b0 = blk * 64;
    philox_block(blk, seed, w);
    if (b0 >= start && b0 + 64 <= end) {
      uint32_t* o = out + (b0 - start);
#pragma omp simd
      for (int i = 0; i < 32; ++i) {
        o[i] = w[i] & 0xffffu;
        o[32 + i] = w[i] >> 16;
      }
    } else {
      const uint64_t lo = std::max(b0, start), hi = std::min(b0 + 64, end);
      for (uint64_t e = lo; e < hi; ++e) {
        const uint64_t i = e - b0;
        out[e - start] = i < 32 ? (w[i] & 0xffffu) : (w[i - 32] >> 16);
      }
    }
  }
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

// Fixed row chunking for deterministic reductions: depends on the row count only.
inline int64_t n_chunks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(64, (rows + 63) / 64)); }

template <typename A>
void reduce_chunks(const std::vector<A>& part, int64_t nch, int64_t d, A* out) {
  for (int64_t j = 0; j < d; ++j) out[j] = 0;
  for (int64_t c = 0; c < nch; ++c) {
    const A* p = part.data() + c * d;
    for (int64_t j = 0; j < d; ++j) out[j] += p[j];
  }
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Row reductions with 4 independent vector accumulators (a single one is bound by the add latency). The order of
// the additions depends on d only: results are bitwise reproducible.
template <typename A> constexpr int64_t kLanes = 4 * 32 / int64_t(sizeof(A));

// v[j] = f(j) for j < d, returning sum_j v[j].
template <typename A, typename F> inline A fill_sum(A* v, int64_t d, F&& f) {
  constexpr int64_t L = kLanes<A>;
  A part[L] = {};
  int64_t j = 0;
  for (; j + L <= d; j += L) {
#pragma omp simd
    for (int64_t k = 0; k < L; ++k) {
      const A t = f(j + k);
      v[j + k] = t;
      part[k] += t;
    }
  }
  A acc = 0;
  for (; j < d; ++j) {
    const A t = f(j);
    v[j] = t;
    acc += t;
  }
  for (int64_t k = 0; k < L; ++k) acc += part[k];
  return acc;
}

template <typename A> inline A row_sqdev(const A* v, A m, int64_t d) {  // sum (v - m)^2
  constexpr int64_t L = kLanes<A>;
  A part[L] = {};
  int64_t j = 0;
  for (; j + L <= d; j += L) {
#pragma omp simd
    for (int64_t k = 0; k < L; ++k) part[k] += (v[j + k] - m) * (v[j + k] - m);
  }
  A acc = 0;
  for (; j < d; ++j) acc += (v[j] - m) * (v[j] - m);
  for (int64_t k = 0; k < L; ++k) acc += part[k];
  return acc;
}

// s1 = sum_j a_j and s2 = sum_j b_j where f(j, a_j, b_j) gives them (and may do more per element), with 4
// independent vector accumulators each, in an order that depends on d only.
template <typename A, typename F> inline void sum2(int64_t d, A& s1, A& s2, F&& f) {
  constexpr int64_t L = kLanes<A>;
  A p1[L] = {}, p2[L] = {};
  int64_t j = 0;
  for (; j + L <= d; j += L) {
#pragma omp simd
    for (int64_t k = 0; k < L; ++k) {
      A a, b;
      f(j + k, a, b);
      p1[k] += a;
      p2[k] += b;
    }
  }
  s1 = 0;
  s2 = 0;
  for (; j < d; ++j) {
    A a, b;
    f(j, a, b);
    s1 += a;
    s2 += b;
  }
  for (int64_t k = 0; k < L; ++k) {
    s1 += p1[k];
    s2 += p2[k];
  }
}

// Dropout keep bits of one row (1 bit per element, what Add & Norm saves for backward instead of regenerating
// the draws): bit j % 8 of byte j / 8 is set iff element j is kept (its draw >= thr).
inline void pack_keep(const uint32_t* rnd, int64_t d, int32_t thr, uint8_t* bits) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256i t = _mm256_set1_epi32(thr - 1);
  for (; j + 8 <= d; j += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rnd + j));
    bits[j >> 3] = uint8_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, t))));
  }
#endif
  for (; j < d; j += 8) {
    uint32_t b = 0;
    for (int64_t k = 0; k < 8 && j + k < d; ++k) b |= uint32_t(int32_t(rnd[j + k]) >= thr) << k;
    bits[j >> 3] = uint8_t(b);
  }
}

// m[j] = scale if element j's keep bit is set, else 0.
template <typename A> inline void unpack_keep(const uint8_t* bits, int64_t d, A scale, A* m) {
  int64_t j = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<A, float>) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 s = _mm256_set1_ps(scale);
    for (; j + 8 <= d; j += 8) {
      const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[j >> 3]), sel);
      _mm256_storeu_ps(m + j, _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel)), s));
    }
  }
#endif
  for (; j < d; ++j) m[j] = ((bits[j >> 3] >> (j & 7)) & 1) ? scale : A(0);
}

// ------------------------------------------------------------------ Add & Norm
}  // namespace
namespace sublayer_cache {  // buffer_cache.cpp: big buffers kept for reuse (no fresh-page faults step after step)
at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype);
}  // namespace sublayer_cache
namespace {

// Streaming (non-temporal) row stores: dst[j] = src[j] without first reading dst's cache lines (a plain store to a
// line not in cache reads it from memory first). Add & Norm streams its saved sum and its input gradients when they
// are big (>= kStreamBytes, beyond a core's L2; any dtype): multi-MB buffers read back only later, so this saves about a third
// of their memory traffic (measured: a fp32 training step 20-25 % faster at 16x128x512 and 64x128x384). The output
// itself is read next by the following layer: plain stores keep it in cache.
constexpr int64_t kStreamBytes = int64_t(1) << 20;
template <typename S> inline void stream_row(S* dst, const S* src, int64_t d) {
  int64_t j = 0;
#if defined(__AVX2__)
  constexpr int64_t L = 32 / int64_t(sizeof(S));  // elements per 32-byte store
  for (; j < d && (reinterpret_cast<uintptr_t>(dst + j) & 31); ++j) dst[j] = src[j];
  for (; j + L <= d; j += L)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
#endif
  for (; j < d; ++j) dst[j] = src[j];
}
inline void stream_fence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

template <typename TX, typename TY, typename TO>
void add_norm_fwd_impl(const Tensor& x, const Tensor& y, const Tensor& w, const Tensor& b, Tensor& out, Tensor& sum,
                       Tensor& mean, Tensor& rstd, Tensor& mask, double eps, const Drop& dr, bool rms) {
  using A = typename Elt<TO>::acc;
  const int64_t N = x.size(0), d = x.size(1);
  const auto* xp = ptr<TX>(x);
  const auto* yp = ptr<TY>(y);
  const A* wp = w.defined() ? static_cast<const A*>(w.data_ptr()) : nullptr;
  const A* bp = b.defined() ? static_cast<const A*>(b.data_ptr()) : nullptr;
  auto* op = ptr<TO>(out);
  auto* sp = sum.numel() ? ptr<TO>(sum) : nullptr;
  A* mp = static_cast<A*>(mean.data_ptr());
  A* rp = static_cast<A*>(rstd.data_ptr());
  uint8_t* kp = mask.numel() ? mask.data_ptr<uint8_t>() : nullptr;
  const int64_t nb = (d + 7) / 8;  // mask bytes per row
  const A scale = A(dr.scale), aeps = A(eps), inv_d = A(1) / A(d);
  const int32_t thr = int32_t(dr.thr);  // draws are 16-bit: a signed compare vectorises
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, d)), [&](int64_t r0, int64_t r1) {
    const A sc = scale;  // locals, not captured references: keeps the inner loops vectorised
    const int32_t th = thr;
    std::vector<A> s(d);
    std::vector<uint32_t> rnd(dr.on ? d : 0);
    const bool nt_sum = sp && N * d * int64_t(sizeof(typename Elt<TO>::store)) >= kStreamBytes;
    // the rounded sum's row when it is not saved, or before it is streamed out
    std::vector<typename Elt<TO>::store> scratch(sp && !nt_sum ? 0 : d);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* xr = xp + r * d;
      const auto* yr = yp + r * d;
      auto* sr = sp && !nt_sum ? sp + r * d : scratch.data();
      A* sv = s.data();
      A total;  // sum of the row: sv (float) and sr (storage type) get the sum rounded to the output type
      if (dr.on) {
        philox_fill(uint64_t(r) * d, d, dr.seed, rnd.data());
        const uint32_t* rv = rnd.data();
        if (kp) pack_keep(rv, d, th, kp + r * nb);
        total = fill_sum(sv, d, [&](int64_t j) {
          const auto t = Elt<TO>::st(Elt<TX>::ld(xr[j]) + Elt<TY>::ld(yr[j]) * (A(int32_t(rv[j]) >= th) * sc));
          sr[j] = t;
          return Elt<TO>::ld(t);
        });
      } else {
        total = fill_sum(sv, d, [&](int64_t j) {
          const auto t = Elt<TO>::st(Elt<TX>::ld(xr[j]) + Elt<TY>::ld(yr[j]));
          sr[j] = t;
          return Elt<TO>::ld(t);
        });
      }
      const A m = rms ? A(0) : total * inv_d;
      const A var = row_sqdev(sv, m, d);
      const A rs = A(1) / std::sqrt(var * inv_d + aeps);
      mp[r] = m;
      rp[r] = rs;
      if (nt_sum) stream_row(sp + r * d, sr, d);
      auto* orow = op + r * d;
      if (wp && bp) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] = Elt<TO>::st((sv[j] - m) * rs * wp[j] + bp[j]);
      } else if (wp) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] = Elt<TO>::st((sv[j] - m) * rs * wp[j]);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] = Elt<TO>::st((sv[j] - m) * rs);
      }
    }
    if (nt_sum) stream_fence();
  });
}

template <typename TX, typename TY, typename TO>
void add_norm_bwd_impl(const Tensor& g, const Tensor& sum, const Tensor& mean, const Tensor& rstd, const Tensor& w,
                       const Tensor& mask, Tensor& dx, Tensor& dy, Tensor& dw, Tensor& db, const Drop& dr, bool rms) {
  using A = typename Elt<TO>::acc;
  const int64_t N = g.size(0), d = g.size(1);
  const auto* gp = ptr<TO>(g);
  const auto* sp = ptr<TO>(sum);
  const A* mp = static_cast<const A*>(mean.data_ptr());
  const A* rp = static_cast<const A*>(rstd.data_ptr());
  const A* wp = w.defined() ? static_cast<const A*>(w.data_ptr()) : nullptr;
  auto* dxp = ptr<TX>(dx);
  auto* dyp = dy.defined() ? ptr<TY>(dy) : nullptr;
  const bool want_dw = dw.defined(), want_db = db.defined();
  const int64_t nch = n_chunks(N), rows_per = (N + nch - 1) / nch;
  std::vector<A> pw(want_dw ? nch * d : 0), pb(want_db ? nch * d : 0);
  const A scale = A(dr.scale), inv_d = A(1) / A(d);
  const uint8_t* kp = mask.defined() && mask.numel() ? mask.data_ptr<uint8_t>() : nullptr;  // saved keep bits
  const int64_t nb = (d + 7) / 8;
  at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
    const A sc = scale;  // a local, not a captured reference: keeps the inner loops vectorised
    std::vector<A> keep(dr.on && dyp ? d : 0), gws(d);
    const bool nt = N * d * int64_t(sizeof(typename Elt<TX>::store)) >= kStreamBytes;  // stream dx, dy out
    std::vector<typename Elt<TX>::store> dxs(nt ? d : 0);  // rows before they are streamed out
    std::vector<typename Elt<TY>::store> dys(nt && dyp ? d : 0);
    for (int64_t c = c0; c < c1; ++c) {
      A* cw = want_dw ? pw.data() + c * d : nullptr;
      A* cb = want_db ? pb.data() + c * d : nullptr;
      if (cw) std::fill(cw, cw + d, A(0));
      if (cb) std::fill(cb, cb + d, A(0));
      const int64_t rend = std::min(N, (c + 1) * rows_per);
      for (int64_t r = c * rows_per; r < rend; ++r) {
        const auto* gr = gp + r * d;
        const auto* sr = sp + r * d;
        const A m = mp[r], rs = rp[r];
        // x^ = (sum - m) * rstd is recomputed where needed rather than stored (the loops are bound by stores, not
        // arithmetic); g * w is stored, so that the final loop uses the very values summed (d = 1 gives dx = 0
        // exactly, whatever the compiler contracts into FMAs).
        auto xh = [&](int64_t j) { return (Elt<TO>::ld(sr[j]) - m) * rs; };
        A* gw_ = gws.data();
        A sg, sgx;  // sum of g*w and of g*w*x^ over the row
        if (wp && cw && cb) {  // the usual training case: weight and bias gradients in the same pass
          sum2(d, sg, sgx, [&](int64_t j, A& s1, A& s2) {
            const A gv = Elt<TO>::ld(gr[j]), xv = xh(j), gw = gv * wp[j];
            cw[j] += gv * xv;
            cb[j] += gv;
            gw_[j] = gw;
            s1 = gw;
            s2 = gw * xv;
          });
        } else {
          if (wp) {
            sum2(d, sg, sgx, [&](int64_t j, A& s1, A& s2) {
              s1 = gw_[j] = Elt<TO>::ld(gr[j]) * wp[j];
              s2 = s1 * xh(j);
            });
          } else {
            sum2(d, sg, sgx, [&](int64_t j, A& s1, A& s2) {
              s1 = gw_[j] = Elt<TO>::ld(gr[j]);
              s2 = s1 * xh(j);
            });
          }
          if (cw) {
#pragma omp simd
            for (int64_t j = 0; j < d; ++j) cw[j] += Elt<TO>::ld(gr[j]) * xh(j);
          }
          if (cb) {
#pragma omp simd
            for (int64_t j = 0; j < d; ++j) cb[j] += Elt<TO>::ld(gr[j]);
          }
        }
        const A a = rms ? A(0) : sg * inv_d, bb = sgx * inv_d;
        A* kv = keep.data();
        if (dyp && dr.on) unpack_keep(kp + r * nb, d, sc, kv);
        auto* dxr = nt ? dxs.data() : dxp + r * d;
        auto* dyr = dyp ? (nt ? dys.data() : dyp + r * d) : nullptr;
        auto ds_at = [&](int64_t j) { return rs * (gw_[j] - a - xh(j) * bb); };  // dx = ds; dy = ds * keep * scale
        if (dyr && dr.on) {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) {
            const A ds = ds_at(j);
            dxr[j] = Elt<TX>::st(ds);
            dyr[j] = Elt<TY>::st(ds * kv[j]);
          }
        } else if (dyr) {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) {
            const A ds = ds_at(j);
            dxr[j] = Elt<TX>::st(ds);
            dyr[j] = Elt<TY>::st(ds);
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) dxr[j] = Elt<TX>::st(ds_at(j));
        }
        if (nt) {
          stream_row(dxp + r * d, dxr, d);
          if (dyr) stream_row(dyp + r * d, dyr, d);
        }
      }
    }
    if (nt) stream_fence();
  });
  if (want_dw) reduce_chunks(pw, nch, d, static_cast<A*>(dw.data_ptr()));
  if (want_db) reduce_chunks(pb, nch, d, static_cast<A*>(db.data_ptr()));
}

// Dispatch (x, y, out) storage types. Supported: (f32|bf16, f32|bf16) and (f64, f64); out = promoted type.
#define SUBLAYER_DISPATCH_XY(XT, YT, NAME, ...)                                                     \
  [&] {                                                                                             \
    using at::kBFloat16;                                                                            \
    using at::kDouble;                                                                              \
    using at::kFloat;                                                                               \
    if (XT == kFloat && YT == kFloat) { using TX = float; using TY = float; using TO = float; return __VA_ARGS__(); } \
    if (XT == kBFloat16 && YT == kBFloat16) { using TX = BF16; using TY = BF16; using TO = BF16; return __VA_ARGS__(); } \
    if (XT == kFloat && YT == kBFloat16) { using TX = float; using TY = BF16; using TO = float; return __VA_ARGS__(); } \
    if (XT == kBFloat16 && YT == kFloat) { using TX = BF16; using TY = float; using TO = float; return __VA_ARGS__(); } \
    if (XT == kDouble && YT == kDouble) { using TX = double; using TY = double; using TO = double; return __VA_ARGS__(); } \
    TORCH_CHECK(false, NAME ": unsupported dtypes ", XT, " and ", YT);                               \
  }()

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> add_norm_fwd(const Tensor& x, const Tensor& y,
                                                        const std::optional<Tensor>& weight,
                                                        const std::optional<Tensor>& bias, double eps, double p,
                                                        int64_t seed, bool rms, bool save_sum) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == y.sizes() && x.is_contiguous() && y.is_contiguous(),
              "add_norm_fwd: x, y must be contiguous 2-D tensors of one shape");
  const auto ot = c10::promoteTypes(x.scalar_type(), y.scalar_type());
  const auto at_ = acc_type(ot);
  const int64_t N = x.size(0), d = x.size(1);
  const int64_t nb = (d + 7) / 8;  // keep bits: bytes per row
  Tensor out = sublayer_cache::empty({N, d}, ot);
  Tensor sum, mean, rstd, mask;
  if (save_sum) {  // what backward needs, in ONE block: sum | keep bits | mean | rstd (each 64-byte aligned)
    auto al = [](int64_t n) { return (n + 63) / 64 * 64; };
    const int64_t sb = al(N * d * int64_t(c10::elementSize(ot))), mb = p > 0 ? al(N * nb) : 0;
    const int64_t rb = al(N * int64_t(c10::elementSize(at_)));
    Tensor block = sublayer_cache::empty({sb + mb + 2 * rb}, at::kByte);
    sum = block.narrow(0, 0, N * d * int64_t(c10::elementSize(ot))).view(ot).view({N, d});
    mask = block.narrow(0, sb, p > 0 ? N * nb : 0).view({p > 0 ? N : 0, nb});
    mean = block.narrow(0, sb + mb, N * int64_t(c10::elementSize(at_))).view(at_);
    rstd = block.narrow(0, sb + mb + rb, N * int64_t(c10::elementSize(at_))).view(at_);
  } else {
    Tensor stats = at::empty({2, N}, x.options().dtype(at_));
    sum = at::empty({0, d}, x.options().dtype(ot));
    mask = at::empty({0, nb}, x.options().dtype(at::kByte));
    mean = stats[0];
    rstd = stats[1];
  }
  Tensor w = weight.has_value() ? weight->contiguous() : Tensor();
  Tensor b = bias.has_value() ? bias->contiguous() : Tensor();
  TORCH_CHECK(!w.defined() || (w.scalar_type() == at_ && w.numel() == d), "add_norm_fwd: weight must be (d,) acc");
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at_ && b.numel() == d), "add_norm_fwd: bias must be (d,) acc");
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_XY(x.scalar_type(), y.scalar_type(), "add_norm_fwd",
                       [&] { add_norm_fwd_impl<TX, TY, TO>(x, y, w, b, out, sum, mean, rstd, mask, eps, dr, rms); });
  return {out, sum, mean, rstd, mask};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_norm_bwd(const Tensor& g, const Tensor& sum, const Tensor& mean,
                                                        const Tensor& rstd, const std::optional<Tensor>& weight,
                                                        const std::optional<Tensor>& mask, at::ScalarType xt, at::ScalarType yt, double p,
                                                        bool rms, bool need_dy, bool need_dw, bool need_db) {
  TORCH_CHECK(g.dim() == 2 && g.sizes() == sum.sizes() && g.is_contiguous() && sum.is_contiguous(),
              "add_norm_bwd: grad and saved sum must be contiguous 2-D tensors of one shape");
  const auto ot = c10::promoteTypes(xt, yt);
  TORCH_CHECK(g.scalar_type() == ot && sum.scalar_type() == ot, "add_norm_bwd: grad dtype must be ", ot);
  const auto at_ = acc_type(ot);
  const int64_t N = g.size(0), d = g.size(1);
  Tensor w = weight.has_value() ? weight->contiguous() : Tensor();
  Tensor k = mask.has_value() ? *mask : Tensor();
  TORCH_CHECK(!(p > 0 && need_dy) || (k.defined() && k.scalar_type() == at::kByte && k.is_contiguous() &&
                                      k.dim() == 2 && k.size(0) == N && k.size(1) == (d + 7) / 8),
              "add_norm_bwd: with dropout, mask must be the (N, ceil(d / 8)) uint8 keep bits of add_norm_fwd");
  Tensor dx = sublayer_cache::empty({N, d}, xt);  // two tensors, never one aliased
  Tensor dy = need_dy ? sublayer_cache::empty({N, d}, yt) : Tensor();
  Tensor dw = need_dw ? at::empty({d}, g.options().dtype(at_)) : Tensor();
  Tensor db = need_db ? at::empty({d}, g.options().dtype(at_)) : Tensor();
  const Drop dr(p, 0);  // the mask comes saved: no draws
  SUBLAYER_DISPATCH_XY(xt, yt, "add_norm_bwd",
                       [&] { add_norm_bwd_impl<TX, TY, TO>(g, sum, mean, rstd, w, k, dx, dy, dw, db, dr, rms); });
  return {dx, dy, dw, db};
}

// ------------------------------------------------------------------ FFN: bias + activation + dropout
using namespace sublayer_act;  // Act, exp_f, vexp, norm_cdf, sigmoid, act_f, act_df (activations.h)

// m[j] = keep * scale of row r's dropout draws (1 without dropout).
template <typename A>
inline void keep_scale_row(const Drop& dr, int64_t r, int64_t f, uint32_t* rnd, A* m) {
  if (!dr.on) {
    std::fill(m, m + f, A(1));
    return;
  }
  philox_fill(uint64_t(r) * f, f, dr.seed, rnd);
  const A sc = A(dr.scale);
  const int32_t th = int32_t(dr.thr);
#pragma omp simd
  for (int64_t j = 0; j < f; ++j) m[j] = A(int32_t(rnd[j]) >= th) * sc;
}

// h = dropout(act(a + bias)) row by row; out may alias a (in-place).
template <typename T, int64_t act>
void act_fwd_impl(const Tensor& a, const Tensor& b, Tensor& out, const Drop& dr) {
  using A = typename Elt<T>::acc;
  const int64_t N = a.size(0), f = a.size(1);
  const auto* ap = ptr<T>(a);
  auto* op = ptr<T>(out);
  const A* bp = b.defined() ? static_cast<const A*>(b.data_ptr()) : nullptr;
  const A scale = A(dr.scale);
  const int32_t thr = int32_t(dr.thr);  // draws are 16-bit: a signed compare vectorises
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, f)), [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> rnd(dr.on ? f : 0);
    std::vector<A> z(f);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* ar = ap + r * f;
      auto* orow = op + r * f;
      if (bp) {
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) z[j] = Elt<T>::ld(ar[j]) + bp[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) z[j] = Elt<T>::ld(ar[j]);
      }
      if (dr.on) {
        philox_fill(uint64_t(r) * f, f, dr.seed, rnd.data());
        if constexpr (act != IDENT) {
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) z[j] = act_f<act>(z[j]);  // separate loop: keeps both vectorised
        }
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) orow[j] = Elt<T>::st(z[j] * (A(int32_t(rnd[j]) >= thr) * scale));
      } else {
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) orow[j] = Elt<T>::st(act_f<act>(z[j]));
      }
    }
  });
}

// da = dh * keep * scale * act'(a + bias) (in place into dh when out aliases it); optionally h (recomputed) and
// the bias gradient sum_rows(da). For RELU, `saved` is h = the fc2 input (h > 0 <=> a > 0 and kept).
template <typename T, int64_t act>
void act_bwd_impl(const Tensor& dh, const Tensor& saved, const Tensor& b, Tensor& da, Tensor& h, Tensor& db,
                  const Drop& dr) {
  using A = typename Elt<T>::acc;
  const int64_t N = dh.size(0), f = dh.size(1);
  const auto* gp = ptr<T>(dh);
  const auto* svp = saved.defined() ? ptr<T>(saved) : nullptr;
  const A* bp = b.defined() ? static_cast<const A*>(b.data_ptr()) : nullptr;
  auto* dap = ptr<T>(da);
  auto* hp = h.defined() ? ptr<T>(h) : nullptr;
  const bool want_db = db.defined();
  const int64_t nch = n_chunks(N), rows_per = (N + nch - 1) / nch;
  std::vector<A> pb(want_db ? nch * f : 0);
  const A scale = A(dr.scale);
  at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
    std::vector<uint32_t> rnd(dr.on ? f : 0);
    std::vector<A> m(f, scale);  // keep * scale per column
    std::vector<A> z(f);
    for (int64_t c = c0; c < c1; ++c) {
      A* cb = want_db ? pb.data() + c * f : nullptr;
      if (cb) std::fill(cb, cb + f, A(0));
      const int64_t rend = std::min(N, (c + 1) * rows_per);
      for (int64_t r = c * rows_per; r < rend; ++r) {
        const auto* gr = gp + r * f;
        auto* dr_ = dap + r * f;
        if constexpr (act == RELU) {
          const auto* hr = svp + r * f;
          const A sc = scale;
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) {  // both loads unconditional and a local scale: vectorises
            const A gv = Elt<T>::ld(gr[j]), hv = Elt<T>::ld(hr[j]);
            dr_[j] = Elt<T>::st(hv > A(0) ? gv * sc : A(0));
          }
        } else {
          if (dr.on) keep_scale_row(dr, r, f, rnd.data(), m.data());
          if constexpr (act == IDENT) {
#pragma omp simd
            for (int64_t j = 0; j < f; ++j) dr_[j] = Elt<T>::st(Elt<T>::ld(gr[j]) * m[j]);
          } else {
            const auto* ar = svp + r * f;
            if (bp) {
#pragma omp simd
              for (int64_t j = 0; j < f; ++j) z[j] = Elt<T>::ld(ar[j]) + bp[j];
            } else {
#pragma omp simd
              for (int64_t j = 0; j < f; ++j) z[j] = Elt<T>::ld(ar[j]);
            }
            if (hp) {  // h and da in one loop: act and act' share their exp / cdf terms
              auto* hr = hp + r * f;
#pragma omp simd
              for (int64_t j = 0; j < f; ++j) {
                const A zj = z[j], mj = m[j];
                hr[j] = Elt<T>::st(act_f<act>(zj) * mj);
                dr_[j] = Elt<T>::st(Elt<T>::ld(gr[j]) * mj * act_df<act>(zj));
              }
            } else {
#pragma omp simd
              for (int64_t j = 0; j < f; ++j) dr_[j] = Elt<T>::st(Elt<T>::ld(gr[j]) * m[j] * act_df<act>(z[j]));
            }
          }
        }
        if (cb) {
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) cb[j] += Elt<T>::ld(dr_[j]);
        }
      }
    }
  });
  if (want_db) reduce_chunks(pb, nch, f, static_cast<A*>(db.data_ptr()));
}

#define SUBLAYER_DISPATCH_T(ST, NAME, ...)                                                      \
  [&] {                                                                                         \
    if (ST == at::kFloat) { using T = float; return __VA_ARGS__(); }                            \
    if (ST == at::kBFloat16) { using T = BF16; return __VA_ARGS__(); }                          \
    if (ST == at::kDouble) { using T = double; return __VA_ARGS__(); }                          \
    TORCH_CHECK(false, NAME ": unsupported dtype ", ST);                                        \
  }()

#define SUBLAYER_DISPATCH_ACT(ACTV, ...)                                                          \
  [&] {                                                                                           \
    switch (ACTV) {                                                                               \
      case RELU: { constexpr int64_t ACT = RELU; return __VA_ARGS__(); }                          \
      case GELU: { constexpr int64_t ACT = GELU; return __VA_ARGS__(); }                          \
      case GELU_TANH: { constexpr int64_t ACT = GELU_TANH; return __VA_ARGS__(); }                \
      case SILU: { constexpr int64_t ACT = SILU; return __VA_ARGS__(); }                          \
      case RELU2: { constexpr int64_t ACT = RELU2; return __VA_ARGS__(); }                        \
      default: { constexpr int64_t ACT = IDENT; return __VA_ARGS__(); }                           \
    }                                                                                             \
  }()

Tensor act_fwd(const Tensor& a, const std::optional<Tensor>& bias, int64_t act, double p, int64_t seed, bool inplace) {
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous(), "act_fwd: a must be a contiguous 2-D tensor");
  TORCH_CHECK(act >= IDENT && act <= RELU2, "act_fwd: unknown activation id ", act);
  Tensor b = bias.has_value() ? bias->contiguous() : Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == acc_type(a.scalar_type()) && b.numel() == a.size(1)),
              "act_fwd: bias must be (f,) in the accumulation dtype");
  Tensor out = inplace ? a : at::empty_like(a);
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_T(a.scalar_type(), "act_fwd", [&] {
    SUBLAYER_DISPATCH_ACT(act, [&] { act_fwd_impl<T, ACT>(a, b, out, dr); });
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> act_bwd(const Tensor& dh, const std::optional<Tensor>& saved,
                                           const std::optional<Tensor>& bias, int64_t act, double p, int64_t seed,
                                           bool want_h, bool want_db, bool inplace) {
  TORCH_CHECK(dh.dim() == 2 && dh.is_contiguous(), "act_bwd: grad must be a contiguous 2-D tensor");
  Tensor sv = saved.has_value() ? saved->contiguous() : Tensor();
  TORCH_CHECK(act == IDENT || (sv.defined() && sv.sizes() == dh.sizes() && sv.scalar_type() == dh.scalar_type()),
              "act_bwd: saved tensor must match the grad");
  Tensor b = bias.has_value() ? bias->contiguous() : Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == acc_type(dh.scalar_type()) && b.numel() == dh.size(1)),
              "act_bwd: bias must be (f,) in the accumulation dtype");
  Tensor da = inplace ? dh : at::empty_like(dh);
  Tensor h = (want_h && act != IDENT && act != RELU) ? at::empty_like(dh) : Tensor();
  Tensor db = want_db ? at::empty({dh.size(1)}, dh.options().dtype(acc_type(dh.scalar_type()))) : Tensor();
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_T(dh.scalar_type(), "act_bwd", [&] {
    SUBLAYER_DISPATCH_ACT(act, [&] { act_bwd_impl<T, ACT>(dh, sv, b, da, h, db, dr); });
  });
  return {da, h, db};
}

// ------------------------------------------------------------------ gated FFN (SwiGLU / GeGLU / ReGLU)
// a: (N, 2f) = x @ W1.T packed [gate | up] along the last dim (bias added here); h = dropout(act(gate) * up), (N, f).
// Dropout element e is the flat index in h, as for the ungated FFN.

template <typename T, int64_t act>
void glu_fwd_impl(const Tensor& a, const std::vector<typename Elt<T>::acc>& bias, Tensor& out, const Drop& dr) {
  using A = typename Elt<T>::acc;
  const int64_t N = a.size(0), f = out.size(1);
  const auto* ap = ptr<T>(a);
  auto* op = ptr<T>(out);  // bias: gate bias (zeros without bias), then the up bias
  at::parallel_for(0, N, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, f)), [&](int64_t r0, int64_t r1) {
    const A* bg = bias.data();  // locals, not captured references: keeps the inner loops vectorised
    const int64_t f = out.size(1);
    std::vector<uint32_t> rnd(dr.on ? f : 0);
    std::vector<A> m(f);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* gr = ap + r * 2 * f;
      const auto* ur = gr + f;
      auto* orow = op + r * f;
      A* mv = m.data();
      keep_scale_row(dr, r, f, rnd.data(), mv);
      const A* bu = bg + f;
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) {
        const A z = Elt<T>::ld(gr[j]) + bg[j], u = Elt<T>::ld(ur[j]) + bu[j];
        orow[j] = Elt<T>::st(act_f<act>(z) * u * mv[j]);
      }
    }
  });
}

// da = [dh * keep * scale * up * act'(gate) | dh * keep * scale * act(gate)], (N, 2f); optionally h (recomputed,
// for fc2's weight gradient) and the bias gradient sum_rows(da), (2f,).
template <typename T, int64_t act>
void glu_bwd_impl(const Tensor& dh, const Tensor& a, const std::vector<typename Elt<T>::acc>& bias, Tensor& da,
                  Tensor& h, Tensor& db, const Drop& dr) {
  using A = typename Elt<T>::acc;
  const int64_t N = dh.size(0), f = dh.size(1), f2 = 2 * f;
  const auto* gp = ptr<T>(dh);
  const auto* ap = ptr<T>(a);
  auto* dap = ptr<T>(da);
  auto* hp = h.defined() ? ptr<T>(h) : nullptr;
  const bool want_db = db.defined();
  const int64_t nch = n_chunks(N), rows_per = (N + nch - 1) / nch;
  std::vector<A> pb(want_db ? nch * f2 : 0);
  at::parallel_for(0, nch, 1, [&](int64_t c0, int64_t c1) {
    const A* bg = bias.data();  // locals, not captured references: keeps the inner loops vectorised
    const int64_t f = dh.size(1), f2 = 2 * f;
    std::vector<uint32_t> rnd(dr.on ? f : 0);
    std::vector<A> m(f);
    for (int64_t c = c0; c < c1; ++c) {
      A* cb = want_db ? pb.data() + c * f2 : nullptr;
      if (cb) std::fill(cb, cb + f2, A(0));
      const int64_t rend = std::min(N, (c + 1) * rows_per);
      for (int64_t r = c * rows_per; r < rend; ++r) {
        const auto* gr = gp + r * f;
        const auto* zr = ap + r * f2;
        const auto* ur = zr + f;
        auto* dg = dap + r * f2;
        auto* du = dg + f;
        A* mv = m.data();
        keep_scale_row(dr, r, f, rnd.data(), mv);
        const A* bu = bg + f;
        if (hp) {  // h in the same loop: act(gate) is computed once
          auto* hr = hp + r * f;
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) {
            const A z = Elt<T>::ld(zr[j]) + bg[j], u = Elt<T>::ld(ur[j]) + bu[j];
            const A gm = Elt<T>::ld(gr[j]) * mv[j], fz = act_f<act>(z);
            dg[j] = Elt<T>::st(gm * u * act_df<act>(z));
            du[j] = Elt<T>::st(gm * fz);
            hr[j] = Elt<T>::st(fz * u * mv[j]);
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) {
            const A z = Elt<T>::ld(zr[j]) + bg[j], u = Elt<T>::ld(ur[j]) + bu[j];
            const A gm = Elt<T>::ld(gr[j]) * mv[j];
            dg[j] = Elt<T>::st(gm * u * act_df<act>(z));
            du[j] = Elt<T>::st(gm * act_f<act>(z));
          }
        }
        if (cb) {
#pragma omp simd
          for (int64_t j = 0; j < f2; ++j) cb[j] += Elt<T>::ld(dg[j]);
        }
      }
    }
  });
  if (want_db) reduce_chunks(pb, nch, f2, static_cast<A*>(db.data_ptr()));
}

// The bias as a (2f,) accumulation-type vector, zeros when absent (one loop for both cases).
template <typename A> std::vector<A> glu_bias(const std::optional<Tensor>& bias, int64_t f2) {
  std::vector<A> v(f2, A(0));
  if (bias.has_value()) {
    const Tensor b = bias->contiguous();
    TORCH_CHECK(b.numel() == f2 && b.scalar_type() == (sizeof(A) == 8 ? at::kDouble : at::kFloat),
                "glu: bias must be (2f,) in the accumulation dtype");
    std::copy(b.data_ptr<A>(), b.data_ptr<A>() + f2, v.begin());
  }
  return v;
}

Tensor glu_fwd(const Tensor& a, const std::optional<Tensor>& bias, int64_t act, double p, int64_t seed) {
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) % 2 == 0,
              "glu_fwd: a must be a contiguous (N, 2f) tensor");
  TORCH_CHECK(act >= RELU && act <= RELU2, "glu_fwd: unknown gate activation id ", act);
  const int64_t f = a.size(1) / 2;
  Tensor out = at::empty({a.size(0), f}, a.options());
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_T(a.scalar_type(), "glu_fwd", [&] {
    const auto b = glu_bias<typename Elt<T>::acc>(bias, 2 * f);
    SUBLAYER_DISPATCH_ACT(act, [&] { glu_fwd_impl<T, ACT>(a, b, out, dr); });
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> glu_bwd(const Tensor& dh, const Tensor& a, const std::optional<Tensor>& bias,
                                           int64_t act, double p, int64_t seed, bool want_h, bool want_db) {
  TORCH_CHECK(dh.dim() == 2 && dh.is_contiguous(), "glu_bwd: grad must be a contiguous 2-D tensor");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(0) == dh.size(0) && a.size(1) == 2 * dh.size(1) &&
                  a.scalar_type() == dh.scalar_type(),
              "glu_bwd: saved pre-activation must be (N, 2f) of the grad's dtype");
  TORCH_CHECK(act >= RELU && act <= RELU2, "glu_bwd: unknown gate activation id ", act);
  const int64_t f = dh.size(1);
  Tensor da = at::empty_like(a);
  Tensor h = want_h ? at::empty_like(dh) : Tensor();
  Tensor db = want_db ? at::empty({2 * f}, dh.options().dtype(acc_type(dh.scalar_type()))) : Tensor();
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_T(dh.scalar_type(), "glu_bwd", [&] {
    const auto b = glu_bias<typename Elt<T>::acc>(bias, 2 * f);
    SUBLAYER_DISPATCH_ACT(act, [&] { glu_bwd_impl<T, ACT>(dh, a, b, da, h, db, dr); });
  });
  return {da, h, db};
}

// Raw Philox words for element indices [start, start + n) (for tests of the stream itself).
// scalar=true: the portable per-lane implementation (tests check the AVX2 one against it).
Tensor philox_words(int64_t start, int64_t n, int64_t seed, bool scalar) {
  Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  std::vector<uint32_t> w(n);
  if (scalar) {
    uint32_t tmp[32];
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t e = uint64_t(start + i);
      philox_block_scalar(e / 32, uint64_t(seed), tmp);
      w[i] = tmp[e % 32];
    }
  } else {
    philox_words_fill(uint64_t(start), n, uint64_t(seed), w.data());
  }
  auto* op = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) op[i] = int64_t(w[i]);
  return out;
}

}  // namespace

TORCH_LIBRARY(sublayer_kernels, m) {
  m.def("add_norm_fwd(Tensor x, Tensor y, Tensor? weight, Tensor? bias, float eps, float p, int seed, bool rms, "
        "bool save_sum) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("add_norm_bwd(Tensor g, Tensor sum, Tensor mean, Tensor rstd, Tensor? weight, Tensor? mask, ScalarType x_dtype, ScalarType y_dtype, "
        "float p, bool rms, bool need_dy, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("act_fwd(Tensor a, Tensor? bias, int act, float p, int seed, bool inplace) -> Tensor");
  m.def("act_bwd(Tensor dh, Tensor? saved, Tensor? bias, int act, float p, int seed, bool want_h, bool want_db, "
        "bool inplace) -> (Tensor, Tensor, Tensor)");
  m.def("glu_fwd(Tensor a, Tensor? bias, int act, float p, int seed) -> Tensor");
  m.def("glu_bwd(Tensor dh, Tensor a, Tensor? bias, int act, float p, int seed, bool want_h, bool want_db) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("philox_words(int start, int n, int seed, bool scalar) -> Tensor");
}

TORCH_LIBRARY_IMPL(sublayer_kernels, CPU, m) {
  m.impl("add_norm_fwd", &add_norm_fwd);
  m.impl("add_norm_bwd", &add_norm_bwd);
  m.impl("act_fwd", &act_fwd);
  m.impl("act_bwd", &act_bwd);
  m.impl("glu_fwd", &glu_fwd);
  m.impl("glu_bwd", &glu_bwd);
}

TORCH_LIBRARY_IMPL(sublayer_kernels, CompositeExplicitAutograd, m) { m.impl("philox_words", &philox_words); }
