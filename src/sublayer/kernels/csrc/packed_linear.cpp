// Packed linear layers for decoding (registered as torch.ops.sublayer_kernels.*): what one generated token costs.
//
//  * skinny_linear: y = act(x @ W^T + b) for few rows (1..16, any count works) reading W once from a packed layout
//    (W (N, K) stored as ceil(N/16) panels of K x 16 floats, zero-padded: see pack_linear_weight). The panels may
//    also be float16 (widened exactly in registers, F16C; accumulation in float32): half the bytes, for the
//    screening pass of greedy decoding's LM head (models/decoding.py, GreedyHead), or int8 with a per-column scale
//    (weight-only int8). Decoding reads every weight once per token, so this is a streaming kernel: each thread
//    walks a contiguous run of panels, each panel is read from memory once and re-read from L2 by the next row
//    chunk (up to 4 rows at a time, 2 AVX2 vectors x 4 rows = 8 FMA accumulators). torch's GEMV (MKL/oneDNN
//    sgemv) reaches about a third of the memory bandwidth here on the GPT-2 shapes; this reaches most of it.
//  * pack_linear_weight: the panel layout; decode_avx512: the switch between the AVX-512 and AVX2 micro-kernels.
//  * screened_argmax: greedy decoding's exact argmax from screened (approximate) logits and error bounds.
//
// float32 activations only (the decode path's compute dtype on an AVX2 CPU), over both threads (at::parallel_for).

#include "common.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <atomic>
#include <limits>

namespace sublayer {
namespace {

constexpr int64_t PANEL = 16;  // output columns per packed panel (two AVX2 vectors)
constexpr int64_t ROWS = 6;    // rows of x per AVX2 micro-kernel call: 12 accumulators + 2 weights + 1 broadcast
constexpr int STREAMS = 4;     // panels read at once for a single row (panels_kernel)
std::atomic<bool> g_avx512{true};  // decode_avx512

// 8 consecutive weights of a panel as float32: float32 as is, float16 widened exactly (F16C), int8 converted
// (its per-column scale is applied in the epilogue).
#if SUBLAYER_AVX2_FMA
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
#if SUBLAYER_AVX2_FMA
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
// (`sublayer bench --decode` reports the GB/s reached). 2*NP
// accumulators (8 for NP=4) fit AVX2's 16 registers and are enough independent FMA chains.
template <int NP, typename T>
inline void panels_kernel(const float* x, const T* w, int64_t K, float* acc) {
#if SUBLAYER_AVX2_FMA
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

#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
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

#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
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

// Epilogue activations: act_norm.h's Act ids (as sublayer.functional.fused.ACT_IDS) and act_f; tanh-GELU,
// GPT-2's, is vectorised here as z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3), as act_f computes it.
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
#if SUBLAYER_AVX2_FMA
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
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
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
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
          if (std::is_same<T, int8_t>::value && g_avx512.load(std::memory_order_relaxed))
            panels_kernel<STREAMS>(xp, wp + p * K * PANEL, K, acc);  // int8: the AVX-512 overload
          else
#endif
            panels_kernel<STREAMS, T>(xp, wp + p * K * PANEL, K, acc);
          for (int64_t q = 0; q < STREAMS; ++q) store(p + q, 0, 1, acc + q * PANEL);
        }
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
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
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
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

}  // namespace

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

namespace {

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

// max_j (a[j] - e[j]) with e[j] = xn * bound[j] + rel * |a[j]| (the lower end of row j's interval); sets nan if
// any a[j] is NaN.
inline float lower_max(const float* a, const float* bound, int64_t V, float xn, float rel, bool& nan) {
  float lo = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if SUBLAYER_AVX2_FMA
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
#if SUBLAYER_AVX2_FMA
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

}  // namespace
}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("decode_avx512(int flag) -> bool", &sublayer::decode_avx512);
  m.def("screened_argmax(Tensor x, Tensor screened, Tensor weight, Tensor? bias, Tensor bound) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int n, int act=0, Tensor? scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(sublayer_kernels, CPU, m) {
  m.impl("pack_linear_weight", &sublayer::pack_linear_weight);
  m.impl("screened_argmax", &sublayer::screened_argmax);
  m.impl("skinny_linear", &sublayer::skinny_linear);
}
