// sublayer decoding kernels (torch.ops.sublayer_kernels.*): what one generated token costs on a CPU.
//
//  * skinny_linear: y = act(x @ W^T + b) for few rows (1..16, any count works) reading W once from a packed layout
//    (W (N, K) stored as ceil(N/16) panels of K x 16 floats, zero-padded: see pack_linear_weight). The panels may
//    also be float16 (widened exactly in registers, F16C; accumulation in float32): half the bytes, for the
//    screening pass of greedy decoding's LM head (models/decoding.py, GreedyHead). Decoding reads
//    every weight once per token, so this is a streaming kernel: each thread walks a contiguous run of panels, each
//    panel is read from memory once and re-read from L2 by the next row chunk (up to 4 rows at a time, 2 AVX2
//    vectors x 4 rows = 8 FMA accumulators). torch's GEMV (MKL/oneDNN sgemv) reaches about a third of the memory
//    bandwidth here on the GPT-2 shapes; this reaches most of it.
//  * decode_attention: one query per row against a static key/value cache (B, H, T_max, hd): optionally writes
//    this step's key/value at position length-1 first, then softmax(q k^T * scale) v over the first `length`
//    positions, skipping those the (B, T_max) padding mask marks True. A row whose keys are all masked gets zeros.
//    An optional (N, T_max) row table says which cache row holds each key (beam search reorders the table, not
//    the caches; beams share their sentence's cross-attention memory). Per head: four keys' dot products at a
//    time (one hadd ladder), the output in registers, the next head's lines prefetched.
//  * qkv_self_attention: the encoder's self-attention read straight from the fused q|k|v projection (B*S rows).
//  * gpt2_decode_layers / transformer_decode_layers: a whole decoding step (every block or layer) in one call.
//
// All run on float32 only (the decode path's compute dtype on an AVX2 CPU), over both threads (at::parallel_for).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include "activations.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SUBLAYER_DECODE_AVX2 1
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;
constexpr int64_t PANEL = 16;  // output columns per packed panel (two AVX2 vectors)
constexpr int64_t ROWS = 6;    // rows of x per AVX2 micro-kernel call: 12 accumulators + 2 weights + 1 broadcast
constexpr int STREAMS = 4;     // panels read at once for a single row (panels_kernel)
std::atomic<bool> g_avx512{true};  // decode_avx512

void check_float_contig(const Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must be ", dim, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// The data of an optional (rows, cols) padding mask (True = skip), checked; null when absent.
const bool* padding_mask(const c10::optional<Tensor>& mask, int64_t rows, int64_t cols, const char* op) {
  if (!mask.has_value() || !mask->defined()) return nullptr;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == rows &&
                  mask->size(1) == cols && mask->is_contiguous(),
              op, ": mask must be a contiguous bool (", rows, ", ", cols, ") tensor");
  return mask->data_ptr<bool>();
}

// 8 consecutive weights of a panel as float32: float32 as is, float16 widened exactly (F16C), int8 converted
// (its per-column scale is applied in the epilogue).
#if SUBLAYER_DECODE_AVX2
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}
#endif

// acc[r][0..15] = sum_k x[r][k] * w[k][0..15] for R rows; w is one panel (K x 16) of T (float, Half or int8).
template <typename T, int R>
inline void panel_kernel(const float* x, int64_t ldx, const T* w, int64_t K, float* acc) {
#if SUBLAYER_DECODE_AVX2
  if constexpr (R >= 3) {  // 2R accumulators (12 at 6 rows): enough independent FMA chains, and with the two
    // weight vectors and a broadcast within AVX2's 16 registers (the two-k scheme below would spill them)
    __m256 a0[R], a1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * PANEL) + 2048, _MM_HINT_T0);
      const __m256 w0 = load8(w + k * PANEL), w1 = load8(w + k * PANEL + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k);
        a0[r] = _mm256_fmadd_ps(xa, w0, a0[r]);
        a1[r] = _mm256_fmadd_ps(xa, w1, a1[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * PANEL, a0[r]);
      _mm256_storeu_ps(acc + r * PANEL + 8, a1[r]);
    }
    return;
  }
  __m256 a0[R], a1[R], b0[R], b1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = b0[r] = b1[r] = _mm256_setzero_ps();
  int64_t k = 0;
  // two k per iteration into separate accumulators: R=1 would otherwise wait on the FMA latency
  for (; k + 2 <= K; k += 2) {
    // software prefetch 2 KB ahead: the hardware streamer stops at 4 KB page boundaries
    _mm_prefetch(reinterpret_cast<const char*>(w + k * PANEL) + 2048, _MM_HINT_T0);
    if (sizeof(T) == 4) _mm_prefetch(reinterpret_cast<const char*>(w + k * PANEL) + 2048 + 64, _MM_HINT_T0);
    const __m256 w0 = load8(w + k * PANEL), w1 = load8(w + k * PANEL + 8);
    const __m256 w2 = load8(w + k * PANEL + 16), w3 = load8(w + k * PANEL + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k), xb = _mm256_broadcast_ss(x + r * ldx + k + 1);
      a0[r] = _mm256_fmadd_ps(xa, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xa, w1, a1[r]);
      b0[r] = _mm256_fmadd_ps(xb, w2, b0[r]);
      b1[r] = _mm256_fmadd_ps(xb, w3, b1[r]);
    }
  }
  for (; k < K; ++k) {
    const __m256 w0 = load8(w + k * PANEL), w1 = load8(w + k * PANEL + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k);
      a0[r] = _mm256_fmadd_ps(xa, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xa, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * PANEL, _mm256_add_ps(a0[r], b0[r]));
    _mm256_storeu_ps(acc + r * PANEL + 8, _mm256_add_ps(a1[r], b1[r]));
  }
#else
  for (int r = 0; r < R; ++r) {
    float s[PANEL] = {0};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int j = 0; j < PANEL; ++j) s[j] += xv * static_cast<float>(w[k * PANEL + j]);
    }
    for (int j = 0; j < PANEL; ++j) acc[r * PANEL + j] = s[j];
  }
#endif
}

// One row against NP panels at once (acc + i*16 as panel_kernel<T, 1> for panel w + i*K*16): NP weight streams in
// flight per thread keep more cache-line misses outstanding than one, which is what bounds a core's read bandwidth
// (GPT-2's layers: ~19 GB/s with one stream per thread, ~26 GB/s with four, on the 2-core Xeon here). 2*NP
// accumulators (8 for NP=4) fit AVX2's 16 registers and are enough independent FMA chains.
template <int NP, typename T>
inline void panels_kernel(const float* x, const T* w, int64_t K, float* acc) {
#if SUBLAYER_DECODE_AVX2
  __m256 a0[NP], a1[NP];
  for (int i = 0; i < NP; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
  const int64_t stride = K * PANEL;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + k + 1);
    for (int i = 0; i < NP; ++i) {
      const T* wi = w + i * stride + k * PANEL;
      _mm_prefetch(reinterpret_cast<const char*>(wi) + 2048, _MM_HINT_T0);
      if (sizeof(T) == 4) _mm_prefetch(reinterpret_cast<const char*>(wi) + 2048 + 64, _MM_HINT_T0);
      a0[i] = _mm256_fmadd_ps(xa, load8(wi), a0[i]);
      a1[i] = _mm256_fmadd_ps(xa, load8(wi + 8), a1[i]);
      a0[i] = _mm256_fmadd_ps(xb, load8(wi + 16), a0[i]);
      a1[i] = _mm256_fmadd_ps(xb, load8(wi + 24), a1[i]);
    }
  }
  for (; k < K; ++k) {
    const __m256 xa = _mm256_broadcast_ss(x + k);
    for (int i = 0; i < NP; ++i) {
      a0[i] = _mm256_fmadd_ps(xa, load8(w + i * stride + k * PANEL), a0[i]);
      a1[i] = _mm256_fmadd_ps(xa, load8(w + i * stride + k * PANEL + 8), a1[i]);
    }
  }
  for (int i = 0; i < NP; ++i) {
    _mm256_storeu_ps(acc + i * PANEL, a0[i]);
    _mm256_storeu_ps(acc + i * PANEL + 8, a1[i]);
  }
#else
  for (int i = 0; i < NP; ++i) panel_kernel<T, 1>(x, 0, w + i * K * PANEL, K, acc + i * PANEL);
#endif
}

#if SUBLAYER_DECODE_AVX2 && defined(__AVX512F__)
// Several rows on AVX-512 CPUs: a panel's 16 columns at one k are one 16-lane vector, so R rows take R
// accumulators, one weight load and R broadcasts per k: up to 8 rows per call (ROWS512), nearly twice the FMAs per
// cycle of the AVX2 kernel where rows make the product compute-bound (batched decoding, beams). Same sums per k
// order as panel_kernel up to its even/odd-k split.
constexpr int64_t ROWS512 = 8;
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const at::Half* w) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

template <typename T, int R>
inline void panel_kernel512(const float* x, int64_t ldx, const T* w, int64_t K, float* acc) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * PANEL) + 2048, _MM_HINT_T0);
    const __m512 wk = load16(w + k * PANEL);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wk, a[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * PANEL, a[r]);
}

// Two neighbouring panels at once (acc: R rows of the first panel, then R rows of the second): each broadcast of
// x feeds two FMAs, so the loads (the limit of panel_kernel512 at 8 rows) drop from 9 to 10 per 16 FMAs.
template <typename T, int R>
inline void panel_pair_kernel512(const float* x, int64_t ldx, const T* w, int64_t K, float* acc) {
  __m512 a[R], b[R];
  for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
  const T* w1 = w + K * PANEL;
  for (int64_t k = 0; k < K; ++k) {
    if ((k & 1) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k * PANEL) + 2048, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + k * PANEL) + 2048, _MM_HINT_T0);
    }
    const __m512 wa = load16(w + k * PANEL), wb = load16(w1 + k * PANEL);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      a[r] = _mm512_fmadd_ps(xv, wa, a[r]);
      b[r] = _mm512_fmadd_ps(xv, wb, b[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * PANEL, a[r]);
    _mm512_storeu_ps(acc + (R + r) * PANEL, b[r]);
  }
}
#endif

#if SUBLAYER_DECODE_AVX2 && defined(__AVX512F__)
// One row against NP int8 panels on AVX-512 CPUs: a panel's 16 int8 at one k widen into one 16-lane vector (half
// the widening instructions of the AVX2 path; int8 panels carry a quarter of float32's bytes, so the widening,
// not memory, is what the AVX2 path spends its time on); each broadcast of x serves all NP panels.
template <int NP>
inline void panels_kernel(const float* x, const int8_t* w, int64_t K, float* acc) {
  __m512 a[NP], b[NP];
  for (int i = 0; i < NP; ++i) a[i] = b[i] = _mm512_setzero_ps();
  const int64_t stride = K * PANEL;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {  // 4 k = one 64-byte line of each panel
    const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
    const __m512 x2 = _mm512_set1_ps(x[k + 2]), x3 = _mm512_set1_ps(x[k + 3]);
    for (int i = 0; i < NP; ++i) {
      const int8_t* wi = w + i * stride + k * PANEL;
      _mm_prefetch(reinterpret_cast<const char*>(wi) + 2048, _MM_HINT_T0);
      a[i] = _mm512_fmadd_ps(x0, load16(wi), a[i]);
      b[i] = _mm512_fmadd_ps(x1, load16(wi + PANEL), b[i]);
      a[i] = _mm512_fmadd_ps(x2, load16(wi + 2 * PANEL), a[i]);
      b[i] = _mm512_fmadd_ps(x3, load16(wi + 3 * PANEL), b[i]);
    }
  }
  for (; k < K; ++k)
    for (int i = 0; i < NP; ++i)
      a[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), load16(w + i * stride + k * PANEL), a[i]);
  for (int i = 0; i < NP; ++i) _mm512_storeu_ps(acc + i * PANEL, _mm512_add_ps(a[i], b[i]));
}
#endif

// Epilogue activations: activations.h's Act ids (as sublayer.functional.fused.ACT_IDS) and act_f; tanh-GELU,
// GPT-2's, is vectorised here as z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3), as act_f computes it.
using namespace sublayer_act;  // Act and act_f (activations.h), as kernels.cpp and int8.cpp

#if SUBLAYER_DECODE_AVX2
// Cephes expf on 8 lanes (range reduction + degree-5 polynomial, ~1 ulp), inputs clamped to [-87.3, 88.3].
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

template <int64_t A>
inline void act_panel(float* v) {
  for (int j = 0; j < PANEL; ++j) v[j] = act_f<A>(v[j]);
}

// v[0..15] = act(v * scale + bias) in place (scale: int8 weights' per-column scale, or null).
inline void epilogue(float* v, const float* scale, const float* bias, int64_t act) {
  if (scale)
    for (int j = 0; j < PANEL; ++j) v[j] *= scale[j];
  if (bias)
    for (int j = 0; j < PANEL; ++j) v[j] += bias[j];
  if (act == GELU_TANH) {
#if SUBLAYER_DECODE_AVX2
    for (int j = 0; j < PANEL; j += 8) {
      const __m256 z = _mm256_loadu_ps(v + j);
      const __m256 z3 = _mm256_mul_ps(_mm256_mul_ps(z, z), z);
      const __m256 u2 = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.79788456080286535588f),
                                      _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), z3, z));
      const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), u2)));
      _mm256_storeu_ps(v + j, _mm256_div_ps(z, den));
    }
#else
    act_panel<GELU_TANH>(v);
#endif
  } else if (act == RELU) {
    act_panel<RELU>(v);
  } else if (act == GELU) {
    act_panel<GELU>(v);
  } else if (act == SILU) {
    act_panel<SILU>(v);
  } else if (act == RELU2) {
    act_panel<RELU2>(v);
  }
}

template <typename T>
void skinny_panels(const float* xp, int64_t ldx, int64_t M, int64_t K, const T* wp, int64_t P, const float* sp,
                   const float* bp, int64_t n, int64_t act, float* op) {
  using PanelFn = void (*)(const float*, int64_t, const T*, int64_t, float*);
  static constexpr PanelFn kPanel[ROWS + 1] = {nullptr,           panel_kernel<T, 1>, panel_kernel<T, 2>,
                                               panel_kernel<T, 3>, panel_kernel<T, 4>, panel_kernel<T, 5>,
                                               panel_kernel<T, 6>};
  const PanelFn* panel = kPanel;
  int64_t rows = ROWS;
#if SUBLAYER_DECODE_AVX2 && defined(__AVX512F__)
  static constexpr PanelFn kPanel512[ROWS512 + 1] = {
      nullptr, panel_kernel512<T, 1>, panel_kernel512<T, 2>, panel_kernel512<T, 3>, panel_kernel512<T, 4>,
      panel_kernel512<T, 5>, panel_kernel512<T, 6>, panel_kernel512<T, 7>, panel_kernel512<T, 8>};
  static constexpr PanelFn kPair512[ROWS512 + 1] = {
      nullptr, panel_pair_kernel512<T, 1>, panel_pair_kernel512<T, 2>, panel_pair_kernel512<T, 3>,
      panel_pair_kernel512<T, 4>, panel_pair_kernel512<T, 5>, panel_pair_kernel512<T, 6>,
      panel_pair_kernel512<T, 7>, panel_pair_kernel512<T, 8>};
  const PanelFn* pair = nullptr;
  if (M > 1 && g_avx512.load(std::memory_order_relaxed)) {
    panel = kPanel512;
    pair = kPair512;
    rows = ROWS512;
  }
#endif
  // Panels are handed out in chunks of ~256 KB from a shared counter, not split in halves up front: a thread
  // that the OS or a neighbour slows down takes fewer chunks instead of holding the other one at the join.
  // (a multiple of STREAMS panels, so that a single row reads STREAMS panels at a time)
  const int64_t bytes = std::max<int64_t>(1, K * PANEL * int64_t(sizeof(T)));
  const int64_t chunk = ((std::max<int64_t>(1, (int64_t(1) << 18) / bytes) + STREAMS - 1) / STREAMS) * STREAMS;
  const int64_t n_chunks = (P + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n_chunks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    float acc[2 * 8 * PANEL];  // up to two panels of max(ROWS, STREAMS, ROWS512) rows
    auto store = [&](int64_t p, int64_t r0, int64_t R, float* a) {  // epilogue + copy out: R rows of panel p
      const int64_t c0 = p * PANEL, nc = std::min<int64_t>(PANEL, n - c0);
      float spanel[PANEL] = {0}, bpanel[PANEL] = {0};  // this panel's scale and bias, zero-padded past n
      if (sp) std::copy(sp + c0, sp + c0 + nc, spanel);
      if (bp) std::copy(bp + c0, bp + c0 + nc, bpanel);
      for (int64_t r = 0; r < R; ++r) {
        epilogue(a + r * PANEL, sp ? spanel : nullptr, bp ? bpanel : nullptr, act);
        std::copy(a + r * PANEL, a + r * PANEL + nc, op + (r0 + r) * n + c0);
      }
    };
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) {
      const int64_t pe = std::min(P, (c + 1) * chunk);
      int64_t p = c * chunk;
      if (M == 1)  // one row (batch-1 decoding): STREAMS panels at a time
        for (; p + STREAMS <= pe; p += STREAMS) {
#if SUBLAYER_DECODE_AVX2 && defined(__AVX512F__)
          if (std::is_same<T, int8_t>::value && g_avx512.load(std::memory_order_relaxed))
            panels_kernel<STREAMS>(xp, wp + p * K * PANEL, K, acc);  // int8: the AVX-512 overload
          else
#endif
            panels_kernel<STREAMS, T>(xp, wp + p * K * PANEL, K, acc);
          for (int64_t q = 0; q < STREAMS; ++q) store(p + q, 0, 1, acc + q * PANEL);
        }
#if SUBLAYER_DECODE_AVX2 && defined(__AVX512F__)
      if (pair)  // several rows on AVX-512: two panels at a time
        for (; p + 2 <= pe; p += 2)
          for (int64_t r0 = 0; r0 < M; r0 += ROWS512) {
            const int64_t R = std::min<int64_t>(ROWS512, M - r0);
            pair[R](xp + r0 * ldx, ldx, wp + p * K * PANEL, K, acc);
            store(p, r0, R, acc);
            store(p + 1, r0, R, acc + R * PANEL);
          }
#endif
      for (; p < pe; ++p)
        for (int64_t r0 = 0; r0 < M; r0 += rows) {
          const int64_t R = std::min<int64_t>(rows, M - r0);
          panel[R](xp + r0 * ldx, ldx, wp + p * K * PANEL, K, acc);
          store(p, r0, R, acc);
        }
    }
  });
}

// Whether skinny_linear uses the AVX-512 micro-kernels (several rows; one row of int8) where compiled in (tests switch it off to
// check the AVX2 one on the same machine): decode_avx512(flag) sets it and returns the previous value; -1 reads it.
bool decode_avx512(int64_t flag) {
#if SUBLAYER_DECODE_AVX2 && defined(__AVX512F__)
  const bool was = g_avx512.load();
  if (flag >= 0) g_avx512.store(flag != 0);
  return was;
#else
  (void)flag;
  return false;
#endif
}

// Checks x (M, K) / packed (P, K, 16) / bias (n,) / act for skinny_linear; returns the bias pointer or null.
const float* check_skinny(const char* op, const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias,
                          int64_t n, int64_t act, const c10::optional<Tensor>& scale) {
  TORCH_CHECK(act >= IDENT && act <= RELU2, op, ": act ", act,
              " unsupported (0 none, 1 relu, 2 GELU, 3 tanh-GELU, 4 SiLU, 5 relu^2)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be a 2-D float32 CPU tensor with unit inner stride");
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.is_contiguous() &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kHalf ||
                   packed.scalar_type() == at::kChar),
              op, ": packed must be a contiguous 3-D float32, float16 or int8 CPU tensor");
  const bool scaled = scale.has_value() && scale->defined() && scale->numel() > 0;
  TORCH_CHECK(scaled == (packed.scalar_type() == at::kChar), op, ": a scale (n,) goes with int8 panels, and only");
  if (scaled) {
    check_float_contig(*scale, op, 1);
    TORCH_CHECK(scale->size(0) == n, op, ": scale must have ", n, " elements, got ", scale->size(0));
  }
  const int64_t K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == PANEL, op, ": packed must be (P, K=", K, ", 16), got ",
              packed.sizes());
  TORCH_CHECK(n > (P - 1) * PANEL && n <= P * PANEL, op, ": n=", n, " does not fit ", P, " panels");
  if (!(bias.has_value() && bias->defined())) return nullptr;
  check_float_contig(*bias, op, 1);
  TORCH_CHECK(bias->size(0) == n, op, ": bias must have ", n, " elements, got ", bias->size(0));
  return bias->data_ptr<float>();
}

// x (M, K) float32 (row stride free, unit inner stride), packed (P, K, 16) -> (M, n) = act(x @ W^T * scale + bias):
// float32 or float16 panels (no scale), or int8 panels with their per-column scale (weight-only int8).
Tensor skinny_linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias, int64_t n,
                     int64_t act, const c10::optional<Tensor>& scale) {
  const float* bp = check_skinny("skinny_linear", x, packed, bias, n, act, scale);
  Tensor out = at::empty({x.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  if (M == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (packed.scalar_type() == at::kChar)
    skinny_panels(xp, x.stride(0), M, K, packed.data_ptr<int8_t>(), P, scale->data_ptr<float>(), bp, n, act, op);
  else if (packed.scalar_type() == at::kHalf)
    skinny_panels(xp, x.stride(0), M, K, packed.data_ptr<at::Half>(), P, nullptr, bp, n, act, op);
  else
    skinny_panels(xp, x.stride(0), M, K, packed.data_ptr<float>(), P, nullptr, bp, n, act, op);
  return out;
}

// Ask for transparent huge pages on the 2 MB-aligned interior of a fresh buffer (before its pages are touched):
// streaming hundreds of MB through 4 KB pages costs a TLB miss every 4 KB. A hint only; ignored where unsupported.
void advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t huge = uintptr_t(2) << 20;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(huge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// W (N, K) -> (ceil(N/16), K, 16), zero-padded columns; float32 or float16, kept.
template <typename T>
void pack_panels(const T* src, T* dst, int64_t N, int64_t K, int64_t P) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < PANEL; ++j) {
          const int64_t c = p * PANEL + j;
          dst[(p * K + k) * PANEL + j] = c < N ? src[c * K + k] : T(0);
        }
  });
}

Tensor pack_linear_weight(const Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf || w.scalar_type() == at::kChar),
              "pack_linear_weight: weight must be a contiguous 2-D float32, float16 or int8 CPU tensor, got ",
              w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL;
  Tensor out = at::empty({P, K, PANEL}, w.options());
  advise_huge_pages(out.data_ptr(), size_t(out.numel()) * out.element_size());
  if (w.scalar_type() == at::kHalf)
    pack_panels(w.data_ptr<at::Half>(), out.data_ptr<at::Half>(), N, K, P);
  else if (w.scalar_type() == at::kChar)
    pack_panels(w.data_ptr<int8_t>(), out.data_ptr<int8_t>(), N, K, P);
  else
    pack_panels(w.data_ptr<float>(), out.data_ptr<float>(), N, K, P);
  return out;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// max_j (a[j] - e[j]) with e[j] = xn * bound[j] + rel * |a[j]| (the lower end of row j's interval); sets nan if
// any a[j] is NaN.
inline float lower_max(const float* a, const float* bound, int64_t V, float xn, float rel, bool& nan) {
  float lo = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if SUBLAYER_DECODE_AVX2
  const __m256 vxn = _mm256_set1_ps(xn), vrel = _mm256_set1_ps(rel), sign = _mm256_set1_ps(-0.0f);
  __m256 vlo = _mm256_set1_ps(lo), vnan = _mm256_setzero_ps();
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(a + j);
    const __m256 e = _mm256_fmadd_ps(vxn, _mm256_loadu_ps(bound + j), _mm256_mul_ps(vrel, _mm256_andnot_ps(sign, v)));
    vlo = _mm256_max_ps(vlo, _mm256_sub_ps(v, e));
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float l8[8];
  _mm256_storeu_ps(l8, vlo);
  for (float l : l8) lo = std::max(lo, l);
  nan |= _mm256_movemask_ps(vnan) != 0;
#endif
  for (; j < V; ++j) {
    lo = std::max(lo, a[j] - (xn * bound[j] + rel * std::fabs(a[j])));
    nan |= std::isnan(a[j]);
  }
  return lo;
}

// The float32 argmax of x @ W^T + bias per row, given screened logits (the same product over an approximate
// weight) and per-row error bounds: |screened[j] - exact[j]| <= ||x_r||_2 * bound[j] + 2^-21 |screened[j]|.
// Only rows whose interval reaches the best lower end are recomputed in float32 (models/decoding.py, GreedyHead,
// has the argument). A NaN or a non-finite best lower end makes every row a candidate; NaN wins as in
// torch.argmax, and ties go to the first index.
Tensor screened_argmax(const Tensor& x, const Tensor& screened, const Tensor& weight, const c10::optional<Tensor>& bias,
                       const Tensor& bound) {
  check_float_contig(screened, "screened_argmax: screened", 2);
  check_float_contig(weight, "screened_argmax: weight", 2);
  check_float_contig(bound, "screened_argmax: bound", 1);
  const int64_t M = screened.size(0), V = screened.size(1), K = weight.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == M && x.size(1) == K && x.stride(1) == 1,
              "screened_argmax: x must be float32 (", M, ", ", K, ") with unit inner stride, got ", x.sizes());
  TORCH_CHECK(weight.size(0) == V && bound.size(0) == V,
              "screened_argmax: weight (V, K) and bound (V,) disagree with screened (M, V)");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_float_contig(*bias, "screened_argmax: bias", 1);
    TORCH_CHECK(bias->size(0) == V, "screened_argmax: bias must have ", V, " elements");
    bp = bias->data_ptr<float>();
  }
  Tensor out = at::empty({M}, screened.options().dtype(at::kLong));
  const float *sp = screened.data_ptr<float>(), *wp = weight.data_ptr<float>(), *eb = bound.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const float rel = std::ldexp(1.0f, -21);
  for (int64_t r = 0; r < M; ++r) {
    const float* a = sp + r * V;
    const float* xr = x.data_ptr<float>() + r * x.stride(0);
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) ss += double(xr[k]) * double(xr[k]);
    const float xn = float(std::sqrt(ss)) * (1.0f + std::ldexp(1.0f, -10));  // ||x_r||_2, rounded up
    bool nan = false;
    const float lo = lower_max(a, eb, V, xn, rel, nan);
    const bool all = nan || !std::isfinite(lo);
    int64_t best = -1;
    float bv = 0.0f;
    auto consider = [&](int64_t j) {
      if (!all && !(a[j] + (xn * eb[j] + rel * std::fabs(a[j])) >= lo)) return;
      const float v = dot(xr, wp + j * K, K) + (bp ? bp[j] : 0.0f);
      if (best < 0 || v > bv || (std::isnan(v) && !std::isnan(bv))) {
        best = j;
        bv = v;
      }
    };
    int64_t j = 0;
#if SUBLAYER_DECODE_AVX2
    if (!all) {  // skip blocks of 8 with no candidate (the test above, 8 lanes at a time)
      const __m256 vxn = _mm256_set1_ps(xn), vrel = _mm256_set1_ps(rel), sign = _mm256_set1_ps(-0.0f);
      const __m256 vlo = _mm256_set1_ps(lo);
      for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(a + j);
        const __m256 e =
            _mm256_fmadd_ps(vxn, _mm256_loadu_ps(eb + j), _mm256_mul_ps(vrel, _mm256_andnot_ps(sign, v)));
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(v, e), vlo, _CMP_GE_OQ)) == 0) continue;
        for (int64_t i = j; i < j + 8; ++i) consider(i);
      }
    }
#endif
    for (; j < V; ++j) consider(j);
    op[r] = best < 0 ? 0 : best;
  }
  return out;
}

// s[j] = scale * (q . K[j]) for j < L (key rows ks floats apart), -inf where m[j] (mask, may be null); returns
// max_j s[j].
inline float head_scores(const float* q, const float* K, int64_t ks, const bool* m, int64_t L, int64_t hd, float sc,
                         float* s) {
  int64_t j = 0;
#if SUBLAYER_DECODE_AVX2
  if (hd % 8 == 0) {  // four keys at a time, their four sums reduced together by a hadd ladder
    const __m128 vsc = _mm_set1_ps(sc);
    for (; j + 4 <= L; j += 4) {
      const float* k0 = K + j * ks;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t e = 0; e < hd; e += 8) {
        const __m256 qv = _mm256_loadu_ps(q + e);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + e), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + ks + e), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * ks + e), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * ks + e), a3);
      }
      // lanes of t: [a0 0-3, a1 0-3, a2 0-3, a3 0-3 | the same over elements 4-7]
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
      _mm_storeu_ps(s + j, _mm_mul_ps(r, vsc));
    }
  }
#endif
  for (; j < L; ++j) s[j] = dot(q, K + j * ks, hd) * sc;
  float mx = -std::numeric_limits<float>::infinity();
  for (j = 0; j < L; ++j) {
    if (m && m[j]) s[j] = -std::numeric_limits<float>::infinity();
    mx = std::max(mx, s[j]);
  }
  return mx;
}

// s[j] = exp(s[j] - mx) in place (-inf -> 0); returns their sum.
inline float exp_scores(float* s, int64_t L, float mx) {
  float sum = 0.0f;
  int64_t j = 0;
#if SUBLAYER_DECODE_AVX2
  {  // exp of 8 scores at a time (exp256: ~1 ulp; masked scores, -inf, are clamped to e^-87.3 -> re-zeroed)
    __m256 vs = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (; j + 8 <= L; j += 8) {
      const __m256 v = _mm256_loadu_ps(s + j);
      const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(v, vmx)));
      _mm256_storeu_ps(s + j, e);
      vs = _mm256_add_ps(vs, e);
    }
    float l8[8];
    _mm256_storeu_ps(l8, vs);
    for (float l : l8) sum += l;
  }
#endif
  for (; j < L; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

#if SUBLAYER_DECODE_AVX2
// o[0, 8*NV) = inv * sum_j p[j] V[j][0, 8*NV) (V rows vs floats apart), the accumulators in registers.
template <int NV>
inline void weighted_sum_chunk(const float* p, float inv, const float* V, int64_t vs, int64_t L, float* o) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (p[j] == 0.0f) continue;  // a masked key: skipped, so a non-finite value there cannot leak in
    const __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = V + j * vs;
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * v), acc[v]);
  }
  const __m256 vi = _mm256_set1_ps(inv);
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + 8 * v, _mm256_mul_ps(acc[v], vi));
}
#endif

// o[0, hd) = inv * sum_{j<L} p[j] V[j] (rows vs floats apart); keys with p[j] == 0 (masked) are skipped.
inline void head_weighted_sum(const float* p, float inv, const float* V, int64_t vs, int64_t L, int64_t hd,
                              float* o) {
#if SUBLAYER_DECODE_AVX2
  if (hd % 8 == 0) {
    for (int64_t c = 0; c < hd; c += 64) {  // up to 8 vectors of the output per pass over the keys
      switch (std::min<int64_t>(8, (hd - c) / 8)) {
        case 1: weighted_sum_chunk<1>(p, inv, V + c, vs, L, o + c); break;
        case 2: weighted_sum_chunk<2>(p, inv, V + c, vs, L, o + c); break;
        case 3: weighted_sum_chunk<3>(p, inv, V + c, vs, L, o + c); break;
        case 4: weighted_sum_chunk<4>(p, inv, V + c, vs, L, o + c); break;
        case 5: weighted_sum_chunk<5>(p, inv, V + c, vs, L, o + c); break;
        case 6: weighted_sum_chunk<6>(p, inv, V + c, vs, L, o + c); break;
        case 7: weighted_sum_chunk<7>(p, inv, V + c, vs, L, o + c); break;
        default: weighted_sum_chunk<8>(p, inv, V + c, vs, L, o + c); break;
      }
    }
    return;
  }
#endif
  std::fill(o, o + hd, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    if (p[j] == 0.0f) continue;
    const float pj = p[j] * inv;
    const float* vj = V + j * vs;
#pragma omp simd
    for (int64_t e = 0; e < hd; ++e) o[e] += pj * vj[e];
  }
}

// q (N, H*hd) unit inner stride; kc, vc (B, H, T_max, hd) contiguous; mask (N, T_max) bool, True = skip; rows
// (N, T_max) int64 or none: key j of query row n is cache row rows[n, j] (beam search reorders this table instead
// of copying caches; beams share their sentence's cross-attention memory), else row n itself (then N == B).
Tensor decode_attention(const Tensor& q, const Tensor& kc, const Tensor& vc, const c10::optional<Tensor>& mask,
                        int64_t length, double scale, const c10::optional<Tensor>& new_k,
                        const c10::optional<Tensor>& new_v, const c10::optional<Tensor>& rows) {
  check_float_contig(kc, "decode_attention: k_cache", 4);
  check_float_contig(vc, "decode_attention: v_cache", 4);
  TORCH_CHECK(kc.sizes() == vc.sizes(), "decode_attention: k_cache and v_cache shapes differ");
  const int64_t B = kc.size(0), H = kc.size(1), T = kc.size(2), hd = kc.size(3), d = H * hd, N = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 2 && q.size(1) == d && q.stride(1) == 1,
              "decode_attention: q must be float32 (N, ", d, ") with unit inner stride, got ", q.sizes());
  TORCH_CHECK(length >= 1 && length <= T, "decode_attention: length ", length, " outside [1, ", T, "]");
  const int64_t* rp = nullptr;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 2 && rows->size(0) == N && rows->size(1) == T &&
                    rows->is_contiguous(),
                "decode_attention: rows must be a contiguous int64 (N=", N, ", T_max=", T, ") tensor");
    rp = rows->data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < length; ++j) {
        TORCH_CHECK(rp[n * T + j] >= 0 && rp[n * T + j] < B, "decode_attention: rows[", n, ", ", j, "] = ",
                    rp[n * T + j], " is not a cache row in [0, ", B, ")");
      }
    }
  } else {
    TORCH_CHECK(N == B, "decode_attention: q has ", N, " rows but the caches ", B, " (pass rows to map them)");
  }
  const bool* mp = padding_mask(mask, N, T, "decode_attention");
  const bool write = new_k.has_value() && new_k->defined();
  if (write) {  // query row n writes cache row n (a compacted batch, N < B, keeps the first N rows' slots)
    TORCH_CHECK(N <= B, "decode_attention: new_k/new_v need at most one query row per cache row");
    for (const Tensor* t : {&*new_k, &*new_v}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == N && t->size(1) == d &&
                      t->stride(1) == 1,
                  "decode_attention: new_k/new_v must be float32 (N, ", d, ") with unit inner stride");
    }
    for (int64_t n = 0; rp && n < N; ++n) {
      TORCH_CHECK(rp[n * T + length - 1] == n, "decode_attention: rows[", n, ", ", length - 1, "] must be ", n,
                  " (the new key is written in the row's own cache row)");
    }
  }
  Tensor out = at::empty({N, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qp = q.data_ptr<float>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* nk = write ? new_k->data_ptr<float>() : nullptr;
  const float* nv = write ? new_v->data_ptr<float>() : nullptr;
  const int64_t qs = q.stride(0), nks = write ? new_k->stride(0) : 0, nvs = write ? new_v->stride(0) : 0;
  const float sc = float(scale);
  // threads only when there is enough to read: a parallel region costs more than a short head's work
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, length * hd));
  // A head's keys and values are a few cache lines that the step last touched long ago (L3 or DRAM), too short a
  // run for the hardware prefetcher: the next head's (two ahead for heads under 8 lines) are fetched explicitly,
  // so its misses overlap this head's arithmetic (in the decoder steps: attention 30-40% faster).
  const int64_t lines = (length * hd * int64_t(sizeof(float)) + 63) / 64, ahead = lines < 8 ? 2 : 1;
  at::parallel_for(0, N * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(length);
    std::vector<float> gk, gv;  // a head's keys and values gathered from several cache rows
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / H, h = i % H;
      if (i + ahead < i1) {
        const int64_t n2 = (i + ahead) / H, h2 = (i + ahead) % H, r2 = rp ? rp[n2 * T] : n2;
        const char* k2 = reinterpret_cast<const char*>(kp + (r2 * H + h2) * T * hd);
        const char* v2 = reinterpret_cast<const char*>(vp + (r2 * H + h2) * T * hd);
        for (int64_t l = 0; l < lines; ++l) {
          __builtin_prefetch(k2 + l * 64, 0, 3);
          __builtin_prefetch(v2 + l * 64, 0, 3);
        }
      }
      const bool* m = mp ? mp + n * T : nullptr;
      const float* qh = qp + n * qs + h * hd;
      float* o = op + n * d + h * hd;
      int64_t r = n;  // the cache row when every key of this query is in one row
      bool one_row = true;
      if (rp) {
        r = rp[n * T];
        for (int64_t j = 1; j < length && one_row; ++j) one_row = rp[n * T + j] == r;
      }
      float* K = kp + (r * H + h) * T * hd;
      float* V = vp + (r * H + h) * T * hd;
      if (write) {
        float* Kn = kp + (n * H + h) * T * hd;
        float* Vn = vp + (n * H + h) * T * hd;
        std::copy(nk + n * nks + h * hd, nk + n * nks + (h + 1) * hd, Kn + (length - 1) * hd);
        std::copy(nv + n * nvs + h * hd, nv + n * nvs + (h + 1) * hd, Vn + (length - 1) * hd);
      }
      if (!one_row) {
        gk.resize(length * hd);
        gv.resize(length * hd);
        for (int64_t j = 0; j < length; ++j) {
          const int64_t off = (rp[n * T + j] * H + h) * T * hd + j * hd;
          std::copy(kp + off, kp + off + hd, gk.data() + j * hd);
          std::copy(vp + off, vp + off + hd, gv.data() + j * hd);
        }
        K = gk.data();
        V = gv.data();
      }
      const float mx = head_scores(qh, K, hd, m, length, hd, sc, s.data());
      if (mx == -std::numeric_limits<float>::infinity()) {  // every key masked: zeros (as SDPA)
        std::fill(o, o + hd, 0.0f);
        continue;
      }
      const float sum = exp_scores(s.data(), length, mx);
      head_weighted_sum(s.data(), 1.0f / sum, V, hd, length, hd, o);
    }
  });
  return out;
}

// Self-attention of B sequences of S rows each, read straight from the fused projection: qkv (B*S, 3*H*hd) with
// unit inner stride (q | k | v of row b*S + t), mask (B, S) bool True = padding (those keys are skipped, and those
// query rows get zeros). Returns (B*S, H*hd) = softmax(q k^T * scale) v per sequence and head; no transposes and
// no (B, H, S, S) scores: each (sequence, head) is a few KB that stay in L1 while its S queries run.
Tensor qkv_self_attention(const Tensor& qkv, const c10::optional<Tensor>& mask, int64_t n_heads, int64_t seq_len,
                          double scale) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1,
              "qkv_self_attention: qkv must be a float32 matrix with unit inner stride, got ", qkv.sizes());
  const int64_t S = seq_len, H = n_heads, rows = qkv.size(0);
  TORCH_CHECK(S >= 1 && H >= 1 && rows % S == 0 && qkv.size(1) % (3 * H) == 0,
              "qkv_self_attention: qkv ", qkv.sizes(), " is not (B*", S, ", 3*", H, "*head_dim)");
  const int64_t B = rows / S, d = qkv.size(1) / 3, hd = d / H, rs = qkv.stride(0);
  const bool* mp = padding_mask(mask, B, S, "qkv_self_attention");
  Tensor out = at::empty({rows, d}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  const float* base = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = float(scale);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, S * S * hd));
  at::parallel_for(0, B * H, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      const float* Q = base + b * S * rs + h * hd;
      const float* K = Q + d;
      const float* V = Q + 2 * d;
      const bool* m = mp ? mp + b * S : nullptr;
      for (int64_t t = 0; t < S; ++t) {
        float* o = op + (b * S + t) * d + h * hd;
        const float mx = (m && m[t]) ? -std::numeric_limits<float>::infinity()
                                     : head_scores(Q + t * rs, K, rs, m, S, hd, sc, s.data());
        if (mx == -std::numeric_limits<float>::infinity()) {  // a padding row, or no key to see: zeros
          std::fill(o, o + hd, 0.0f);
          continue;
        }
        const float sum = exp_scores(s.data(), S, mx);
        head_weighted_sum(s.data(), 1.0f / sum, V, rs, S, hd, o);
      }
    }
  });
  return out;
}

// h = LayerNorm(x) per row (two-pass variance), and first x += y when y is given: GPT-2's residual + ln.
void add_layer_norm(float* x, const float* y, const Tensor& w, const Tensor& b, double eps, float* h, int64_t B,
                    int64_t d) {
  const float *wp = w.data_ptr<float>(), *bp = b.data_ptr<float>();
  // rows on both threads only for big batches (a translate step's hundreds of rows): a parallel region costs more
  // than a few rows' work
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, d));
  at::parallel_for(0, B, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = x + r * d;
      if (y) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) xr[j] += y[r * d + j];
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < d; ++j) sum += xr[j];
      const float m = sum / float(d);
      float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < d; ++j) sq += (xr[j] - m) * (xr[j] - m);
      const float rs = 1.0f / std::sqrt(sq / float(d) + float(eps));
      float* hr = h + r * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) hr[j] = (xr[j] - m) * rs * wp[j] + bp[j];
    }
  });
}

// One GPT-2 decoding step through every block (models/decoding.py's gpt2_step, in one call): x (B, d) the
// embeddings of this step's tokens; per block 16 tensors in `params`: ln_1 weight, bias; then for q|k|v, the
// out-projection, [ln_2 weight, bias], fc1 and fc2 each (packed, scale, bias) as skinny_linear takes them (scale
// empty for float panels); then ln_f weight, bias; the blocks' caches (B, H, T_max, hd), written at position
// length-1. Returns ln_f of the last residual stream (B, d).
Tensor gpt2_decode_layers(const Tensor& x, at::TensorList params, at::TensorList k_caches, at::TensorList v_caches,
                          const c10::optional<Tensor>& mask, int64_t length, double eps, int64_t act) {
  constexpr int64_t PER = 16;
  const int64_t n_layers = int64_t(k_caches.size());
  TORCH_CHECK(n_layers > 0 && int64_t(params.size()) == PER * n_layers + 2 && int64_t(v_caches.size()) == n_layers,
              "gpt2_decode_layers: expected 16 tensors per block + 2 and one k/v cache per block");
  check_float_contig(x, "gpt2_decode_layers: x", 2);
  const int64_t B = x.size(0), d = x.size(1);
  Tensor resid = x.clone();
  Tensor h = at::empty_like(resid);
  float *rp = resid.data_ptr<float>(), *hp = h.data_ptr<float>();
  for (int64_t i = 0; i <= n_layers; ++i) {  // every LayerNorm: float32 (d,)
    const Tensor* P = params.data() + PER * i;
    constexpr int64_t norms[] = {0, 1, 8, 9};  // ln_1 weight, bias; ln_2 weight, bias (ln_f: the first two)
    for (int64_t u = 0; u < (i < n_layers ? 4 : 2); ++u) {
      check_float_contig(P[norms[u]], "gpt2_decode_layers: LayerNorm parameter", 1);
      TORCH_CHECK(P[norms[u]].size(0) == d, "gpt2_decode_layers: LayerNorm parameters must have ", d, " elements");
    }
  }
  add_layer_norm(rp, nullptr, params[0], params[1], eps, hp, B, d);
  const double scale = 1.0 / std::sqrt(double(d / k_caches[0].size(1)));
  for (int64_t i = 0; i < n_layers; ++i) {
    const Tensor* P = params.data() + PER * i;
    auto linear = [&](const Tensor& in, const Tensor* L, int64_t n, int64_t a) {  // L: packed, scale, bias
      return skinny_linear(in, L[0], L[2], n, a, L[1]);
    };
    const int64_t dff = P[12].size(0);  // fc1 bias
    const Tensor qkv = linear(h, P + 2, 3 * d, IDENT);
    const Tensor ctx = decode_attention(qkv.narrow(1, 0, d), k_caches[i], v_caches[i], mask, length, scale,
                                        qkv.narrow(1, d, d), qkv.narrow(1, 2 * d, d), c10::nullopt);
    const Tensor o = linear(ctx, P + 5, d, IDENT);
    add_layer_norm(rp, o.data_ptr<float>(), P[8], P[9], eps, hp, B, d);
    const Tensor f = linear(h, P + 10, dff, act);
    const Tensor y = linear(f, P + 13, d, IDENT);
    const Tensor* next = P + PER;  // the next block's ln_1, or ln_f
    add_layer_norm(rp, y.data_ptr<float>(), next[0], next[1], eps, hp, B, d);
  }
  return h;
}

template <int64_t A>
void act_rows(float* p, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) p[i] = act_f<A>(p[i]);
  });
}

// y = act(x @ W^T + b) for a decoder step's rows: skinny_linear on the packed panels for up to max_rows rows,
// else torch's GEMM (addmm) on the unpacked weight and the activation in place (models/decoding.py, PackedLinear).
// L: packed, scale (empty: float panels), bias, weight.
Tensor step_linear(const Tensor& x, const Tensor* L, int64_t act, int64_t max_rows) {
  const int64_t n = L[2].size(0);
  if (x.size(0) <= max_rows) return skinny_linear(x, L[0], L[2], n, act, L[1]);
  Tensor y = at::addmm(L[2], x, L[3].t());
  float* yp = y.data_ptr<float>();
  switch (act) {
    case RELU: act_rows<RELU>(yp, y.numel()); break;
    case GELU: act_rows<GELU>(yp, y.numel()); break;
    case GELU_TANH: act_rows<GELU_TANH>(yp, y.numel()); break;
    case SILU: act_rows<SILU>(yp, y.numel()); break;
    case RELU2: act_rows<RELU2>(yp, y.numel()); break;
    default: break;
  }
  return y;
}

// One Transformer decoder step through every layer (models/decoding.py's transformer_stepper step, in one call):
// x (N, d) this step's target embeddings (scaled, plus the position's encoding). Per layer 30 tensors in `params`:
// for q|k|v, out, q_cross, out_cross, fc1, fc2 each (packed, scale, bias, weight) as step_linear takes them; then
// the self-attention, cross-attention and FFN residuals' LayerNorm weight, bias; then the final norm's weight and
// bias (empty tensors: none). k_caches/v_caches (N, H, T_max, hd) get this step's keys at position length-1;
// cross_k/cross_v (B, H, S, hd) hold the memory's, with cross_mask (N, S) True = padding; rows (N, T_max) and
// cross_rows (N, S) map query rows to cache rows (decode_attention) or are absent. norm_first: pre-norm residuals
// x + f(LN(x)), else post-norm LN(x + f(x)). Returns the final hidden states (N, d), what the LM head reads.
Tensor transformer_decode_layers(const Tensor& x, at::TensorList params, at::TensorList k_caches,
                                 at::TensorList v_caches, at::TensorList cross_k, at::TensorList cross_v,
                                 const c10::optional<Tensor>& cross_mask, const c10::optional<Tensor>& rows,
                                 const c10::optional<Tensor>& cross_rows, int64_t length, double eps, int64_t act,
                                 bool norm_first, int64_t max_rows) {
  constexpr int64_t PER = 30, NORMS = 24;
  const int64_t n_layers = int64_t(k_caches.size());
  TORCH_CHECK(n_layers > 0 && int64_t(params.size()) == PER * n_layers + 2 && int64_t(v_caches.size()) == n_layers &&
                  int64_t(cross_k.size()) == n_layers && int64_t(cross_v.size()) == n_layers,
              "transformer_decode_layers: expected 30 tensors per layer + 2 and one cache of each kind per layer");
  TORCH_CHECK(act >= IDENT && act <= RELU2, "transformer_decode_layers: act ", act, " is not a fused activation");
  check_float_contig(x, "transformer_decode_layers: x", 2);
  const int64_t N = x.size(0), d = x.size(1), S = cross_k[0].size(2);
  const bool final_norm = params[PER * n_layers].numel() > 0;
  for (int64_t i = 0; i <= n_layers; ++i) {  // every LayerNorm: float32 (d,)
    for (int64_t u = 0; u < (i < n_layers ? 6 : (final_norm ? 2 : 0)); ++u) {
      const Tensor& t = params[PER * i + (i < n_layers ? NORMS : 0) + u];
      check_float_contig(t, "transformer_decode_layers: LayerNorm parameter", 1);
      TORCH_CHECK(t.size(0) == d, "transformer_decode_layers: LayerNorm parameters must have ", d, " elements");
    }
  }
  Tensor resid = x.clone();
  Tensor h = norm_first ? at::empty_like(resid) : resid;  // post-norm: the sublayers read the residual stream
  float *rp = resid.data_ptr<float>(), *hp = h.data_ptr<float>();
  const double scale = 1.0 / std::sqrt(double(d / k_caches[0].size(1)));
  // a residual: pre-norm x += y, then h = LN(x) with the norm that follows (the next sublayer's; none: h = x);
  // post-norm x = LN(x + y) in place (h is x)
  auto residual = [&](const Tensor& y, const Tensor* norm_here, const Tensor* norm_next) {
    if (!norm_first) {
      add_layer_norm(rp, y.data_ptr<float>(), norm_here[0], norm_here[1], eps, rp, N, d);
    } else if (norm_next) {
      add_layer_norm(rp, y.data_ptr<float>(), norm_next[0], norm_next[1], eps, hp, N, d);
    } else {
      const float* yp = y.data_ptr<float>();
      for (int64_t j = 0; j < N * d; ++j) hp[j] = rp[j] += yp[j];
    }
  };
  if (norm_first) add_layer_norm(rp, nullptr, params[NORMS], params[NORMS + 1], eps, hp, N, d);
  for (int64_t i = 0; i < n_layers; ++i) {
    const Tensor* P = params.data() + PER * i;
    const Tensor* norm = P + NORMS;  // self, cross, ffn: weight, bias each
    const Tensor* after = i + 1 < n_layers ? P + PER + NORMS : (final_norm ? P + PER : nullptr);
    const Tensor qkv = step_linear(h, P, IDENT, max_rows);
    const Tensor ctx = decode_attention(qkv.narrow(1, 0, d), k_caches[i], v_caches[i], c10::nullopt, length, scale,
                                        qkv.narrow(1, d, d), qkv.narrow(1, 2 * d, d), rows);
    residual(step_linear(ctx, P + 4, IDENT, max_rows), norm, norm + 2);
    const Tensor q = step_linear(h, P + 8, IDENT, max_rows);
    const Tensor cctx = decode_attention(q, cross_k[i], cross_v[i], cross_mask, S, scale, c10::nullopt, c10::nullopt,
                                         cross_rows);
    residual(step_linear(cctx, P + 12, IDENT, max_rows), norm + 2, norm + 4);
    const Tensor f = step_linear(h, P + 16, act, max_rows);
    residual(step_linear(f, P + 20, IDENT, max_rows), norm + 4, after);
  }
  if (!norm_first && final_norm) {
    Tensor out = at::empty_like(resid);
    add_layer_norm(rp, nullptr, params[PER * n_layers], params[PER * n_layers + 1], eps, out.data_ptr<float>(), N, d);
    return out;
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("decode_avx512(int flag) -> bool", &decode_avx512);
  m.def("gpt2_decode_layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor? mask, "
        "int length, float eps, int act) -> Tensor");
  m.def("transformer_decode_layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor[] cross_k, Tensor[] cross_v, Tensor? cross_mask, Tensor? rows, Tensor? cross_rows, int length, "
        "float eps, int act, bool norm_first, int max_rows) -> Tensor");
  m.def("screened_argmax(Tensor x, Tensor screened, Tensor weight, Tensor? bias, Tensor bound) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int n, int act=0, Tensor? scale=None) -> Tensor");
  m.def("qkv_self_attention(Tensor qkv, Tensor? mask, int n_heads, int seq_len, float scale) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? mask, int length, float scale, "
        "Tensor? new_k, Tensor? new_v, Tensor? rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(sublayer_kernels, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("gpt2_decode_layers", &gpt2_decode_layers);
  m.impl("transformer_decode_layers", &transformer_decode_layers);
  m.impl("screened_argmax", &screened_argmax);
  m.impl("skinny_linear", &skinny_linear);
  m.impl("decode_attention", &decode_attention);
  m.impl("qkv_self_attention", &qkv_self_attention);
}
