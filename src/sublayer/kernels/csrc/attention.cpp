// Attention kernels for decoding and encoding (registered as torch.ops.sublayer_kernels.*).
//
//  * decode_attention: one query per row against a static key/value cache (B, H_kv, T_max, hd), grouped-query
//    (each key/value head serves H / H_kv query heads): optionally writes this step's key/value at position
//    length-1 first, then softmax(q k^T * scale) v over the first `length` positions, skipping those the (B, T_max)
//    padding mask marks True. A row whose keys are all masked gets zeros. An optional (N, T_max) row table says
//    which cache row holds each key (beam search). Per head: eight keys' dot products at a time on 16 lanes with
//    AVX-512 (four on 8 lanes with AVX2), reduced by hadd ladders, the output in registers, the next head's lines
//    prefetched.
//  * qkv_self_attention: the encoder's self-attention (causal: a causal LM prompt's) read straight from the fused
//    q|k|v projection (B*S rows), float32 or bfloat16.
//
// float32, over both threads (at::parallel_for); decode_attention's caches may also be bfloat16 (both the same):
// keys and values widened exactly to float32 in registers, the new key/value rounded to bfloat16 (nearest even),
// the scores, softmax and output in float32.

#include "common.h"

#include <limits>
#include <type_traits>

namespace sublayer {
namespace {

// The data of an optional (rows, cols) padding mask (True = skip), checked; null when absent.
const bool* padding_mask(const c10::optional<Tensor>& mask, int64_t rows, int64_t cols, const char* op) {
  if (!mask.has_value() || !mask->defined()) return nullptr;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == rows &&
                  mask->size(1) == cols && mask->is_contiguous(),
              op, ": mask must be a contiguous bool (", rows, ", ", cols, ") tensor");
  return mask->data_ptr<bool>();
}

#if SUBLAYER_AVX2_FMA
// Eight cache elements widened to float32 (bfloat16: a 16-bit shift, exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// The sums of four 8-lane vectors, [sum a, sum b, sum c, sum d], by a hadd ladder (lanes of t: a 0-3, b 0-3,
// c 0-3, d 0-3 | the same over lanes 4-7).
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
#endif
std::atomic<bool> g_att512{true};  // attention_avx512: the 16-lane head loops below
#if SUBLAYER_AVX2_FMA && defined(__AVX512F__)
#define SUBLAYER_ATT512 1
// Sixteen cache elements widened to float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return bf16_to_f_x16(p); }
// The 16 lanes of a added pairwise into 8 (lane i + lane i+8).
inline __m256 fold8(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#else
#define SUBLAYER_ATT512 0
#endif
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_f(v); }
template <typename S> inline float key_dot(const float* q, const S* k, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += q[i] * widen(k[i]);
  return s;
}
// A row of n elements as float32: float32 rows as they are, bfloat16 ones widened into buf.
inline const float* float_row(const float* p, int64_t, float*) { return p; }
inline const float* float_row(const uint16_t* p, int64_t n, float* buf) {
  for (int64_t e = 0; e < n; ++e) buf[e] = bf16_to_f(p[e]);
  return buf;
}
// n floats stored as cache elements (bfloat16: rounded to nearest even).
inline void store_row(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
inline void store_row(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t e = 0; e < n; ++e) dst[e] = f_to_bf16(src[e]);
}

// s[j] = scale * (q . K[j]) for j < L (key rows ks elements apart; S: float or bfloat16 bits), -inf where m[j]
// (mask, may be null); returns max_j s[j].
template <typename S>
inline float head_scores(const float* q, const S* K, int64_t ks, const bool* m, int64_t L, int64_t hd, float sc,
                         float* s) {
  int64_t j = 0;
#if SUBLAYER_ATT512
  if (hd % 16 == 0 && g_att512.load(std::memory_order_relaxed)) {  // eight keys at a time on 16 lanes
    const __m128 vsc = _mm_set1_ps(sc);
    for (; j + 8 <= L; j += 8) {
      const S* k0 = K + j * ks;
      __m512 a[8];
      for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
      for (int64_t e = 0; e < hd; e += 16) {
        const __m512 qv = _mm512_loadu_ps(q + e);
        for (int r = 0; r < 8; ++r) a[r] = _mm512_fmadd_ps(qv, load16(k0 + r * ks + e), a[r]);
      }
      _mm_storeu_ps(s + j, _mm_mul_ps(sum4(fold8(a[0]), fold8(a[1]), fold8(a[2]), fold8(a[3])), vsc));
      _mm_storeu_ps(s + j + 4, _mm_mul_ps(sum4(fold8(a[4]), fold8(a[5]), fold8(a[6]), fold8(a[7])), vsc));
    }
  }
#endif
#if SUBLAYER_AVX2_FMA
  if (hd % 8 == 0) {  // four keys at a time, their four sums reduced together by a hadd ladder
    const __m128 vsc = _mm_set1_ps(sc);
    for (; j + 4 <= L; j += 4) {
      const S* k0 = K + j * ks;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t e = 0; e < hd; e += 8) {
        const __m256 qv = _mm256_loadu_ps(q + e);
        a0 = _mm256_fmadd_ps(qv, load8(k0 + e), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k0 + ks + e), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k0 + 2 * ks + e), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k0 + 3 * ks + e), a3);
      }
      _mm_storeu_ps(s + j, _mm_mul_ps(sum4(a0, a1, a2, a3), vsc));
    }
  }
#endif
  for (; j < L; ++j) s[j] = key_dot(q, K + j * ks, hd) * sc;
  float mx = -std::numeric_limits<float>::infinity();
  for (j = 0; j < L; ++j) {
    if (m && m[j]) s[j] = -std::numeric_limits<float>::infinity();
    mx = std::max(mx, s[j]);
  }
  return mx;
}

// Whether a query sees no key (its output is zeros): head_scores' max mx is -inf and no score is NaN. The max
// passes over NaN scores (a NaN in the query or a key), which make the softmax NaN, as torch's.
inline bool no_key(float mx, const float* s, int64_t L) {
  if (mx != -std::numeric_limits<float>::infinity()) return false;
  for (int64_t j = 0; j < L; ++j)
    if (std::isnan(s[j])) return false;
  return true;
}

// s[j] = exp(s[j] - mx) in place (-inf -> 0, NaN stays); returns their sum.
inline float exp_scores(float* s, int64_t L, float mx) {
  float sum = 0.0f;
  int64_t j = 0;
#if SUBLAYER_AVX2_FMA
  {  // exp of 8 scores at a time (exp256: ~1 ulp; masked scores, -inf, are clamped to e^-87.3 -> re-zeroed)
    __m256 vs = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (; j + 8 <= L; j += 8) {
      const __m256 v = _mm256_loadu_ps(s + j);
      const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), exp256(_mm256_sub_ps(v, vmx)));
      _mm256_storeu_ps(s + j, e);
      vs = _mm256_add_ps(vs, e);
    }
    float l8[8];
    _mm256_storeu_ps(l8, vs);
    for (float l : l8) sum += l;
  }
#endif
  for (; j < L; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

#if SUBLAYER_AVX2_FMA
// o[0, 8*NV) = inv * sum_j p[j] V[j][0, 8*NV) (V rows vs elements apart), the accumulators in registers.
template <int NV, typename S>
inline void weighted_sum_chunk(const float* p, float inv, const S* V, int64_t vs, int64_t L, float* o) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (p[j] == 0.0f) continue;  // a masked key: skipped, so a non-finite value there cannot leak in
    const __m256 pj = _mm256_set1_ps(p[j]);
    const S* vj = V + j * vs;
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(pj, load8(vj + 8 * v), acc[v]);
  }
  const __m256 vi = _mm256_set1_ps(inv);
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + 8 * v, _mm256_mul_ps(acc[v], vi));
}
#endif

#if SUBLAYER_ATT512
// o[0, 16*NV) = inv * sum_j p[j] V[j][0, 16*NV): even and odd keys into two sets of accumulators (two chains per
// output vector), added at the end.
template <int NV, typename S>
inline void weighted_sum_chunk16(const float* p, float inv, const S* V, int64_t vs, int64_t L, float* o) {
  __m512 a0[NV], a1[NV];
  for (int v = 0; v < NV; ++v) a0[v] = a1[v] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= L; j += 2) {
    if (p[j] != 0.0f) {  // a masked key is skipped, so a non-finite value there cannot leak in
      const __m512 pj = _mm512_set1_ps(p[j]);
      for (int v = 0; v < NV; ++v) a0[v] = _mm512_fmadd_ps(pj, load16(V + j * vs + 16 * v), a0[v]);
    }
    if (p[j + 1] != 0.0f) {
      const __m512 pj = _mm512_set1_ps(p[j + 1]);
      for (int v = 0; v < NV; ++v) a1[v] = _mm512_fmadd_ps(pj, load16(V + (j + 1) * vs + 16 * v), a1[v]);
    }
  }
  if (j < L && p[j] != 0.0f) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int v = 0; v < NV; ++v) a0[v] = _mm512_fmadd_ps(pj, load16(V + j * vs + 16 * v), a0[v]);
  }
  const __m512 vi = _mm512_set1_ps(inv);
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(_mm512_add_ps(a0[v], a1[v]), vi));
}
#endif

// o[0, hd) = inv * sum_{j<L} p[j] V[j] (rows vs elements apart); keys with p[j] == 0 (masked) are skipped.
template <typename S>
inline void head_weighted_sum(const float* p, float inv, const S* V, int64_t vs, int64_t L, int64_t hd,
                              float* o) {
#if SUBLAYER_ATT512
  if (hd % 16 == 0 && g_att512.load(std::memory_order_relaxed)) {
    for (int64_t c = 0; c < hd; c += 64)  // up to 4 vectors of the output per pass over the keys
      tile_rest<4>(std::min<int64_t>(4, (hd - c) / 16),
                   [&](auto nv) { weighted_sum_chunk16<nv, S>(p, inv, V + c, vs, L, o + c); });
    return;
  }
#endif
#if SUBLAYER_AVX2_FMA
  if (hd % 8 == 0) {
    for (int64_t c = 0; c < hd; c += 64)  // up to 8 vectors of the output per pass over the keys
      tile_rest<8>(std::min<int64_t>(8, (hd - c) / 8),
                   [&](auto nv) { weighted_sum_chunk<nv, S>(p, inv, V + c, vs, L, o + c); });
    return;
  }
#endif
  std::fill(o, o + hd, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    if (p[j] == 0.0f) continue;
    const float pj = p[j] * inv;
    const S* vj = V + j * vs;
#pragma omp simd
    for (int64_t e = 0; e < hd; ++e) o[e] += pj * widen(vj[e]);
  }
}

}  // namespace

// q (N, H*hd) unit inner stride; kc, vc (B, H_kv, T_max, hd) contiguous, both float32 or both bfloat16, H a
// multiple of H_kv (grouped-query attention: query head h reads key/value head h / (H / H_kv)); mask (N, T_max)
// bool, True = skip; rows (N, T_max) int64 or none: key j of query row n is cache row rows[n, j] (beam search
// reorders this table instead of copying caches; beams share their sentence's cross-attention memory), else row n
// itself (then N == B).
// new_k/new_v (N, H_kv*hd): written at position length-1 of cache rows [0, N) before any head reads.
Tensor decode_attention(const Tensor& q, const Tensor& kc, const Tensor& vc, const c10::optional<Tensor>& mask,
                        int64_t length, double scale, const c10::optional<Tensor>& new_k,
                        const c10::optional<Tensor>& new_v, const c10::optional<Tensor>& rows) {
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&kc, "k_cache"}, {&vc, "v_cache"}}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 4 && t->is_contiguous() &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                "decode_attention: ", name, " must be a contiguous 4-D float32 or bfloat16 CPU tensor, got ",
                t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(vc.scalar_type() == kc.scalar_type(), "decode_attention: v_cache must have k_cache's dtype ",
              kc.scalar_type(), ", got ", vc.scalar_type());
  TORCH_CHECK(kc.sizes() == vc.sizes(), "decode_attention: k_cache and v_cache shapes differ");
  const int64_t B = kc.size(0), Hkv = kc.size(1), T = kc.size(2), hd = kc.size(3), dkv = Hkv * hd, N = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 2 && q.size(1) % dkv == 0 && q.size(1) > 0 &&
                  q.stride(1) == 1,
              "decode_attention: q must be float32 (N, H*", hd, ") with H a multiple of the caches' ", Hkv,
              " heads and unit inner stride, got ", q.sizes());
  const int64_t d = q.size(1), H = d / hd, group = H / Hkv;
  TORCH_CHECK(length >= 1 && length <= T, "decode_attention: length ", length, " outside [1, ", T, "]");
  const int64_t* rp = nullptr;
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 2 && rows->size(0) == N && rows->size(1) == T &&
                    rows->is_contiguous(),
                "decode_attention: rows must be a contiguous int64 (N=", N, ", T_max=", T, ") tensor");
    rp = rows->data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < length; ++j)
        TORCH_CHECK(rp[n * T + j] >= 0 && rp[n * T + j] < B, "decode_attention: rows[", n, ", ", j, "] = ",
                    rp[n * T + j], " is not a cache row in [0, ", B, ")");
  } else {
    TORCH_CHECK(N == B, "decode_attention: q has ", N, " rows but the caches ", B, " (pass rows to map them)");
  }
  const bool* mp = padding_mask(mask, N, T, "decode_attention");
  const bool write = new_k.has_value() && new_k->defined();
  if (write) {  // query row n writes cache row n (a compacted batch, N < B, keeps the first N rows' slots)
    TORCH_CHECK(N <= B, "decode_attention: new_k/new_v need at most one query row per cache row");
    for (const Tensor* t : {&*new_k, &*new_v})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == N && t->size(1) == dkv &&
                      t->stride(1) == 1,
                  "decode_attention: new_k/new_v must be float32 (N, ", dkv, ") with unit inner stride");
    for (int64_t n = 0; rp && n < N; ++n)
      TORCH_CHECK(rp[n * T + length - 1] == n, "decode_attention: rows[", n, ", ", length - 1, "] must be ", n,
                  " (the new key is written in the row's own cache row)");
  }
  const float* nk = write ? new_k->data_ptr<float>() : nullptr;
  const float* nv = write ? new_v->data_ptr<float>() : nullptr;
  const int64_t nks = write ? new_k->stride(0) : 0, nvs = write ? new_v->stride(0) : 0;
  Tensor out = at::empty({N, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  // the heads over caches of elements S (float, or bfloat16 bits as uint16_t)
  auto run = [&](auto* kp, auto* vp) {
    using S = std::remove_pointer_t<decltype(kp)>;
    // this step's key/value of cache row n, head h, at position length-1
    auto write_head = [&](int64_t n, int64_t h) {
      const int64_t off = ((n * Hkv + h) * T + length - 1) * hd;
      store_row(nk + n * nks + h * hd, hd, kp + off);
      store_row(nv + n * nvs + h * hd, hd, vp + off);
    };
    // Grouped-query heads share a key/value head that several threads may read: every new key is written first.
    // Otherwise each head writes its own just before reading it (the lines its prefetch brought in, on its thread).
    for (int64_t n = 0; write && group > 1 && n < N; ++n)
      for (int64_t h = 0; h < Hkv; ++h) write_head(n, h);
    const float* qp = q.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t qs = q.stride(0);
    const float sc = float(scale);
    // threads only when there is enough to read: a parallel region costs more than a short head's work
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, length * hd));
    // A head's keys and values are a few cache lines that the step last touched long ago (L3 or DRAM), too short a
    // run for the hardware prefetcher: the next head's (two ahead for heads under 8 lines) are fetched explicitly,
    // so its misses overlap this head's arithmetic.
    const int64_t lines = (length * hd * int64_t(sizeof(S)) + 63) / 64, ahead = lines < 8 ? 2 : 1;
    const int64_t NH = N * H;
    parallel_chunks((NH + grain - 1) / grain, [&](int64_t c) {
      const int64_t i0 = c * grain, i1 = std::min(NH, i0 + grain);
      std::vector<float> s(length);
      std::vector<S> gk, gv;  // a head's keys and values gathered from several cache rows
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n = i / H, h = (i % H) / group;  // h: the key/value head
        if (i + ahead < i1) {
          const int64_t n2 = (i + ahead) / H, h2 = ((i + ahead) % H) / group, r2 = rp ? rp[n2 * T] : n2;
          const char* k2 = reinterpret_cast<const char*>(kp + (r2 * Hkv + h2) * T * hd);
          const char* v2 = reinterpret_cast<const char*>(vp + (r2 * Hkv + h2) * T * hd);
          for (int64_t l = 0; l < lines; ++l) {
            __builtin_prefetch(k2 + l * 64, 0, 3);
            __builtin_prefetch(v2 + l * 64, 0, 3);
          }
        }
        const bool* m = mp ? mp + n * T : nullptr;
        const float* qh = qp + n * qs + (i % H) * hd;
        float* o = op + n * d + (i % H) * hd;
        int64_t r = n;  // the cache row when every key of this query is in one row
        bool one_row = true;
        if (rp) {
          r = rp[n * T];
          for (int64_t j = 1; j < length && one_row; ++j) one_row = rp[n * T + j] == r;
        }
        if (write && group == 1) write_head(n, h);
        const S* K = kp + (r * Hkv + h) * T * hd;
        const S* V = vp + (r * Hkv + h) * T * hd;
        if (!one_row) {
          gk.resize(length * hd);
          gv.resize(length * hd);
          for (int64_t j = 0; j < length; ++j) {
            const int64_t off = (rp[n * T + j] * Hkv + h) * T * hd + j * hd;
            std::copy(kp + off, kp + off + hd, gk.data() + j * hd);
            std::copy(vp + off, vp + off + hd, gv.data() + j * hd);
          }
          K = gk.data();
          V = gv.data();
        }
        const float mx = head_scores(qh, K, hd, m, length, hd, sc, s.data());
        if (no_key(mx, s.data(), length)) {  // every key masked: zeros (as SDPA)
          std::fill(o, o + hd, 0.0f);
          continue;
        }
        const float sum = exp_scores(s.data(), length, mx);
        head_weighted_sum(s.data(), 1.0f / sum, V, hd, length, hd, o);
      }
    });
  };
  if (kc.scalar_type() == at::kBFloat16)
    run(static_cast<uint16_t*>(kc.data_ptr()), static_cast<uint16_t*>(vc.data_ptr()));
  else
    run(kc.data_ptr<float>(), vc.data_ptr<float>());
  return out;
}

namespace {

// Self-attention of B sequences of S rows each, read straight from the fused projection: qkv (B*S, 3*H*hd) with
// unit inner stride (q | k | v of row b*S + t), float32 or bfloat16, mask (B, S) bool True = padding (those keys
// are skipped, and those query rows get zeros); causal: query t sees keys [0, t] only. Returns (B*S, H*hd) in
// qkv's dtype = softmax(q k^T * scale) v per sequence and head (bfloat16: q, k, v widened exactly, scores, softmax
// and sums in float32, the output rounded once); no transposes and no (B, H, S, S) scores: each (sequence, head)
// is a few KB that stay in L1 while its S queries run.
Tensor qkv_self_attention(const Tensor& qkv, const c10::optional<Tensor>& mask, int64_t n_heads, int64_t seq_len,
                          double scale, bool causal) {
  TORCH_CHECK((qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16) && qkv.dim() == 2 &&
                  qkv.stride(1) == 1,
              "qkv_self_attention: qkv must be a float32 or bfloat16 matrix with unit inner stride, got ",
              qkv.scalar_type(), " ", qkv.sizes());
  const int64_t S = seq_len, H = n_heads, rows = qkv.size(0);
  TORCH_CHECK(S >= 1 && H >= 1 && rows % S == 0 && qkv.size(1) % (3 * H) == 0,
              "qkv_self_attention: qkv ", qkv.sizes(), " is not (B*", S, ", 3*", H, "*head_dim)");
  const int64_t B = rows / S, d = qkv.size(1) / 3, hd = d / H, rs = qkv.stride(0);
  const bool* mp = padding_mask(mask, B, S, "qkv_self_attention");
  Tensor out = at::empty({rows, d}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  const float sc = float(scale);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, S * S * hd));
  auto run = [&](const auto* base, auto* op) {  // elements E: float, or bfloat16 bits as uint16_t
    at::parallel_for(0, B * H, grain, [&](int64_t i0, int64_t i1) {
      std::vector<float> s(S), qf(hd), of(hd);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / H, h = i % H;
        const auto* Q = base + b * S * rs + h * hd;
        const auto* K = Q + d;
        const auto* V = Q + 2 * d;
        const bool* m = mp ? mp + b * S : nullptr;
        for (int64_t t = 0; t < S; ++t) {
          auto* o = op + (b * S + t) * d + h * hd;
          constexpr bool f32 = std::is_same_v<std::remove_pointer_t<decltype(o)>, float>;
          float* of32 = f32 ? reinterpret_cast<float*>(o) : of.data();  // float32: written in place
          const int64_t L = causal ? t + 1 : S;  // the keys this query sees
          const bool pad_row = m && m[t];
          const float mx = pad_row ? -std::numeric_limits<float>::infinity()
                                   : head_scores(float_row(Q + t * rs, hd, qf.data()), K, rs, m, L, hd, sc,
                                                 s.data());
          if (pad_row || no_key(mx, s.data(), L)) {  // a padding row, or no key to see: zeros
            std::fill(of32, of32 + hd, 0.0f);
          } else {
            const float sum = exp_scores(s.data(), L, mx);
            head_weighted_sum(s.data(), 1.0f / sum, V, rs, L, hd, of32);
          }
          if constexpr (!f32) store_row(of32, hd, o);
        }
      }
    });
  };
  if (qkv.scalar_type() == at::kBFloat16)
    run(static_cast<const uint16_t*>(qkv.data_ptr()), static_cast<uint16_t*>(out.data_ptr()));
  else
    run(qkv.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

}  // namespace

// Whether decode_attention and qkv_self_attention run their 16-lane head loops where compiled in (set_switch: -1
// reads it; false where not compiled in).
bool attention_avx512(int64_t flag) { return set_switch(g_att512, flag, SUBLAYER_ATT512); }

}  // namespace sublayer

TORCH_LIBRARY_FRAGMENT(sublayer_kernels, m) {
  m.def("attention_avx512(int flag) -> bool", &sublayer::attention_avx512);
  m.def("qkv_self_attention(Tensor qkv, Tensor? mask, int n_heads, int seq_len, float scale, bool causal=False) -> Tensor",
        sublayer::cpu_kernel(&sublayer::qkv_self_attention));
  m.def("decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? mask, int length, float scale, "
        "Tensor? new_k, Tensor? new_v, Tensor? rows=None) -> Tensor",
        sublayer::cpu_kernel(&sublayer::decode_attention));
}
