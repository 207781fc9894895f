// FFN elementwise passes and dropout (registered as torch.ops.sublayer_kernels.*).
//
//  * act_fwd / act_bwd: bias + activation + dropout in one elementwise pass between the FFN's GEMMs, and its
//    backward (bias gradient reduced in the same pass). act 0 (identity) is "bias + dropout".
//  * glu_fwd / glu_bwd: the same for gated FFNs (SwiGLU, GeGLU, ReGLU): act(gate) * up from fc1's packed output.
//  * Dropout is a counter-based Philox4x32-10 stream: element e (row-major flat index) keeps iff its 16-bit draw
//    (see philox_fill) >= round(p * 2^16). The FFN regenerates the mask in backward from the seed (Add & Norm
//    saves it as bits). philox_words exposes the raw stream to tests; philox_avx512 switches the AVX-512VL Philox
//    rounds off (and on) so that tests check the AVX2 rounds on the same machine.
//
// Storage types, checks and deterministic reductions as add_norm.cpp.

#include <atomic>

#include "common.h"

namespace sublayer {
namespace {

// ------------------------------------------------------------------ Philox4x32-10
// Element e uses word k = (e / 8) % 4 of philox(counter = (e / 32) * 8 + e % 8, key = seed): a block of 32
// consecutive elements comes from 8 counters, so 8 lanes of AVX2 produce it without a transpose.
constexpr uint32_t PH_M0 = 0xD2511F53u, PH_M1 = 0xCD9E8D57u, PH_W0 = 0x9E3779B9u, PH_W1 = 0xBB67AE85u;

inline void philox_block_scalar(uint64_t blk, uint64_t seed, uint32_t* out32) {
  for (int l = 0; l < 8; ++l) {
    const uint64_t c = blk * 8 + l;
    uint32_t c0 = uint32_t(c), c1 = uint32_t(c >> 32), c2 = 0, c3 = 0;
    uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const uint64_t p0 = uint64_t(PH_M0) * c0, p1 = uint64_t(PH_M1) * c2;
      const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
      c1 = uint32_t(p1);
      c3 = uint32_t(p0);
      c0 = n0;
      c2 = n2;
      k0 += PH_W0;
      k1 += PH_W1;
    }
    out32[l] = c0;
    out32[8 + l] = c1;
    out32[16 + l] = c2;
    out32[24 + l] = c3;
  }
}

#if defined(__AVX2__)
// One Philox round on 8 counters (lanes): (c0, c1, c2, c3) <- (hi(c2 * M1) ^ c1 ^ k0, lo(c2 * M1),
// hi(c0 * M0) ^ c3 ^ k1, lo(c0 * M0)). mul_epu32 multiplies the even lanes; the odd ones are shifted down first.
// AVX-512VL (VL = true, where compiled in and philox_avx512 is on) gathers each product's halves with one masked
// dword swap and the two xors with one ternary-logic op, where AVX2 needs two shifts, two blends and two xors: the
// same words, about 1.3x the throughput.
template <bool VL>
inline void ph_round(__m256i& c0, __m256i& c1, __m256i& c2, __m256i& c3, __m256i k0, __m256i k1) {
  const __m256i m0 = _mm256_set1_epi32(int(PH_M0)), m1 = _mm256_set1_epi32(int(PH_M1));
  const __m256i pe0 = _mm256_mul_epu32(c0, m0), po0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), m0);
  const __m256i pe1 = _mm256_mul_epu32(c2, m1), po1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), m1);
#if defined(__AVX512VL__)
  if constexpr (VL) {
    c0 = _mm256_ternarylogic_epi32(_mm256_mask_shuffle_epi32(po1, 0x55, pe1, _MM_PERM_CDAB), c1, k0, 0x96);
    c2 = _mm256_ternarylogic_epi32(_mm256_mask_shuffle_epi32(po0, 0x55, pe0, _MM_PERM_CDAB), c3, k1, 0x96);
    c1 = _mm256_mask_shuffle_epi32(pe1, 0xAA, po1, _MM_PERM_CDAB);
    c3 = _mm256_mask_shuffle_epi32(pe0, 0xAA, po0, _MM_PERM_CDAB);
    return;
  }
#endif
  const __m256i lo0 = _mm256_blend_epi32(pe0, _mm256_slli_epi64(po0, 32), 0xAA);
  const __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(pe0, 32), po0, 0xAA);
  const __m256i lo1 = _mm256_blend_epi32(pe1, _mm256_slli_epi64(po1, 32), 0xAA);
  const __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(pe1, 32), po1, 0xAA);
  c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), k0);
  c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), k1);
  c1 = lo1;
  c3 = lo0;
}

// The 32 words of block `blk` (counters 8 * blk .. 8 * blk + 7) for each of G consecutive blocks, out[32 * g ..]:
// G = 2 runs two independent dependency chains interleaved, about twice the throughput of one (bound by the
// multiply latency).
template <bool VL, int G>
inline void philox_blocks(uint64_t blk, uint64_t seed, uint32_t* out) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i c[G][4];
  for (int g = 0; g < G; ++g) {
    const uint64_t cg = (blk + uint64_t(g)) * 8;
    c[g][0] = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(cg))), lane);
    c[g][1] = _mm256_set1_epi32(int(uint32_t(cg >> 32)));  // 8 | c, so the low word never wraps inside a block
    c[g][2] = c[g][3] = _mm256_setzero_si256();
  }
  __m256i k0 = _mm256_set1_epi32(int(uint32_t(seed))), k1 = _mm256_set1_epi32(int(uint32_t(seed >> 32)));
  const __m256i w0 = _mm256_set1_epi32(int(PH_W0)), w1 = _mm256_set1_epi32(int(PH_W1));
  for (int r = 0; r < 10; ++r) {
    for (int g = 0; g < G; ++g) ph_round<VL>(c[g][0], c[g][1], c[g][2], c[g][3], k0, k1);
    k0 = _mm256_add_epi32(k0, w0);
    k1 = _mm256_add_epi32(k1, w1);
  }
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < 4; ++w) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * g + 8 * w), c[g][w]);
}
#endif

// Whether the AVX-512VL Philox rounds run (compiled in and switched on: philox_avx512).
#if defined(__AVX2__) && defined(__AVX512VL__)
constexpr bool kPhiloxVL = true;
#else
constexpr bool kPhiloxVL = false;
#endif
std::atomic<bool> g_philox_vl{true};
inline bool philox_vl() { return kPhiloxVL && g_philox_vl.load(std::memory_order_relaxed); }

// G consecutive blocks (G = 1 or 2) from `blk`, through the fastest path compiled in (vl: philox_vl()).
template <int G>
inline void philox_block_n(uint64_t blk, uint64_t seed, uint32_t* out, bool vl) {
#if defined(__AVX2__)
  if (vl)
    philox_blocks<true, G>(blk, seed, out);
  else
    philox_blocks<false, G>(blk, seed, out);
#else
  (void)vl;
  for (int g = 0; g < G; ++g) philox_block_scalar(blk + uint64_t(g), seed, out + 32 * g);
#endif
}

}  // namespace

// Dropout draws: 16 bits per element. Element e uses block e / 64: its word (e % 64) % 32, low half for
// e % 64 < 32, high half otherwise. out[i] (0..65535) is the draw of element start + i, for i in [0, n).
void philox_fill(uint64_t start, int64_t n, uint64_t seed, uint32_t* out) {
  if (n <= 0) return;
  const uint64_t end = start + uint64_t(n);
  const bool vl = philox_vl();
  alignas(32) uint32_t w[64];
  uint64_t blk = start / 64;
  if (blk * 64 == start) {  // aligned start: whole blocks two at a time
    for (; (blk + 2) * 64 <= end; blk += 2) {
      philox_block_n<2>(blk, seed, w, vl);
      uint32_t* o = out + (blk * 64 - start);
#pragma omp simd
      for (int i = 0; i < 32; ++i) {
        o[i] = w[i] & 0xffffu;
        o[32 + i] = w[i] >> 16;
        o[64 + i] = w[32 + i] & 0xffffu;
        o[96 + i] = w[32 + i] >> 16;
      }
    }
  }
  for (; blk * 64 < end; ++blk) {
    const uint64_t b0 = blk * 64;
    philox_block_n<1>(blk, seed, w, vl);
    if (b0 >= start && b0 + 64 <= end) {
      uint32_t* o = out + (b0 - start);
#pragma omp simd
      for (int i = 0; i < 32; ++i) {
        o[i] = w[i] & 0xffffu;
        o[32 + i] = w[i] >> 16;
      }
    } else {
      const uint64_t lo = std::max(b0, start), hi = std::min(b0 + 64, end);
      for (uint64_t e = lo; e < hi; ++e) {
        const uint64_t i = e - b0;
        out[e - start] = i < 32 ? (w[i] & 0xffffu) : (w[i - 32] >> 16);
      }
    }
  }
}

// Keep bits of whole 64-element blocks: bit e of bits[i] is set iff element 64 * (blk + i) + e keeps (its draw, as
// philox_fill gives it, is >= thr); as little-endian bytes, the layout of Add & Norm's saved mask. No draws are
// stored: each pair of blocks goes from its 64 words straight to two 64-bit masks.
void philox_keep_bits(uint64_t blk, int64_t nblk, uint64_t seed, uint32_t thr, uint64_t* bits) {
  const bool vl = philox_vl();
  alignas(32) uint32_t w[64];
  for (int64_t i = 0; i < nblk; i += 2) {
    const int G = nblk - i >= 2 ? 2 : 1;
    if (G == 2)
      philox_block_n<2>(blk + uint64_t(i), seed, w, vl);
    else
      philox_block_n<1>(blk + uint64_t(i), seed, w, vl);
    for (int g = 0; g < G; ++g) {
      const uint32_t* wg = w + 32 * g;
      uint64_t b = 0;
#if defined(__AVX2__)
      const __m256i t = _mm256_set1_epi32(int32_t(thr) - 1), lo16 = _mm256_set1_epi32(0xffff);
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(wg + 8 * q));
        const uint64_t lo = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_and_si256(v, lo16), t))));
        const uint64_t hi = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_srli_epi32(v, 16), t))));
        b |= lo << (8 * q) | hi << (32 + 8 * q);
      }
#else
      for (int e = 0; e < 32; ++e) {
        b |= uint64_t((wg[e] & 0xffffu) >= thr) << e;
        b |= uint64_t((wg[e] >> 16) >= thr) << (32 + e);
      }
#endif
      bits[i + g] = b;
    }
  }
}

// Whether the Philox rounds use AVX-512VL (set_switch: -1 reads it; false where not compiled in).
bool philox_avx512(int64_t flag) { return set_switch(g_philox_vl, flag, kPhiloxVL); }

namespace {

// ------------------------------------------------------------------ FFN: bias + activation + dropout
// m[j] = keep * scale of row r's dropout draws (1 without dropout).
template <typename A>
inline void keep_scale_row(const Drop& dr, int64_t r, int64_t f, uint32_t* rnd, A* m) {
  if (!dr.on) {
    std::fill(m, m + f, A(1));
    return;
  }
  philox_fill(uint64_t(r) * f, f, dr.seed, rnd);
  const A sc = A(dr.scale);
  const int32_t th = int32_t(dr.thr);
#pragma omp simd
  for (int64_t j = 0; j < f; ++j) m[j] = A(int32_t(rnd[j]) >= th) * sc;
}

// h = dropout(act(a + bias)) row by row; out may alias a (in-place).
template <typename T, int64_t act>
void act_fwd_impl(const Tensor& a, const Tensor& b, Tensor& out, const Drop& dr) {
  using A = typename Elt<T>::acc;
  const int64_t N = a.size(0), f = a.size(1);
  const auto* ap = ptr<T>(a);
  auto* op = ptr<T>(out);
  const A* bp = b.defined() ? static_cast<const A*>(b.data_ptr()) : nullptr;
  const A scale = A(dr.scale);
  const int32_t thr = int32_t(dr.thr);  // draws are 16-bit: a signed compare vectorises
  at::parallel_for(0, N, row_grain(f), [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> rnd(dr.on ? f : 0);
    std::vector<A> z(f);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* ar = ap + r * f;
      auto* orow = op + r * f;
      if (bp) {
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) z[j] = Elt<T>::ld(ar[j]) + bp[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) z[j] = Elt<T>::ld(ar[j]);
      }
      if (dr.on) {
        philox_fill(uint64_t(r) * f, f, dr.seed, rnd.data());
        if constexpr (act != IDENT) {
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) z[j] = act_f<act>(z[j]);  // separate loop: keeps both vectorised
        }
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) orow[j] = Elt<T>::st(z[j] * (A(int32_t(rnd[j]) >= thr) * scale));
      } else {
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) orow[j] = Elt<T>::st(act_f<act>(z[j]));
      }
    }
  });
}

// da = dh * keep * scale * act'(a + bias) (in place into dh when out aliases it); optionally h (recomputed) and
// the bias gradient sum_rows(da). For RELU, `saved` is h = the fc2 input (h > 0 <=> a > 0 and kept).
template <typename T, int64_t act>
void act_bwd_impl(const Tensor& dh, const Tensor& saved, const Tensor& b, Tensor& da, Tensor& h, Tensor& db,
                  const Drop& dr) {
  using A = typename Elt<T>::acc;
  const int64_t N = dh.size(0), f = dh.size(1);
  const auto* gp = ptr<T>(dh);
  const auto* svp = saved.defined() ? ptr<T>(saved) : nullptr;
  const A* bp = b.defined() ? static_cast<const A*>(b.data_ptr()) : nullptr;
  auto* dap = ptr<T>(da);
  auto* hp = h.defined() ? ptr<T>(h) : nullptr;
  const bool want_db = db.defined();
  const int64_t nch = n_chunks(N), rows_per = (N + nch - 1) / nch;
  std::vector<A> pb(want_db ? nch * f : 0);
  const A scale = A(dr.scale);
  at::parallel_for(0, nch, row_grain(rows_per * f), [&](int64_t c0, int64_t c1) {
    std::vector<uint32_t> rnd(dr.on ? f : 0);
    std::vector<A> m(f, scale);  // keep * scale per column
    std::vector<A> z(f);
    for (int64_t c = c0; c < c1; ++c) {
      A* cb = want_db ? pb.data() + c * f : nullptr;
      if (cb) std::fill(cb, cb + f, A(0));
      const int64_t rend = std::min(N, (c + 1) * rows_per);
      for (int64_t r = c * rows_per; r < rend; ++r) {
        const auto* gr = gp + r * f;
        auto* dr_ = dap + r * f;
        if constexpr (act == RELU) {
          const auto* hr = svp + r * f;
          const A sc = scale;
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) {  // both loads unconditional and a local scale: vectorises
            const A gv = Elt<T>::ld(gr[j]), hv = Elt<T>::ld(hr[j]);
            dr_[j] = Elt<T>::st(hv > A(0) ? gv * sc : A(0));
          }
        } else {
          if (dr.on) keep_scale_row(dr, r, f, rnd.data(), m.data());
          if constexpr (act == IDENT) {
#pragma omp simd
            for (int64_t j = 0; j < f; ++j) dr_[j] = Elt<T>::st(Elt<T>::ld(gr[j]) * m[j]);
          } else {
            const auto* ar = svp + r * f;
            if (bp) {
#pragma omp simd
              for (int64_t j = 0; j < f; ++j) z[j] = Elt<T>::ld(ar[j]) + bp[j];
            } else {
#pragma omp simd
              for (int64_t j = 0; j < f; ++j) z[j] = Elt<T>::ld(ar[j]);
            }
            if (hp) {  // h and da in one loop: act and act' share their exp / cdf terms
              auto* hr = hp + r * f;
#pragma omp simd
              for (int64_t j = 0; j < f; ++j) {
                const A zj = z[j], mj = m[j];
                hr[j] = Elt<T>::st(act_f<act>(zj) * mj);
                dr_[j] = Elt<T>::st(Elt<T>::ld(gr[j]) * mj * act_df<act>(zj));
              }
            } else {
#pragma omp simd
              for (int64_t j = 0; j < f; ++j) dr_[j] = Elt<T>::st(Elt<T>::ld(gr[j]) * m[j] * act_df<act>(z[j]));
            }
          }
        }
        if (cb) {
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) cb[j] += Elt<T>::ld(dr_[j]);
        }
      }
    }
  });
  if (want_db) reduce_chunks(pb, nch, f, static_cast<A*>(db.data_ptr()));
}

#define SUBLAYER_DISPATCH_T(ST, NAME, ...)                                                      \
  [&] {                                                                                         \
    if (ST == at::kFloat) { using T = float; return __VA_ARGS__(); }                            \
    if (ST == at::kBFloat16) { using T = BF16; return __VA_ARGS__(); }                          \
    if (ST == at::kDouble) { using T = double; return __VA_ARGS__(); }                          \
    TORCH_CHECK(false, NAME ": unsupported dtype ", ST);                                        \
  }()

Tensor act_fwd(const Tensor& a, const std::optional<Tensor>& bias, int64_t act, double p, int64_t seed, bool inplace) {
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous(), "act_fwd: a must be a contiguous 2-D tensor");
  TORCH_CHECK(act >= IDENT && act <= RELU2, "act_fwd: unknown activation id ", act);
  Tensor b = bias.has_value() ? bias->contiguous() : Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == acc_type(a.scalar_type()) && b.numel() == a.size(1)),
              "act_fwd: bias must be (f,) in the accumulation dtype");
  Tensor out = inplace ? a : at::empty_like(a);
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_T(a.scalar_type(), "act_fwd", [&] {
    SUBLAYER_DISPATCH_ACT(act, [&] { act_fwd_impl<T, ACT>(a, b, out, dr); });
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> act_bwd(const Tensor& dh, const std::optional<Tensor>& saved,
                                           const std::optional<Tensor>& bias, int64_t act, double p, int64_t seed,
                                           bool want_h, bool want_db, bool inplace) {
  TORCH_CHECK(dh.dim() == 2 && dh.is_contiguous(), "act_bwd: grad must be a contiguous 2-D tensor");
  Tensor sv = saved.has_value() ? saved->contiguous() : Tensor();
  TORCH_CHECK(act == IDENT || (sv.defined() && sv.sizes() == dh.sizes() && sv.scalar_type() == dh.scalar_type()),
              "act_bwd: saved tensor must match the grad");
  Tensor b = bias.has_value() ? bias->contiguous() : Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == acc_type(dh.scalar_type()) && b.numel() == dh.size(1)),
              "act_bwd: bias must be (f,) in the accumulation dtype");
  Tensor da = inplace ? dh : at::empty_like(dh);
  Tensor h = (want_h && act != IDENT && act != RELU) ? at::empty_like(dh) : Tensor();
  Tensor db = want_db ? at::empty({dh.size(1)}, dh.options().dtype(acc_type(dh.scalar_type()))) : Tensor();
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_T(dh.scalar_type(), "act_bwd", [&] {
    SUBLAYER_DISPATCH_ACT(act, [&] { act_bwd_impl<T, ACT>(dh, sv, b, da, h, db, dr); });
  });
  return {da, h, db};
}

// ------------------------------------------------------------------ gated FFN (SwiGLU / GeGLU / ReGLU)
// a: (N, 2f) = x @ W1.T packed [gate | up] along the last dim (bias added here); h = dropout(act(gate) * up), (N, f).
// Dropout element e is the flat index in h, as for the ungated FFN.

template <typename T, int64_t act>
void glu_fwd_impl(const Tensor& a, const std::vector<typename Elt<T>::acc>& bias, Tensor& out, const Drop& dr) {
  using A = typename Elt<T>::acc;
  const int64_t N = a.size(0), f = out.size(1);
  const auto* ap = ptr<T>(a);
  auto* op = ptr<T>(out);  // bias: gate bias (zeros without bias), then the up bias
  at::parallel_for(0, N, row_grain(2 * f), [&](int64_t r0, int64_t r1) {
    const A* bg = bias.data();  // locals, not captured references: keeps the inner loops vectorised
    const int64_t f = out.size(1);
    std::vector<uint32_t> rnd(dr.on ? f : 0);
    std::vector<A> m(f);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* gr = ap + r * 2 * f;
      const auto* ur = gr + f;
      auto* orow = op + r * f;
      A* mv = m.data();
      keep_scale_row(dr, r, f, rnd.data(), mv);
      const A* bu = bg + f;
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) {
        const A z = Elt<T>::ld(gr[j]) + bg[j], u = Elt<T>::ld(ur[j]) + bu[j];
        orow[j] = Elt<T>::st(act_f<act>(z) * u * mv[j]);
      }
    }
  });
}

// da = [dh * keep * scale * up * act'(gate) | dh * keep * scale * act(gate)], (N, 2f); optionally h (recomputed,
// for fc2's weight gradient) and the bias gradient sum_rows(da), (2f,).
template <typename T, int64_t act>
void glu_bwd_impl(const Tensor& dh, const Tensor& a, const std::vector<typename Elt<T>::acc>& bias, Tensor& da,
                  Tensor& h, Tensor& db, const Drop& dr) {
  using A = typename Elt<T>::acc;
  const int64_t N = dh.size(0), f = dh.size(1), f2 = 2 * f;
  const auto* gp = ptr<T>(dh);
  const auto* ap = ptr<T>(a);
  auto* dap = ptr<T>(da);
  auto* hp = h.defined() ? ptr<T>(h) : nullptr;
  const bool want_db = db.defined();
  const int64_t nch = n_chunks(N), rows_per = (N + nch - 1) / nch;
  std::vector<A> pb(want_db ? nch * f2 : 0);
  at::parallel_for(0, nch, row_grain(rows_per * f2), [&](int64_t c0, int64_t c1) {
    const A* bg = bias.data();  // locals, not captured references: keeps the inner loops vectorised
    const int64_t f = dh.size(1), f2 = 2 * f;
    std::vector<uint32_t> rnd(dr.on ? f : 0);
    std::vector<A> m(f);
    for (int64_t c = c0; c < c1; ++c) {
      A* cb = want_db ? pb.data() + c * f2 : nullptr;
      if (cb) std::fill(cb, cb + f2, A(0));
      const int64_t rend = std::min(N, (c + 1) * rows_per);
      for (int64_t r = c * rows_per; r < rend; ++r) {
        const auto* gr = gp + r * f;
        const auto* zr = ap + r * f2;
        const auto* ur = zr + f;
        auto* dg = dap + r * f2;
        auto* du = dg + f;
        A* mv = m.data();
        keep_scale_row(dr, r, f, rnd.data(), mv);
        const A* bu = bg + f;
        if (hp) {  // h in the same loop: act(gate) is computed once
          auto* hr = hp + r * f;
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) {
            const A z = Elt<T>::ld(zr[j]) + bg[j], u = Elt<T>::ld(ur[j]) + bu[j];
            const A gm = Elt<T>::ld(gr[j]) * mv[j], fz = act_f<act>(z);
            dg[j] = Elt<T>::st(gm * u * act_df<act>(z));
            du[j] = Elt<T>::st(gm * fz);
            hr[j] = Elt<T>::st(fz * u * mv[j]);
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < f; ++j) {
            const A z = Elt<T>::ld(zr[j]) + bg[j], u = Elt<T>::ld(ur[j]) + bu[j];
            const A gm = Elt<T>::ld(gr[j]) * mv[j];
            dg[j] = Elt<T>::st(gm * u * act_df<act>(z));
            du[j] = Elt<T>::st(gm * act_f<act>(z));
          }
        }
        if (cb) {
#pragma omp simd
          for (int64_t j = 0; j < f2; ++j) cb[j] += Elt<T>::ld(dg[j]);
        }
      }
    }
  });
  if (want_db) reduce_chunks(pb, nch, f2, static_cast<A*>(db.data_ptr()));
}

// The bias as a (2f,) accumulation-type vector, zeros when absent (one loop for both cases).
template <typename A> std::vector<A> glu_bias(const std::optional<Tensor>& bias, int64_t f2) {
  std::vector<A> v(f2, A(0));
  if (bias.has_value()) {
    const Tensor b = bias->contiguous();
    TORCH_CHECK(b.numel() == f2 && b.scalar_type() == (sizeof(A) == 8 ? at::kDouble : at::kFloat),
                "glu: bias must be (2f,) in the accumulation dtype");
    std::copy(b.data_ptr<A>(), b.data_ptr<A>() + f2, v.begin());
  }
  return v;
}

Tensor glu_fwd(const Tensor& a, const std::optional<Tensor>& bias, int64_t act, double p, int64_t seed) {
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) % 2 == 0,
              "glu_fwd: a must be a contiguous (N, 2f) tensor");
  TORCH_CHECK(act >= RELU && act <= RELU2, "glu_fwd: unknown gate activation id ", act);
  const int64_t f = a.size(1) / 2;
  Tensor out = at::empty({a.size(0), f}, a.options());
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_T(a.scalar_type(), "glu_fwd", [&] {
    const auto b = glu_bias<typename Elt<T>::acc>(bias, 2 * f);
    SUBLAYER_DISPATCH_ACT(act, [&] { glu_fwd_impl<T, ACT>(a, b, out, dr); });
  });
  return out;
}

std::tuple<Tensor, Tensor, Tensor> glu_bwd(const Tensor& dh, const Tensor& a, const std::optional<Tensor>& bias,
                                           int64_t act, double p, int64_t seed, bool want_h, bool want_db) {
  TORCH_CHECK(dh.dim() == 2 && dh.is_contiguous(), "glu_bwd: grad must be a contiguous 2-D tensor");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(0) == dh.size(0) && a.size(1) == 2 * dh.size(1) &&
                  a.scalar_type() == dh.scalar_type(),
              "glu_bwd: saved pre-activation must be (N, 2f) of the grad's dtype");
  TORCH_CHECK(act >= RELU && act <= RELU2, "glu_bwd: unknown gate activation id ", act);
  const int64_t f = dh.size(1);
  Tensor da = at::empty_like(a);
  Tensor h = want_h ? at::empty_like(dh) : Tensor();
  Tensor db = want_db ? at::empty({2 * f}, dh.options().dtype(acc_type(dh.scalar_type()))) : Tensor();
  const Drop dr(p, seed);
  SUBLAYER_DISPATCH_T(dh.scalar_type(), "glu_bwd", [&] {
    const auto b = glu_bias<typename Elt<T>::acc>(bias, 2 * f);
    SUBLAYER_DISPATCH_ACT(act, [&] { glu_bwd_impl<T, ACT>(dh, a, b, da, h, db, dr); });
  });
  return {da, h, db};
}

// Raw 32-bit Philox words [start, start + n) of the stream (for tests of the stream itself): word w of a block of 32
// is word w / 8 of counter w % 8. scalar=true: the portable per-lane implementation (tests check the AVX2 one
// against it).
Tensor philox_words(int64_t start, int64_t n, int64_t seed, bool scalar) {
  Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  auto* op = out.data_ptr<int64_t>();
  alignas(32) uint32_t tmp[32];
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t e = uint64_t(start + i);
    if (i == 0 || e % 32 == 0) {  // the next block
      if (scalar)
        philox_block_scalar(e / 32, uint64_t(seed), tmp);
      else
        philox_block_n<1>(e / 32, uint64_t(seed), tmp, philox_vl());
    }
    op[i] = int64_t(tmp[e % 32]);
  }
  return out;
}

}  // namespace
}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("act_fwd(Tensor a, Tensor? bias, int act, float p, int seed, bool inplace) -> Tensor",
        sublayer::cpu_kernel(&sublayer::act_fwd));
  m.def("act_bwd(Tensor dh, Tensor? saved, Tensor? bias, int act, float p, int seed, bool want_h, bool want_db, "
        "bool inplace) -> (Tensor, Tensor, Tensor)",
        sublayer::cpu_kernel(&sublayer::act_bwd));
  m.def("glu_fwd(Tensor a, Tensor? bias, int act, float p, int seed) -> Tensor",
        sublayer::cpu_kernel(&sublayer::glu_fwd));
  m.def("glu_bwd(Tensor dh, Tensor a, Tensor? bias, int act, float p, int seed, bool want_h, bool want_db) -> "
        "(Tensor, Tensor, Tensor)",
        sublayer::cpu_kernel(&sublayer::glu_bwd));
  m.def("philox_words(int start, int n, int seed, bool scalar) -> Tensor",
        torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &sublayer::philox_words));
  m.def("philox_avx512(int flag) -> bool", &sublayer::philox_avx512);
}
