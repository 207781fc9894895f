// One decoding step through every block or layer in one call (registered as torch.ops.sublayer_kernels.*):
// gpt2_decode_layers and transformer_decode_layers, built from packed_linear.cpp's skinny_linear,
// attention.cpp's decode_attention and a fused residual + LayerNorm. float32 only.

#include "common.h"

#include <ATen/ops/addmm.h>

namespace sublayer {
namespace {

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
      layer_norm_row(xr, wp, bp, float(eps), h + r * d, d);
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
  if (act != IDENT) SUBLAYER_DISPATCH_ACT(act, [&] { act_rows<ACT>(y.data_ptr<float>(), y.numel()); });
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
}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("gpt2_decode_layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor? mask, "
        "int length, float eps, int act) -> Tensor");
  m.def("transformer_decode_layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor[] cross_k, Tensor[] cross_v, Tensor? cross_mask, Tensor? rows, Tensor? cross_rows, int length, "
        "float eps, int act, bool norm_first, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(sublayer_kernels, CPU, m) {
  m.impl("gpt2_decode_layers", &sublayer::gpt2_decode_layers);
  m.impl("transformer_decode_layers", &sublayer::transformer_decode_layers);
}
