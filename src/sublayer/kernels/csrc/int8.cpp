// int8 inference helpers (sublayer.models.quantized): the per-token scaling around fbgemm's dynamic int8 linear.
//
//  * int8_scale_rows(x, inv_smooth?) -> (xs, r): r[i] = max_k |x[i,k] * inv_smooth[k]| (1 for an all-zero row),
//    xs[i,k] = x[i,k] * inv_smooth[k] / r[i]; one read of x, one write of xs (a row stays in L1 between passes).
//  * int8_rescale_rows_(y, r, bias?) -> y: y[i,j] = y[i,j] * r[i] + bias[j], in place.
//  * int8_act_rows_(y, r?, bias?, act, inv_next?) -> (y, r2): h = act(y * r + bias) (the FFN's first epilogue);
//    with inv_next, y := h * inv_next / r2 and r2 = the rows' max |h * inv_next| (the next linear's input),
//    otherwise y := h (r2 empty).
//  * int8_add_norm_rows_(y, r?, bias?, resid, w, beta, eps, inv_next?) -> (y, xs, r2): y := LN(y * r + bias +
//    resid) (two-pass variance, float32), and with inv_next also xs, r2 = int8_scale_rows(y, inv_next).
// Both float32, 2-D contiguous, rows split over the OpenMP threads. The PyTorch expressions above are the
// reference (sublayer.models.quantized uses them when the kernels are off); tests compare the two.
//
// Weight-only int8 for decoding (sublayer.models.quantized_gpt2):
//  * pack_int8_linear_weight(q) : q (N, K) int8 -> (ceil(N/16), K, 16) int8, zero-padded: decode.cpp's panel
//    layout (pack_linear_weight) at a quarter of the bytes, streamed sequentially.
//  * int8_skinny_linear(x, packed, scale, bias?, n, act) : y = act((x @ q^T) * scale + bias) for fp32 x (M, K),
//    scale (n,) per output channel. The int8 weights are widened to fp32 in registers (vpmovsxbd + vcvtdq2ps) and
//    multiplied with FMA: exact products, fp32 sums (as x @ dequant(q)^T up to the summation order); the scale
//    is applied once per column at the end. Any M works (4 rows per micro-kernel call, each panel read from
//    memory once and re-read from cache by the next rows); panels split over the threads (at::parallel_for).
//    Compiled for AVX-512, a 16-lane micro-kernel (8 rows per call) runs instead (int8_gemv_avx512 switches it);
//    without AVX2 a scalar loop.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include "activations.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

namespace {

using at::Tensor;

void check_2d_f32(const Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == at::kFloat && t.device().is_cpu(), what,
              ": expected a contiguous 2-D float32 CPU tensor, got ", t.sizes(), " ", t.scalar_type());
}

void check_vec(const std::optional<Tensor>& v, int64_t n, const char* what) {
  if (!v) return;
  TORCH_CHECK(v->dim() == 1 && v->numel() == n && v->is_contiguous() && v->scalar_type() == at::kFloat, what,
              ": expected a contiguous float32 vector of ", n, " elements, got ", v->sizes(), " ", v->scalar_type());
}

std::tuple<Tensor, Tensor> int8_scale_rows(const Tensor& x, const std::optional<Tensor>& inv_smooth) {
  check_2d_f32(x, "int8_scale_rows: x");
  const int64_t N = x.size(0), K = x.size(1);
  check_vec(inv_smooth, K, "int8_scale_rows: inv_smooth");
  Tensor xs = at::empty_like(x);
  Tensor r = at::empty({N, 1}, x.options());
  const float* X = x.data_ptr<float>();
  const float* S = inv_smooth ? inv_smooth->data_ptr<float>() : nullptr;
  float* O = xs.data_ptr<float>();
  float* R = r.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* xi = X + i * K;
      float* oi = O + i * K;
      int64_t k = 0;
      float m = 0.f;
#ifdef __AVX2__
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 vm = _mm256_setzero_ps();
      for (; k + 8 <= K; k += 8) {
        __m256 v = _mm256_loadu_ps(xi + k);
        if (S) v = _mm256_mul_ps(v, _mm256_loadu_ps(S + k));
        _mm256_storeu_ps(oi + k, v);
        vm = _mm256_max_ps(vm, _mm256_andnot_ps(sign, v));
      }
      alignas(32) float buf[8];
      _mm256_store_ps(buf, vm);
      for (float b : buf) m = std::max(m, b);
#endif
      for (; k < K; ++k) {
        float v = S ? xi[k] * S[k] : xi[k];
        oi[k] = v;
        m = std::max(m, std::fabs(v));
      }
      const float ri = m > 0.f ? m : 1.f;
      R[i] = ri;
      const float inv = 1.f / ri;
      k = 0;
#ifdef __AVX2__
      const __m256 vinv = _mm256_set1_ps(inv);
      for (; k + 8 <= K; k += 8) _mm256_storeu_ps(oi + k, _mm256_mul_ps(_mm256_loadu_ps(oi + k), vinv));
#endif
      for (; k < K; ++k) oi[k] *= inv;
    }
  });
  return {xs, r};
}

Tensor int8_rescale_rows_(Tensor y, const Tensor& r, const std::optional<Tensor>& bias) {
  check_2d_f32(y, "int8_rescale_rows_: y");
  const int64_t N = y.size(0), M = y.size(1);
  TORCH_CHECK(r.numel() == N && r.is_contiguous() && r.scalar_type() == at::kFloat,
              "int8_rescale_rows_: r must hold one float32 per row (", N, "), got ", r.sizes());
  check_vec(bias, M, "int8_rescale_rows_: bias");
  float* Y = y.data_ptr<float>();
  const float* R = r.data_ptr<float>();
  const float* B = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(M, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      float* yi = Y + i * M;
      const float ri = R[i];
      int64_t j = 0;
#ifdef __AVX2__
      const __m256 vr = _mm256_set1_ps(ri);
      if (B) {
        for (; j + 8 <= M; j += 8)
          _mm256_storeu_ps(yi + j, _mm256_fmadd_ps(_mm256_loadu_ps(yi + j), vr, _mm256_loadu_ps(B + j)));
      } else {
        for (; j + 8 <= M; j += 8) _mm256_storeu_ps(yi + j, _mm256_mul_ps(_mm256_loadu_ps(yi + j), vr));
      }
#endif
      for (; j < M; ++j) yi[j] = B ? std::fma(yi[j], ri, B[j]) : yi[j] * ri;
    }
  });
  return y;
}


using namespace sublayer_act;  // Act and act_f (activations.h), as kernels.cpp

// v[0:K] *= inv_next (if any); returns max |v| (1 for an all-zero row) and divides v by it.
inline float scale_row(float* v, const float* inv, int64_t K) {
  float m = 0.f;
  if (inv) {
#pragma omp simd reduction(max : m)
    for (int64_t k = 0; k < K; ++k) {
      v[k] *= inv[k];
      m = std::max(m, std::fabs(v[k]));
    }
  } else {
#pragma omp simd reduction(max : m)
    for (int64_t k = 0; k < K; ++k) m = std::max(m, std::fabs(v[k]));
  }
  const float r = m > 0.f ? m : 1.f, ir = 1.f / r;
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) v[k] *= ir;
  return r;
}

template <int64_t act>
void act_rows(float* Y, const float* R, const float* B, const float* S, float* R2, int64_t N, int64_t M) {
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(M, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      float* yi = Y + i * M;
      const float ri = R ? R[i] : 1.f;
      if (B) {
#pragma omp simd
        for (int64_t j = 0; j < M; ++j) yi[j] = act_f<act>(yi[j] * ri + B[j]);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < M; ++j) yi[j] = act_f<act>(yi[j] * ri);
      }
      if (S) R2[i] = scale_row(yi, S, M);
    }
  });
}

std::tuple<Tensor, Tensor> int8_act_rows_(Tensor y, const std::optional<Tensor>& r, const std::optional<Tensor>& bias,
                                          int64_t act, const std::optional<Tensor>& inv_next) {
  check_2d_f32(y, "int8_act_rows_: y");
  const int64_t N = y.size(0), M = y.size(1);
  TORCH_CHECK(act >= IDENT && act <= RELU2, "int8_act_rows_: unknown activation id ", act);
  TORCH_CHECK(!r || (r->numel() == N && r->is_contiguous() && r->scalar_type() == at::kFloat),
              "int8_act_rows_: r must hold one float32 per row");
  check_vec(bias, M, "int8_act_rows_: bias");
  check_vec(inv_next, M, "int8_act_rows_: inv_next");
  Tensor r2 = at::empty({inv_next ? N : 0, 1}, y.options());
  float* Y = y.data_ptr<float>();
  const float* R = r ? r->data_ptr<float>() : nullptr;
  const float* B = bias ? bias->data_ptr<float>() : nullptr;
  const float* S = inv_next ? inv_next->data_ptr<float>() : nullptr;
  float* R2 = inv_next ? r2.data_ptr<float>() : nullptr;
  switch (act) {
    case RELU: act_rows<RELU>(Y, R, B, S, R2, N, M); break;
    case GELU: act_rows<GELU>(Y, R, B, S, R2, N, M); break;
    case GELU_TANH: act_rows<GELU_TANH>(Y, R, B, S, R2, N, M); break;
    case SILU: act_rows<SILU>(Y, R, B, S, R2, N, M); break;
    case RELU2: act_rows<RELU2>(Y, R, B, S, R2, N, M); break;
    default: act_rows<IDENT>(Y, R, B, S, R2, N, M);
  }
  return {y, r2};
}

std::tuple<Tensor, Tensor, Tensor> int8_add_norm_rows_(Tensor y, const std::optional<Tensor>& r,
                                                       const std::optional<Tensor>& bias, const Tensor& resid,
                                                       const Tensor& w, const Tensor& beta, double eps,
                                                       const std::optional<Tensor>& inv_next) {
  check_2d_f32(y, "int8_add_norm_rows_: y");
  check_2d_f32(resid, "int8_add_norm_rows_: resid");
  TORCH_CHECK(resid.sizes() == y.sizes(), "int8_add_norm_rows_: resid must have y's shape ", y.sizes(), ", got ",
              resid.sizes());
  const int64_t N = y.size(0), M = y.size(1);
  TORCH_CHECK(!r || (r->numel() == N && r->is_contiguous() && r->scalar_type() == at::kFloat),
              "int8_add_norm_rows_: r must hold one float32 per row");
  check_vec(bias, M, "int8_add_norm_rows_: bias");
  check_vec(w, M, "int8_add_norm_rows_: w");
  check_vec(beta, M, "int8_add_norm_rows_: beta");
  check_vec(inv_next, M, "int8_add_norm_rows_: inv_next");
  Tensor xs = at::empty({inv_next ? N : 0, M}, y.options());
  Tensor r2 = at::empty({inv_next ? N : 0, 1}, y.options());
  float* Y = y.data_ptr<float>();
  const float* X = resid.data_ptr<float>();
  const float* R = r ? r->data_ptr<float>() : nullptr;
  const float* B = bias ? bias->data_ptr<float>() : nullptr;
  const float* W = w.data_ptr<float>();
  const float* BE = beta.data_ptr<float>();
  const float* S = inv_next ? inv_next->data_ptr<float>() : nullptr;
  float* XS = inv_next ? xs.data_ptr<float>() : nullptr;
  float* R2 = inv_next ? r2.data_ptr<float>() : nullptr;
  const float e = float(eps);
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(M, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      float* yi = Y + i * M;
      const float* xi = X + i * M;
      const float ri = R ? R[i] : 1.f;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < M; ++j) {
        const float v = yi[j] * ri + (B ? B[j] : 0.f) + xi[j];
        yi[j] = v;
        sum += v;
      }
      const float mean = sum / float(M);
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < M; ++j) {
        const float d = yi[j] - mean;
        ss += d * d;
      }
      const float rstd = 1.f / std::sqrt(ss / float(M) + e);
#pragma omp simd
      for (int64_t j = 0; j < M; ++j) yi[j] = (yi[j] - mean) * rstd * W[j] + BE[j];
      if (S) {
        float* oi = XS + i * M;
        std::copy(yi, yi + M, oi);
        R2[i] = scale_row(oi, S, M);
      }
    }
  });
  return {y, xs, r2};
}


// ------------------------------------------------------------------------------------ weight-only int8 GEMV
constexpr int64_t I8_PANEL = 16;  // output columns per packed panel (two AVX2 vectors of fp32)
constexpr int64_t I8_ROWS = 4;    // rows of x per micro-kernel call

Tensor pack_int8_linear_weight(const Tensor& q) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
              "pack_int8_linear_weight: q must be a contiguous 2-D int8 CPU tensor, got ", q.sizes(), " ",
              q.scalar_type());
  const int64_t N = q.size(0), K = q.size(1), P = (N + I8_PANEL - 1) / I8_PANEL;
  Tensor out = at::empty({P, K, I8_PANEL}, q.options());
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < I8_PANEL; ++j) {
          const int64_t c = p * I8_PANEL + j;
          dst[(p * K + k) * I8_PANEL + j] = c < N ? src[c * K + k] : int8_t(0);
        }
  });
  return out;
}

// acc[r][0..15] = sum_k x[r][k] * w[k][0..15] (fp32) for R rows; w is one int8 panel (K x 16).
template <int R>
inline void i8_panel_kernel(const float* x, int64_t ldx, const int8_t* w, int64_t K, float* acc) {
#if defined(__AVX2__) && defined(__FMA__)
  // R <= 2: a second accumulator set (odd k) so one row does not wait on the FMA latency; R > 2 has enough
  // independent chains with one set (and keeps the accumulators within AVX2's 16 registers)
  constexpr int S = R <= 2 ? 2 : 1;
  __m256 lo[S][R], hi[S][R];
  for (int u = 0; u < S; ++u)
    for (int r = 0; r < R; ++r) lo[u][r] = hi[u][r] = _mm256_setzero_ps();
  auto widen = [](const int8_t* p) {  // 8 int8 -> 8 fp32
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    // 64 bytes = 4 k per line; prefetch ~2 KB ahead (the hardware streamer stops at 4 KB pages)
    if ((k & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + k * I8_PANEL) + 2048, _MM_HINT_T0);
    const int8_t* wk = w + k * I8_PANEL;
    const __m256 w0 = widen(wk), w1 = widen(wk + 8), w2 = widen(wk + 16), w3 = widen(wk + 24);
    for (int r = 0; r < R; ++r) {
      const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k), xb = _mm256_broadcast_ss(x + r * ldx + k + 1);
      lo[0][r] = _mm256_fmadd_ps(xa, w0, lo[0][r]);
      hi[0][r] = _mm256_fmadd_ps(xa, w1, hi[0][r]);
      lo[S - 1][r] = _mm256_fmadd_ps(xb, w2, lo[S - 1][r]);
      hi[S - 1][r] = _mm256_fmadd_ps(xb, w3, hi[S - 1][r]);
    }
  }
  for (; k < K; ++k) {
    const int8_t* wk = w + k * I8_PANEL;
    const __m256 w0 = widen(wk), w1 = widen(wk + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xa = _mm256_broadcast_ss(x + r * ldx + k);
      lo[0][r] = _mm256_fmadd_ps(xa, w0, lo[0][r]);
      hi[0][r] = _mm256_fmadd_ps(xa, w1, hi[0][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 a = lo[0][r], b = hi[0][r];
    if constexpr (S == 2) {
      a = _mm256_add_ps(a, lo[1][r]);
      b = _mm256_add_ps(b, hi[1][r]);
    }
    _mm256_storeu_ps(acc + r * I8_PANEL, a);
    _mm256_storeu_ps(acc + r * I8_PANEL + 8, b);
  }
#else
  for (int r = 0; r < R; ++r) {
    float s[I8_PANEL] = {0};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int j = 0; j < I8_PANEL; ++j) s[j] += xv * float(w[k * I8_PANEL + j]);
    }
    for (int j = 0; j < I8_PANEL; ++j) acc[r * I8_PANEL + j] = s[j];
  }
#endif
}

using I8PanelFn = void (*)(const float*, int64_t, const int8_t*, int64_t, float*);
constexpr I8PanelFn kI8Panel[I8_ROWS + 1] = {nullptr, i8_panel_kernel<1>, i8_panel_kernel<2>, i8_panel_kernel<3>,
                                             i8_panel_kernel<4>};

#if defined(__AVX512F__)
// The same panel product with one 16-lane vector per k (AVX-512 CPUs): half the instructions of the AVX2 kernel
// and 32 registers, so 8 rows per call. Used where the AVX2 kernel is compute-bound (8 rows and more: batched
// decoding, the prompt). Same numbers as the AVX2 kernel up to the summation order (fp32 FMAs).
constexpr int64_t I8_ROWS512 = 8;

template <int R>
inline void i8_panel_kernel512(const float* x, int64_t ldx, const int8_t* w, int64_t K, float* acc) {
  constexpr int S = R <= 2 ? 4 : (R <= 4 ? 2 : 1);  // independent accumulator sets (k mod S)
  __m512 a[S][R];
  for (int u = 0; u < S; ++u)
    for (int r = 0; r < R; ++r) a[u][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {  // 4 k = one 64-byte line of the panel
    _mm_prefetch(reinterpret_cast<const char*>(w + k * I8_PANEL) + 2048, _MM_HINT_T0);
    for (int j = 0; j < 4; ++j) {
      const __m512 wv = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k + j) * I8_PANEL))));
      for (int r = 0; r < R; ++r)
        a[j % S][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k + j]), wv, a[j % S][r]);
    }
  }
  for (; k < K; ++k) {
    const __m512 wv = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * I8_PANEL))));
    for (int r = 0; r < R; ++r) a[0][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, a[0][r]);
  }
  for (int r = 0; r < R; ++r) {
    __m512 v = a[0][r];
    for (int u = 1; u < S; ++u) v = _mm512_add_ps(v, a[u][r]);
    _mm512_storeu_ps(acc + r * I8_PANEL, v);
  }
}

constexpr I8PanelFn kI8Panel512[I8_ROWS512 + 1] = {
    nullptr, i8_panel_kernel512<1>, i8_panel_kernel512<2>, i8_panel_kernel512<3>, i8_panel_kernel512<4>,
    i8_panel_kernel512<5>, i8_panel_kernel512<6>, i8_panel_kernel512<7>, i8_panel_kernel512<8>};
#endif

// Whether int8_skinny_linear uses the AVX-512 micro-kernel where it was compiled in (tests switch it off to check
// the AVX2 one on the same machine): int8_gemv_avx512(flag) sets it and returns the previous value; -1 reads it.
std::atomic<bool> g_i8_avx512{true};

bool int8_gemv_avx512(int64_t flag) {
#if defined(__AVX512F__)
  const bool was = g_i8_avx512.load();
  if (flag >= 0) g_i8_avx512.store(flag != 0);
  return was;
#else
  (void)flag;
  return false;
#endif
}

// v[0..15] = act(v * scale + bias) (scale, bias: this panel's, zero-padded past n).
template <int64_t act>
inline void i8_epilogue(float* v, const float* scale, const float* bias) {
#pragma omp simd
  for (int j = 0; j < I8_PANEL; ++j) v[j] = act_f<act>(v[j] * scale[j] + bias[j]);
}

using I8EpiFn = void (*)(float*, const float*, const float*);
constexpr I8EpiFn kI8Epi[] = {i8_epilogue<IDENT>, i8_epilogue<RELU>, i8_epilogue<GELU>,
                              i8_epilogue<GELU_TANH>, i8_epilogue<SILU>, i8_epilogue<RELU2>};

// x (M, K) float32 (row stride free, unit inner stride), packed (P, K, 16) int8, scale (n,) -> (M, n).
Tensor int8_skinny_linear(const Tensor& x, const Tensor& packed, const Tensor& scale,
                          const std::optional<Tensor>& bias, int64_t n, int64_t act) {
  TORCH_CHECK(act >= IDENT && act <= RELU2, "int8_skinny_linear: unknown activation id ", act);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "int8_skinny_linear: x must be a 2-D float32 CPU tensor with unit inner stride");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kChar && packed.dim() == 3 &&
                  packed.is_contiguous(),
              "int8_skinny_linear: packed must be a contiguous 3-D int8 CPU tensor (pack_int8_linear_weight)");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == I8_PANEL, "int8_skinny_linear: packed must be (P, K=", K,
              ", 16), got ", packed.sizes());
  TORCH_CHECK(n > (P - 1) * I8_PANEL && n <= P * I8_PANEL, "int8_skinny_linear: n=", n, " does not fit ", P,
              " panels");
  check_vec(scale, n, "int8_skinny_linear: scale");
  check_vec(bias, n, "int8_skinny_linear: bias");
  Tensor out = at::empty({M, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const I8EpiFn epi = kI8Epi[act];
  // grain: at least ~32 KB of weights (and of row work) per task so small matrices skip thread wake-ups
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, K * I8_PANEL * std::min<int64_t>(M, 8)));
  const I8PanelFn* panel = kI8Panel;
  int64_t rows = I8_ROWS;
#if defined(__AVX512F__)
  if (g_i8_avx512.load(std::memory_order_relaxed)) {
    panel = kI8Panel512;
    rows = I8_ROWS512;
  }
#endif
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    float acc[8 * I8_PANEL];
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* w = wp + p * K * I8_PANEL;
      const int64_t c0 = p * I8_PANEL, nc = std::min<int64_t>(I8_PANEL, n - c0);
      float spanel[I8_PANEL] = {0}, bpanel[I8_PANEL] = {0};  // zero-padded past n
      for (int64_t j = 0; j < nc; ++j) {
        spanel[j] = sp[c0 + j];
        bpanel[j] = bp ? bp[c0 + j] : 0.f;
      }
      for (int64_t r0 = 0; r0 < M; r0 += rows) {
        const int64_t R = std::min<int64_t>(rows, M - r0);
        panel[R](xp + r0 * ldx, ldx, w, K, acc);
        for (int64_t r = 0; r < R; ++r) {
          float* a = acc + r * I8_PANEL;
          epi(a, spanel, bpanel);
          std::copy(a, a + nc, op + (r0 + r) * n + c0);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("int8_scale_rows(Tensor x, Tensor? inv_smooth) -> (Tensor, Tensor)");
  m.def("int8_rescale_rows_(Tensor(a!) y, Tensor r, Tensor? bias) -> Tensor(a!)");
  m.def("int8_act_rows_(Tensor(a!) y, Tensor? r, Tensor? bias, int act, Tensor? inv_next) -> (Tensor(a!), Tensor)");
  m.def(
      "int8_add_norm_rows_(Tensor(a!) y, Tensor? r, Tensor? bias, Tensor resid, Tensor w, Tensor beta, float eps, "
      "Tensor? inv_next) -> (Tensor(a!), Tensor, Tensor)");
  m.def("pack_int8_linear_weight(Tensor q) -> Tensor");
  m.def("int8_skinny_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n, int act=0) -> Tensor");
  m.def("int8_gemv_avx512(int flag) -> bool", &int8_gemv_avx512);
}

TORCH_LIBRARY_IMPL(sublayer_kernels, CPU, m) {
  m.impl("int8_scale_rows", &int8_scale_rows);
  m.impl("int8_rescale_rows_", &int8_rescale_rows_);
  m.impl("int8_act_rows_", &int8_act_rows_);
  m.impl("int8_add_norm_rows_", &int8_add_norm_rows_);
  m.impl("pack_int8_linear_weight", &pack_int8_linear_weight);
  m.impl("int8_skinny_linear", &int8_skinny_linear);
}
