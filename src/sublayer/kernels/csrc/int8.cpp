// int8 inference helpers (sublayer.models.quantized): the per-token scaling around fbgemm's dynamic int8 linear.
//
//  * int8_scale_rows(x, inv_smooth?) -> (xs, r): r[i] = max_k |x[i,k] * inv_smooth[k]| (1 for an all-zero row),
//    xs[i,k] = x[i,k] * inv_smooth[k] / r[i]; one read of x, one write of xs (a row stays in L1 between passes).
//    A row of subnormal entries, whose 1 / r[i] overflows float32, gets r[i] = 1 and xs[i] = 0 (quantized as zero).
//  * int8_rescale_rows_(y, r, bias?) -> y: y[i,j] = y[i,j] * r[i] + bias[j], in place.
//  * int8_act_rows_(y, r?, bias?, act, inv_next?) -> (y, r2): h = act(y * r + bias) (the FFN's first epilogue);
//    with inv_next, y := h * inv_next / r2 and r2 = the rows' max |h * inv_next| (the next linear's input),
//    otherwise y := h (r2 empty).
//  * int8_add_norm_rows_(y, r?, bias?, resid, w, beta, eps, inv_next?) -> (y, xs, r2): y := LN(y * r + bias +
//    resid) (act_norm.h's layer_norm_row), and with inv_next also xs, r2 = int8_scale_rows(y, inv_next).
// Both float32, 2-D contiguous, rows split over the OpenMP threads. The PyTorch expressions above are the
// reference (sublayer.models.quantized uses them when the kernels are off); tests compare the two.
//
// Weight-only int8 for decoding (sublayer.models.quantized_gpt2) is packed_linear.cpp's skinny_linear on int8 panels.

#include "common.h"

namespace sublayer {
namespace {

void check_2d_f32(const Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == at::kFloat && t.device().is_cpu(), what,
              ": expected a contiguous 2-D float32 CPU tensor, got ", t.sizes(), " ", t.scalar_type());
}

// One float32 per row of y (N rows): their data (null when absent).
const float* check_r(const std::optional<Tensor>& r, int64_t N, const char* what) {
  TORCH_CHECK(!r || (r->numel() == N && r->is_contiguous() && r->scalar_type() == at::kFloat), what,
              ": r must hold one float32 per row (", N, "), got ", r->sizes());
  return r ? r->data_ptr<float>() : nullptr;
}

std::tuple<Tensor, Tensor> int8_scale_rows(const Tensor& x, const std::optional<Tensor>& inv_smooth) {
  check_2d_f32(x, "int8_scale_rows: x");
  const int64_t N = x.size(0), K = x.size(1);
  const float* S = float_vec(inv_smooth, "int8_scale_rows: inv_smooth", K);
  Tensor xs = at::empty_like(x);
  Tensor r = at::empty({N, 1}, x.options());
  const float* X = x.data_ptr<float>();
  float* O = xs.data_ptr<float>();
  float* R = r.data_ptr<float>();
  at::parallel_for(0, N, row_grain(K), [&](int64_t r0, int64_t r1) {
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
      float ri = m > 0.f ? m : 1.f, inv = 1.f / ri;
      if (std::isinf(inv)) ri = 1.f, inv = 0.f;  // subnormal entries only (1 / max overflows): a row of zeros
      R[i] = ri;
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
  const float* R = check_r(r, N, "int8_rescale_rows_");
  const float* B = float_vec(bias, "int8_rescale_rows_: bias", M);
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, row_grain(M), [&](int64_t r0, int64_t r1) {
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

// v[0:K] *= inv_next (if any); returns max |v| and divides v by it (1 for an all-zero row; for a row of subnormal
// entries, whose 1 / max overflows, 1 with v set to zeros, as int8_scale_rows).
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
  float r = m > 0.f ? m : 1.f, ir = 1.f / r;
  if (std::isinf(ir)) r = 1.f, ir = 0.f;
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) v[k] *= ir;
  return r;
}

template <int64_t act>
void act_rows(float* Y, const float* R, const float* B, const float* S, float* R2, int64_t N, int64_t M) {
  at::parallel_for(0, N, row_grain(M), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      float* yi = Y + i * M;
      const float ri = R ? R[i] : 1.f;
      if (B) {
#pragma omp simd
        for (int64_t j = 0; j < M; ++j) yi[j] = act_int8<act>(yi[j] * ri + B[j]);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < M; ++j) yi[j] = act_int8<act>(yi[j] * ri);
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
  const float* R = check_r(r, N, "int8_act_rows_");
  const float* B = float_vec(bias, "int8_act_rows_: bias", M);
  const float* S = float_vec(inv_next, "int8_act_rows_: inv_next", M);
  Tensor r2 = at::empty({inv_next ? N : 0, 1}, y.options());
  float* Y = y.data_ptr<float>();
  float* R2 = inv_next ? r2.data_ptr<float>() : nullptr;
  SUBLAYER_DISPATCH_ACT(act, [&] { act_rows<ACT>(Y, R, B, S, R2, N, M); });
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
  const float* R = check_r(r, N, "int8_add_norm_rows_");
  const float* B = float_vec(bias, "int8_add_norm_rows_: bias", M);
  const float* W = float_vec(w, "int8_add_norm_rows_: w", M);
  const float* BE = float_vec(beta, "int8_add_norm_rows_: beta", M);
  const float* S = float_vec(inv_next, "int8_add_norm_rows_: inv_next", M);
  Tensor xs = at::empty({inv_next ? N : 0, M}, y.options());
  Tensor r2 = at::empty({inv_next ? N : 0, 1}, y.options());
  float* Y = y.data_ptr<float>();
  const float* X = resid.data_ptr<float>();
  float* XS = inv_next ? xs.data_ptr<float>() : nullptr;
  float* R2 = inv_next ? r2.data_ptr<float>() : nullptr;
  const float e = float(eps);
  at::parallel_for(0, N, row_grain(M), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      float* yi = Y + i * M;
      const float* xi = X + i * M;
      const float ri = R ? R[i] : 1.f;
#pragma omp simd
      for (int64_t j = 0; j < M; ++j) yi[j] = yi[j] * ri + (B ? B[j] : 0.f) + xi[j];
      layer_norm_row(yi, W, BE, e, yi, M);
      if (S) {
        float* oi = XS + i * M;
        std::copy(yi, yi + M, oi);
        R2[i] = scale_row(oi, S, M);
      }
    }
  });
  return {y, xs, r2};
}

}  // namespace
}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("int8_scale_rows(Tensor x, Tensor? inv_smooth) -> (Tensor, Tensor)",
        sublayer::cpu_kernel(&sublayer::int8_scale_rows));
  m.def("int8_rescale_rows_(Tensor(a!) y, Tensor r, Tensor? bias) -> Tensor(a!)",
        sublayer::cpu_kernel(&sublayer::int8_rescale_rows_));
  m.def("int8_act_rows_(Tensor(a!) y, Tensor? r, Tensor? bias, int act, Tensor? inv_next) -> (Tensor(a!), Tensor)",
        sublayer::cpu_kernel(&sublayer::int8_act_rows_));
  m.def(
      "int8_add_norm_rows_(Tensor(a!) y, Tensor? r, Tensor? bias, Tensor resid, Tensor w, Tensor beta, float eps, "
      "Tensor? inv_next) -> (Tensor(a!), Tensor, Tensor)",
      sublayer::cpu_kernel(&sublayer::int8_add_norm_rows_));
}
