// One decoding step through every block or layer in one call (registered as torch.ops.sublayer_kernels.*):
// causal_decode_layers (any decoder-only language model: GPT-2, the Llama family) and transformer_decode_layers,
// built from packed_linear.cpp's skinny_linear, attention.cpp's decode_attention and a fused residual + norm.
// float32 only.

#include "common.h"

#include <ATen/ops/addmm.h>

namespace sublayer {
namespace {

// The steps take their weights as one flat list (runtime/causal.py's flat_weights, models/decoding.py's
// flat_transformer build them);
// these views name its entries, so the layout is written here once.
struct Linear {  // as skinny_linear takes it (scale: empty for float panels); weight: unpacked, for torch's GEMM;
  // colsum: int8_linear's (non-empty: packed holds int8 quads, the rows' activations are quantized to uint8)
  const Tensor &packed, &scale, &bias, *weight;
  const Tensor* colsum = nullptr;
};
struct Norm {
  const Tensor &weight, &bias;
};

// One decoder-only block (20 tensors): the attention residual's norm, q|k|v and out, the FFN residual's norm, fc1,
// fc2. A LayerNorm has weight and bias, an RMSNorm an empty bias; a linear is (packed, scale, bias, colsum), a
// linear without bias has an empty one, float or weight-only int8 panels an empty colsum (skinny_linear), int8
// quads their column sums (int8_linear).
struct CausalBlock {
  static constexpr int64_t SIZE = 20;
  Norm norm_1;
  Linear qkv, out;
  Norm norm_2;
  Linear fc1, fc2;
  static Linear linear(const Tensor* P) { return {P[0], P[1], P[2], nullptr, &P[3]}; }
  explicit CausalBlock(const Tensor* P)
      : norm_1{P[0], P[1]}, qkv(linear(P + 2)), out(linear(P + 6)), norm_2{P[10], P[11]}, fc1(linear(P + 12)),
        fc2(linear(P + 16)) {}
};

// 30 tensors: q|k|v, out, q_cross, out_cross, fc1, fc2 (packed, scale, bias, weight each); then the
// self-attention, cross-attention and FFN residuals' norms
struct TransformerLayer {
  static constexpr int64_t SIZE = 30;
  Linear qkv, out, q_cross, out_cross, fc1, fc2;
  Norm self_norm, cross_norm, ffn_norm;
  static Linear linear(const Tensor* P) { return {P[0], P[1], P[2], &P[3]}; }
  explicit TransformerLayer(const Tensor* P)
      : qkv(linear(P)), out(linear(P + 4)), q_cross(linear(P + 8)), out_cross(linear(P + 12)), fc1(linear(P + 16)),
        fc2(linear(P + 20)), self_norm{P[24], P[25]}, cross_norm{P[26], P[27]}, ffn_norm{P[28], P[29]} {}
};

// Every norm parameter: float32 (d,) (an RMSNorm has no bias); what: "<op>: norm parameter".
void check_norm(const Norm& n, int64_t d, const char* what, bool rms = false) {
  for (const Tensor* t : {&n.weight, &n.bias}) {
    if (rms && t == &n.bias) continue;
    check_float_contig(*t, what, 1);
    TORCH_CHECK(t->size(0) == d, what, "s must have ", d, " elements");
  }
}

// RMSNorm of one float32 row: out[j] = x[j] / sqrt(mean(x^2) + eps) * w[j] (out may be x).
inline void rms_norm_row(const float* x, const float* w, float eps, float* out, int64_t d) {
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < d; ++j) sq += x[j] * x[j];
  const float rs = 1.0f / std::sqrt(sq / float(d) + eps);
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) out[j] = x[j] * rs * w[j];
}

// h = LayerNorm(x) (two-pass variance) or RMSNorm(x) per row, and first x += y when y is given: a pre-norm
// residual followed by the next norm.
void add_layer_norm(float* x, const float* y, const Norm& n, double eps, float* h, int64_t B, int64_t d,
                    bool rms = false) {
  const float *wp = n.weight.data_ptr<float>(), *bp = rms ? nullptr : n.bias.data_ptr<float>();
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
      if (rms)
        rms_norm_row(xr, wp, float(eps), h + r * d, d);
      else
        layer_norm_row(xr, wp, bp, float(eps), h + r * d, d);
    }
  });
}

// x[:, h*hd : (h+1)*hd] rotated in place for heads h < H of each row (HF rotate_half convention): the pair
// (i, i + hd/2) by cos/sin (B, hd) of the row's position.
void rotate_heads(Tensor& x, int64_t col0, int64_t H, int64_t hd, const Tensor& cos, const Tensor& sin) {
  const int64_t B = x.size(0), rs = x.stride(0), half = hd / 2;
  float* xp = x.data_ptr<float>() + col0;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r) {
    const float *c = cp + r * hd, *s = sp + r * hd;
    for (int64_t h = 0; h < H; ++h) {
      float* v = xp + r * rs + h * hd;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

template <int64_t A>
void glu_row(const float* a, float* o, int64_t f) {
#pragma omp simd
  for (int64_t j = 0; j < f; ++j) o[j] = act_f<A>(a[j]) * a[f + j];
}

// act(gate) * up of a gated FFN: a (B, 2f) = [gate | up] per row -> (B, f).
Tensor glu_rows(const Tensor& a, int64_t act) {
  const int64_t B = a.size(0), f = a.size(1) / 2;
  Tensor out = at::empty({B, f}, a.options());
  const float* ap = a.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r) SUBLAYER_DISPATCH_ACT(act, [&] { glu_row<ACT>(ap + r * 2 * f, op + r * f, f); });
  return out;
}

c10::optional<Tensor> maybe(const Tensor& t) { return t.numel() ? c10::optional<Tensor>(t) : c10::nullopt; }

// One decoding step of a decoder-only language model through every block (sublayer.runtime.causal's step, in one
// call): x (B, d) the embeddings of this step's tokens (plus learned positions); `params`: each block's
// CausalBlock, then the final norm's weight and bias. Norms are LayerNorms or (rms) RMSNorms; q|k|v has n_heads
// query heads and the caches' (B, H_kv, T_max, hd) key/value heads (grouped-query attention), the new ones
// written at position length-1 after rotary (cos/sin (B, hd) of each row's position, when given) rotates q and k.
// fc1 has d_ff outputs: act(fc1) -> fc2, or with `gated` fc1 = [gate | up] -> act(gate) * up -> fc2.
// Returns the final norm of the last residual stream (B, d).
Tensor causal_decode_layers(const Tensor& x, at::TensorList params, at::TensorList k_caches, at::TensorList v_caches,
                            const c10::optional<Tensor>& mask, const c10::optional<Tensor>& cos,
                            const c10::optional<Tensor>& sin, int64_t length, int64_t n_heads, int64_t d_ff,
                            double eps, bool rms, int64_t act, bool gated) {
  constexpr int64_t PER = CausalBlock::SIZE;
  const int64_t n_layers = int64_t(k_caches.size());
  TORCH_CHECK(n_layers > 0 && int64_t(params.size()) == PER * n_layers + 2 && int64_t(v_caches.size()) == n_layers,
              "causal_decode_layers: expected 20 tensors per block + 2 and one k/v cache per block");
  TORCH_CHECK(act >= IDENT && act <= RELU2, "causal_decode_layers: act ", act, " is not a fused activation");
  check_float_contig(x, "causal_decode_layers: x", 2);
  const int64_t B = x.size(0), d = x.size(1), H_kv = k_caches[0].size(1), hd = k_caches[0].size(3);
  TORCH_CHECK(n_heads > 0 && n_heads % H_kv == 0, "causal_decode_layers: n_heads ", n_heads,
              " is not a multiple of the caches' ", H_kv, " key/value heads");
  const bool rotary = cos.has_value() && cos->defined();
  if (rotary) {
    for (const Tensor* t : {&*cos, &*sin}) {
      check_float_contig(*t, "causal_decode_layers: cos/sin", 2);
      TORCH_CHECK(t->size(0) == B && t->size(1) == hd, "causal_decode_layers: cos/sin must be (", B, ", ", hd, ")");
    }
  }
  Tensor resid = x.clone();
  Tensor h = at::empty_like(resid);
  float *rp = resid.data_ptr<float>(), *hp = h.data_ptr<float>();
  const Norm final_norm{params[PER * n_layers], params[PER * n_layers + 1]};
  constexpr const char* kNormWhat = "causal_decode_layers: norm parameter";
  for (int64_t i = 0; i < n_layers; ++i) {
    const CausalBlock L(params.data() + PER * i);
    check_norm(L.norm_1, d, kNormWhat, rms);
    check_norm(L.norm_2, d, kNormWhat, rms);
  }
  check_norm(final_norm, d, kNormWhat, rms);
  const double scale = 1.0 / std::sqrt(double(hd));
  const int64_t dq = n_heads * hd, dkv = H_kv * hd;
  auto linear = [&](const Tensor& in, const Linear& l, int64_t n, int64_t a) {
    if (l.colsum->numel()) return int8_linear(in, l.packed, *l.colsum, l.scale, maybe(l.bias), n, a, c10::nullopt);
    return skinny_linear(in, l.packed, maybe(l.bias), n, a, maybe(l.scale));
  };
  // one parallel region for the whole step: its linears' and attentions' loops run on the step's team
  with_step_team([&] {
    add_layer_norm(rp, nullptr, CausalBlock(params.data()).norm_1, eps, hp, B, d, rms);
    for (int64_t i = 0; i < n_layers; ++i) {
      const CausalBlock L(params.data() + PER * i);
      Tensor qkv = linear(h, L.qkv, dq + 2 * dkv, IDENT);
      if (rotary) {
        rotate_heads(qkv, 0, n_heads, hd, *cos, *sin);
        rotate_heads(qkv, dq, H_kv, hd, *cos, *sin);
      }
      const Tensor ctx = decode_attention(qkv.narrow(1, 0, dq), k_caches[i], v_caches[i], mask, length, scale,
                                          qkv.narrow(1, dq, dkv), qkv.narrow(1, dq + dkv, dkv), c10::nullopt);
      const Tensor o = linear(ctx, L.out, d, IDENT);
      add_layer_norm(rp, o.data_ptr<float>(), L.norm_2, eps, hp, B, d, rms);
      const Tensor f = gated ? glu_rows(linear(h, L.fc1, d_ff, IDENT), act) : linear(h, L.fc1, d_ff, act);
      const Tensor y = linear(f, L.fc2, d, IDENT);
      const Norm next = i + 1 < n_layers ? CausalBlock(params.data() + PER * (i + 1)).norm_1 : final_norm;
      add_layer_norm(rp, y.data_ptr<float>(), next, eps, hp, B, d, rms);
    }
  });
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
Tensor step_linear(const Tensor& x, const Linear& l, int64_t act, int64_t max_rows) {
  if (x.size(0) <= max_rows) return skinny_linear(x, l.packed, l.bias, l.bias.size(0), act, l.scale);
  Tensor y = at::addmm(l.bias, x, l.weight->t());
  if (act != IDENT) SUBLAYER_DISPATCH_ACT(act, [&] { act_rows<ACT>(y.data_ptr<float>(), y.numel()); });
  return y;
}

// One Transformer decoder step through every layer (models/decoding.py's transformer_stepper step, in one call):
// x (N, d) this step's target embeddings (scaled, plus the position's encoding). `params`: each layer's
// TransformerLayer, then the final norm's weight and bias (empty tensors: none). k_caches/v_caches (N, H, T_max,
// hd) get this step's keys at position length-1; cross_k/cross_v (B, H, S, hd) hold the memory's, with cross_mask
// (N, S) True = padding; rows (N, T_max) and cross_rows (N, S) map query rows to cache rows (decode_attention) or
// are absent. norm_first: pre-norm residuals x + f(LN(x)), else post-norm LN(x + f(x)). Returns the final hidden
// states (N, d), what the LM head reads.
Tensor transformer_decode_layers(const Tensor& x, at::TensorList params, at::TensorList k_caches,
                                 at::TensorList v_caches, at::TensorList cross_k, at::TensorList cross_v,
                                 const c10::optional<Tensor>& cross_mask, const c10::optional<Tensor>& rows,
                                 const c10::optional<Tensor>& cross_rows, int64_t length, double eps, int64_t act,
                                 bool norm_first, int64_t max_rows) {
  constexpr int64_t PER = TransformerLayer::SIZE;
  constexpr const char* kNormWhat = "transformer_decode_layers: LayerNorm parameter";
  const int64_t n_layers = int64_t(k_caches.size());
  TORCH_CHECK(n_layers > 0 && int64_t(params.size()) == PER * n_layers + 2 && int64_t(v_caches.size()) == n_layers &&
                  int64_t(cross_k.size()) == n_layers && int64_t(cross_v.size()) == n_layers,
              "transformer_decode_layers: expected 30 tensors per layer + 2 and one cache of each kind per layer");
  TORCH_CHECK(act >= IDENT && act <= RELU2, "transformer_decode_layers: act ", act, " is not a fused activation");
  check_float_contig(x, "transformer_decode_layers: x", 2);
  const int64_t N = x.size(0), d = x.size(1), S = cross_k[0].size(2);
  const Norm final_norm{params[PER * n_layers], params[PER * n_layers + 1]};
  const bool has_final = final_norm.weight.numel() > 0;
  for (int64_t i = 0; i < n_layers; ++i) {
    const TransformerLayer L(params.data() + PER * i);
    for (const Norm* n : {&L.self_norm, &L.cross_norm, &L.ffn_norm}) check_norm(*n, d, kNormWhat);
  }
  if (has_final) check_norm(final_norm, d, kNormWhat);
  Tensor resid = x.clone();
  Tensor h = norm_first ? at::empty_like(resid) : resid;  // post-norm: the sublayers read the residual stream
  float *rp = resid.data_ptr<float>(), *hp = h.data_ptr<float>();
  const double scale = 1.0 / std::sqrt(double(d / k_caches[0].size(1)));
  // a residual: pre-norm x += y, then h = LN(x) with the norm that follows (the next sublayer's; none: h = x);
  // post-norm x = LN(x + y) in place (h is x)
  auto residual = [&](const Tensor& y, const Norm& norm_here, const Norm* norm_next) {
    if (!norm_first) {
      add_layer_norm(rp, y.data_ptr<float>(), norm_here, eps, rp, N, d);
    } else if (norm_next) {
      add_layer_norm(rp, y.data_ptr<float>(), *norm_next, eps, hp, N, d);
    } else {
      const float* yp = y.data_ptr<float>();
      for (int64_t j = 0; j < N * d; ++j) hp[j] = rp[j] += yp[j];
    }
  };
  if (norm_first) add_layer_norm(rp, nullptr, TransformerLayer(params.data()).self_norm, eps, hp, N, d);
  for (int64_t i = 0; i < n_layers; ++i) {
    const TransformerLayer L(params.data() + PER * i);
    // pre-norm: the norm after the FFN is the next layer's first (or the final one)
    const std::optional<TransformerLayer> next =
        i + 1 < n_layers ? std::optional<TransformerLayer>(params.data() + PER * (i + 1)) : std::nullopt;
    const Norm* after = next ? &next->self_norm : (has_final ? &final_norm : nullptr);
    const Tensor qkv = step_linear(h, L.qkv, IDENT, max_rows);
    const Tensor ctx = decode_attention(qkv.narrow(1, 0, d), k_caches[i], v_caches[i], c10::nullopt, length, scale,
                                        qkv.narrow(1, d, d), qkv.narrow(1, 2 * d, d), rows);
    residual(step_linear(ctx, L.out, IDENT, max_rows), L.self_norm, &L.cross_norm);
    const Tensor q = step_linear(h, L.q_cross, IDENT, max_rows);
    const Tensor cctx = decode_attention(q, cross_k[i], cross_v[i], cross_mask, S, scale, c10::nullopt, c10::nullopt,
                                         cross_rows);
    residual(step_linear(cctx, L.out_cross, IDENT, max_rows), L.cross_norm, &L.ffn_norm);
    const Tensor f = step_linear(h, L.fc1, act, max_rows);
    residual(step_linear(f, L.fc2, IDENT, max_rows), L.ffn_norm, after);
  }
  if (!norm_first && has_final) {
    Tensor out = at::empty_like(resid);
    add_layer_norm(rp, nullptr, final_norm, eps, out.data_ptr<float>(), N, d);
    return out;
  }
  return h;
}

}  // namespace
}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("causal_decode_layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor? mask, "
        "Tensor? cos, Tensor? sin, int length, int n_heads, int d_ff, float eps, bool rms, int act, bool gated) -> Tensor");
  m.def("transformer_decode_layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor[] cross_k, Tensor[] cross_v, Tensor? cross_mask, Tensor? rows, Tensor? cross_rows, int length, "
        "float eps, int act, bool norm_first, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(sublayer_kernels, CPU, m) {
  m.impl("causal_decode_layers", &sublayer::causal_decode_layers);
  m.impl("transformer_decode_layers", &sublayer::transformer_decode_layers);
}
