// Elementwise activations shared by the kernels (kernels.cpp's FFN passes, int8.cpp's epilogues): float32 with
// a vectorisable exp, double through std:: functions. Ids as sublayer.functional.fused.ACT_IDS.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sublayer_act {

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
template <typename A> inline A sigmoid(A v) { return A(1) / (A(1) + vexp(-v)); }

template <int64_t act, typename A> inline A act_f(A z) {
  if constexpr (act == RELU) return z > A(0) ? z : A(0);
  if constexpr (act == GELU) return z * norm_cdf(z);
  if constexpr (act == GELU_TANH) {
    const A k = A(0.79788456080286535588), u = k * (z + A(0.044715) * z * z * z);
    return z * sigmoid(A(2) * u);
  }
  if constexpr (act == SILU) return z * sigmoid(z);
  if constexpr (act == RELU2) return z > A(0) ? z * z : A(0);
  return z;
}
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

}  // namespace sublayer_act
