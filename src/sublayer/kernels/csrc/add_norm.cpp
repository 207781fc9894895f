// Add & Norm (registered as torch.ops.sublayer_kernels.add_norm_fwd / add_norm_bwd).
//
//  * add_norm_fwd / add_norm_bwd: dropout(y) + x -> LayerNorm/RMSNorm, one pass over each row forward and one
//    backward, statistics in float32 (float64 for float64), two-pass variance; dx and dy from the same pass;
//    forward saves the sum, mean, rstd and the dropout mask as bits for backward.
//  * Dropout is ffn.cpp's Philox stream (philox_fill); Add & Norm saves the mask as 1 bit per element
//    (pack_keep), which costs d/8 bytes a row and spares its backward the draws. A seed < 0 is drawn here from
//    torch's default generator (default_generator_seed).
//  * AVX-512 rows (add_norm_fwd_512 / add_norm_bwd_512) where one storage type and d allow; the loops below them
//    are the AVX2 (and portable) path, which the add_norm_avx512 switch selects on any machine.
//
// Tensors come in contiguous and 2-D from Python (sublayer/functional/fused.py does the checks). Storage types:
// float, double and bfloat16 (as raw uint16 with round-to-nearest-even, written so the compiler vectorises it).
// Reductions over rows (weight/bias gradients) use a fixed chunking that depends on the row count only, so results
// are bitwise reproducible whatever the thread count.
//
// This file holds TORCH_LIBRARY(sublayer_kernels); every other .cpp adds its ops with TORCH_LIBRARY_FRAGMENT.

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "common.h"

namespace sublayer {
namespace {

// Dropout keep bits of one row (1 bit per element, what Add & Norm saves for backward instead of regenerating
// the draws): bit j % 8 of byte j / 8 is set iff element j is kept (its draw >= thr).
inline void pack_keep(const uint32_t* rnd, int64_t d, int32_t thr, uint8_t* bits) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256i t = _mm256_set1_epi32(thr - 1);
  for (; j + 8 <= d; j += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rnd + j));
    bits[j >> 3] = uint8_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, t))));
  }
#endif
  for (; j < d; j += 8) {
    uint32_t b = 0;
    for (int64_t k = 0; k < 8 && j + k < d; ++k) b |= uint32_t(int32_t(rnd[j + k]) >= thr) << k;
    bits[j >> 3] = uint8_t(b);
  }
}

// m[j] = scale if element j's keep bit is set, else 0.
template <typename A> inline void unpack_keep(const uint8_t* bits, int64_t d, A scale, A* m) {
  int64_t j = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<A, float>) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 s = _mm256_set1_ps(scale);
    for (; j + 8 <= d; j += 8) {
      const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[j >> 3]), sel);
      _mm256_storeu_ps(m + j, _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel)), s));
    }
  }
#endif
  for (; j < d; ++j) m[j] = ((bits[j >> 3] >> (j & 7)) & 1) ? scale : A(0);
}

// Streaming (non-temporal) row stores: dst[j] = src[j] without first reading dst's cache lines (a plain store to a
// line not in cache reads it from memory first). Add & Norm streams its saved sum and its input gradients when they
// are big (>= kStreamBytes, beyond a core's L2; any dtype): multi-MB buffers read back only later, so this saves
// about a third of their memory traffic. The output itself is read next by the following layer: plain stores keep
// it in cache.
constexpr int64_t kStreamBytes = int64_t(1) << 20;
template <typename S> inline void stream_row(S* dst, const S* src, int64_t d) {
  int64_t j = 0;
#if defined(__AVX2__)
  constexpr int64_t L = 32 / int64_t(sizeof(S));  // elements per 32-byte store
  for (; j < d && (reinterpret_cast<uintptr_t>(dst + j) & 31); ++j) dst[j] = src[j];
  for (; j + L <= d; j += L)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
#endif
  for (; j < d; ++j) dst[j] = src[j];
}
inline void stream_fence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

// ------------------------------------------------------------------ AVX-512 rows
// One storage type for x, y and the output (float32 or bfloat16), d a multiple of 64 (forward: every row starts a
// Philox block) or of 16 (backward), 16 lanes at a time with explicit FMAs: the forward makes the row's keep bits
// straight from the Philox words (philox_keep_bits, into the saved mask) and masks y with them, with no draws
// stored; the backward handles up to 4 rows at once, so the weight/bias gradients are loaded and stored once per 4
// rows. Same statistics (float32, two-pass variance), the same mask; add_norm_avx512(0) switches it off (tests
// check the AVX2 loops on the same machine).
std::atomic<bool> g_an512{true};
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SUBLAYER_AN512 1

template <typename T> struct V16;  // 16 elements of storage type T as float32 lanes
template <> struct V16<float> {
  static __m512 ld(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 round(__m512 v) { return v; }  // the value the storage keeps
  static void st(float* p, __m512 v, bool nt) { nt ? _mm512_stream_ps(p, v) : _mm512_storeu_ps(p, v); }
  static void st_rounded(float* p, __m512 v, bool nt) { st(p, v, nt); }
};
template <> struct V16<BF16> {
  static __m512 ld(const uint16_t* p) { return bf16_to_f_x16(p); }
  static __m512 round(__m512 v) {  // f_to_bf16's rounding, widened back
    return _mm512_castsi512_ps(_mm512_slli_epi32(f_to_bf16_x16(v), 16));
  }
  static void st_rounded(uint16_t* p, __m512 rv, bool nt) {  // rv: lanes that round(v) gave
    auto* q = reinterpret_cast<__m256i*>(p);
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rv), 16));
    nt ? _mm256_stream_si256(q, h) : _mm256_storeu_si256(q, h);
  }
  static void st(uint16_t* p, __m512 v, bool nt) { st_rounded(p, round(v), nt); }  // v: any float32 lanes
};
inline bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }
// y's factor: scale where the keep bit is set, else 0 (y * 0, as the generic loops: NaN stays NaN)
inline __m512 keep_scale(const uint8_t* bits, int64_t v, __m512 sc) {
  uint16_t k;
  std::memcpy(&k, bits + 2 * v, 2);
  return _mm512_maskz_mov_ps(__mmask16(k), sc);
}

template <typename T>
void add_norm_fwd_512(const typename Elt<T>::store* xp, const typename Elt<T>::store* yp, const float* wp, const float* bp,
                      typename Elt<T>::store* op, typename Elt<T>::store* sp, float* mp, float* rp, uint8_t* kp,
                      int64_t N, int64_t d, float eps, const Drop& dr, bool rms) {
  const int64_t nb = d / 8, nv = d / 16;
  const bool nt = sp && N * d * int64_t(sizeof(typename Elt<T>::store)) >= kStreamBytes && aligned64(sp);
  at::parallel_for(0, N, row_grain(d), [&](int64_t r0, int64_t r1) {
    std::vector<float> s(d), one(wp ? 0 : d, 1.0f), zero(bp ? 0 : d, 0.0f);
    std::vector<uint64_t> scratch_bits(dr.on && !kp ? d / 64 : 0);
    const float* w = wp ? wp : one.data();
    const float* b = bp ? bp : zero.data();
    const __m512 sc = _mm512_set1_ps(float(dr.scale));
    const float inv_d = 1.0f / float(d);
    float* sv = s.data();
    for (int64_t r = r0; r < r1; ++r) {
      const auto* xr = xp + r * d;
      const auto* yr = yp + r * d;
      auto* sr = sp ? sp + r * d : nullptr;
      uint8_t* kb = kp ? kp + r * nb : reinterpret_cast<uint8_t*>(scratch_bits.data());
      // (the saved mask's rows are d / 8 bytes into a 64-byte aligned block: 8-byte aligned)
      if (dr.on) philox_keep_bits(uint64_t(r) * uint64_t(d) / 64, d / 64, dr.seed, dr.thr, reinterpret_cast<uint64_t*>(kb));
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      auto one_vec = [&](int64_t v, __m512& acc) {
        const int64_t j = 16 * v;
        const __m512 xv = V16<T>::ld(xr + j), yv = V16<T>::ld(yr + j);
        const __m512 t = V16<T>::round(dr.on ? _mm512_fmadd_ps(yv, keep_scale(kb, v, sc), xv) : _mm512_add_ps(xv, yv));
        _mm512_storeu_ps(sv + j, t);
        if (sr) V16<T>::st_rounded(sr + j, t, nt);
        acc = _mm512_add_ps(acc, t);
      };
      int64_t v = 0;
      for (; v + 4 <= nv; v += 4) {
        one_vec(v, a0);
        one_vec(v + 1, a1);
        one_vec(v + 2, a2);
        one_vec(v + 3, a3);
      }
      for (; v < nv; ++v) one_vec(v, a0);
      const float m = rms ? 0.0f : _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) * inv_d;
      const __m512 mv = _mm512_set1_ps(m);
      __m512 q0 = _mm512_setzero_ps(), q1 = q0;
      v = 0;
      for (; v + 2 <= nv; v += 2) {
        const __m512 e0 = _mm512_sub_ps(_mm512_loadu_ps(sv + 16 * v), mv), e1 = _mm512_sub_ps(_mm512_loadu_ps(sv + 16 * v + 16), mv);
        q0 = _mm512_fmadd_ps(e0, e0, q0);
        q1 = _mm512_fmadd_ps(e1, e1, q1);
      }
      for (; v < nv; ++v) {
        const __m512 e0 = _mm512_sub_ps(_mm512_loadu_ps(sv + 16 * v), mv);
        q0 = _mm512_fmadd_ps(e0, e0, q0);
      }
      const float rs = 1.0f / std::sqrt(_mm512_reduce_add_ps(_mm512_add_ps(q0, q1)) * inv_d + eps);
      mp[r] = m;
      rp[r] = rs;
      const __m512 rv = _mm512_set1_ps(rs);
      auto* orow = op + r * d;
      for (v = 0; v < nv; ++v) {
        const int64_t j = 16 * v;
        const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(sv + j), mv), rv);
        V16<T>::st(orow + j, _mm512_fmadd_ps(xh, _mm512_loadu_ps(w + j), _mm512_loadu_ps(b + j)), false);
      }
    }
    if (nt) stream_fence();
  });
}

template <typename T>
void add_norm_bwd_512(const typename Elt<T>::store* gp, const typename Elt<T>::store* sp, const float* mp, const float* rp,
                      const float* wp, const uint8_t* kp, typename Elt<T>::store* dxp, typename Elt<T>::store* dyp,
                      float* dw, float* db, int64_t N, int64_t d, const Drop& dr, bool rms) {
  constexpr int R = 4;  // rows at once
  const int64_t nb = d / 8, nv = d / 16;
  const bool want_dw = dw != nullptr, want_db = db != nullptr;
  const int64_t nch = n_chunks(N), rows_per = (N + nch - 1) / nch;
  std::vector<float> pw(want_dw ? nch * d : 0), pb(want_db ? nch * d : 0);
  const bool big = N * d * int64_t(sizeof(typename Elt<T>::store)) >= kStreamBytes;
  const bool ntx = big && aligned64(dxp), nty = big && dyp && aligned64(dyp);
  const bool drop = dr.on && dyp;
  at::parallel_for(0, nch, row_grain(rows_per * d), [&](int64_t c0, int64_t c1) {
    std::vector<float> one(wp ? 0 : d, 1.0f);
    const float* w = wp ? wp : one.data();
    const __m512 sc = _mm512_set1_ps(float(dr.scale));
    const float inv_d = 1.0f / float(d);
    for (int64_t c = c0; c < c1; ++c) {
      float* cw = want_dw ? pw.data() + c * d : nullptr;
      float* cb = want_db ? pb.data() + c * d : nullptr;
      if (cw) std::fill(cw, cw + d, 0.0f);
      if (cb) std::fill(cb, cb + d, 0.0f);
      const int64_t rend = std::min(N, (c + 1) * rows_per);
      for (int64_t r = c * rows_per; r < rend; r += R) {
        const int nr = int(std::min<int64_t>(R, rend - r));
        float m[R], rs[R], a[R], bb[R];
        for (int i = 0; i < nr; ++i) {  // the row's sums of g*w and g*w*x^
          const auto* gr = gp + (r + i) * d;
          const auto* sr = sp + (r + i) * d;
          m[i] = mp[r + i];
          rs[i] = rp[r + i];
          const __m512 mv = _mm512_set1_ps(m[i]), rv = _mm512_set1_ps(rs[i]);
          __m512 s1a = _mm512_setzero_ps(), s1b = s1a, s2a = s1a, s2b = s1a;
          int64_t v = 0;
          for (; v + 2 <= nv; v += 2) {
            const int64_t j = 16 * v;
            const __m512 gw0 = _mm512_mul_ps(V16<T>::ld(gr + j), _mm512_loadu_ps(w + j));
            const __m512 gw1 = _mm512_mul_ps(V16<T>::ld(gr + j + 16), _mm512_loadu_ps(w + j + 16));
            s1a = _mm512_add_ps(s1a, gw0);
            s1b = _mm512_add_ps(s1b, gw1);
            s2a = _mm512_fmadd_ps(gw0, _mm512_mul_ps(_mm512_sub_ps(V16<T>::ld(sr + j), mv), rv), s2a);
            s2b = _mm512_fmadd_ps(gw1, _mm512_mul_ps(_mm512_sub_ps(V16<T>::ld(sr + j + 16), mv), rv), s2b);
          }
          for (; v < nv; ++v) {
            const int64_t j = 16 * v;
            const __m512 gw0 = _mm512_mul_ps(V16<T>::ld(gr + j), _mm512_loadu_ps(w + j));
            s1a = _mm512_add_ps(s1a, gw0);
            s2a = _mm512_fmadd_ps(gw0, _mm512_mul_ps(_mm512_sub_ps(V16<T>::ld(sr + j), mv), rv), s2a);
          }
          a[i] = rms ? 0.0f : _mm512_reduce_add_ps(_mm512_add_ps(s1a, s1b)) * inv_d;
          bb[i] = _mm512_reduce_add_ps(_mm512_add_ps(s2a, s2b)) * inv_d;
        }
        for (int64_t v = 0; v < nv; ++v) {  // dx = ds, dy = ds * keep * scale; weight/bias gradients of the nr rows
          const int64_t j = 16 * v;
          const __m512 wv = _mm512_loadu_ps(w + j);
          __m512 dwv = _mm512_setzero_ps(), dbv = dwv;
          for (int i = 0; i < nr; ++i) {
            const int64_t o = (r + i) * d + j;
            const __m512 gv = V16<T>::ld(gp + o);
            const __m512 xh = _mm512_mul_ps(_mm512_sub_ps(V16<T>::ld(sp + o), _mm512_set1_ps(m[i])), _mm512_set1_ps(rs[i]));
            const __m512 in = _mm512_sub_ps(_mm512_mul_ps(gv, wv), _mm512_set1_ps(a[i]));
            const __m512 ds = _mm512_mul_ps(_mm512_set1_ps(rs[i]), _mm512_fnmadd_ps(xh, _mm512_set1_ps(bb[i]), in));
            V16<T>::st(dxp + o, ds, ntx);
            if (dyp) V16<T>::st(dyp + o, drop ? _mm512_mul_ps(ds, keep_scale(kp + (r + i) * nb, v, sc)) : ds, nty);
            dwv = _mm512_fmadd_ps(gv, xh, dwv);
            dbv = _mm512_add_ps(dbv, gv);
          }
          if (cw) _mm512_storeu_ps(cw + j, _mm512_add_ps(_mm512_loadu_ps(cw + j), dwv));
          if (cb) _mm512_storeu_ps(cb + j, _mm512_add_ps(_mm512_loadu_ps(cb + j), dbv));
        }
      }
    }
    if (ntx || nty) stream_fence();
  });
  if (want_dw) reduce_chunks(pw, nch, d, dw);
  if (want_db) reduce_chunks(pb, nch, d, db);
}

// The AVX-512 rows apply: switched on, one storage type (float32 or bfloat16: the if constexpr around the call), d
// a positive multiple of m.
inline bool use_512(int64_t d, int64_t m) { return g_an512.load(std::memory_order_relaxed) && d > 0 && d % m == 0; }
template <typename TX, typename TY, typename TO>
constexpr bool kOneType512 = std::is_same_v<TX, TO> && std::is_same_v<TY, TO> && !std::is_same_v<TO, double>;
#else
#define SUBLAYER_AN512 0
#endif

template <typename TX, typename TY, typename TO>
void add_norm_fwd_impl(const Tensor& x, const Tensor& y, const Tensor& w, const Tensor& b, Tensor& out, Tensor& sum,
                       Tensor& mean, Tensor& rstd, Tensor& mask, double eps, const Drop& dr, bool rms) {
  using A = typename Elt<TO>::acc;
  const int64_t N = x.size(0), d = x.size(1);
  const auto* xp = ptr<TX>(x);
  const auto* yp = ptr<TY>(y);
  const A* wp = w.defined() ? static_cast<const A*>(w.data_ptr()) : nullptr;
  const A* bp = b.defined() ? static_cast<const A*>(b.data_ptr()) : nullptr;
  auto* op = ptr<TO>(out);
  auto* sp = sum.numel() ? ptr<TO>(sum) : nullptr;
  A* mp = static_cast<A*>(mean.data_ptr());
  A* rp = static_cast<A*>(rstd.data_ptr());
  uint8_t* kp = mask.numel() ? mask.data_ptr<uint8_t>() : nullptr;
  const int64_t nb = (d + 7) / 8;  // mask bytes per row
  const A scale = A(dr.scale), aeps = A(eps), inv_d = A(1) / A(d);
  const int32_t thr = int32_t(dr.thr);  // draws are 16-bit: a signed compare vectorises
#if SUBLAYER_AN512
  if constexpr (kOneType512<TX, TY, TO>) {
    if (use_512(d, 64)) return add_norm_fwd_512<TO>(xp, yp, wp, bp, op, sp, mp, rp, kp, N, d, float(eps), dr, rms);
  }
#endif
  at::parallel_for(0, N, row_grain(d), [&](int64_t r0, int64_t r1) {
    const A sc = scale;  // locals, not captured references: keeps the inner loops vectorised
    const int32_t th = thr;
    std::vector<A> s(d);
    std::vector<uint32_t> rnd(dr.on ? d : 0);
    const bool nt_sum = sp && N * d * int64_t(sizeof(typename Elt<TO>::store)) >= kStreamBytes;
    // the rounded sum's row when it is not saved, or before it is streamed out
    std::vector<typename Elt<TO>::store> scratch(sp && !nt_sum ? 0 : d);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* xr = xp + r * d;
      const auto* yr = yp + r * d;
      auto* sr = sp && !nt_sum ? sp + r * d : scratch.data();
      A* sv = s.data();
      A total;  // sum of the row: sv (float) and sr (storage type) get the sum rounded to the output type
      if (dr.on) {
        philox_fill(uint64_t(r) * d, d, dr.seed, rnd.data());
        const uint32_t* rv = rnd.data();
        if (kp) pack_keep(rv, d, th, kp + r * nb);
        total = fill_sum(sv, d, [&](int64_t j) {
          const auto t = Elt<TO>::st(Elt<TX>::ld(xr[j]) + Elt<TY>::ld(yr[j]) * (A(int32_t(rv[j]) >= th) * sc));
          sr[j] = t;
          return Elt<TO>::ld(t);
        });
      } else {
        total = fill_sum(sv, d, [&](int64_t j) {
          const auto t = Elt<TO>::st(Elt<TX>::ld(xr[j]) + Elt<TY>::ld(yr[j]));
          sr[j] = t;
          return Elt<TO>::ld(t);
        });
      }
      const A m = rms ? A(0) : total * inv_d;
      const A var = row_sqdev(sv, m, d);
      const A rs = A(1) / std::sqrt(var * inv_d + aeps);
      mp[r] = m;
      rp[r] = rs;
      if (nt_sum) stream_row(sp + r * d, sr, d);
      auto* orow = op + r * d;
      if (wp && bp) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] = Elt<TO>::st((sv[j] - m) * rs * wp[j] + bp[j]);
      } else if (wp) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] = Elt<TO>::st((sv[j] - m) * rs * wp[j]);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) orow[j] = Elt<TO>::st((sv[j] - m) * rs);
      }
    }
    if (nt_sum) stream_fence();
  });
}

template <typename TX, typename TY, typename TO>
void add_norm_bwd_impl(const Tensor& g, const Tensor& sum, const Tensor& mean, const Tensor& rstd, const Tensor& w,
                       const Tensor& mask, Tensor& dx, Tensor& dy, Tensor& dw, Tensor& db, const Drop& dr, bool rms) {
  using A = typename Elt<TO>::acc;
  const int64_t N = g.size(0), d = g.size(1);
  const auto* gp = ptr<TO>(g);
  const auto* sp = ptr<TO>(sum);
  const A* mp = static_cast<const A*>(mean.data_ptr());
  const A* rp = static_cast<const A*>(rstd.data_ptr());
  const A* wp = w.defined() ? static_cast<const A*>(w.data_ptr()) : nullptr;
  auto* dxp = ptr<TX>(dx);
  auto* dyp = dy.defined() ? ptr<TY>(dy) : nullptr;
  const bool want_dw = dw.defined(), want_db = db.defined();
  const int64_t nch = n_chunks(N), rows_per = (N + nch - 1) / nch;
  std::vector<A> pw(want_dw ? nch * d : 0), pb(want_db ? nch * d : 0);
  const A scale = A(dr.scale), inv_d = A(1) / A(d);
  const uint8_t* kp = mask.defined() && mask.numel() ? mask.data_ptr<uint8_t>() : nullptr;  // saved keep bits
  const int64_t nb = (d + 7) / 8;
#if SUBLAYER_AN512
  if constexpr (kOneType512<TX, TY, TO>) {
    if (use_512(d, 16))
      return add_norm_bwd_512<TO>(gp, sp, mp, rp, wp, kp, dxp, dyp, want_dw ? static_cast<A*>(dw.data_ptr()) : nullptr,
                                  want_db ? static_cast<A*>(db.data_ptr()) : nullptr, N, d, dr, rms);
  }
#endif
  at::parallel_for(0, nch, row_grain(rows_per * d), [&](int64_t c0, int64_t c1) {
    const A sc = scale;  // a local, not a captured reference: keeps the inner loops vectorised
    std::vector<A> keep(dr.on && dyp ? d : 0), gws(d);
    const bool nt = N * d * int64_t(sizeof(typename Elt<TX>::store)) >= kStreamBytes;  // stream dx, dy out
    std::vector<typename Elt<TX>::store> dxs(nt ? d : 0);  // rows before they are streamed out
    std::vector<typename Elt<TY>::store> dys(nt && dyp ? d : 0);
    for (int64_t c = c0; c < c1; ++c) {
      A* cw = want_dw ? pw.data() + c * d : nullptr;
      A* cb = want_db ? pb.data() + c * d : nullptr;
      if (cw) std::fill(cw, cw + d, A(0));
      if (cb) std::fill(cb, cb + d, A(0));
      const int64_t rend = std::min(N, (c + 1) * rows_per);
      for (int64_t r = c * rows_per; r < rend; ++r) {
        const auto* gr = gp + r * d;
        const auto* sr = sp + r * d;
        const A m = mp[r], rs = rp[r];
        // x^ = (sum - m) * rstd is recomputed where needed rather than stored (the loops are bound by stores, not
        // arithmetic); g * w is stored, so that the final loop uses the very values summed (d = 1 gives dx = 0
        // exactly, whatever the compiler contracts into FMAs).
        auto xh = [&](int64_t j) { return (Elt<TO>::ld(sr[j]) - m) * rs; };
        A* gw_ = gws.data();
        A sg, sgx;  // sum of g*w and of g*w*x^ over the row
        if (wp && cw && cb) {  // the usual training case: weight and bias gradients in the same pass
          sum2(d, sg, sgx, [&](int64_t j, A& s1, A& s2) {
            const A gv = Elt<TO>::ld(gr[j]), xv = xh(j), gw = gv * wp[j];
            cw[j] += gv * xv;
            cb[j] += gv;
            gw_[j] = gw;
            s1 = gw;
            s2 = gw * xv;
          });
        } else {
          if (wp) {
            sum2(d, sg, sgx, [&](int64_t j, A& s1, A& s2) {
              s1 = gw_[j] = Elt<TO>::ld(gr[j]) * wp[j];
              s2 = s1 * xh(j);
            });
          } else {
            sum2(d, sg, sgx, [&](int64_t j, A& s1, A& s2) {
              s1 = gw_[j] = Elt<TO>::ld(gr[j]);
              s2 = s1 * xh(j);
            });
          }
          if (cw) {
#pragma omp simd
            for (int64_t j = 0; j < d; ++j) cw[j] += Elt<TO>::ld(gr[j]) * xh(j);
          }
          if (cb) {
#pragma omp simd
            for (int64_t j = 0; j < d; ++j) cb[j] += Elt<TO>::ld(gr[j]);
          }
        }
        const A a = rms ? A(0) : sg * inv_d, bb = sgx * inv_d;
        A* kv = keep.data();
        if (dyp && dr.on) unpack_keep(kp + r * nb, d, sc, kv);
        auto* dxr = nt ? dxs.data() : dxp + r * d;
        auto* dyr = dyp ? (nt ? dys.data() : dyp + r * d) : nullptr;
        auto ds_at = [&](int64_t j) { return rs * (gw_[j] - a - xh(j) * bb); };  // dx = ds; dy = ds * keep * scale
        if (dyr && dr.on) {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) {
            const A ds = ds_at(j);
            dxr[j] = Elt<TX>::st(ds);
            dyr[j] = Elt<TY>::st(ds * kv[j]);
          }
        } else if (dyr) {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) {
            const A ds = ds_at(j);
            dxr[j] = Elt<TX>::st(ds);
            dyr[j] = Elt<TY>::st(ds);
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < d; ++j) dxr[j] = Elt<TX>::st(ds_at(j));
        }
        if (nt) {
          stream_row(dxp + r * d, dxr, d);
          if (dyr) stream_row(dyp + r * d, dyr, d);
        }
      }
    }
    if (nt) stream_fence();
  });
  if (want_dw) reduce_chunks(pw, nch, d, static_cast<A*>(dw.data_ptr()));
  if (want_db) reduce_chunks(pb, nch, d, static_cast<A*>(db.data_ptr()));
}

// Dispatch (x, y, out) storage types. Supported: (f32|bf16, f32|bf16) and (f64, f64); out = promoted type.
#define SUBLAYER_DISPATCH_XY(XT, YT, NAME, ...)                                                     \
  [&] {                                                                                             \
    using at::kBFloat16;                                                                            \
    using at::kDouble;                                                                              \
    using at::kFloat;                                                                               \
    if (XT == kFloat && YT == kFloat) { using TX = float; using TY = float; using TO = float; return __VA_ARGS__(); } \
    if (XT == kBFloat16 && YT == kBFloat16) { using TX = BF16; using TY = BF16; using TO = BF16; return __VA_ARGS__(); } \
    if (XT == kFloat && YT == kBFloat16) { using TX = float; using TY = BF16; using TO = float; return __VA_ARGS__(); } \
    if (XT == kBFloat16 && YT == kFloat) { using TX = BF16; using TY = float; using TO = float; return __VA_ARGS__(); } \
    if (XT == kDouble && YT == kDouble) { using TX = double; using TY = double; using TO = double; return __VA_ARGS__(); } \
    TORCH_CHECK(false, NAME ": unsupported dtypes ", XT, " and ", YT);                               \
  }()

// The default CPU generator's next int64 random_() draw (random64() mod 2^63, under its lock): the seed
// sublayer.functional.fused.dropout_seed() would give, without making a tensor for it.
int64_t default_generator_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return int64_t(gen.get<at::CPUGeneratorImpl>()->random64() % (uint64_t(1) << 63));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> add_norm_fwd(const Tensor& x, const Tensor& y,
                                                        const std::optional<Tensor>& weight,
                                                        const std::optional<Tensor>& bias, double eps, double p,
                                                        int64_t seed, bool rms, bool save_sum) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == y.sizes() && x.is_contiguous() && y.is_contiguous(),
              "add_norm_fwd: x, y must be contiguous 2-D tensors of one shape");
  const auto ot = c10::promoteTypes(x.scalar_type(), y.scalar_type());
  const auto at_ = acc_type(ot);
  const int64_t N = x.size(0), d = x.size(1);
  const int64_t nb = (d + 7) / 8;  // keep bits: bytes per row
  Tensor out = sublayer_cache::empty({N, d}, ot);
  Tensor sum, mean, rstd, mask;
  if (save_sum) {  // what backward needs, in ONE block: sum | keep bits | mean | rstd (each 64-byte aligned)
    auto al = [](int64_t n) { return (n + 63) / 64 * 64; };
    const int64_t sb = al(N * d * int64_t(c10::elementSize(ot))), mb = p > 0 ? al(N * nb) : 0;
    const int64_t rb = al(N * int64_t(c10::elementSize(at_)));
    Tensor block = sublayer_cache::empty({sb + mb + 2 * rb}, at::kByte);
    sum = block.narrow(0, 0, N * d * int64_t(c10::elementSize(ot))).view(ot).view({N, d});
    mask = block.narrow(0, sb, p > 0 ? N * nb : 0).view({p > 0 ? N : 0, nb});
    mean = block.narrow(0, sb + mb, N * int64_t(c10::elementSize(at_))).view(at_);
    rstd = block.narrow(0, sb + mb + rb, N * int64_t(c10::elementSize(at_))).view(at_);
  } else {
    Tensor stats = at::empty({2, N}, x.options().dtype(at_));
    sum = at::empty({0, d}, x.options().dtype(ot));
    mask = at::empty({0, nb}, x.options().dtype(at::kByte));
    mean = stats[0];
    rstd = stats[1];
  }
  Tensor w = weight.has_value() ? weight->contiguous() : Tensor();
  Tensor b = bias.has_value() ? bias->contiguous() : Tensor();
  TORCH_CHECK(!w.defined() || (w.scalar_type() == at_ && w.numel() == d), "add_norm_fwd: weight must be (d,) acc");
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at_ && b.numel() == d), "add_norm_fwd: bias must be (d,) acc");
  const Drop dr(p, p > 0 && seed < 0 ? default_generator_seed() : seed);  // seed < 0: draw it here
  SUBLAYER_DISPATCH_XY(x.scalar_type(), y.scalar_type(), "add_norm_fwd",
                       [&] { add_norm_fwd_impl<TX, TY, TO>(x, y, w, b, out, sum, mean, rstd, mask, eps, dr, rms); });
  return {out, sum, mean, rstd, mask};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> add_norm_bwd(const Tensor& g, const Tensor& sum, const Tensor& mean,
                                                        const Tensor& rstd, const std::optional<Tensor>& weight,
                                                        const std::optional<Tensor>& mask, at::ScalarType xt, at::ScalarType yt, double p,
                                                        bool rms, bool need_dy, bool need_dw, bool need_db) {
  TORCH_CHECK(g.dim() == 2 && g.sizes() == sum.sizes() && g.is_contiguous() && sum.is_contiguous(),
              "add_norm_bwd: grad and saved sum must be contiguous 2-D tensors of one shape");
  const auto ot = c10::promoteTypes(xt, yt);
  TORCH_CHECK(g.scalar_type() == ot && sum.scalar_type() == ot, "add_norm_bwd: grad dtype must be ", ot);
  const auto at_ = acc_type(ot);
  const int64_t N = g.size(0), d = g.size(1);
  Tensor w = weight.has_value() ? weight->contiguous() : Tensor();
  Tensor k = mask.has_value() ? *mask : Tensor();
  TORCH_CHECK(!(p > 0 && need_dy) || (k.defined() && k.scalar_type() == at::kByte && k.is_contiguous() &&
                                      k.dim() == 2 && k.size(0) == N && k.size(1) == (d + 7) / 8),
              "add_norm_bwd: with dropout, mask must be the (N, ceil(d / 8)) uint8 keep bits of add_norm_fwd");
  Tensor dx = sublayer_cache::empty({N, d}, xt);  // two tensors, never one aliased
  Tensor dy = need_dy ? sublayer_cache::empty({N, d}, yt) : Tensor();
  Tensor dw = need_dw ? at::empty({d}, g.options().dtype(at_)) : Tensor();
  Tensor db = need_db ? at::empty({d}, g.options().dtype(at_)) : Tensor();
  const Drop dr(p, 0);  // the mask comes saved: no draws
  SUBLAYER_DISPATCH_XY(xt, yt, "add_norm_bwd",
                       [&] { add_norm_bwd_impl<TX, TY, TO>(g, sum, mean, rstd, w, k, dx, dy, dw, db, dr, rms); });
  return {dx, dy, dw, db};
}

// Whether Add & Norm's AVX-512 rows run where they apply (set_switch: -1 reads it; false where not compiled in).
bool add_norm_avx512(int64_t flag) { return set_switch(g_an512, flag, SUBLAYER_AN512); }

}  // namespace
}  // namespace sublayer

TORCH_LIBRARY(sublayer_kernels, m) {
  m.def("add_norm_fwd(Tensor x, Tensor y, Tensor? weight, Tensor? bias, float eps, float p, int seed, bool rms, "
        "bool save_sum) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        sublayer::cpu_kernel(&sublayer::add_norm_fwd));
  m.def("add_norm_bwd(Tensor g, Tensor sum, Tensor mean, Tensor rstd, Tensor? weight, Tensor? mask, ScalarType x_dtype, ScalarType y_dtype, "
        "float p, bool rms, bool need_dy, bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor, Tensor)",
        sublayer::cpu_kernel(&sublayer::add_norm_bwd));
  m.def("add_norm_avx512(int flag) -> bool", &sublayer::add_norm_avx512);
}
