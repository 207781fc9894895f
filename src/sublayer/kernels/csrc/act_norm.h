// Activations and row norms shared by the kernels: the elementwise activations (the FFN passes, the packed linear's
// and the int8 epilogues: float32 with a vectorisable exp, double through std:: functions; ids as
// sublayer.functional.fused.ACT_IDS), exp on 8 float32 lanes, and the row reductions of the norms.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define SUBLAYER_AVX2_FMA 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace sublayer {

enum Act : int64_t { IDENT = 0, RELU = 1, GELU = 2, GELU_TANH = 3, SILU = 4, RELU2 = 5 };

// Vectorisable float32 exp (Cephes expf: range reduction + degree-5 polynomial, ~1 ulp); double uses std::exp.
inline float exp_f(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}
inline float vexp(float x) { return exp_f(x); }
inline double vexp(double x) { return std::exp(x); }

// Phi(z), the standard normal CDF: 0.5*erfc(-z/sqrt2). float: erfc from Numerical Recipes' erfcc (relative error
// < 1.2e-7 everywhere, so the tails keep their relative accuracy); double: std::erfc.
inline float norm_cdf(float z) {
  const float w = std::fabs(z) * 0.70710678118654752440f, t = 1.0f / (1.0f + 0.5f * w);
  const float poly =
      -1.26551223f +
      t * (1.00002368f +
           t * (0.37409196f +
                t * (0.09678418f +
                     t * (-0.18628806f +
                          t * (0.27886807f + t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
  const float half_erfc = 0.5f * t * exp_f(-w * w + poly);
  return z >= 0.0f ? 1.0f - half_erfc : half_erfc;
}
inline double norm_cdf(double z) { return 0.5 * std::erfc(-z * 0.70710678118654752440); }

// tanh-GELU through one exp: 1 + tanh(u) = 2*sigmoid(2u), 1 - tanh(u)^2 = 4*sigmoid(2u)*(1 - sigmoid(2u)).
// float: 0 below -88.3, where exp_f clamps and exp(-v) overflows, as in torch (z * sigmoid(z) at z = -inf is NaN,
// at a huge negative z -0, not z times a tiny number).
template <typename A> inline A sigmoid(A v) {
  if constexpr (std::is_same_v<A, float>) return v < -88.3f ? 0.0f : 1.0f / (1.0f + exp_f(-v));
  return A(1) / (A(1) + vexp(-v));
}

// ReLU's compare keeps a NaN (z < 0 is false for it), as torch.relu does.
template <int64_t act, typename A> inline A act_f(A z) {
  if constexpr (act == RELU) return z < A(0) ? A(0) : z;
  if constexpr (act == GELU) return z * norm_cdf(z);
  if constexpr (act == GELU_TANH) {
    const A k = A(0.79788456080286535588), u = k * (z + A(0.044715) * z * z * z);
    return z * sigmoid(A(2) * u);
  }
  if constexpr (act == SILU) return z * sigmoid(z);
  if constexpr (act == RELU2) return z < A(0) ? A(0) : z * z;
  return z;
}
// The int8 GEMMs' epilogue activation: act_f, except GELU as z * (0.5 + 0.5*erf(z/sqrt2)) with erf a rational
// function on [-4, 4] (an odd degree-13 over an even degree-8 polynomial, the float erf of Eigen and XLA; +-1
// beyond): absolute error ~2e-7 in Phi, as PyTorch's vectorised float32 erf, far below the int8 activations' rounding,
// in a third of norm_cdf's operations.
template <int64_t act> inline float act_int8(float z) {
  if constexpr (act == GELU) {
    const float x = std::min(std::max(z * 0.70710678118654752440f, -4.0f), 4.0f), x2 = x * x;
    float p = -2.72614225801306e-10f;
    p = p * x2 + 2.77068142495902e-08f;
    p = p * x2 + -2.10102402082508e-06f;
    p = p * x2 + -5.69250639462346e-05f;
    p = p * x2 + -7.34990630326855e-04f;
    p = p * x2 + -2.95459980854025e-03f;
    p = p * x2 + -1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * x2 + -2.13374055278905e-04f;
    q = q * x2 + -1.68282697438203e-03f;
    q = q * x2 + -7.37332916720468e-03f;
    q = q * x2 + -1.42647390514189e-02f;
    return z * (0.5f + 0.5f * (x * p / q));
  }
  return act_f<act>(z);
}
// Runs __VA_ARGS__ (a lambda) with `constexpr int64_t ACT` = the activation id ACTV (unknown ids: IDENT).
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

template <int64_t act, typename A> inline A act_df(A z) {
  if constexpr (act == RELU) return z > A(0) ? A(1) : A(0);
  if constexpr (act == GELU) return norm_cdf(z) + z * A(0.39894228040143267794) * vexp(A(-0.5) * z * z);
  if constexpr (act == GELU_TANH) {
    const A k = A(0.79788456080286535588), z2 = z * z, s = sigmoid(A(2) * k * (z + A(0.044715) * z2 * z));
    return s + A(2) * z * s * (A(1) - s) * k * (A(1) + A(3 * 0.044715) * z2);
  }
  if constexpr (act == SILU) {
    const A s = sigmoid(z);
    return s * (A(1) + z * (A(1) - s));
  }
  if constexpr (act == RELU2) return z > A(0) ? A(2) * z : A(0);
  return A(1);
}

#if SUBLAYER_AVX2_FMA
// Cephes expf on the float32 lanes of a vector (range reduction + degree-5 polynomial, ~1 ulp), inputs clamped to
// [-87.3, 88.3], at any width: P the intrinsics' prefix (_mm256), W its bits, FLOOR rounds down. exp256 (8 lanes)
// here; packed_attention.cpp makes exp512. A NaN stays NaN (max_ps / min_ps return their second operand when one
// is NaN: x comes second; the bounds are nonzero, so other inputs clamp as either order would).
#define SUBLAYER_VEXP(NAME, V, P, W, FLOOR)                                                                   \
  inline V NAME(V x) {                                                                                        \
    x = P##_min_ps(P##_set1_ps(88.3f), P##_max_ps(P##_set1_ps(-87.3f), x));                                   \
    const V n = FLOOR(P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), P##_set1_ps(0.5f)));                 \
    V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                                     \
    r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                                    \
    V p = P##_set1_ps(1.9875691500E-4f);                                                                      \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507E-3f));                                                    \
    p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073E-3f));                                                    \
    p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894E-2f));                                                    \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459E-1f));                                                    \
    p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201E-1f));                                                    \
    const V y = P##_add_ps(P##_fmadd_ps(P##_mul_ps(p, r), r, r), P##_set1_ps(1.0f));                          \
    const auto e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);                \
    return P##_mul_ps(y, P##_castsi##W##_ps(e));                                                              \
  }
SUBLAYER_VEXP(exp256, __m256, _mm256, 256, _mm256_floor_ps)
#endif

// ------------------------------------------------------------------ row norms
// Row reductions with 4 independent vector accumulators (a single one is bound by the add latency). The order of
// the additions depends on d only: results are bitwise reproducible.
template <typename A> constexpr int64_t kLanes = 4 * 32 / int64_t(sizeof(A));

// sum_{j < d} f(j) (f may do more per element).
template <typename A, typename F> inline A lane_sum(int64_t d, F&& f) {
  constexpr int64_t L = kLanes<A>;
  A part[L] = {};
  int64_t j = 0;
  for (; j + L <= d; j += L) {
#pragma omp simd
    for (int64_t k = 0; k < L; ++k) part[k] += f(j + k);
  }
  A acc = 0;
  for (; j < d; ++j) acc += f(j);
  for (int64_t k = 0; k < L; ++k) acc += part[k];
  return acc;
}

// v[j] = f(j) for j < d, returning sum_j v[j].
template <typename A, typename F> inline A fill_sum(A* v, int64_t d, F&& f) {
  return lane_sum<A>(d, [&](int64_t j) {
    const A t = f(j);
    v[j] = t;
    return t;
  });
}

template <typename A> inline A row_sqdev(const A* v, A m, int64_t d) {  // sum (v - m)^2
  return lane_sum<A>(d, [&](int64_t j) { return (v[j] - m) * (v[j] - m); });
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

// LayerNorm of one float32 row: out[j] = (x[j] - mean) * rstd * w[j] + b[j], two-pass variance (out may be x).
inline void layer_norm_row(const float* x, const float* w, const float* b, float eps, float* out, int64_t d) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < d; ++j) sum += x[j];
  const float m = sum / float(d);
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < d; ++j) sq += (x[j] - m) * (x[j] - m);
  const float rs = 1.0f / std::sqrt(sq / float(d) + eps);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) out[j] = (x[j] - m) * rs * w[j] + b[j];
}

}  // namespace sublayer
