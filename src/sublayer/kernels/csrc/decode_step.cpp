// One decoding step through every block or layer in one call (registered as torch.ops.sublayer_kernels.*):
// causal_decode_layers (any decoder-only language model: GPT-2, the Llama family) and transformer_decode_layers,
// built from packed_linear.cpp's skinny_linear, attention.cpp's decode_attention and a fused residual + norm.
// float32 only.

#include "common.h"

#include <ATen/ops/addmm_cpu_dispatch.h>

#include <limits>

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
  float_vec(n.weight, what, d);
  if (!rms) float_vec(n.bias, what, d);
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

// h = LayerNorm(x) (two-pass variance) or RMSNorm(x) per row, or h = x without a norm, and first x += y when y is
// given: a pre-norm residual followed by the next norm. Rows in chunks (on the step's team inside one).
void add_layer_norm(float* x, const float* y, const Norm* n, double eps, float* h, int64_t B, int64_t d,
                    bool rms = false) {
  const float *wp = n ? n->weight.data_ptr<float>() : nullptr, *bp = n && !rms ? n->bias.data_ptr<float>() : nullptr;
  // rows on both threads only for big batches (a translate step's hundreds of rows): a chunk costs more than a
  // few rows' work
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, d));
  parallel_chunks((B + grain - 1) / grain, [&](int64_t c) {
    for (int64_t r = c * grain; r < std::min(B, (c + 1) * grain); ++r) {
      float* xr = x + r * d;
      if (y) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) xr[j] += y[r * d + j];
      }
      if (!n)
        std::copy(xr, xr + d, h + r * d);
      else if (rms)
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

template <int64_t A>
void act_rows(float* p, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) p[i] = act_f<A>(p[i]);
}

// y = act(x @ W^T + b) (n outputs) for a decoder step's rows: skinny_linear on the packed panels (int8_linear on
// int8 quads: one row at 24 bits, several at 8) for up to max_rows rows, else torch's GEMM (models/decoding.py,
// PackedLinear) on the unpacked weight, on blocks of up to 256 rows, at least two, shared by the step's threads
// (inside the step's parallel region one GEMM would run on one thread; each call costs microseconds, so few big
// blocks; the blocks depend on the row count only, so the threads change no result).
Tensor step_linear(const Tensor& x, const Linear& l, int64_t n, int64_t act, int64_t max_rows) {
  const int64_t M = x.size(0);
  if (M <= max_rows) {
    if (l.colsum && l.colsum->numel())
      return int8_linear(x, l.packed, *l.colsum, l.scale, maybe(l.bias), n, act, c10::nullopt, M == 1 ? 24 : 8);
    return skinny_linear(x, l.packed, maybe(l.bias), n, act, maybe(l.scale));
  }
  const int64_t blocks = std::max<int64_t>(2, (M + 255) / 256), rows = (M + blocks - 1) / blocks;
  Tensor y = at::empty({M, n}, x.options());
  parallel_chunks((M + rows - 1) / rows, [&](int64_t c) {
    const int64_t r0 = c * rows, rn = std::min(rows, M - r0);
    Tensor yc = y.narrow(0, r0, rn);
    at::cpu::addmm_out(yc, l.bias, x.narrow(0, r0, rn), l.weight->t());  // the CPU kernel, no dispatch
    if (act != IDENT) SUBLAYER_DISPATCH_ACT(act, [&] { act_rows<ACT>(yc.data_ptr<float>(), rn * n); });
  });
  return y;
}

// A decoding step's layers in one parallel region (with_step_team: the parallel_chunks loops of their kernels run
// on a team kept for the step, not a region each): first(layer 0), then body(i, layer i, layer i+1 or null).
template <typename Layer, typename First, typename Body>
void step_layers(at::TensorList params, int64_t n_layers, const First& first, const Body& body) {
  with_step_team([&] {
    first(Layer(params.data()));
    for (int64_t i = 0; i < n_layers; ++i) {
      const std::optional<Layer> next =
          i + 1 < n_layers ? std::optional<Layer>(params.data() + Layer::SIZE * (i + 1)) : std::nullopt;
      body(i, Layer(params.data() + Layer::SIZE * i), next ? &*next : nullptr);
    }
  });
}

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
  const int64_t dq = n_heads * hd, dkv = H_kv * hd, all = std::numeric_limits<int64_t>::max();
  step_layers<CausalBlock>(
      params, n_layers,
      [&](const CausalBlock& L0) { add_layer_norm(rp, nullptr, &L0.norm_1, eps, hp, B, d, rms); },
      [&](int64_t i, const CausalBlock& L, const CausalBlock* next) {
        Tensor qkv = step_linear(h, L.qkv, dq + 2 * dkv, IDENT, all);
        if (rotary) {
          rotate_heads(qkv, 0, n_heads, hd, *cos, *sin);
          rotate_heads(qkv, dq, H_kv, hd, *cos, *sin);
        }
        const Tensor ctx = decode_attention(qkv.narrow(1, 0, dq), k_caches[i], v_caches[i], mask, length, scale,
                                            qkv.narrow(1, dq, dkv), qkv.narrow(1, dq + dkv, dkv), c10::nullopt);
        const Tensor o = step_linear(ctx, L.out, d, IDENT, all);
        add_layer_norm(rp, o.data_ptr<float>(), &L.norm_2, eps, hp, B, d, rms);
        const Tensor f = gated ? glu_rows(step_linear(h, L.fc1, d_ff, IDENT, all), act)
                               : step_linear(h, L.fc1, d_ff, act, all);
        const Tensor y = step_linear(f, L.fc2, d, IDENT, all);
        add_layer_norm(rp, y.data_ptr<float>(), next ? &next->norm_1 : &final_norm, eps, hp, B, d, rms);
      });
  return h;
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
  // post-norm: the sublayers read the residual stream, and the final norm (if any) writes h
  Tensor h = norm_first || has_final ? at::empty_like(resid) : resid;
  float *rp = resid.data_ptr<float>(), *hp = h.data_ptr<float>();
  const double scale = 1.0 / std::sqrt(double(d / k_caches[0].size(1)));
  // a residual: pre-norm x += y, then h = LN(x) with the norm that follows (the next sublayer's; none: h = x);
  // post-norm x = LN(x + y) in place
  auto residual = [&](const Tensor& y, const Norm& norm_here, const Norm* norm_next) {
    if (norm_first)
      add_layer_norm(rp, y.data_ptr<float>(), norm_next, eps, hp, N, d);
    else
      add_layer_norm(rp, y.data_ptr<float>(), &norm_here, eps, rp, N, d);
  };
  auto linear = [&](const Tensor& in, const Linear& l, int64_t a) {
    return step_linear(in, l, l.bias.size(0), a, max_rows);
  };
  step_layers<TransformerLayer>(
      params, n_layers,
      [&](const TransformerLayer& L0) {
        if (norm_first) add_layer_norm(rp, nullptr, &L0.self_norm, eps, hp, N, d);
      },
      [&](int64_t i, const TransformerLayer& L, const TransformerLayer* next) {
        const Tensor& in = norm_first ? h : resid;
        const Tensor qkv = linear(in, L.qkv, IDENT);
        const Tensor ctx = decode_attention(qkv.narrow(1, 0, d), k_caches[i], v_caches[i], c10::nullopt, length,
                                            scale, qkv.narrow(1, d, d), qkv.narrow(1, 2 * d, d), rows);
        residual(linear(ctx, L.out, IDENT), L.self_norm, &L.cross_norm);
        const Tensor cctx = decode_attention(linear(in, L.q_cross, IDENT), cross_k[i], cross_v[i], cross_mask, S,
                                             scale, c10::nullopt, c10::nullopt, cross_rows);
        residual(linear(cctx, L.out_cross, IDENT), L.cross_norm, &L.ffn_norm);
        // pre-norm: the norm after the FFN is the next layer's first (or the final one)
        residual(linear(linear(in, L.fc1, act), L.fc2, IDENT), L.ffn_norm,
                 next ? &next->self_norm : (has_final ? &final_norm : nullptr));
        if (!norm_first && has_final && !next) add_layer_norm(rp, nullptr, &final_norm, eps, hp, N, d);
      });
  return h;
}

}  // namespace
}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("causal_decode_layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor? mask, "
        "Tensor? cos, Tensor? sin, int length, int n_heads, int d_ff, float eps, bool rms, int act, bool gated) -> Tensor",
        sublayer::cpu_kernel(&sublayer::causal_decode_layers));
  m.def("transformer_decode_layers(Tensor x, Tensor[] params, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor[] cross_k, Tensor[] cross_v, Tensor? cross_mask, Tensor? rows, Tensor? cross_rows, int length, "
        "float eps, int act, bool norm_first, int max_rows) -> Tensor",
        sublayer::cpu_kernel(&sublayer::transformer_decode_layers));
}
