// Packed linear layers for decoding (registered as torch.ops.sublayer_kernels.*): what one generated token costs.
//
//  * skinny_linear: y = act(x @ W^T + b) for few rows (1..16, any count works) reading W once from a packed layout
//    (W (N, K) stored as ceil(N/16) panels of K x 16 floats, zero-padded: see pack_linear_weight). The panels may
//    also be float16 (widened exactly in registers, F16C; accumulation in float32): half the bytes, for the
//    screening pass of greedy decoding's LM head (models/decoding.py, GreedyHead), bfloat16 (k pairs
//    interleaved, widened exactly by a shift or a mask; half the bytes of float32: bf16 decoding), compact bfloat16
//    (the same weights in 12 bits each, lossless: pack_compact_bf16), or int8 with a per-column scale (weight-only
//    int8). bfloat16 numerics: one row, AVX2, or decode_bf16_dot(0): float32 x times
//    the exactly widened weights, float32 sums (= F.linear(x, w.float())); several rows on AVX512_BF16 CPUs: x
//    rounded to bf16, vdpbf16ps (= F.linear(x.bfloat16().float(), w.float()), as torch's bf16 GEMM multiplies).
//    Decoding reads every weight once per token, so this is a streaming kernel: each thread
//    walks a contiguous run of panels, each panel is read from memory once and re-read from L2 by the next row
//    chunk (up to 4 rows at a time, 2 AVX2 vectors x 4 rows = 8 FMA accumulators). torch's GEMV (MKL/oneDNN
//    sgemv) reaches about a third of the memory bandwidth here on the GPT-2 shapes; this reaches most of it.
//  * pack_linear_weight: the panel layout; decode_avx512: the switch between the AVX-512 and AVX2 micro-kernels;
//    decode_bf16_dot: between vdpbf16ps and widening for several rows of bf16 panels.
//  * screened_argmax: greedy decoding's exact argmax from screened (approximate) logits and error bounds.
//
// float32 activations only (the decode path's compute dtype), over both threads (at::parallel_for).

#include "common.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <array>
#include <atomic>
#include <limits>
#include <utility>

namespace sublayer {
namespace {

constexpr int64_t PANEL = 16;  // output columns per packed panel (two AVX2 vectors)
constexpr int64_t ROWS = 6;    // rows of x per AVX2 micro-kernel call: 12 accumulators + 2 weights + 1 broadcast
constexpr int STREAMS = 4;     // panels read at once for a single row (panels_kernel)
std::atomic<bool> g_avx512{true};  // decode_avx512
std::atomic<bool> g_bf16dot{true};  // decode_bf16_dot

// A kernel's table by row count: {null, make(1), ..., make(N)}, make taking std::integral_constant<int, R>; nested,
// a table by panel count of tables by row count.
template <typename Make, int... R>
constexpr auto rows_table(Make make, std::integer_sequence<int, R...>) {
  using E = decltype(make(std::integral_constant<int, 1>()));
  return std::array<E, sizeof...(R) + 1>{E{}, make(std::integral_constant<int, R + 1>())...};
}
template <int N, typename Make> constexpr auto rows_table(Make make) {
  return rows_table(make, std::make_integer_sequence<int, N>());
}

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

// The kernels walk K in pairs: wk = a panel + k * PANEL (k even) and wload8<ODD>(wk, h) is columns 8h..8h+7 at k
// (ODD=0) or k+1 (ODD=1). bfloat16 panels interleave the pair (pack_linear_weight): one 32-byte load holds both
// k of 8 columns, k in the low and k+1 in the high half of each 32-bit lane, so widening is one shift (k) or one
// mask (k+1) and no shuffle. Widening is exact: a float32 with the bf16's bits and 16 zero bits.
template <int ODD, typename T>
inline __m256 wload8(const T* wk, int h) {
  return load8(wk + ODD * PANEL + h * 8);
}
template <int ODD>
inline __m256 wload8(const at::BFloat16* wk, int h) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + h * 16));
  return _mm256_castsi256_ps(ODD ? _mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))) : _mm256_slli_epi32(v, 16));
}
#endif

// Weight (k, column j) of a panel, any element type (the portable path): bfloat16 panels are k-pair interleaved.
template <typename T>
inline float wat(const T* w, int64_t k, int64_t j) {
  return static_cast<float>(w[k * PANEL + j]);
}
inline float wat(const at::BFloat16* w, int64_t k, int64_t j) {
  return static_cast<float>(w[(k & ~int64_t(1)) * PANEL + 2 * j + (k & 1)]);
}

// Elements from one panel to the next: K x 16, or for bfloat16 K rounded up to even (the pairs' zero padding).
template <typename T>
constexpr int64_t panel_elems(int64_t K) {
  return (std::is_same<T, at::BFloat16>::value ? K + (K & 1) : K) * PANEL;
}

// acc[r][0..15] = sum_k x[r][k] * w[k][0..15] for R rows; w is one panel (K x 16) of T (float, Half or int8).
template <typename T, int R>
inline void panel_kernel(const float* x, int64_t ldx, const T* w, int64_t K, float* acc) {
#if SUBLAYER_AVX2_FMA
  if constexpr (R >= 3) {  // 2R accumulators (12 at 6 rows): enough independent FMA chains, and with the two
    // weight vectors and a broadcast within AVX2's 16 registers (the two-k scheme below would spill them)
    __m256 a0[R], a1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    auto step = [&](auto odd, const T* wk, int64_t k) {  // odd: std::integral_constant, k + odd's row
      constexpr int ODD = decltype(odd)::value;
      const __m256 w0 = wload8<ODD>(wk, 0), w1 = wload8<ODD>(wk, 1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k + ODD);
        a0[r] = _mm256_fmadd_ps(xa, w0, a0[r]);
        a1[r] = _mm256_fmadd_ps(xa, w1, a1[r]);
      }
    };
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      const T* wk = w + k * PANEL;
      if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(wk) + 2048, _MM_HINT_T0);
      step(std::integral_constant<int, 0>(), wk, k);
      step(std::integral_constant<int, 1>(), wk, k);
    }
    if (k < K) step(std::integral_constant<int, 0>(), w + k * PANEL, k);
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
    const T* wk = w + k * PANEL;
    const __m256 w0 = wload8<0>(wk, 0), w1 = wload8<0>(wk, 1), w2 = wload8<1>(wk, 0), w3 = wload8<1>(wk, 1);
    for (int r = 0; r < R; ++r) {
      const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k), xb = _mm256_broadcast_ss(x + r * ldx + k + 1);
      a0[r] = _mm256_fmadd_ps(xa, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xa, w1, a1[r]);
      b0[r] = _mm256_fmadd_ps(xb, w2, b0[r]);
      b1[r] = _mm256_fmadd_ps(xb, w3, b1[r]);
    }
  }
  for (; k < K; ++k) {  // odd K: the last k
    const __m256 w0 = wload8<0>(w + k * PANEL, 0), w1 = wload8<0>(w + k * PANEL, 1);
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
      for (int j = 0; j < PANEL; ++j) s[j] += xv * wat(w, k, j);
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
  const int64_t stride = panel_elems<T>(K);
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + k + 1);
    for (int i = 0; i < NP; ++i) {
      const T* wi = w + i * stride + k * PANEL;
      _mm_prefetch(reinterpret_cast<const char*>(wi) + 2048, _MM_HINT_T0);
      if (sizeof(T) == 4) _mm_prefetch(reinterpret_cast<const char*>(wi) + 2048 + 64, _MM_HINT_T0);
      a0[i] = _mm256_fmadd_ps(xa, wload8<0>(wi, 0), a0[i]);
      a1[i] = _mm256_fmadd_ps(xa, wload8<0>(wi, 1), a1[i]);
      a0[i] = _mm256_fmadd_ps(xb, wload8<1>(wi, 0), a0[i]);
      a1[i] = _mm256_fmadd_ps(xb, wload8<1>(wi, 1), a1[i]);
    }
  }
  for (; k < K; ++k) {
    const __m256 xa = _mm256_broadcast_ss(x + k);
    for (int i = 0; i < NP; ++i) {
      a0[i] = _mm256_fmadd_ps(xa, wload8<0>(w + i * stride + k * PANEL, 0), a0[i]);
      a1[i] = _mm256_fmadd_ps(xa, wload8<0>(w + i * stride + k * PANEL, 1), a1[i]);
    }
  }
  for (int i = 0; i < NP; ++i) {
    _mm256_storeu_ps(acc + i * PANEL, a0[i]);
    _mm256_storeu_ps(acc + i * PANEL + 8, a1[i]);
  }
#else
  for (int i = 0; i < NP; ++i) panel_kernel<T, 1>(x, 0, w + i * panel_elems<T>(K), K, acc + i * PANEL);
#endif
}

#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
// Several rows on AVX-512 CPUs: a panel's 16 columns at one k are one 16-lane vector, so R rows take R
// accumulators, one weight load and R broadcasts per k: up to 8 rows per call (ROWS512), nearly twice the FMAs per
// cycle of the AVX2 kernel where rows make the product compute-bound (batched decoding, beams). Same sums per k
// order as panel_kernel up to its even/odd-k split.
constexpr int64_t ROWS512 = 8;
constexpr bool kAvx512 = true;  // what decode_avx512 switches is compiled in
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const at::Half* w) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
// A panel's 16 columns at k (ODD=0) or k+1 (ODD=1), wk = panel + k * PANEL with k even (as wload8).
template <int ODD, typename T>
inline __m512 wload16(const T* wk) {
  return load16(wk + ODD * PANEL);
}
template <int ODD>
inline __m512 wload16(const at::BFloat16* wk) {
  const __m512i v = _mm512_loadu_si512(wk);
  return _mm512_castsi512_ps(ODD ? _mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))) : _mm512_slli_epi32(v, 16));
}

// R rows against NPAN neighbouring panels (acc: R rows of each panel in turn). Two panels: each broadcast of x
// feeds two FMAs, so the loads (the limit of one panel at 8 rows) drop from 9 to 10 per 16 FMAs.
template <typename T, int R, int NPAN = 1>
inline void panel_kernel512(const float* x, int64_t ldx, const T* w, int64_t K, float* acc) {
  __m512 a[NPAN][R];
  for (int q = 0; q < NPAN; ++q)
    for (int r = 0; r < R; ++r) a[q][r] = _mm512_setzero_ps();
  const int64_t stride = panel_elems<T>(K);
  auto step = [&](auto odd, int64_t k) {
    constexpr int ODD = decltype(odd)::value;
    __m512 wv[NPAN];
    for (int q = 0; q < NPAN; ++q) wv[q] = wload16<ODD>(w + q * stride + k * PANEL);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k + ODD]);
      for (int q = 0; q < NPAN; ++q) a[q][r] = _mm512_fmadd_ps(xv, wv[q], a[q][r]);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    for (int q = 0; q < NPAN; ++q)
      _mm_prefetch(reinterpret_cast<const char*>(w + q * stride + k * PANEL) + 2048, _MM_HINT_T0);
    step(std::integral_constant<int, 0>(), k);
    step(std::integral_constant<int, 1>(), k);
  }
  if (k < K) step(std::integral_constant<int, 0>(), k);
  for (int q = 0; q < NPAN; ++q)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (q * R + r) * PANEL, a[q][r]);
}

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
#else
constexpr bool kAvx512 = false;
#endif

#if SUBLAYER_AVX2_FMA && defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;  // what decode_bf16_dot switches is compiled in
// One row x (K floats) rounded to bf16 as f_to_bf16 does (nearest even, NaN -> 0x7fc0) into ceil(K/2) k pairs
// (k in the low, k+1 in the high half; an odd K's last pair has a zero high half), 16 at a time.
inline void bf16_pairs(const float* x, int64_t K, uint32_t* out) {
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256i lo = _mm512_cvtepi32_epi16(f_to_bf16_x16(_mm512_loadu_ps(x + k)));
    const __m256i hi = _mm512_cvtepi32_epi16(f_to_bf16_x16(_mm512_loadu_ps(x + k + 16)));
    _mm512_storeu_si512(out + k / 2, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
  }
  for (; k < K; k += 2)
    out[k / 2] = uint32_t(f_to_bf16(x[k])) | (k + 1 < K ? uint32_t(f_to_bf16(x[k + 1])) << 16 : 0u);
}

// Several rows on AVX512_BF16 CPUs: two bf16 panels against R rows of x rounded to bf16 (xb: ceil(K/2) 32-bit k
// pairs per row), one vdpbf16ps per k pair, panel and row: half the instructions of widening the weights and an
// FMA per k, which is what several rows are bound by. Each bf16 x bf16 product is exact in float32 and the sums
// are float32 (vdpbf16ps rounds to nearest even and treats denormal inputs and results as zero).
template <int R, int NPAN>  // NPAN panels (1 or 2; acc: R rows of each panel in turn)
inline void panels_kernel_dp(const uint32_t* xb, int64_t K2, const at::BFloat16* w, int64_t stride, float* acc) {
  __m512 a[NPAN][R];
  for (int q = 0; q < NPAN; ++q)
    for (int r = 0; r < R; ++r) a[q][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < K2; ++i) {
    __m512bh wv[NPAN];
    for (int q = 0; q < NPAN; ++q) {
      // into L2, 4 KB ahead: at 8 rows the vdpbf16ps take as long as the loads, so the panels' lines must be
      // on their way further ahead than the widening kernels' 2 KB (and L1 keeps x's pairs)
      _mm_prefetch(reinterpret_cast<const char*>(w + q * stride + i * 32) + 4096, _MM_HINT_T1);
      wv[q] = (__m512bh)_mm512_loadu_si512(w + q * stride + i * 32);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(xb[r * K2 + i]));
      for (int q = 0; q < NPAN; ++q) a[q][r] = _mm512_dpbf16_ps(a[q][r], xv, wv[q]);
    }
  }
  for (int q = 0; q < NPAN; ++q)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (q * R + r) * PANEL, a[q][r]);
}
#else
constexpr bool kBf16Dot = false;
#endif

// ------------------------------------------------------------------ compact bfloat16 panels (12 bits a weight)
// A bf16 weight's high byte (sign and the exponent's top 7 bits) takes few values in a layer, so the layout keeps
// each weight's low byte (the exponent's last bit and the 7 mantissa bits) as it is and its high byte as a 4-bit
// code into a 16-entry table of the layer: 12 bits a weight instead of 16, three quarters of the bytes a decoding
// step streams, and lossless: entry 0 is 0x00, and a weight whose high byte is not in the table is stored as 0 (low
// byte 0) with its value in an exception list that the epilogue adds (acc[j] += w * x[k]).
// Layout (pack_compact_bf16; one uint8 tensor): P = ceil(N/16) panels of S = ceil(K/4) steps of CSTEP bytes: a
// step holds k = 4s..4s+3 of the panel's 16 columns, 64 low bytes and then 32 bytes of codes (byte m: positions 2m
// in its low and 2m+1 in its high nibble). Panels go in groups of CGROUP (the last one padded with zero panels),
// their steps interleaved: step s of a group's panels 0..3, then step s + 1, ..., so a one-row kernel reading a
// group reads one sequential stream. Position b sits in 128-bit lane b/16 at u = b%16: u < 8 is word
// l*8+u of the step's first k pair, else word l*8+u-8 of its second; word w of a pair is column w/2 at k + w%2,
// the bf16 pair layout of pack_linear_weight. So `unpacklo/hi_epi8(low bytes, looked-up high bytes)` rebuild the
// two pairs' 32-bit lanes in place. After the panels: CTABLE bytes (the table's 16, then N and K as int64), int32
// offsets (P + 1) of each panel's exceptions, then the exceptions' int32 (k * 16 + j) and their float32 values.
constexpr int64_t CSTEP = 96, CTABLE = 64, CGROUP = STREAMS;
constexpr int CROWS = 4;  // rows per compact_kernel_dp call: 4 x CGROUP accumulators

struct Compact {  // a view of pack_compact_bf16's tensor for an (n, K) weight
  static constexpr int64_t SSTRIDE = CGROUP * CSTEP;  // from one step of a panel to its next
  const uint8_t *data, *table;
  const int64_t* shape;  // N, K
  const int32_t *off, *idx;
  const float* val;
  int64_t S;
  Compact(const uint8_t* p, int64_t P, int64_t K) : data(p), S((K + 3) / 4) {
    table = p + panel_bytes(P, K);
    shape = reinterpret_cast<const int64_t*>(table + 16);
    off = reinterpret_cast<const int32_t*>(table + CTABLE);
    idx = off + P + 1;
    val = reinterpret_cast<const float*>(idx + off[P]);
  }
  static int64_t panel_bytes(int64_t P, int64_t K) { return (P + CGROUP - 1) / CGROUP * ((K + 3) / 4) * SSTRIDE; }
  static int64_t bytes(int64_t P, int64_t K, int64_t E) { return panel_bytes(P, K) + CTABLE + 4 * (P + 1) + 8 * E; }
  const uint8_t* at(int64_t p, int64_t s) const { return data + (p / CGROUP * S + s) * SSTRIDE + p % CGROUP * CSTEP; }
  // acc[j] += w * x(k) for panel p's exceptions (x: one row's activations as the panel's kernel took them)
  template <typename X>
  void except(int64_t p, const X& x, float* acc) const {
    for (int32_t e = off[p]; e < off[p + 1]; ++e) acc[idx[e] & 15] += val[e] * x(idx[e] >> 4);
  }
};

// Step position b -> (k offset 0..3, column j) of its weight (the layout above).
inline std::pair<int, int> compact_pos(int b) {
  const int l = b / 16, u = b % 16, w = l * 8 + (u < 8 ? u : u - 8);
  return {(u < 8 ? 0 : 2) + w % 2, w / 2};
}

#if SUBLAYER_AVX2_FMA && defined(__AVX512BW__)
// One step's two k pairs of a panel (32 bf16 lanes each, pack_linear_weight's layout) from its 96 bytes.
inline void compact_step(const uint8_t* ps, __m512i table, __m512i& a, __m512i& b) {
  const __m512i lo = _mm512_loadu_si512(ps);
  __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ps + 64)));
  c = _mm512_ternarylogic_epi32(c, _mm512_slli_epi16(c, 4), _mm512_set1_epi16(0x0F0F), 0xA8);  // (c | c << 4) & 0x0F0F
  const __m512i hi = _mm512_shuffle_epi8(table, c);
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// One row against NP compact panels of one group from w = at(p, 0) (acc + i*16: panel i's sums without its
// exceptions), the weights widened exactly and multiplied by float32 x as panels_kernel does for bf16 panels: the
// decoding step's one-row GEMV, bound by memory at three quarters of bf16's bytes. The group's step is six cache
// lines, fetched 4 KB ahead from q = 0 and q = 2.
template <int NP>
void compact_kernel(const float* x, int64_t K, const Compact& c, const uint8_t* w, float* acc) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c.table)));
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 a0[NP], a1[NP];
  for (int q = 0; q < NP; ++q) a0[q] = a1[q] = _mm512_setzero_ps();
  float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the last step's x where K is not a multiple of 4
  for (int64_t k = K / 4 * 4; k < K; ++k) tail[k % 4] = x[k];
  for (int64_t s = 0; s < c.S; ++s) {
    const float* xs = 4 * s + 4 <= K ? x + 4 * s : tail;
    const __m512 x0 = _mm512_set1_ps(xs[0]), x1 = _mm512_set1_ps(xs[1]), x2 = _mm512_set1_ps(xs[2]),
                 x3 = _mm512_set1_ps(xs[3]);
    for (int q = 0; q < NP; ++q) {
      const uint8_t* ps = w + s * Compact::SSTRIDE + q * CSTEP;
      if (q % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(ps) + 4096, _MM_HINT_T0);
      if (q % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(ps) + 4096 + 64, _MM_HINT_T0);
      if (q % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(ps) + 4096 + 128, _MM_HINT_T0);
      __m512i pa, pb;
      compact_step(ps, table, pa, pb);
      a0[q] = _mm512_fmadd_ps(x0, _mm512_castsi512_ps(_mm512_slli_epi32(pa, 16)), a0[q]);
      a1[q] = _mm512_fmadd_ps(x1, _mm512_castsi512_ps(_mm512_and_si512(pa, high)), a1[q]);
      a0[q] = _mm512_fmadd_ps(x2, _mm512_castsi512_ps(_mm512_slli_epi32(pb, 16)), a0[q]);
      a1[q] = _mm512_fmadd_ps(x3, _mm512_castsi512_ps(_mm512_and_si512(pb, high)), a1[q]);
    }
  }
  for (int q = 0; q < NP; ++q) _mm512_storeu_ps(acc + q * PANEL, _mm512_add_ps(a0[q], a1[q]));
}
#endif

#if SUBLAYER_AVX2_FMA && defined(__AVX512BF16__)
// R rows against NPAN compact panels of one group from w = at(p, 0) by vdpbf16ps (acc: R rows of each panel in
// turn), as panels_kernel_dp on the panels unpacked: each step's two pairs are rebuilt once in registers and serve
// every row.
template <int R, int NPAN>
void compact_kernel_dp(const uint32_t* xb, int64_t K2, const Compact& c, const uint8_t* w, float* acc) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c.table)));
  __m512 a[NPAN][R];
  for (int q = 0; q < NPAN; ++q)
    for (int r = 0; r < R; ++r) a[q][r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < c.S; ++s) {
    __m512i pa[NPAN], pb[NPAN];
    for (int q = 0; q < NPAN; ++q) {
      const uint8_t* ps = w + s * Compact::SSTRIDE + q * CSTEP;
      _mm_prefetch(reinterpret_cast<const char*>(ps) + 4096, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(ps) + 4096 + 64, _MM_HINT_T1);
      compact_step(ps, table, pa[q], pb[q]);
    }
    const bool odd = 2 * s + 1 < K2;  // the step's second pair exists
    for (int r = 0; r < R; ++r) {
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(int(xb[r * K2 + 2 * s]));
      const __m512bh x1 = (__m512bh)_mm512_set1_epi32(odd ? int(xb[r * K2 + 2 * s + 1]) : 0);
      for (int q = 0; q < NPAN; ++q) {
        a[q][r] = _mm512_dpbf16_ps(a[q][r], x0, (__m512bh)pa[q]);
        a[q][r] = _mm512_dpbf16_ps(a[q][r], x1, (__m512bh)pb[q]);
      }
    }
  }
  for (int q = 0; q < NPAN; ++q)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (q * R + r) * PANEL, a[q][r]);
}
#endif

// Panel p of a compact weight into pack_linear_weight's bf16 layout (K2 = ceil(K/2) pairs x 16 columns x 2), its
// exceptions in place: the bf16 panel itself, for the other kernels where compact_kernel / compact_kernel_dp are
// switched off (tests; the panels are made compact only where both are compiled in) or x is not finite (an
// exception's 0 times an infinite x would be NaN where the weight times it is infinite).
void compact_unpack(const Compact& c, int64_t p, int64_t K2, at::BFloat16* out) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  auto at = [&](int64_t k, int64_t j) -> uint16_t& { return o[((k / 2) * PANEL + j) * 2 + k % 2]; };
  for (int64_t s = 0; s < c.S; ++s)
    for (int b = 0; b < 64; ++b) {
      const auto [kk, j] = compact_pos(b);
      const int64_t k = 4 * s + kk;
      if (k / 2 >= K2) continue;
      const uint8_t* w = c.at(p, s);
      const uint8_t code = (w[64 + b / 2] >> (4 * (b % 2))) & 15;
      at(k, j) = uint16_t(w[b] | (c.table[code] << 8));
    }
  for (int32_t e = c.off[p]; e < c.off[p + 1]; ++e) at(c.idx[e] >> 4, c.idx[e] & 15) = f_to_bf16(c.val[e]);
}

// Whether every entry of x's M rows (K each, ldx apart) is finite in bfloat16 too (at most bf16's largest value:
// the vdpbf16ps path rounds x to bf16).
bool rows_finite(const float* x, int64_t ldx, int64_t M, int64_t K) {
  constexpr float kMax = 3.38953139e38f;  // bf16's largest finite value
  for (int64_t r = 0; r < M; ++r) {
    const float* row = x + r * ldx;
    int64_t k = 0;
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
    __mmask16 bad = 0;
    for (; k + 16 <= K; k += 16)  // not |x| <= kMax: true for NaN too
      bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(row + k)), _mm512_set1_ps(kMax), _CMP_NLE_UQ);
    if (bad) return false;
#endif
    for (; k < K; ++k)
      if (!(std::fabs(row[k]) <= kMax)) return false;
  }
  return true;
}

// A panel's (or panel group's) per-column parameters from column c0 on: `src + c0` itself when all `width` columns
// exist, else the nc that do copied into `pad` (zero-initialised, so the columns past n read zeros).
template <typename V>
inline const V* panel_params(const V* src, int64_t c0, int64_t nc, int64_t width, V* pad) {
  if (nc == width) return src + c0;
  std::copy(src + c0, src + c0 + nc, pad);
  return pad;
}

// v[0..15] = act(v * scale + bias) in place (scale: int8 weights' per-column scale, or null). Activations:
// act_norm.h's Act ids (as sublayer.functional.fused.ACT_IDS) and act_f; tanh-GELU, GPT-2's, is vectorised here as
// z * sigmoid(2u), u = sqrt(2/pi) (z + 0.044715 z^3), as act_f computes it.
inline void epilogue(float* v, const float* scale, const float* bias, int64_t act) {
  if (scale)
    for (int j = 0; j < PANEL; ++j) v[j] *= scale[j];
  if (bias)
    for (int j = 0; j < PANEL; ++j) v[j] += bias[j];
#if SUBLAYER_AVX2_FMA
  if (act == GELU_TANH) {
    for (int j = 0; j < PANEL; j += 8) {
      const __m256 z = _mm256_loadu_ps(v + j);
      const __m256 z3 = _mm256_mul_ps(_mm256_mul_ps(z, z), z);
      const __m256 u2 = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.79788456080286535588f),
                                      _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), z3, z));
      __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), u2)));
      // exp(-2u) overflows below 2u = -88.3 (exp256 clamps): den = inf, so z = -inf gives NaN as act_f and torch
      den = _mm256_blendv_ps(den, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(u2, _mm256_set1_ps(-88.3f), _CMP_LT_OQ));
      _mm256_storeu_ps(v + j, _mm256_div_ps(z, den));
    }
    return;
  }
#endif
  SUBLAYER_DISPATCH_ACT(act, [&] {
    if constexpr (ACT != IDENT)
      for (int j = 0; j < PANEL; ++j) v[j] = act_f<ACT>(v[j]);
  });
}

template <typename T>
void skinny_panels(const float* xp, int64_t ldx, int64_t M, int64_t K, const T* wp, int64_t P, const float* sp,
                   const float* bp, int64_t n, int64_t act, float* op, const Compact* cw = nullptr) {
  static constexpr auto kPanel = rows_table<ROWS>([](auto r) { return &panel_kernel<T, decltype(r)::value>; });
  auto panel = kPanel.data();
  int64_t rows = ROWS;
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
  decltype(panel) pair = nullptr;
  static constexpr auto kPanel512 = rows_table<ROWS512>([](auto r) { return &panel_kernel512<T, decltype(r)::value>; });
  static constexpr auto kPair512 = rows_table<ROWS512>([](auto r) { return &panel_kernel512<T, decltype(r)::value, 2>; });
  if (M > 1 && g_avx512.load(std::memory_order_relaxed)) {
    panel = kPanel512.data();
    pair = kPair512.data();
    rows = ROWS512;
  }
#endif
  // Panels are handed out in chunks of ~256 KB from a shared counter, not split in halves up front: a thread
  // that the OS or a neighbour slows down takes fewer chunks instead of holding the other one at the join.
  // (a multiple of STREAMS panels, so that a single row reads STREAMS panels at a time; of three for several rows
  // by vdpbf16ps, which take three panels a call). Compact panels: whole groups, and chunks of ~512 KB as bf16
  // (384 KB read): a chunk's groups are one sequential stream, and longer streams read faster.
  const int64_t K2 = (K + 1) / 2;
  std::vector<uint32_t> xb;
#if SUBLAYER_AVX2_FMA && defined(__AVX512BF16__)
  if (std::is_same<T, at::BFloat16>::value && pair && g_bf16dot.load()) {
    xb.resize(M * K2);
    for (int64_t r = 0; r < M; ++r) bf16_pairs(xp + r * ldx, K, xb.data() + r * K2);
  }
#endif
  const int64_t stride = panel_elems<T>(K), bytes = std::max<int64_t>(1, stride * int64_t(sizeof(T)));
  const int64_t unit = xb.empty() || cw ? STREAMS : 3;  // compact: whole groups
  const int64_t chunk = ((std::max<int64_t>(1, (int64_t(1) << (cw ? 19 : 18)) / bytes) + unit - 1) / unit) * unit;
  const int64_t n_chunks = (P + chunk - 1) / chunk;
  const bool cfused = cw && rows_finite(xp, ldx, M, K);  // compact kernels (else unpacked, exceptions in place)
  parallel_chunks(n_chunks, [&](int64_t c) {
    float acc[3 * 8 * PANEL];  // up to three panels of max(ROWS, STREAMS, ROWS512) rows
    bool add_exceptions = false;  // the compact kernels ran: their exceptions go in the epilogue
    auto store = [&](int64_t p, int64_t r0, int64_t R, float* a) {  // epilogue + copy out: R rows of panel p
      const int64_t c0 = p * PANEL, nc = std::min<int64_t>(PANEL, n - c0);
      // this panel's scale and bias (panel_params), and the stores below with constant lengths for a whole panel:
      // inlined, no memmove call per row
      float spanel[PANEL] = {0}, bpanel[PANEL] = {0};
      const float* s = sp ? panel_params(sp, c0, nc, PANEL, spanel) : nullptr;
      const float* b = bp ? panel_params(bp, c0, nc, PANEL, bpanel) : nullptr;
      for (int64_t r = 0; r < R; ++r) {
        float* v = a + r * PANEL;
        if (add_exceptions && xb.empty())
          cw->except(p, [&](int64_t k) { return xp[(r0 + r) * ldx + k]; }, v);
        else if (add_exceptions)  // x rounded to bf16, as vdpbf16ps took it
          cw->except(p, [&](int64_t k) { return bf16_to_f(uint16_t(xb[(r0 + r) * K2 + k / 2] >> (16 * (k % 2)))); }, v);
        epilogue(v, s, b, act);
        float* o = op + (r0 + r) * n + c0;
        if (nc == PANEL) {
#pragma omp simd
          for (int64_t j = 0; j < PANEL; ++j) o[j] = v[j];
        } else {
          std::copy(v, v + nc, o);
        }
      }
    };
    const int64_t p0 = c * chunk, pe = std::min(P, (c + 1) * chunk);
    int64_t p = p0;
    const T* wc = wp ? wp + p0 * stride : nullptr;  // the chunk's first panel
    // panels [p, pe) G at a time (whole: while G remain) x the rows RR at a time: kern(np, R, r0) leaves in acc the
    // R rows of each of its np panels in turn, stored out here
    auto tiles = [&](int64_t G, int64_t RR, bool whole, const auto& kern) {
      for (; whole ? p + G <= pe : p < pe; p += G) {
        const int64_t np = std::min(G, pe - p);
        for (int64_t r0 = 0; r0 < M; r0 += RR) {  // the panels' later row passes read them from L2
          const int64_t R = std::min(RR, M - r0);
          kern(np, R, r0);
          for (int64_t q = 0; q < np; ++q) store(p + q, r0, R, acc + q * R * PANEL);
        }
      }
    };
    if constexpr (std::is_same<T, at::BFloat16>::value)
      if (cw) {
#if SUBLAYER_AVX2_FMA && defined(__AVX512BW__)
        if (cfused && M == 1 && g_avx512.load(std::memory_order_relaxed)) {  // one row: widened as they stream in
          add_exceptions = true;
          static constexpr auto kC = rows_table<STREAMS>([](auto r) { return &compact_kernel<decltype(r)::value>; });
          return tiles(STREAMS, 1, false, [&](int64_t np, int64_t, int64_t) { kC[np](xp, K, *cw, cw->at(p, 0), acc); });
        }
#endif
#if SUBLAYER_AVX2_FMA && defined(__AVX512BF16__)
        if (cfused && !xb.empty()) {  // several rows by vdpbf16ps: a group's panels at once, CROWS rows at a time
          add_exceptions = true;
          static constexpr auto kDp = rows_table<CGROUP>([](auto np) {
            return rows_table<CROWS>([](auto r) { return &compact_kernel_dp<decltype(r)::value, decltype(np)::value>; });
          });
          return tiles(CGROUP, CROWS, false, [&](int64_t np, int64_t R, int64_t r0) {
            kDp[np][R](xb.data() + r0 * K2, K2, *cw, cw->at(p, 0), acc);
          });
        }
#endif
        thread_local std::vector<at::BFloat16> buf;  // the chunk in bf16 panels, for the kernels below
        buf.resize(size_t((pe - p0) * stride));
        for (int64_t q = p0; q < pe; ++q) compact_unpack(*cw, q, (K + 1) / 2, buf.data() + (q - p0) * stride);
        wc = buf.data();
      }
    if (M == 1)  // one row (batch-1 decoding): STREAMS panels at a time
      tiles(STREAMS, 1, true, [&](int64_t, int64_t, int64_t) {
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
        if (std::is_same<T, int8_t>::value && g_avx512.load(std::memory_order_relaxed))
          return panels_kernel<STREAMS>(xp, wc + (p - p0) * stride, K, acc);  // int8: the AVX-512 overload
#endif
        panels_kernel<STREAMS, T>(xp, wc + (p - p0) * stride, K, acc);
      });
#if SUBLAYER_AVX2_FMA && defined(__AVX512BF16__)
    if constexpr (std::is_same<T, at::BFloat16>::value)
      if (!xb.empty()) {  // several rows by vdpbf16ps: three panels at a time, then the rest
        static constexpr auto kDp = rows_table<3>([](auto np) {
          return rows_table<ROWS512>([](auto r) { return &panels_kernel_dp<decltype(r)::value, decltype(np)::value>; });
        });
        return tiles(3, ROWS512, false, [&](int64_t np, int64_t R, int64_t r0) {
          kDp[np][R](xb.data() + r0 * K2, K2, wc + (p - p0) * stride, stride, acc);
        });
      }
#endif
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
    if (pair)  // several rows on AVX-512: two panels at a time
      tiles(2, ROWS512, true, [&](int64_t, int64_t R, int64_t r0) {
        pair[R](xp + r0 * ldx, ldx, wc + (p - p0) * stride, K, acc);
      });
#endif
    tiles(1, rows, false, [&](int64_t, int64_t R, int64_t r0) {
      panel[R](xp + r0 * ldx, ldx, wc + (p - p0) * stride, K, acc);
    });
  });
}

// Whether several rows of bfloat16 panels use vdpbf16ps, x rounded to bf16 (where compiled in and the AVX-512
// kernels are on), or widen the weights to float32 (exact products with float32 x): decode_bf16_dot(flag) sets it
// and returns the previous value; -1 reads it.
bool decode_bf16_dot(int64_t flag) { return set_switch(g_bf16dot, flag, kBf16Dot); }

// Whether skinny_linear uses the AVX-512 micro-kernels (several rows; one row of int8) where compiled in (tests switch it off to
// check the AVX2 one on the same machine): decode_avx512(flag) sets it and returns the previous value; -1 reads it.
bool decode_avx512(int64_t flag) { return set_switch(g_avx512, flag, kAvx512); }

// Checks x (M, K) / packed (P, K, 16) / bias (n,) / act for skinny_linear; returns the bias pointer or null.
const float* check_skinny(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias, int64_t n,
                          int64_t act, const c10::optional<Tensor>& scale) {
  constexpr const char* op = "skinny_linear";  // the messages' op (float_vec's names below spell it too)
  TORCH_CHECK(act >= IDENT && act <= RELU2, op, ": act ", act,
              " unsupported (0 none, 1 relu, 2 GELU, 3 tanh-GELU, 4 SiLU, 5 relu^2)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, op,
              ": x must be a 2-D float32 CPU tensor with unit inner stride");
  const int64_t K = x.size(1);
  if (packed.scalar_type() == at::kByte) {  // compact bf16 (pack_compact_bf16)
    const int64_t P = (n + PANEL - 1) / PANEL, base = Compact::bytes(P, K, 0);
    TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 1 && packed.is_contiguous() &&
                    packed.numel() >= base && (packed.numel() - base) % 8 == 0,
                op, ": compact packed must be pack_compact_bf16's bytes of an (n=", n, ", K=", K, ") weight");
    const Compact c(packed.data_ptr<uint8_t>(), P, K);
    TORCH_CHECK(c.shape[0] == n && c.shape[1] == K, op, ": compact packed holds an (", c.shape[0], ", ", c.shape[1],
                ") weight, not (n=", n, ", K=", K, ")");
    const int64_t E = (packed.numel() - base) / 8;
    bool ok = c.off[0] == 0 && c.off[P] == E;
    for (int64_t p = 0; p < P && ok; ++p) ok = c.off[p] <= c.off[p + 1];
    for (int64_t e = 0; e < E && ok; ++e) ok = c.idx[e] >= 0 && (c.idx[e] >> 4) < K;
    TORCH_CHECK(ok, op, ": compact packed is damaged (its exception list)");
    TORCH_CHECK(!(scale.has_value() && scale->defined() && scale->numel() > 0), op, ": compact panels take no scale");
  } else {
    const bool bf16 = packed.scalar_type() == at::kBFloat16;
    TORCH_CHECK(packed.device().is_cpu() && packed.dim() == (bf16 ? 4 : 3) && packed.is_contiguous() &&
                    (bf16 || packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kHalf ||
                     packed.scalar_type() == at::kChar),
                op, ": packed must be a contiguous 3-D float32, float16 or int8 or 4-D bfloat16 CPU tensor");
    const bool scaled = scale.has_value() && scale->defined() && scale->numel() > 0;
    TORCH_CHECK(scaled == (packed.scalar_type() == at::kChar), op, ": a scale (n,) goes with int8 panels, and only");
    if (scaled) float_vec(*scale, "skinny_linear: scale", n);
    const int64_t P = packed.size(0);
    if (bf16) {
      TORCH_CHECK(packed.size(1) == (K + 1) / 2 && packed.size(2) == PANEL && packed.size(3) == 2, op,
                  ": bfloat16 packed must be (P, ceil(K/2)=", (K + 1) / 2, ", 16, 2), got ", packed.sizes());
    } else {
      TORCH_CHECK(packed.size(1) == K && packed.size(2) == PANEL, op, ": packed must be (P, K=", K, ", 16), got ",
                  packed.sizes());
    }
    TORCH_CHECK(n > (P - 1) * PANEL && n <= P * PANEL, op, ": n=", n, " does not fit ", P, " panels");
  }
  return float_vec(bias, "skinny_linear: bias", n);
}

}  // namespace

// x (M, K) float32 (row stride free, unit inner stride), packed (P, K, 16) -> (M, n) = act(x @ W^T * scale + bias):
// float32, float16 or bfloat16 panels (no scale), or int8 panels with their per-column scale (weight-only int8).
Tensor skinny_linear(const Tensor& x, const Tensor& packed, const c10::optional<Tensor>& bias, int64_t n,
                     int64_t act, const c10::optional<Tensor>& scale) {
  const float* bp = check_skinny(x, packed, bias, n, act, scale);
  Tensor out = at::empty({x.size(0), n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = x.size(0), K = x.size(1), P = packed.scalar_type() == at::kByte ? (n + PANEL - 1) / PANEL : packed.size(0);
  if (M == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (packed.scalar_type() == at::kByte) {
    const Compact c(packed.data_ptr<uint8_t>(), P, K);
    skinny_panels<at::BFloat16>(xp, x.stride(0), M, K, nullptr, P, nullptr, bp, n, act, op, &c);
  } else if (packed.scalar_type() == at::kChar)
    skinny_panels(xp, x.stride(0), M, K, packed.data_ptr<int8_t>(), P, scale->data_ptr<float>(), bp, n, act, op);
  else if (packed.scalar_type() == at::kBFloat16)
    skinny_panels(xp, x.stride(0), M, K, packed.data_ptr<at::BFloat16>(), P, nullptr, bp, n, act, op);
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
#endif
}

// W (N, K) -> (ceil(N/16), ceil(K/G), 16, G), [p, i, j, t] = W[16p + j, G i + t], zero-padded columns and k: each
// column's G consecutive k are one lane. G = 1: float32, float16 or int8 panels (K x 16); G = 2: bfloat16 k pairs,
// one 32-bit lane (wload8/wload16 widen it without a shuffle); G = 4: int8 quads (pack_int8_quads).
template <int G, typename T>
void pack_groups(const T* src, T* dst, int64_t N, int64_t K, int64_t P, int64_t W = PANEL) {  // W: columns per panel
  const int64_t KG = (K + G - 1) / G;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = 0; i < KG; ++i)
        for (int64_t j = 0; j < W; ++j)
          for (int64_t t = 0; t < G; ++t) {
            const int64_t c = p * W + j, k = G * i + t;
            dst[((p * KG + i) * W + j) * G + t] = c < N && k < K ? src[c * K + k] : T(0.0f);
          }
  });
}

Tensor pack_linear_weight(const Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kHalf || w.scalar_type() == at::kChar ||
                   w.scalar_type() == at::kBFloat16),
              "pack_linear_weight: weight must be a contiguous 2-D float32, float16, bfloat16 or int8 CPU tensor, got ",
              w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL;
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  Tensor out = bf16 ? at::empty({P, (K + 1) / 2, PANEL, 2}, w.options()) : at::empty({P, K, PANEL}, w.options());
  advise_huge_pages(out.data_ptr(), size_t(out.numel()) * out.element_size());
  if (bf16)
    pack_groups<2>(w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), N, K, P);
  else if (w.scalar_type() == at::kHalf)
    pack_groups<1>(w.data_ptr<at::Half>(), out.data_ptr<at::Half>(), N, K, P);
  else if (w.scalar_type() == at::kChar)
    pack_groups<1>(w.data_ptr<int8_t>(), out.data_ptr<int8_t>(), N, K, P);
  else
    pack_groups<1>(w.data_ptr<float>(), out.data_ptr<float>(), N, K, P);
  return out;
}

// W (N, K) bfloat16 and a 16-entry table of high bytes (table[0] = 0) -> the compact layout (Compact, above): each
// weight's code is its high byte's first index in the table; a weight whose high byte is not there is an exception.
Tensor pack_compact_bf16(const Tensor& w, const Tensor& table) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "pack_compact_bf16: weight must be a contiguous 2-D bfloat16 CPU tensor, got ", w.scalar_type(), " ",
              w.sizes());
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kByte && table.dim() == 1 &&
                  table.numel() == 16 && table.is_contiguous() && table.data_ptr<uint8_t>()[0] == 0,
              "pack_compact_bf16: table must be 16 uint8 high bytes, the first 0");
  const int64_t N = w.size(0), K = w.size(1), P = (N + PANEL - 1) / PANEL, S = (K + 3) / 4;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  int code_of[256];
  std::fill(code_of, code_of + 256, -1);
  for (int i = 15; i >= 0; --i) code_of[table.data_ptr<uint8_t>()[i]] = i;
  std::vector<int32_t> count(P + 1, 0);
  auto word = [&](int64_t p, int64_t s, int b) -> uint16_t {  // the weight at step position b (0 past the edges)
    const auto [kk, j] = compact_pos(b);
    const int64_t c = p * PANEL + j, k = 4 * s + kk;
    return c < N && k < K ? src[c * K + k] : uint16_t(0);
  };
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t s = 0; s < S; ++s)
        for (int b = 0; b < 64; ++b) count[p + 1] += code_of[word(p, s, b) >> 8] < 0;
  });
  for (int64_t p = 0; p < P; ++p) count[p + 1] += count[p];
  Tensor out = at::empty({Compact::bytes(P, K, count[P])}, w.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  advise_huge_pages(o, size_t(out.numel()));
  uint8_t* tab = o + Compact::panel_bytes(P, K);  // the table and the offsets first: the view below reads them
  std::fill(tab, tab + CTABLE, 0);
  std::copy(table.data_ptr<uint8_t>(), table.data_ptr<uint8_t>() + 16, tab);
  const int64_t shape[2] = {N, K};
  std::memcpy(tab + 16, shape, sizeof(shape));
  std::copy(count.begin(), count.end(), reinterpret_cast<int32_t*>(tab + CTABLE));
  const Compact c(o, P, K);
  int32_t* idx = const_cast<int32_t*>(c.idx);
  float* val = const_cast<float*>(c.val);
  at::parallel_for(0, (P + CGROUP - 1) / CGROUP * CGROUP, 1, [&](int64_t p0, int64_t p1) {  // with the padding
    for (int64_t p = p0; p < p1; ++p) {
      int32_t e = count[std::min(p, P)];
      for (int64_t s = 0; s < S; ++s) {
        uint8_t* ps = const_cast<uint8_t*>(c.at(p, s));
        std::fill(ps + 64, ps + CSTEP, 0);
        for (int b = 0; b < 64; ++b) {
          const uint16_t v = word(p, s, b);
          int code = code_of[v >> 8];
          if (code < 0) {  // stored as 0; the exception restores it
            idx[e] = int32_t((4 * s + compact_pos(b).first) * PANEL + compact_pos(b).second);
            val[e++] = bf16_to_f(v);
            code = 0;
          }
          ps[b] = code == 0 && v >> 8 != 0 ? 0 : uint8_t(v & 0xFF);
          ps[64 + b / 2] |= uint8_t(code << (4 * (b % 2)));
        }
      }
    }
  });
  return out;
}

// ------------------------------------------------------------------ int8 x int8 (int8 activations)
constexpr int64_t QPAN = 3;  // panels per quad_kernel call (and per group of pack_int8_quads' grouped layout)

// W (N, K) int8 -> (ceil(N/16), ceil(K/4), 16, 4) (pack_groups<4>): each column's 4 consecutive k are one 32-bit
// lane, the operand layout of vpdpbusd. grouped: (ceil(N/48), ceil(K/4), 48, 4) instead, [g, i, c, t] =
// W[48g + c, 4i + t] (zero-padded to whole groups): the QPAN panels a quad_kernel call reads are one sequential
// stream (a decoding step's few rows read each weight once, from memory); the plain layout's three streams suit
// many rows (tiles that read a panel group many times).
Tensor pack_int8_quads(const Tensor& q, bool grouped) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "pack_int8_quads: q must be a contiguous 2-D int8 CPU tensor, got ", q.scalar_type(), " ", q.sizes());
  const int64_t W = grouped ? QPAN * PANEL : PANEL;
  const int64_t N = q.size(0), K = q.size(1), P = (N + W - 1) / W, K4 = (K + 3) / 4;
  Tensor out = at::empty({P, K4, W, 4}, q.options());
  advise_huge_pages(out.data_ptr(), size_t(out.numel()));
  pack_groups<4>(q.data_ptr<int8_t>(), out.data_ptr<int8_t>(), N, K, P, W);
  return out;
}

// acc[r][p][0..15] (int32) = sum_k xu[r][k] * w_p[k][0..15] for R rows and NP quad panels (NP panels `pstride` bytes
// apart, a panel's consecutive quads `istride` bytes apart: plain layout K4 * 64 and 64, grouped 64 and QPAN * 64),
// xu: the rows' uint8 activations (quantize_row), K4 32-bit quads per row, rows `xstride` quads apart.
// AVX512-VNNI: per quad, NP weight loads and R broadcasts feed R * NP vpdpbusd (up to 24 accumulators); the
// portable loop elsewhere (same integer sums). At 8 x 3, int8_linear's main tile, the 24 accumulators are named
// (GCC keeps a __m512i array of them on the stack).
// The grouped layout (istride != 64) is one stream: the NP lines of quad i's step, fetched 4 KB ahead. Always
// inlined: as a call inside the 8 x 3 tile's loop it would spill the tile's 24 accumulators.
__attribute__((always_inline)) inline void prefetch_group(const int8_t* wi, int64_t istride, int np) {
  if (istride != 64)
    for (int l = 0; l < np; ++l) _mm_prefetch(reinterpret_cast<const char*>(wi) + 4096 + 64 * l, _MM_HINT_T0);
}

template <int R, int NP>
inline void quad_kernel(const uint32_t* xu, int64_t xstride, int64_t K4, const int8_t* w, int64_t pstride,
                        int64_t istride, int32_t* acc) {
#if SUBLAYER_AVX2_FMA && defined(__AVX512VNNI__)
  if (g_avx512.load(std::memory_order_relaxed)) {
    if constexpr (R == 8 && NP == 3) {
#define SUBLAYER_Q8X3(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#define SUBLAYER_QDECL(r) __m512i a##r##0 = _mm512_setzero_si512(), a##r##1 = a##r##0, a##r##2 = a##r##0;
#define SUBLAYER_QROW(r)                                                      \
  {                                                                           \
    const __m512i xb = _mm512_set1_epi32(int(xu[r * xstride + i]));          \
    a##r##0 = _mm512_dpbusd_epi32(a##r##0, xb, w0);                          \
    a##r##1 = _mm512_dpbusd_epi32(a##r##1, xb, w1);                          \
    a##r##2 = _mm512_dpbusd_epi32(a##r##2, xb, w2);                          \
  }
#define SUBLAYER_QSTORE(r)                                                    \
  _mm512_storeu_si512(acc + (r * 3 + 0) * PANEL, a##r##0);                   \
  _mm512_storeu_si512(acc + (r * 3 + 1) * PANEL, a##r##1);                   \
  _mm512_storeu_si512(acc + (r * 3 + 2) * PANEL, a##r##2);
      SUBLAYER_Q8X3(SUBLAYER_QDECL)
      for (int64_t i = 0; i < K4; ++i) {
        const int8_t* wi = w + i * istride;
        prefetch_group(wi, istride, 3);
        const __m512i w0 = _mm512_loadu_si512(wi), w1 = _mm512_loadu_si512(wi + pstride),
                      w2 = _mm512_loadu_si512(wi + 2 * pstride);
        SUBLAYER_Q8X3(SUBLAYER_QROW)
      }
      SUBLAYER_Q8X3(SUBLAYER_QSTORE)
#undef SUBLAYER_Q8X3
#undef SUBLAYER_QDECL
#undef SUBLAYER_QROW
#undef SUBLAYER_QSTORE
      return;
    }
    __m512i a[R][NP];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) a[r][p] = _mm512_setzero_si512();
    for (int64_t i = 0; i < K4; ++i) {
      __m512i wv[NP];
      prefetch_group(w + i * istride, istride, NP);
      for (int p = 0; p < NP; ++p) wv[p] = _mm512_loadu_si512(w + p * pstride + i * istride);
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(int(xu[r * xstride + i]));
        for (int p = 0; p < NP; ++p) a[r][p] = _mm512_dpbusd_epi32(a[r][p], xb, wv[p]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < NP; ++p) _mm512_storeu_si512(acc + (r * NP + p) * PANEL, a[r][p]);
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) {
      int32_t s[PANEL] = {0};
      const uint8_t* xr = reinterpret_cast<const uint8_t*>(xu + r * xstride);
      const int8_t* wp = w + p * pstride;
      for (int64_t i = 0; i < K4; ++i)
        for (int t = 0; t < 4; ++t) {
          const int32_t xv = xr[4 * i + t];
#pragma omp simd
          for (int j = 0; j < PANEL; ++j) s[j] += xv * int32_t(wp[i * istride + j * 4 + t]);
        }
      std::copy(s, s + PANEL, acc + (r * NP + p) * PANEL);
    }
}

// Per-row asymmetric uint8 quantization as int8_linear's reference computes it: v[k] = x[k] * inv_smooth[k] (or
// x[k]), lo = min(min_k v, 0), hi = max(max_k v, 0), inv = 255 / (hi - lo), zero point zp = round(-lo * inv),
// u[k] = clamp(round-half-even(v[k] * inv) + zp, 0, 255) (v ~ (u - zp) * scale, scale = (hi - lo) / 255: the
// row's 256 levels span its own range). Writes u (K4 quads, padded with zp: u - zp = 0), sets *zp and returns the
// scale (an all-zero row: u = 0, zp = 0, scale 0; a row whose 255 / range overflows float32: u = 0, zp = 0; a row
// of finite entries whose hi - lo overflows float32: inv and scale from the range in double, both finite).
float quantize_row(const float* x, const float* S, int64_t K, int64_t K4, uint8_t* out, int32_t* zp_out) {
  float lo = 0.f, hi = 0.f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_loadu_ps(x + k);
    if (S) v = _mm512_mul_ps(v, _mm512_loadu_ps(S + k));
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
  }
  lo = _mm512_reduce_min_ps(vlo);
  hi = _mm512_reduce_max_ps(vhi);
#endif
  for (; k < K; ++k) {
    const float v = S ? x[k] * S[k] : x[k];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  // a range under 255 / FLT_MAX (subnormal entries) would make 255 / range infinite: such a row quantizes as zero
  const float range = hi - lo;
  float inv = range > 0.f && std::isfinite(255.f / range) ? 255.f / range : 0.f, scale = range / 255.f;
  if (std::isinf(range) && std::isfinite(lo) && std::isfinite(hi)) {  // entries near -FLT_MAX and +FLT_MAX
    const double wide = double(hi) - double(lo);
    inv = float(255.0 / wide);
    scale = float(wide / 255.0);
  }
  const int32_t zp = int32_t(std::nearbyint(-lo * inv));
  k = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i vzp = _mm512_set1_epi32(zp), z0 = _mm512_setzero_si512(), z255 = _mm512_set1_epi32(255);
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_loadu_ps(x + k);
    if (S) v = _mm512_mul_ps(v, _mm512_loadu_ps(S + k));
    __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_epi32(z255, _mm512_max_epi32(z0, _mm512_add_epi32(q, vzp)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(q));
  }
#endif
  for (; k < K; ++k) {
    const float v = S ? x[k] * S[k] : x[k];
    out[k] = uint8_t(std::min<int32_t>(255, std::max<int32_t>(0, int32_t(std::nearbyint(v * inv)) + zp)));
  }
  for (k = K; k < 4 * K4; ++k) out[k] = uint8_t(zp);
  *zp_out = zp;
  return scale;
}

// A row as 24-bit integers (int8_linear's bits = 24: weight-only precision on the int8 kernels): v[k] = x[k] *
// inv_smooth[k] (or x[k]), m = max_k |v[k]|, E the exponent with m < 2^E (frexp), s = 2^(E - 22),
// t[k] = round-half-even(v[k] / s) (|t| <= 2^22, |v[k] - t[k] s| <= s / 2 <= m 2^-22), u[k] = t[k] + 2^23 as
// three uint8 planes (bits 0-7, 8-15, 16-23; each K4 quads, padded with u = 2^23: t = 0), so that
// t @ W^T = A0 + 2^8 A1 + 2^16 A2 - 2^23 colsum with A_p the planes' exact int32 sums. Returns s (0 for an
// all-zero row, NaN for a row with an infinite or NaN entry: its outputs are NaN).
double quantize_row24(const float* x, const float* S, int64_t K, int64_t K4, uint8_t* out) {
  const int64_t stride = 4 * K4;
  float m = 0.f;
  bool finite = true;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_setzero_ps();
  __mmask16 bad = 0;
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_loadu_ps(x + k);
    if (S) v = _mm512_mul_ps(v, _mm512_loadu_ps(S + k));
    v = _mm512_abs_ps(v);
    bad |= _mm512_cmp_ps_mask(v, inf, _CMP_NLT_UQ);  // NaN or infinite
    vm = _mm512_max_ps(vm, v);
  }
  m = _mm512_reduce_max_ps(vm);
  finite = bad == 0;
#endif
  for (; k < K; ++k) {
    const float v = std::fabs(S ? x[k] * S[k] : x[k]);
    finite = finite && std::isfinite(v);
    m = std::max(m, v);
  }
  int E = 0;
  std::frexp(m, &E);
  const int sh = 22 - E;
  k = 0;
  if (finite && m > 0.f) {
#if defined(__AVX512F__)
    const __m512 vsh = _mm512_set1_ps(float(sh));
    const __m512i off = _mm512_set1_epi32(1 << 23);
    for (; k + 16 <= K; k += 16) {
      __m512 v = _mm512_loadu_ps(x + k);
      if (S) v = _mm512_mul_ps(v, _mm512_loadu_ps(S + k));
      const __m512i u = _mm512_add_epi32(
          _mm512_cvt_roundps_epi32(_mm512_scalef_ps(v, vsh), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), off);
      for (int p = 0; p < 3; ++p)  // byte p of each u into plane p
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + p * stride + k),
                         _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8 * p)));
    }
#endif
    for (; k < K; ++k) {
      const float v = S ? x[k] * S[k] : x[k];
      const uint32_t u = uint32_t(int32_t(std::nearbyint(std::ldexp(v, sh))) + (1 << 23));
      for (int p = 0; p < 3; ++p) out[p * stride + k] = uint8_t(u >> (8 * p));
    }
  }
  for (; k < stride; ++k) {  // padding, and every k of a zero or non-finite row: t = 0
    out[k] = out[stride + k] = 0;
    out[2 * stride + k] = 128;
  }
  if (!finite) return std::numeric_limits<double>::quiet_NaN();
  return m > 0.f ? std::ldexp(1.0, E - 22) : 0.0;
}

constexpr int64_t QROWS = 8;   // rows per quad_kernel call (x QPAN panels: 24 accumulators)
constexpr int64_t QBLOCK = 64; // rows per tile: their quantized activations stay in L1/L2 across the panels

// One tile: rows [r0, r1) x panels [p0, p1) of int8_linear's output (p0 a multiple of QPAN), ACT fused into the
// epilogue. grouped: pack_int8_quads' grouped layout (a group of QPAN panels starts where the plain layout's first
// panel of the group does).
// Rows of 24 bits (sx24 non-null) are three consecutive plane rows of xu each, combined in the epilogue.
template <int64_t ACT>
void int8_tile(const uint32_t* xu, const float* sx, const double* sx24, const int32_t* zp, int64_t K4,
               const int8_t* wp, bool grouped, const int32_t* cp, const float* sp, const float* bp, float* op,
               int64_t n, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
  static constexpr auto kQuad = rows_table<QPAN>([](auto np) {
    return rows_table<QROWS>([](auto r) { return &quad_kernel<decltype(r)::value, decltype(np)::value>; });
  });
  const int64_t pstride = K4 * PANEL * 4, inner_p = grouped ? PANEL * 4 : pstride;
  const int64_t inner_i = grouped ? QPAN * PANEL * 4 : PANEL * 4;
  alignas(64) int32_t acc[QROWS * QPAN * PANEL];
  alignas(64) float pre[QROWS * QPAN * PANEL];  // the tile's rows rescaled, then activated
  const int64_t planes = sx24 ? 3 : 1;
  for (int64_t p = p0; p < p1; p += QPAN) {
    const int64_t np = std::min<int64_t>(QPAN, p1 - p);
    const int64_t c0 = p * PANEL, nc = std::min<int64_t>(np * PANEL, n - c0);
    // the group's scales, column sums and bias (panel_params; no bias: zeros)
    alignas(64) float spad[QPAN * PANEL] = {}, bpad[QPAN * PANEL] = {};
    alignas(64) int32_t cpad[QPAN * PANEL] = {};
    const float* spanel = panel_params(sp, c0, nc, np * PANEL, spad);
    const int32_t* cpanel = panel_params(cp, c0, nc, np * PANEL, cpad);
    const float* bpanel = bp ? panel_params(bp, c0, nc, np * PANEL, bpad) : bpad;
    for (int64_t r = r0; r < r1; r += QROWS / planes) {
      const int64_t R = std::min<int64_t>(QROWS / planes, r1 - r);
      kQuad[np][R * planes](xu + r * planes * K4, K4, K4, wp + p * pstride, inner_p, inner_i, acc);
      // rescaled, then the activation over all R rows at once (one long loop: an activation's dependency chain,
      // GELU's most of all, overlaps across many vectors), then the rows' nc columns out
      const int64_t w = np * PANEL;
      for (int64_t i = 0; i < R; ++i) {
        if (sx24) {  // t @ W^T exactly in double (|terms| < 2^48), times s = 2^(E - 22), rounded once to float
          const double s = sx24[r + i];
          const int32_t *a0 = acc + 3 * i * w, *a1 = a0 + w, *a2 = a1 + w;
#pragma omp simd
          for (int64_t j = 0; j < w; ++j) {
            const double t = double(a0[j]) + 256.0 * a1[j] + 65536.0 * a2[j] - 8388608.0 * cpanel[j];
            pre[i * w + j] = float(t * s) * spanel[j] + bpanel[j];
          }
          continue;
        }
        const float s = sx[r + i];
        const int32_t z = zp[r + i];
#pragma omp simd
        for (int64_t j = 0; j < w; ++j)
          pre[i * w + j] = float(acc[i * w + j] - z * cpanel[j]) * s * spanel[j] + bpanel[j];
      }
      if constexpr (ACT != IDENT) {
#pragma omp simd
        for (int64_t j = 0; j < R * w; ++j) pre[j] = act_int8<ACT>(pre[j]);
      }
      for (int64_t i = 0; i < R; ++i) std::memcpy(op + (r + i) * n + c0, pre + i * w, nc * sizeof(float));
    }
  }
}

}  // namespace

// x (M, K) float32 -> (M, n) = act((((u - zp) @ W^T) * sx[row]) * scale[col] + bias): uint8 activations u
// quantized per row with their zero point zp (quantize_row; of x * inv_smooth when given: SmoothQuant's
// per-input-channel divisor), int8 weights in quad panels (pack_int8_quads) with colsum[c] = sum_k W[c, k] (int32;
// u @ W^T - zp * colsum), exact int32 sums. Blocked: x is quantized once (rows over the threads), then tiles of QBLOCK rows
// x all panels (or, with fewer row blocks than twice the threads, x a share of the panels) go to the threads; in a
// tile each group of QPAN panels stays in L1/L2 while the tile's rows stream past it.
// bits = 24: each row as 24-bit integers instead (quantize_row24: three uint8 planes, weight-only precision).
Tensor int8_linear(const Tensor& x, const Tensor& packed, const Tensor& colsum, const Tensor& scale,
                   const c10::optional<Tensor>& bias, int64_t n, int64_t act, const c10::optional<Tensor>& inv_smooth,
                   int64_t bits) {
  TORCH_CHECK(act >= IDENT && act <= RELU2, "int8_linear: act ", act, " unsupported");
  TORCH_CHECK(bits == 8 || bits == 24, "int8_linear: bits must be 8 or 24, got ", bits);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "int8_linear: x must be a 2-D float32 CPU tensor with unit inner stride");
  const int64_t M = x.size(0), K = x.size(1), K4 = (K + 3) / 4;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kChar && packed.dim() == 4 &&
                  packed.is_contiguous() && packed.size(1) == K4 &&
                  (packed.size(2) == PANEL || packed.size(2) == QPAN * PANEL) && packed.size(3) == 4,
              "int8_linear: packed must be int8 (P, ceil(K/4)=", K4, ", 16 or 48, 4), got ", packed.sizes());
  const int64_t width = packed.size(2), P = (n + PANEL - 1) / PANEL;  // P: the panels of n outputs
  const bool grouped = width != PANEL;
  TORCH_CHECK(n > (packed.size(0) - 1) * width && n <= packed.size(0) * width, "int8_linear: n=", n,
              " does not fit ", packed.size(0), " panels of ", width);
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.dim() == 1 && colsum.numel() == n && colsum.is_contiguous(),
              "int8_linear: colsum must be int32 (", n, ",)");
  const float* sp = float_vec(scale, "int8_linear: scale", n);
  const float* bp = float_vec(bias, "int8_linear: bias", n);
  const float* smp = float_vec(inv_smooth, "int8_linear: inv_smooth", K);
  Tensor out = sublayer_cache::empty({M, n}, at::kFloat);  // recycled: no fresh-page faults call after call
  if (M == 0 || n == 0) return out;
  const int64_t planes = bits / 8;
  Tensor xu_t = sublayer_cache::empty({M * planes * K4}, at::kInt);
  uint32_t* xu = reinterpret_cast<uint32_t*>(xu_t.data_ptr<int32_t>());
  std::vector<float> sx(M);
  std::vector<double> sx24(planes == 3 ? M : 0);
  std::vector<int32_t> zp(M);
  const float* xp = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, M, row_grain(K), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      uint8_t* u = reinterpret_cast<uint8_t*>(xu + r * planes * K4);
      if (planes == 3)
        sx24[r] = quantize_row24(xp + r * xs, smp, K, K4, u);
      else
        sx[r] = quantize_row(xp + r * xs, smp, K, K4, u, &zp[r]);
    }
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cp = colsum.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t n_rb = (M + QBLOCK - 1) / QBLOCK, threads = at::get_num_threads();
  // few row blocks: column groups too, two per thread (24-bit rows: about 256 KB of weights each, at least two a
  // thread; a thread the OS or a neighbour slows down takes fewer of them)
  const int64_t n_cg = n_rb >= 2 * threads ? 1 : std::min<int64_t>((P + QPAN - 1) / QPAN,
      std::max<int64_t>((2 * threads + n_rb - 1) / n_rb, planes == 3 ? P * PANEL * 4 * K4 >> 18 : 0));
  const int64_t cg_pan = ((P + n_cg - 1) / n_cg + QPAN - 1) / QPAN * QPAN;  // panels per column group
  const int64_t tile_work = std::min<int64_t>(QBLOCK, M) * cg_pan * PANEL * K;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, tile_work));
  SUBLAYER_DISPATCH_ACT(act, [&] {
    const int64_t n_t = n_rb * n_cg;
    parallel_chunks((n_t + grain - 1) / grain, [&](int64_t c) {
      const int64_t t0 = c * grain, t1 = std::min(n_t, t0 + grain);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t rb = t / n_cg, cg = t % n_cg;
        const int64_t p0 = cg * cg_pan, p1 = std::min(P, p0 + cg_pan);
        if (p0 < p1)
          int8_tile<ACT>(xu, sx.data(), planes == 3 ? sx24.data() : nullptr, zp.data(), K4, wp, grouped, cp, sp, bp,
                         op, n, rb * QBLOCK, std::min(M, (rb + 1) * QBLOCK), p0, p1);
      }
    });
  });
  return out;
}

namespace {

// max_j (a[j] - e[j]) with e[j] = xn * bound[j] + xq * bq[j] + rel * |a[j]| (the lower end of row j's interval);
// sets nan if any a[j] is NaN.
inline float lower_max(const float* a, const float* bound, const float* bq, int64_t V, float xn, float xq, float rel,
                       bool& nan) {
  float lo = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if SUBLAYER_AVX2_FMA
  const __m256 vxn = _mm256_set1_ps(xn), vxq = _mm256_set1_ps(xq), vrel = _mm256_set1_ps(rel), sign = _mm256_set1_ps(-0.0f);
  __m256 vlo = _mm256_set1_ps(lo), vnan = _mm256_setzero_ps();
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(a + j);
    const __m256 e = _mm256_fmadd_ps(vxn, _mm256_loadu_ps(bound + j),
                                     _mm256_fmadd_ps(vxq, _mm256_loadu_ps(bq + j), _mm256_mul_ps(vrel, _mm256_andnot_ps(sign, v))));
    vlo = _mm256_max_ps(vlo, _mm256_sub_ps(v, e));
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float l8[8];
  _mm256_storeu_ps(l8, vlo);
  for (float l : l8) lo = std::max(lo, l);
  nan |= _mm256_movemask_ps(vnan) != 0;
#endif
  for (; j < V; ++j) {
    lo = std::max(lo, a[j] - (xn * bound[j] + xq * bq[j] + rel * std::fabs(a[j])));
    nan |= std::isnan(a[j]);
  }
  return lo;
}

// With int8_linear's quantized activations: the bound on ||x - xq||_2 + 2^-22 ||xq||_2 for the row x (K floats),
// xq = (u - zp) * sx its uint8 quantization exactly as int8_linear forms it (quantize_row, no smoothing),
// computed in double and rounded up; at least 2^-80 (with bq >= 2^-40: covers an underflow of the dequantizing
// product, <= 2^-149).
float quantized_error(const float* x, int64_t K) {
  const int64_t K4 = (K + 3) / 4;
  std::vector<uint8_t> u(size_t(4 * K4));
  int32_t zp = 0;
  const double sx = quantize_row(x, nullptr, K, K4, u.data(), &zp);
  double dd = 0.0, qq = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    const double xq = double(int32_t(u[k]) - zp) * sx, d = double(x[k]) - xq;
    dd += d * d;
    qq += xq * xq;
  }
  const double e = (std::sqrt(dd) + std::ldexp(std::sqrt(qq), -22)) * (1.0 + std::ldexp(1.0, -10));
  return float(std::max(e, std::ldexp(1.0, -80)) * (1.0 + std::ldexp(1.0, -20)));
}

// The float32 argmax of x @ W^T + bias per row, given screened logits (the same product over an approximate
// weight) and per-row error bounds: |screened[j] - exact[j]| <= ||x_r||_2 * bound[j] + 2^-21 |screened[j]|.
// With bound_q (V,): the screen multiplied x quantized per row as int8_linear does (uint8, no smoothing), and
// the bound adds e_x * bound_q[j], e_x = ||x_r - xq_r||_2 + 2^-22 ||xq_r||_2 (quantized_error).
// Only rows whose interval reaches the best lower end are recomputed in float32 (runtime/linear.py, GreedyHead,
// has the argument). A NaN, a non-finite best lower end or a non-finite ||x_r|| makes every row a candidate; NaN
// wins as in torch.argmax, and ties go to the first index.
Tensor screened_argmax(const Tensor& x, const Tensor& screened, const Tensor& weight, const c10::optional<Tensor>& bias,
                       const Tensor& bound, const c10::optional<Tensor>& bound_q) {
  check_float_contig(screened, "screened_argmax: screened", 2);
  check_float_contig(weight, "screened_argmax: weight", 2);
  check_float_contig(bound, "screened_argmax: bound", 1);
  const int64_t M = screened.size(0), V = screened.size(1), K = weight.size(1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == M && x.size(1) == K && x.stride(1) == 1,
              "screened_argmax: x must be float32 (", M, ", ", K, ") with unit inner stride, got ", x.sizes());
  TORCH_CHECK(weight.size(0) == V && bound.size(0) == V,
              "screened_argmax: weight (V, K) and bound (V,) disagree with screened (M, V)");
  const float* bp = float_vec(bias, "screened_argmax: bias", V);
  const float* bq = float_vec(bound_q, "screened_argmax: bound_q", V);
  Tensor out = at::empty({M}, screened.options().dtype(at::kLong));
  const float *sp = screened.data_ptr<float>(), *wp = weight.data_ptr<float>(), *eb = bound.data_ptr<float>();
  const float* ebq = bq ? bq : eb;  // read times xq = 0 without bound_q
  int64_t* op = out.data_ptr<int64_t>();
  const float rel = std::ldexp(1.0f, -21);
  // rows handed out from a shared counter (parallel_chunks: a thread a neighbour slows takes fewer); each reads its
  // own screened logits, and which thread takes a row changes no result
  parallel_chunks(M, [&](int64_t r) {
    const float* a = sp + r * V;
    const float* xr = x.data_ptr<float>() + r * x.stride(0);
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) ss += double(xr[k]) * double(xr[k]);
    const float xn = float(std::sqrt(ss)) * (1.0f + std::ldexp(1.0f, -10));  // ||x_r||_2, rounded up
    const float xq = bq ? quantized_error(xr, K) : 0.0f;
    bool nan = false;
    const float lo = lower_max(a, eb, ebq, V, xn, xq, rel, nan);
    const bool all = nan || !std::isfinite(lo) || !std::isfinite(xn) || !std::isfinite(xq);
    int64_t best = -1;
    float bv = 0.0f;
    auto consider = [&](int64_t j) {
      if (!all && !(a[j] + (xn * eb[j] + xq * ebq[j] + rel * std::fabs(a[j])) >= lo)) return;
      const float v = dot(xr, wp + j * K, K) + (bp ? bp[j] : 0.0f);
      if (best < 0 || v > bv || (std::isnan(v) && !std::isnan(bv))) {
        best = j;
        bv = v;
      }
    };
    int64_t j = 0;
#if SUBLAYER_AVX2_FMA
    if (!all) {  // skip blocks of 8 with no candidate (the test above, 8 lanes at a time)
      const __m256 vxn = _mm256_set1_ps(xn), vxq = _mm256_set1_ps(xq), vrel = _mm256_set1_ps(rel);
      const __m256 sign = _mm256_set1_ps(-0.0f), vlo = _mm256_set1_ps(lo);
      for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(a + j);
        const __m256 e = _mm256_fmadd_ps(
            vxn, _mm256_loadu_ps(eb + j),
            _mm256_fmadd_ps(vxq, _mm256_loadu_ps(ebq + j), _mm256_mul_ps(vrel, _mm256_andnot_ps(sign, v))));
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(v, e), vlo, _CMP_GE_OQ)) == 0) continue;
        for (int64_t i = j; i < j + 8; ++i) consider(i);
      }
    }
#endif
    for (; j < V; ++j) consider(j);
    op[r] = best < 0 ? 0 : best;
  });
  return out;
}

}  // namespace
}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor", sublayer::cpu_kernel(&sublayer::pack_linear_weight));
  m.def("pack_compact_bf16(Tensor weight, Tensor table) -> Tensor", sublayer::cpu_kernel(&sublayer::pack_compact_bf16));
  m.def("decode_avx512(int flag) -> bool", &sublayer::decode_avx512);
  m.def("decode_bf16_dot(int flag) -> bool", &sublayer::decode_bf16_dot);
  m.def("screened_argmax(Tensor x, Tensor screened, Tensor weight, Tensor? bias, Tensor bound, Tensor? bound_q=None) -> Tensor",
        sublayer::cpu_kernel(&sublayer::screened_argmax));
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int n, int act=0, Tensor? scale=None) -> Tensor",
        sublayer::cpu_kernel(&sublayer::skinny_linear));
  m.def("pack_int8_quads(Tensor q, bool grouped=False) -> Tensor", sublayer::cpu_kernel(&sublayer::pack_int8_quads));
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor colsum, Tensor scale, Tensor? bias, int n, int act=0, "
      "Tensor? inv_smooth=None, int bits=8) -> Tensor",
      sublayer::cpu_kernel(&sublayer::int8_linear));
}
