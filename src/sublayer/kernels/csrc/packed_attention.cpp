// packed_self_attention (torch.ops.sublayer_kernels.packed_self_attention): an encoder's self-attention on packed
// rows in bfloat16, read straight from the fused q|k|v projection.
//
// qkv (N, 3*d) bf16 (or float32, rounded to bf16 per task) holds the real tokens of a batch only, each sequence on
// consecutive rows; `runs` (R, 3) int64 lists runs of `count` sequences of one `length` starting at `row`
// (sublayer.runtime.encoder.runs). Every (sequence, head) is one task: its q, k and v are packed into bf16 pairs
// (q: head-dim pairs per query; k: 16-key blocks of head-dim pairs; v: key pairs per head-dim column), the scores
// S = scale * q k^T come from vdpbf16ps (exact bf16 products, float32 sums), the softmax is float32 (max
// subtracted, exp, summed), P v again from vdpbf16ps with P as the sum of two bf16 parts (split_probs: high and
// low, P to ~2^-17, twice the P v work) or as one (bf16's 2^-9; the sum then of the rounded P), and the output row
// is divided by the sum in float32, then stored as `out_dtype` (float32 or bf16). Queries go 16 at a time, so
// memory is O(16 * length) per thread whatever the length. Tasks run longest first over OpenMP's dynamic schedule
// (lengths differ). Without AVX512_BF16 (or with packed_attention_avx512(0)) a portable loop computes the same
// products and roundings.
//
// float32_products (float32 q|k|v only): the same tasks in float32 throughout — k packed in 16-key blocks, v rows
// padded to whole vectors, S = scale * q k^T and P v by float32 FMAs (AVX-512F tiles, or the portable loop), the
// probabilities unrounded: the attention of a float32 model, to float32's rounding. Its tasks are a sequence's
// heads (in groups when there are fewer sequences than 4 per thread): one thread reads a sequence's rows, k is
// packed by 16 x 16 register transposes, the next head's rows are prefetched into L2, and up to 64 keys the scores
// and their softmax stay in registers (the same roundings as the separate pass).

#include "common.h"

#include <ATen/ops/zeros.h>

#include <atomic>
#include <limits>

namespace sublayer {

namespace {

std::atomic<bool> g_avx512{true};  // packed_attention_avx512
// The AVX-512F tiles (float32 products) and the AVX512_BF16 ones compiled in.
#if defined(__AVX512BF16__)
constexpr bool kF32Tiles = true, kBF16Tiles = true;
#elif defined(__AVX512F__)
constexpr bool kF32Tiles = true, kBF16Tiles = false;
#else
constexpr bool kF32Tiles = false, kBF16Tiles = false;
#endif

constexpr int64_t QB = 16;  // queries per block

struct Task {
  int64_t row, n, h, nh = 1;  // heads h..h+nh-1 of the sequence at rows row..row+n-1
};

struct Scratch {
  std::vector<uint32_t> q, k;  // q: n x dp pairs; k: nb x dp x 16 pairs
  std::vector<uint16_t> v, p, pl, x;  // x: a float32 task's q|k|v rounded to bf16  // v: ceil(n/2) x hv x 2; p, pl: QB x nk (probabilities' high, low bf16 parts)
  std::vector<float> s;        // QB x nk
  std::vector<float> kf, vf, pf;  // float32 tasks: k (nb x hd x 16), v (n x hv), probabilities (QB x nk)
};

inline uint32_t pair_bits(const uint16_t* x, int64_t c, int64_t hd) {
  return uint32_t(x[c]) | (c + 1 < hd ? uint32_t(x[c + 1]) << 16 : 0u);
}

// q, k, v of one task into the scratch layouts (bf16 bits; padding keys, rows and columns zero).
void pack(const uint16_t* base, int64_t ld, int64_t d, const Task& t, int64_t hd, int64_t dp, int64_t hv,
          bool fast, Scratch& w) {
  const int64_t n = t.n, nb = (n + 15) / 16, nk = nb * 16, nh = (n + 1) / 2;
  w.q.resize(n * dp);
  w.k.assign(nb * dp * 16, 0u);
  w.v.resize(nh * hv * 2);
  w.s.resize(QB * nk);
  w.p.resize(QB * nk);
  w.pl.resize(QB * nk);
  const uint16_t* q0 = base + t.row * ld + t.h * hd;
  const bool even = hd % 2 == 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* qj = q0 + j * ld;
    const uint16_t* kj = qj + d;
    uint32_t* qp = w.q.data() + j * dp;
    uint32_t* kt = w.k.data() + (j / 16) * dp * 16 + (j % 16);
    if (even) {
      std::memcpy(qp, qj, 2 * hd);
      for (int64_t c = 0; c < dp; ++c) std::memcpy(kt + c * 16, kj + 2 * c, 4);
    } else {
      for (int64_t c = 0; c < dp; ++c) {
        qp[c] = pair_bits(qj, 2 * c, hd);
        kt[c * 16] = pair_bits(kj, 2 * c, hd);
      }
    }
  }
  const uint16_t* v0 = q0 + 2 * d;
  for (int64_t j2 = 0; j2 < nh; ++j2) {
    const uint16_t* va = v0 + 2 * j2 * ld;
    const uint16_t* vb = 2 * j2 + 1 < n ? va + ld : nullptr;
    uint16_t* o = w.v.data() + j2 * hv * 2;
#if defined(__AVX512BF16__)
    // columns 32 at a time: a and b interleaved by two two-source permutes
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t c = 0; fast && c < hv; c += 32) {
      const __mmask32 k = hd - c >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << (hd - c)) - 1u);
      const __m512i a = _mm512_maskz_loadu_epi16(k, va + c);
      const __m512i b = vb ? _mm512_maskz_loadu_epi16(k, vb + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + 2 * c, _mm512_permutex2var_epi16(a, lo, b));
      if (c + 16 < hv) _mm512_storeu_si512(o + 2 * c + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
    if (fast) continue;
#else
    (void)fast;
#endif
    for (int64_t c = 0; c < hv; ++c) {
      o[2 * c] = c < hd ? va[c] : 0;
      o[2 * c + 1] = c < hd && vb ? vb[c] : 0;
    }
  }
}

// Softmax of row s[0, n): the unnormalised probabilities e as two bf16 parts, p = bf16(e) and pl = bf16(e - p)
// (zeros to nk; p + pl holds e to ~2^-17), returns the sum of e; without `split`, p only (pl zeros) and the sum
// of the rounded p.
inline float softmax_row(const float* s, int64_t n, int64_t nk, uint16_t* p, uint16_t* pl, bool split) {
  float mx = s[0];
#pragma omp simd reduction(max : mx)
  for (int64_t j = 1; j < n; ++j) mx = std::max(mx, s[j]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_f(s[j] - mx);
    const uint16_t hi = f_to_bf16(e);
    p[j] = hi;
    pl[j] = split ? f_to_bf16(e - bf16_to_f(hi)) : 0;
    sum += split ? e : bf16_to_f(hi);
  }
  for (int64_t j = n; j < nk; ++j) p[j] = pl[j] = 0;
  return sum;
}

// The portable task: the same bf16 operands, float32 products and sums.
void task_portable(const Scratch& w, const Task& t, int64_t hd, int64_t dp, int64_t hv, float sc, bool split,
                   float* inv, Scratch& m, std::vector<float>& o, int64_t q0, int64_t qn) {
  const int64_t n = t.n, nk = (n + 15) / 16 * 16;
  for (int64_t i = 0; i < qn; ++i) {
    float* s = m.s.data() + i * nk;
    const uint32_t* qi = w.q.data() + (q0 + i) * dp;
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t* kt = w.k.data() + (j / 16) * dp * 16 + (j % 16);
      float a = 0.0f;
      for (int64_t c = 0; c < dp; ++c) {
        a += bf16_to_f(uint16_t(qi[c])) * bf16_to_f(uint16_t(kt[c * 16])) +
             bf16_to_f(uint16_t(qi[c] >> 16)) * bf16_to_f(uint16_t(kt[c * 16] >> 16));
      }
      s[j] = a * sc;
    }
    inv[i] = 1.0f / softmax_row(s, n, nk, m.p.data() + i * nk, m.pl.data() + i * nk, split);
    const uint16_t* p = m.p.data() + i * nk;
    const uint16_t* pl = m.pl.data() + i * nk;
    float* oi = o.data() + i * hv;
    std::fill(oi, oi + hv, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float pj = bf16_to_f(p[j]), plj = bf16_to_f(pl[j]);
      const uint16_t* vj = w.v.data() + (j / 2) * hv * 2 + (j % 2);
      for (int64_t c = 0; c < hd; ++c) oi[c] += pj * bf16_to_f(vj[2 * c]) + plj * bf16_to_f(vj[2 * c]);
    }
  }
}

#if defined(__AVX512F__)
inline void pack_k16(const float* k0, int64_t ld, int64_t n, int64_t hd, float* kf);
#endif

// A float32 task's k as 16-key blocks (key j at [j / 16][c][j % 16]) and v rows padded to hv, zeros beyond n and hd.
// q0: the task's first q row, ld floats between rows, k and v at +d and +2d. With `direct` (the AVX-512 tiles and
// hd a multiple of 16) v is not copied: the tiles read it in place.
void pack_f32(const float* q0, int64_t ld, int64_t d, int64_t n, int64_t hd, int64_t hv, bool direct, Scratch& w) {
  const int64_t nb = (n + 15) / 16;
  w.s.resize(QB * nb * 16);
  w.pf.resize(QB * nb * 16);
  w.kf.resize(nb * hd * 16);
#if defined(__AVX512F__)
  if (direct) return pack_k16(q0 + d, ld, n, hd, w.kf.data());
#endif
  std::fill(w.kf.begin() + (n / 16) * hd * 16, w.kf.end(), 0.0f);  // the last block's missing keys
  if (!direct) w.vf.assign(n * hv, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = q0 + j * ld + d;
    float* kt = w.kf.data() + (j / 16) * hd * 16 + (j % 16);
    for (int64_t c = 0; c < hd; ++c) kt[c * 16] = kj[c];
    if (!direct) std::memcpy(w.vf.data() + j * hv, kj + d, sizeof(float) * hd);
  }
}

// The portable float32 task: queries qs..qs+qn of q0 (ld apart) into o (qn x hv, unnormalised) and inv.
void task_f32_portable(const float* q0, int64_t ld, Scratch& w, int64_t n, int64_t hd, int64_t hv, float sc,
                       float* inv, std::vector<float>& o, int64_t qs, int64_t qn) {
  const int64_t nk = (n + 15) / 16 * 16;
  for (int64_t i = 0; i < qn; ++i) {
    float* s = w.s.data() + i * nk;
    const float* qi = q0 + (qs + i) * ld;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      const float* kt = w.kf.data() + (j / 16) * hd * 16 + (j % 16);
      float a = 0.0f;
      for (int64_t c = 0; c < hd; ++c) a += qi[c] * kt[c * 16];
      s[j] = a * sc;
      mx = std::max(mx, s[j]);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += s[j] = exp_f(s[j] - mx);
    inv[i] = 1.0f / sum;
    float* oi = o.data() + i * hv;
    std::fill(oi, oi + hv, 0.0f);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < hd; ++c) oi[c] += s[j] * w.vf[j * hv + c];
  }
}

#if defined(__AVX512F__)
// The maximum of row s (nk a multiple of 16; keys past the last block's `tail` mask off) on 16 lanes, broadcast.
inline __m512 row_max16(const float* s, int64_t nk, __mmask16 tail) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < nk - 16; j += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + j));
  vm = _mm512_mask_max_ps(vm, tail, vm, _mm512_loadu_ps(s + nk - 16));
  return _mm512_set1_ps(_mm512_reduce_max_ps(vm));
}

// exp256 of act_norm.h on 16 lanes.
#define SUBLAYER_FLOOR512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
SUBLAYER_VEXP(exp512, __m512, _mm512, 512, SUBLAYER_FLOOR512)

// r[i][l] <- r[l][i]: a 16 x 16 float32 transpose in registers.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// pack_f32's k blocks (key j at [j / 16][c][j % 16], zeros past n) by 16 x 16 register transposes; hd % 16 == 0.
inline void pack_k16(const float* k0, int64_t ld, int64_t n, int64_t hd, float* kf) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    for (int64_t c0 = 0; c0 < hd; c0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = i < m ? _mm512_loadu_ps(k0 + (j0 + i) * ld + c0) : _mm512_setzero_ps();
      transpose16(r);
      float* to = kf + ((j0 / 16) * hd + c0) * 16;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(to + i * 16, r[i]);
    }
  }
}

// Ask for the q, k and v rows of one head (q0: its first q row, ld floats between rows, k and v at +d and +2d) to
// be brought into L2 (the packed rows of a batch are larger than L2: each head reads scattered 4 * hd bytes a row).
inline void prefetch_head(const float* q0, int64_t ld, int64_t d, int64_t n, int64_t hd) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t part = 0; part < 3; ++part)
      for (int64_t c = 0; c < hd; c += 16) _mm_prefetch(reinterpret_cast<const char*>(q0 + j * ld + part * d + c),
                                                        _MM_HINT_T1);
}

// The scores of R queries (ld floats apart) against all KB key blocks (KB * 16 >= n keys, the last block's keys
// past `tail` masked off) in registers, then their float32 softmax as task_f32_avx512's separate pass computes it:
// p[r] (np floats apart) the unnormalised probabilities, inv[r] 1 / their sum.
template <int R, int KB>
inline void qk_softmax_f32(const float* q, int64_t ld, int64_t hd, const float* k, float sc, __mmask16 tail,
                           float* p, int64_t np, float* inv) {
  __m512 a[R][KB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) a[r][b] = _mm512_setzero_ps();
  for (int64_t c = 0; c < hd; ++c) {
    __m512 kv[KB];
    for (int b = 0; b < KB; ++b) {
      kv[b] = _mm512_loadu_ps(k + (b * hd + c) * 16);
      asm("" : "+v"(kv[b]));  // in a register: one load per key block, not one per query
    }
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * ld + c]);
      for (int b = 0; b < KB; ++b) a[r][b] = _mm512_fmadd_ps(qv, kv[b], a[r][b]);
    }
  }
  const __m512 vs = _mm512_set1_ps(sc);
  for (int r = 0; r < R; ++r) {
    __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int b = 0; b < KB; ++b) {
      a[r][b] = _mm512_mul_ps(a[r][b], vs);
      asm("" : "+v"(a[r][b]));  // rounded here, as the separate pass stores it (no multiply-subtract contraction)
      vm = b + 1 < KB ? _mm512_max_ps(vm, a[r][b]) : _mm512_mask_max_ps(vm, tail, vm, a[r][b]);
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
    __m512 sum = _mm512_setzero_ps();
    for (int b = 0; b < KB; ++b) {
      const __m512 e = _mm512_maskz_mov_ps(b + 1 < KB ? __mmask16(0xffff) : tail, exp512(_mm512_sub_ps(a[r][b], mx)));
      _mm512_storeu_ps(p + r * np + b * 16, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
  }
}

template <int KB>
inline void qk_softmax_rows_f32(const float* q, int64_t ld, int64_t hd, const float* k, float sc, __mmask16 tail,
                                float* p, int64_t qn, float* inv) {
  constexpr int64_t np = KB * 16;
  int64_t i = 0;
  for (; i + 4 <= qn; i += 4) qk_softmax_f32<4, KB>(q + i * ld, ld, hd, k, sc, tail, p + i * np, np, inv + i);
  tile_rest<3>(qn - i,
               [&](auto R) { qk_softmax_f32<R, KB>(q + i * ld, ld, hd, k, sc, tail, p + i * np, np, inv + i); });
}

// S[r][16 b + l] = sc * q_r . k_{16 b + l} in float32: R queries (ld floats apart) x KB key blocks in registers.
template <int R, int KB>
inline void qk_tile_f32(const float* q, int64_t ld, int64_t hd, const float* k, float sc, float* s, int64_t ns) {
  __m512 a[R][KB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) a[r][b] = _mm512_setzero_ps();
  for (int64_t c = 0; c < hd; ++c) {
    __m512 kv[KB];
    for (int b = 0; b < KB; ++b) kv[b] = _mm512_loadu_ps(k + (b * hd + c) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * ld + c]);
      for (int b = 0; b < KB; ++b) a[r][b] = _mm512_fmadd_ps(qv, kv[b], a[r][b]);
    }
  }
  const __m512 vs = _mm512_set1_ps(sc);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) _mm512_storeu_ps(s + r * ns + b * 16, _mm512_mul_ps(a[r][b], vs));
}

template <int R>
inline void qk_rows_f32(const float* q, int64_t ld, int64_t hd, const float* k, int64_t nb, float sc, float* s,
                        int64_t ns) {
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) qk_tile_f32<R, 4>(q, ld, hd, k + b * hd * 16, sc, s + b * 16, ns);
  tile_rest<3>(nb - b, [&](auto KB) { qk_tile_f32<R, KB>(q, ld, hd, k + b * hd * 16, sc, s + b * 16, ns); });
}

// o[r][16 c + l] = sum_j p_r[j] v[j][16 c + l] in float32: R rows x CB column blocks (v rows vs floats apart, o
// rows hv).
template <int R, int CB>
inline void pv_tile_f32(const float* p, int64_t np, const float* v, int64_t vs, int64_t hv, int64_t n, float* o) {
  __m512 a[R][CB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < CB; ++b) a[r][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[CB];
    for (int b = 0; b < CB; ++b) vv[b] = _mm512_loadu_ps(v + j * vs + 16 * b);
    for (int r = 0; r < R; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * np + j]);
      for (int b = 0; b < CB; ++b) a[r][b] = _mm512_fmadd_ps(pv, vv[b], a[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < CB; ++b) _mm512_storeu_ps(o + r * hv + 16 * b, a[r][b]);
}

template <int R>
inline void pv_rows_f32(const float* p, int64_t np, const float* v, int64_t vs, int64_t hv, int64_t n, float* o) {
  int64_t c = 0;
  for (; c + 32 <= hv; c += 32) pv_tile_f32<R, 2>(p, np, v + c, vs, hv, n, o + c);
  if (c < hv) pv_tile_f32<R, 1>(p, np, v + c, vs, hv, n, o + c);
}

// task_f32_portable on AVX-512F tiles: the scores, a float32 softmax (keys n..nk masked off), P v (v rows vs floats
// apart: the packed copy, or q|k|v itself).
void task_f32_avx512(const float* q0, int64_t ld, Scratch& w, const float* v, int64_t vs, int64_t n, int64_t hd,
                     int64_t hv, float sc, float* inv, std::vector<float>& o, int64_t qs, int64_t qn) {
  const int64_t nb = (n + 15) / 16, nk = nb * 16, last = nk - 16;
  const float* q = q0 + qs * ld;
  float* s = w.s.data();
  const __mmask16 tail = __mmask16((1u << (n % 16 ? n % 16 : 16)) - 1u);
  int64_t i = 0;
  if (nb <= 4) {  // up to 64 keys: scores and softmax in registers, one pass
    tile_rest<4>(nb, [&](auto KB) { qk_softmax_rows_f32<KB>(q, ld, hd, w.kf.data(), sc, tail, w.pf.data(), qn, inv); });
    i = qn;
  }
  for (; i + 4 <= qn; i += 4) qk_rows_f32<4>(q + i * ld, ld, hd, w.kf.data(), nb, sc, s + i * nk, nk);
  tile_rest<3>(qn - i, [&](auto R) { qk_rows_f32<R>(q + i * ld, ld, hd, w.kf.data(), nb, sc, s + i * nk, nk); });
  for (i = nb <= 4 ? qn : 0; i < qn; ++i) {
    const float* si = s + i * nk;
    float* p = w.pf.data() + i * nk;
    const __m512 mx = row_max16(si, nk, tail);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j += 16) {
      const __m512 e = _mm512_maskz_mov_ps(j == last ? tail : __mmask16(0xffff),
                                           exp512(_mm512_sub_ps(_mm512_loadu_ps(si + j), mx)));
      _mm512_storeu_ps(p + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[i] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  const float* p = w.pf.data();
  for (i = 0; i + 8 <= qn; i += 8) pv_rows_f32<8>(p + i * nk, nk, v, vs, hv, n, o.data() + i * hv);
  tile_rest<7>(qn - i, [&](auto R) { pv_rows_f32<R>(p + i * nk, nk, v, vs, hv, n, o.data() + i * hv); });
}
#endif

#if defined(__AVX512BF16__)
// S[r][16 b + l] = sc * sum_c q_r . k_{16 b + l} over head-dim pairs c: R queries x KB key blocks in registers.
template <int R, int KB>
inline void qk_tile(const uint32_t* q, int64_t dp, const uint32_t* k, float sc, float* s, int64_t ns) {
  __m512 a[R][KB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) a[r][b] = _mm512_setzero_ps();
  for (int64_t c = 0; c < dp; ++c) {
    __m512bh kv[KB];
    for (int b = 0; b < KB; ++b) kv[b] = (__m512bh)_mm512_loadu_si512(k + (b * dp + c) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(int(q[r * dp + c]));
      for (int b = 0; b < KB; ++b) a[r][b] = _mm512_dpbf16_ps(a[r][b], qv, kv[b]);
    }
  }
  const __m512 vs = _mm512_set1_ps(sc);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) _mm512_storeu_ps(s + r * ns + b * 16, _mm512_mul_ps(a[r][b], vs));
}

template <int R>
inline void qk_rows(const uint32_t* q, int64_t dp, const uint32_t* k, int64_t nb, float sc, float* s, int64_t ns) {
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) qk_tile<R, 4>(q, dp, k + b * dp * 16, sc, s + b * 16, ns);
  tile_rest<3>(nb - b, [&](auto KB) { qk_tile<R, KB>(q, dp, k + b * dp * 16, sc, s + b * 16, ns); });
}

// o[r][16 c + l] = sum over key pairs j2 of (p + pl)_r[2 j2, 2 j2 + 1] . v[j2][16 c + l][0, 1]: R rows x CB
// column blocks.
template <int R, int CB, bool SPLIT>
inline void pv_tile(const uint16_t* p, const uint16_t* pl, int64_t np, const uint16_t* v, int64_t hv, int64_t nh,
                    float* o) {
  __m512 a[R][CB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < CB; ++b) a[r][b] = _mm512_setzero_ps();
  for (int64_t j2 = 0; j2 < nh; ++j2) {
    __m512bh vv[CB];
    for (int b = 0; b < CB; ++b) vv[b] = (__m512bh)_mm512_loadu_si512(v + (j2 * hv + 16 * b) * 2);
    for (int r = 0; r < R; ++r) {
      uint32_t ph;
      std::memcpy(&ph, p + r * np + 2 * j2, 4);
      const __m512bh hv_ = (__m512bh)_mm512_set1_epi32(int(ph));
      for (int b = 0; b < CB; ++b) a[r][b] = _mm512_dpbf16_ps(a[r][b], hv_, vv[b]);
      if (SPLIT) {
        uint32_t pw;
        std::memcpy(&pw, pl + r * np + 2 * j2, 4);
        const __m512bh lv = (__m512bh)_mm512_set1_epi32(int(pw));
        for (int b = 0; b < CB; ++b) a[r][b] = _mm512_dpbf16_ps(a[r][b], lv, vv[b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < CB; ++b) _mm512_storeu_ps(o + r * hv + 16 * b, a[r][b]);
}

template <int R, bool SPLIT>
inline void pv_rows(const uint16_t* p, const uint16_t* pl, int64_t np, const uint16_t* v, int64_t hv, int64_t nh,
                    float* o) {
  int64_t c = 0;
  for (; c + 32 <= hv; c += 32) pv_tile<R, 2, SPLIT>(p, pl, np, v + 2 * c, hv, nh, o + c);
  if (c < hv) pv_tile<R, 1, SPLIT>(p, pl, np, v + 2 * c, hv, nh, o + c);
}

// softmax_row on 16 lanes (keys n..nk masked off).
template <bool SPLIT>
inline float softmax_row16(const float* s, int64_t n, int64_t nk, uint16_t* p, uint16_t* pl) {
  const __mmask16 tail = __mmask16((1u << (n % 16 ? n % 16 : 16)) - 1u);
  const int64_t last = nk - 16;
  const __m512 mx = row_max16(s, nk, tail);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk; j += 16) {
    const __mmask16 k = j == last ? tail : __mmask16(0xffff);
    const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx)));
    const __m256i b = (__m256i)_mm512_cvtneps_pbh(e);
    const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), b);
    if (SPLIT) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pl + j), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, hi)));
      sum = _mm512_add_ps(sum, e);
    } else {
      sum = _mm512_add_ps(sum, hi);
    }
  }
  return _mm512_reduce_add_ps(sum);
}

// out row = o * inv, the first hd of hv columns, as bf16 or float32.
inline void store_row16(const float* o, float inv, int64_t hd, float* of, uint16_t* ob) {
  const __m512 vi = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < hd; c += 16) {
    const __mmask16 k = hd - c >= 16 ? __mmask16(0xffff) : __mmask16((1u << (hd - c)) - 1u);
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(o + c), vi);
    if (of)
      _mm512_mask_storeu_ps(of + c, k, v);
    else
      _mm256_mask_storeu_epi16(ob + c, k, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

template <bool SPLIT>
void task_avx512(const Scratch& w, const Task& t, int64_t dp, int64_t hv, float sc, float* inv, Scratch& m,
                 std::vector<float>& o, int64_t q0, int64_t qn) {
  const int64_t n = t.n, nb = (n + 15) / 16, nk = nb * 16, nh = (n + 1) / 2;
  const uint32_t* q = w.q.data() + q0 * dp;
  int64_t i = 0;
  for (; i + 4 <= qn; i += 4) qk_rows<4>(q + i * dp, dp, w.k.data(), nb, sc, m.s.data() + i * nk, nk);
  tile_rest<3>(qn - i, [&](auto R) { qk_rows<R>(q + i * dp, dp, w.k.data(), nb, sc, m.s.data() + i * nk, nk); });
  for (i = 0; i < qn; ++i)
    inv[i] = 1.0f / softmax_row16<SPLIT>(m.s.data() + i * nk, n, nk, m.p.data() + i * nk, m.pl.data() + i * nk);
  const uint16_t* p = m.p.data();
  const uint16_t* pl = m.pl.data();
  for (i = 0; i + 8 <= qn; i += 8) pv_rows<8, SPLIT>(p + i * nk, pl + i * nk, nk, w.v.data(), hv, nh, o.data() + i * hv);
  tile_rest<7>(qn - i,
               [&](auto R) { pv_rows<R, SPLIT>(p + i * nk, pl + i * nk, nk, w.v.data(), hv, nh, o.data() + i * hv); });
}
#endif

}  // namespace

Tensor packed_self_attention(const Tensor& qkv, const Tensor& runs, int64_t n_heads, double scale,
                             at::ScalarType out_dtype, bool split_probs, bool float32_products) {
  TORCH_CHECK(qkv.device().is_cpu() && (qkv.scalar_type() == at::kBFloat16 || qkv.scalar_type() == at::kFloat) &&
                  qkv.dim() == 2 && qkv.is_contiguous(),
              "packed_self_attention: qkv must be a contiguous bfloat16 or float32 (N, 3*d) CPU tensor, got ",
              qkv.scalar_type(), " ", qkv.sizes());
  TORCH_CHECK(n_heads >= 1 && qkv.size(1) % (3 * n_heads) == 0 && qkv.size(1) > 0,
              "packed_self_attention: qkv's ", qkv.size(1), " columns are not 3 * n_heads (", n_heads,
              ") * head_dim");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "packed_self_attention: out_dtype must be float32 or bfloat16, got ", out_dtype);
  TORCH_CHECK(!float32_products || qkv.scalar_type() == at::kFloat,
              "packed_self_attention: float32_products needs float32 qkv, got ", qkv.scalar_type());
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 3 && runs.is_contiguous(),
              "packed_self_attention: runs must be a contiguous int64 (R, 3) tensor (row, count, length)");
  const int64_t N = qkv.size(0), d = qkv.size(1) / 3, hd = d / n_heads, dp = (hd + 1) / 2, hv = (hd + 15) / 16 * 16;
  const int64_t* rp = runs.data_ptr<int64_t>();
  std::vector<Task> tasks;
  int64_t covered = 0, work = 0, seqs = 0;
  for (int64_t r = 0; r < runs.size(0); ++r) {
    const int64_t row = rp[3 * r], count = rp[3 * r + 1], n = rp[3 * r + 2];
    TORCH_CHECK(row >= 0 && count >= 1 && n >= 1 && row + count * n <= N, "packed_self_attention: run ", r, " (",
                row, ", ", count, ", ", n, ") is outside qkv's ", N, " rows");
    seqs += count;
  }
  // float32 products: a task is a sequence's heads in groups (one group when there are sequences enough for the
  // threads), so one thread reads a sequence's rows and prefetches its next head; bf16: one head a task
  const int64_t groups = float32_products ? std::min<int64_t>(n_heads, (4 * at::get_num_threads() + seqs - 1) /
                                                                          std::max<int64_t>(seqs, 1)) : n_heads;
  const int64_t per = (n_heads + groups - 1) / groups;
  for (int64_t r = 0; r < runs.size(0); ++r) {
    const int64_t row = rp[3 * r], count = rp[3 * r + 1], n = rp[3 * r + 2];
    for (int64_t c = 0; c < count; ++c)
      for (int64_t h = 0; h < n_heads; h += per) tasks.push_back({row + c * n, n, h, std::min(per, n_heads - h)});
    covered += count * n;
    work += count * n * n;
  }
  // rows outside every run (none when the runs cover the packed rows) are zeros
  Tensor out = covered == N ? at::empty({N, d}, qkv.options().dtype(out_dtype))
                            : at::zeros({N, d}, qkv.options().dtype(out_dtype));
  if (tasks.empty()) return out;
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.n > b.n; });
  const bool f32 = qkv.scalar_type() == at::kFloat;
  const uint16_t* base = f32 ? nullptr : reinterpret_cast<const uint16_t*>(qkv.data_ptr());
  const float* base32 = f32 ? qkv.data_ptr<float>() : nullptr;
  const float sc = float(scale);
  const bool fast32 = kF32Tiles && g_avx512.load(std::memory_order_relaxed), fast = kBF16Tiles && fast32;
  const int64_t T = int64_t(tasks.size());
  const bool par = work * d > kGrainElems * 16 && at::get_num_threads() > 1;
  float* of = out_dtype == at::kFloat ? out.data_ptr<float>() : nullptr;
  uint16_t* ob = out_dtype == at::kFloat ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel num_threads(par ? at::get_num_threads() : 1)
  {
    Scratch w;
    std::vector<float> o(QB * hv), inv(QB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < T; ++ti) {
      const Task& t = tasks[ti];
      for (int64_t h = t.h; float32_products && h < t.h + t.nh; ++h) {
        const float* q0 = base32 + t.row * 3 * d + h * hd;
        const bool direct = fast32 && hd % 16 == 0;
#if defined(__AVX512F__)
        if (direct && h == t.h) prefetch_head(q0, 3 * d, d, t.n, hd);
        if (direct && h + 1 < t.h + t.nh) prefetch_head(q0 + hd, 3 * d, d, t.n, hd);
#endif
        pack_f32(q0, 3 * d, d, t.n, hd, hv, direct, w);
        for (int64_t qs = 0; qs < t.n; qs += QB) {
          const int64_t qn = std::min(QB, t.n - qs);
#if defined(__AVX512F__)
          if (fast32)
            task_f32_avx512(q0, 3 * d, w, direct ? q0 + 2 * d : w.vf.data(), direct ? 3 * d : hv, t.n, hd, hv, sc,
                            inv.data(), o, qs, qn);
          else
#endif
            task_f32_portable(q0, 3 * d, w, t.n, hd, hv, sc, inv.data(), o, qs, qn);
          for (int64_t i = 0; i < qn; ++i) {
            const int64_t at_ = (t.row + qs + i) * d + h * hd;
            const float* oi = o.data() + i * hv;
            if (of) {
#pragma omp simd
              for (int64_t c = 0; c < hd; ++c) of[at_ + c] = oi[c] * inv[i];
            } else {
              for (int64_t c = 0; c < hd; ++c) ob[at_ + c] = f_to_bf16(oi[c] * inv[i]);
            }
          }
        }
      }
      if (float32_products) continue;
      if (f32) {  // the task's q|k|v rounded to bf16 ([n][3][hd]), packed from there
        w.x.resize(t.n * 3 * hd);
        for (int64_t j = 0; j < t.n; ++j) {
          for (int64_t part = 0; part < 3; ++part) {
            const float* from = base32 + (t.row + j) * 3 * d + part * d + t.h * hd;
            uint16_t* to = w.x.data() + (j * 3 + part) * hd;
#pragma omp simd
            for (int64_t c = 0; c < hd; ++c) to[c] = f_to_bf16(from[c]);
          }
        }
        pack(w.x.data(), 3 * hd, hd, Task{0, t.n, 0}, hd, dp, hv, fast, w);
      } else {
        pack(base, 3 * d, d, t, hd, dp, hv, fast, w);
      }
      for (int64_t q0 = 0; q0 < t.n; q0 += QB) {
        const int64_t qn = std::min(QB, t.n - q0);
#if defined(__AVX512BF16__)
        if (fast && split_probs)
          task_avx512<true>(w, t, dp, hv, sc, inv.data(), w, o, q0, qn);
        else if (fast)
          task_avx512<false>(w, t, dp, hv, sc, inv.data(), w, o, q0, qn);
        else
#endif
          task_portable(w, t, hd, dp, hv, sc, split_probs, inv.data(), w, o, q0, qn);
#if defined(__AVX512BF16__)
        if (fast) {
          for (int64_t i = 0; i < qn; ++i) {
            const int64_t at_ = (t.row + q0 + i) * d + t.h * hd;
            store_row16(o.data() + i * hv, inv[i], hd, of ? of + at_ : nullptr, ob ? ob + at_ : nullptr);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < qn; ++i) {
          const int64_t at_ = (t.row + q0 + i) * d + t.h * hd;
          const float* oi = o.data() + i * hv;
          const float s = inv[i];
          if (of) {
            for (int64_t c = 0; c < hd; ++c) of[at_ + c] = oi[c] * s;
          } else {
            for (int64_t c = 0; c < hd; ++c) ob[at_ + c] = f_to_bf16(oi[c] * s);
          }
        }
      }
    }
  }
  return out;
}

// Whether packed_self_attention uses its AVX-512 kernels where compiled in (AVX512_BF16 tiles; float32 products:
// AVX-512F tiles; set_switch: -1 reads it; false where not compiled in).
bool packed_attention_avx512(int64_t flag) { return set_switch(g_avx512, flag, kF32Tiles); }

}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("packed_self_attention(Tensor qkv, Tensor runs, int n_heads, float scale, ScalarType out_dtype, bool split_probs=True, bool float32_products=False) -> Tensor",
        sublayer::cpu_kernel(&sublayer::packed_self_attention));
  m.def("packed_attention_avx512(int flag) -> bool", &sublayer::packed_attention_avx512);
}
