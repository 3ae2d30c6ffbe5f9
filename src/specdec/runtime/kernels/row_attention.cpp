// specdec::row_attention: scaled dot-product attention whose every output row is computed on its own.
//
//   out[b, h, m, :] = softmax_l(scale * q[b, h, m, :] . k[b, h / rep, l, :] + mask[b, h|0, m, l]) @ v[b, h / rep, l, :]
//
// Row-invariant by construction: a row's result depends only on its own query, its own mask row and the keys and
// values of the slots it sees, in slot order; never on the number of rows in the pass, their batch or neighbours,
// the cache length, holes between its slots, or where its slots fall in the blocks below. That is what makes a
// γ+1-row verification pass, a tree pass or a batched pass give a row exactly the logits a one-row pass gives it
// (library kernels pick other reduction orders for other row counts). How each step keeps it:
//
// - a slot's score is a fixed function of its own products: W lanes of q[d] * k[l, d] partial sums, accumulated
//   over the head's vectors in order (`partial_dot`), then summed by one fixed tree (`slot_sums`). Scores are
//   computed W slots at a time (the tree reduces the W slots' partial vectors together), and every slot gets the
//   same tree whatever its lane and whether the other lanes hold slots, masked slots or nothing;
// - a slot whose mask is below -FLT_MAX / 2 (or false) is skipped: its exp() would be exactly 0, so skipping it
//   (or holes, or a longer cache) changes no sum. Each row scans only its own first-to-last visible range;
// - the row maximum is exact whatever the order; exp() is lane-wise;
// - the softmax sum and the weighted values are accumulated slot by slot in slot order, over the slots whose
//   weight is not 0, each value row as a vector over the head dimension.
//
// Arithmetic is float32 (bfloat16 and float16 inputs are widened exactly); the build passes -ffp-contract=off, so
// the only fused multiply-adds are the explicit ones. Where the CPU has AVX512_BF16, a bfloat16 slot's partial sums
// come from its dot-product instruction (each lane adds exact products of bfloat16 pairs in float32, one fixed order)
// and the scale multiplies the summed dot product; elsewhere the query is scaled first. Either way one machine gives
// one row one result. Built on first use by specdec.runtime.rowwise.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr float kInf = std::numeric_limits<float>::infinity();
static_assert(W % 4 == 0 && (W & (W - 1)) == 0, "the slot tree reduces lanes in blocks of 4, blocks in pairs");

// n (<= W) elements of T at p as floats, zeros past n
template <typename T>
inline Vec load_vec(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return n == W ? Vec::loadu(p) : Vec::loadu(p, n);
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {  // exact widening
    const __m256i x = n == W ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                             : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    if constexpr (std::is_same_v<T, at::Half>) return _mm512_cvtph_ps(x);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
#elif defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {  // exact widening
    __m128i x;
    if (n == W) {
      x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::memcpy(tmp, p, 2 * n);
      x = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
    }
    if constexpr (std::is_same_v<T, at::Half>) return _mm256_cvtph_ps(x);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
#endif
  } else {
    return at::vec::convert<float>(n == W ? at::vec::Vectorized<T>::loadu(p, W) : at::vec::Vectorized<T>::loadu(p, n));
  }
}

template <typename T>
inline void store_vec(const Vec& x, T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == W) x.store(p); else x.store(p, n);
  } else {
    at::vec::convert<T>(x).store(p, n);
  }
}

// The mask of slots [l, l + n) (n <= W) as additive floats, lanes past n -inf: its own dtype read directly.
template <typename MT>
inline Vec mask_vec(const MT* p, int64_t n) {
  if constexpr (std::is_same_v<MT, bool>) {
    alignas(64) float bias[W];
    for (int64_t i = 0; i < W; ++i) bias[i] = i < n && p[i] ? 0.f : -kInf;
    return Vec::loadu(bias);
  } else {
    const Vec x = load_vec(p, n);
    return n == W ? x : Vec::set(Vec(-kInf), x, n);
  }
}

// The W sums of W slots' partial vectors: lane i of the result sums the lanes of p[i], always by the same tree,
// ((l0 + l2) + (l1 + l3)) within each block of 4 lanes, then the blocks pairwise ((b0 + b1) + (b2 + b3)).
// Both operands of every step below are treated alike, so a slot's sum does not depend on its lane.
inline Vec slot_sums(const Vec* p) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(W == 16);
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {  // per block of slot 2i: (l0 + l2), slot 2i + 1: (l0 + l2), then both (l1 + l3)
    const __m512 a = p[2 * i], b = p[2 * i + 1];
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i)  // per block: slots 4i .. 4i + 3, each (l0 + l2) + (l1 + l3)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // blocks: (b0 + b1), (b2 + b3) of slots 8i .. 8i + 3, then of 8i + 4 .. 8i + 7
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // (b0 + b1) + (b2 + b3) of slots 0 .. 15, in slot order
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  static_assert(W == 8);
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i) {  // per 128-bit block of slots 2i, 2i + 1: (l0 + l2), (l1 + l3)
    const __m256 a = p[2 * i], b = p[2 * i + 1];
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i)  // per block: slots 4i .. 4i + 3, each (l0 + l2) + (l1 + l3)
    u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // (b0 + b1) of slots 0 .. 7, in slot order
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
#else
  alignas(64) float lanes[W], sums[W], blocks[W / 4];
  for (int64_t i = 0; i < W; ++i) {
    p[i].store(lanes);
    for (int64_t k = 0; k < W / 4; ++k) {
      const float* x = lanes + 4 * k;
      blocks[k] = (x[0] + x[2]) + (x[1] + x[3]);
    }
    for (int64_t n = W / 4; n > 1; n /= 2)
      for (int64_t k = 0; k < n / 2; ++k) blocks[k] = blocks[2 * k] + blocks[2 * k + 1];
    sums[i] = blocks[0];
  }
  return Vec::loadu(sums);
#endif
}

// Vector j of NV of a head row at p whose last vector holds `tail` values.
template <typename KT>
inline Vec row_vec(const KT* p, int64_t j, int64_t NV, int64_t tail) {
  return load_vec(p + j * W, j + 1 < NV ? W : tail);
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// bfloat16 scores by the CPU's bf16 dot product: W lanes, each summing its pairs of exact products in float32
constexpr bool kDotBF16 = true;
#else
constexpr bool kDotBF16 = false;
#endif

// A pass of R query rows over one kv head: the inputs of attend_rows.
template <typename KT>
struct Rows {
  int64_t R, NV, tail;             // rows; vectors per head row, the last holding `tail` values
  const Vec* qv;                   // [R, NV]: each row's query times the scale, as floats
  const void* qb;                  // with the bf16 dot product: [R, (NV + 1) / 2] vectors of 2W bfloat16 (unscaled)
  float scale;
  const int64_t *first, *last;     // row r sees slots [first[r], last[r])
  const float* const* bias;        // bias[r][l]: row r's additive mask at slot l (-inf past last[r], up to W - 1)
  float skip;                      // masks at or below it: a slot not seen
  const KT *kf, *vf;               // slot l's key and value rows at kf + l * D, vf + l * D
  int64_t D;
  float* sc;                       // sc + r * S - lo, indexed by slot: row r's scores
  int64_t S, lo;
  Vec* out;                        // [R, NV]: each row's normalised output
};

// Slot k's W partial dot products with a row's query: its products summed over the head's vectors in order.
// q: the row's query, as floats times the scale; qb: with the bf16 dot product, as bfloat16 (unscaled).
template <typename KT>
inline Vec partial_dot(const Vec* q, const void* qb, int64_t NV, int64_t tail, int64_t D, const KT* k) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<KT, at::BFloat16>) {
    const int64_t NB = (NV + 1) / 2, rest = D - (NB - 1) * 2 * W;  // 2W bfloat16 a vector, `rest` in the last
    const __m512i* qv = static_cast<const __m512i*>(qb);
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < NB; ++j) {
      const __m512i kk = j + 1 < NB ? _mm512_loadu_si512(k + j * 2 * W)
                                    : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << rest) - 1),
                                                               k + j * 2 * W);
      s = _mm512_dpbf16_ps(s, (__m512bh)qv[j], (__m512bh)kk);
    }
    return s;
  }
#endif
  Vec s = q[0] * row_vec(k, 0, NV, tail);
  for (int64_t j = 1; j < NV; ++j) s = at::vec::fmadd(q[j], row_vec(k, j, NV, tail), s);
  return s;
}

// The softmax sums and weighted values of G rows r0 .. r0 + G - 1, each over its own slots in slot order, skipping
// slots whose weight is 0 (masked, or underflowed: they add exactly nothing). The rows go through their slots side by
// side, so that one value row, read and widened once, serves all G, and their independent sums overlap in the
// pipeline; each row's own sequence of additions is the one it has alone (G = 1). NVT: NV as a constant (0: NV at
// run time, accumulating in the output rows).
template <int G, int NVT, typename KT>
inline void weigh_values(const Rows<KT>& x, int64_t r0) {
  const int64_t NV = NVT ? NVT : x.NV;
  const int64_t tail = x.tail, D = x.D, S = x.S, lo = x.lo;
  const float* row[G];  // row[g][l]: row r0 + g's weight at slot l, within [first, last)
  int64_t f[G], e[G];
  float total[G];
  Vec acc[G][NVT ? NVT : 1];  // in registers (NVT known)
  int64_t from = std::numeric_limits<int64_t>::max(), to = 0;
  for (int g = 0; g < G; ++g) {
    row[g] = x.sc + (r0 + g) * S - lo;
    f[g] = x.first[r0 + g];
    e[g] = x.last[r0 + g];
    total[g] = 0.f;
    Vec* a = NVT ? acc[g] : x.out + (r0 + g) * NV;
    for (int64_t j = 0; j < NV; ++j) a[j] = Vec(0.f);
    if (f[g] < e[g]) { from = std::min(from, f[g]); to = std::max(to, e[g]); }
  }
  for (int64_t l = from; l < to; ++l) {
    float w[G];
    bool any = false;
    for (int g = 0; g < G; ++g) {
      w[g] = l >= f[g] && l < e[g] ? row[g][l] : 0.f;
      any = any || w[g] != 0.f;
    }
    if (!any) continue;
    const KT* v = x.vf + l * D;
    if constexpr (NVT > 0) {
      Vec vv[NVT];
      for (int64_t j = 0; j < NVT; ++j) vv[j] = row_vec(v, j, NVT, tail);
      for (int g = 0; g < G; ++g) {
        if (w[g] == 0.f) continue;
        total[g] += w[g];
        const Vec wv(w[g]);
        for (int64_t j = 0; j < NVT; ++j) acc[g][j] = at::vec::fmadd(wv, vv[j], acc[g][j]);
      }
    } else {
      for (int g = 0; g < G; ++g) {
        if (w[g] == 0.f) continue;
        total[g] += w[g];
        const Vec wv(w[g]);
        Vec* a = x.out + (r0 + g) * NV;
        for (int64_t j = 0; j < NV; ++j) a[j] = at::vec::fmadd(wv, row_vec(v, j, NV, tail), a[j]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const Vec inv(total[g] > 0.f ? 1.f / total[g] : 0.f);
    Vec* o = x.out + (r0 + g) * NV;
    const Vec* a = NVT ? acc[g] : o;
    for (int64_t j = 0; j < NV; ++j) o[j] = a[j] * inv;
  }
}

// Every row of a pass on its own: scores, W slots at a time, their maximum, exp(); then the softmax sum and the
// weighted values slot by slot (`weigh_values`). Key and value rows are widened to float32 where they are read
// (bfloat16 rows read from the cache and widened at each use beat a float32 copy: half the bytes). NVT: NV as a
// constant (0: NV at run time).
template <int NVT, typename KT>
void attend_rows(const Rows<KT>& x) {
  const int64_t NV = NVT ? NVT : x.NV;
  const bool dot_bf16 = kDotBF16 && std::is_same_v<KT, at::BFloat16>;
  const int64_t NB = (NV + 1) / 2;
  const int64_t R = x.R, tail = x.tail, D = x.D, S = x.S, lo = x.lo;
  const Vec scale(x.scale), skip(x.skip);
  const KT* kf = x.kf;
  for (int64_t r = 0; r < R; ++r) {
    Vec q[NVT ? NVT : 1];  // the row's query in registers (NVT known)
    const Vec* qr = x.qv + r * NV;
    if constexpr (NVT > 0) {
      for (int64_t j = 0; j < NVT; ++j) q[j] = qr[j];
      qr = q;
    }
    const void* qb = x.qb ? static_cast<const void*>(static_cast<const char*>(x.qb) + r * NB * 64) : nullptr;
    const int64_t f = x.first[r], e = x.last[r];
    const float* bias = x.bias[r];
    float* row = x.sc + r * S - lo;  // row[l]: slot l
    // scores, W slots at a time, and their maximum
    Vec top(std::numeric_limits<float>::lowest());
    for (int64_t l0 = f; l0 < e; l0 += W) {
      const int64_t n = std::min(W, e - l0);
      Vec p[W];
      if (n == W) {
        for (int64_t i = 0; i < W; ++i) p[i] = partial_dot(qr, qb, NV, tail, D, kf + (l0 + i) * D);
      } else {
        for (int64_t i = 0; i < W; ++i)
          p[i] = i < n ? partial_dot(qr, qb, NV, tail, D, kf + (l0 + i) * D) : Vec(0.f);
      }
      const Vec add = Vec::loadu(bias + l0);
      const Vec dot = dot_bf16 ? slot_sums(p) * scale : slot_sums(p);
      const Vec s = Vec::blendv(dot + add, Vec(-kInf), add <= skip);
      s.store(row + l0);
      top = at::vec::maximum(top, s);
    }
    const float best = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top);
    // exp(score - best), W at a time (masked: exactly 0)
    const Vec bv(best);
    for (int64_t l0 = f; l0 < e; l0 += W) (Vec::loadu(row + l0) - bv).exp_u20().store(row + l0);
  }
  // then the softmax sums and the weighted values: four rows at a time where the head's vectors fit in registers,
  // two where they are 8 of AVX-512's 32 (over a 4096-slot cache, 8 query rows of a 128-wide head: 0.83x the time)
  int64_t r = 0;
  if constexpr (NVT > 0 && NVT <= 4) {
    for (; r + 4 <= R; r += 4) weigh_values<4, NVT>(x, r);
    for (; r + 2 <= R; r += 2) weigh_values<2, NVT>(x, r);
  } else if constexpr (NVT == 8 && W == 16) {  // two rows' 16 sums and the 8 value vectors: 24 registers
    for (; r + 2 <= R; r += 2) weigh_values<2, NVT>(x, r);
  }
  for (; r < R; ++r) weigh_values<1, NVT>(x, r);
}

template <typename KT>
using AttendRows = void (*)(const Rows<KT>&);

template <typename KT>
AttendRows<KT> attend_rows_for(int64_t NV) {
  switch (NV) {
    case 1: return attend_rows<1, KT>;
    case 2: return attend_rows<2, KT>;
    case 3: return attend_rows<3, KT>;
    case 4: return attend_rows<4, KT>;
    case 8: return attend_rows<8, KT>;
    default: return attend_rows<0, KT>;
  }
}

// Bit i set where lane i of an additive mask is a slot to attend (above `skip`).
inline int64_t visible_bits(const Vec& bias, float skip) {
  return ~static_cast<int64_t>((bias > Vec(skip)).zero_mask()) & ((int64_t{1} << W) - 1);
}

// The distinct rows of a mask (one per (b, h, m) it does not broadcast over; a single row of zeros without one),
// each as its first and last visible slots and its additive values over that range as floats (-inf after it, up
// to a whole number of vectors): what every query row reading it needs, computed once per call rather than once
// per head or query row that shares it.
struct MaskRows {
  int64_t Bm = 1, Hm = 1, Mm = 1;
  const int64_t* first;
  const int64_t* last;
  const float* const* bias;  // bias[i][l]: slot l of distinct row i

  int64_t index(int64_t b, int64_t h, int64_t m) const {
    return ((Bm > 1 ? b : 0) * Hm + (Hm > 1 ? h : 0)) * Mm + (Mm > 1 ? m : 0);
  }
};

template <typename MT>
MaskRows mask_rows(const MT* mp, int64_t B, int64_t H, int64_t M, int64_t L, int64_t mb, int64_t mh, int64_t mm,
                   float skip) {
  // the calling thread's scratch, reused across calls; read (not written) by the workers of one call
  thread_local std::vector<int64_t> range_buf, offset_buf;
  thread_local std::vector<float> value_buf;
  thread_local std::vector<const float*> row_buf;
  MaskRows rows;
  if (mp) {
    rows.Bm = mb ? B : 1;
    rows.Hm = mh ? H : 1;
    rows.Mm = mm ? M : 1;
  }
  const int64_t N = rows.Bm * rows.Hm * rows.Mm;
  range_buf.resize(2 * N); offset_buf.resize(N); row_buf.resize(N);
  int64_t* first = range_buf.data();
  int64_t* last = first + N;
  int64_t size = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t m = i % rows.Mm, h = i / rows.Mm % rows.Hm, b = i / (rows.Mm * rows.Hm);
    int64_t f = 0, e = L;
    if (mp) {  // the row's first and last visible slots
      const MT* mrow = mp + b * mb + h * mh + m * mm;
      for (; f < L; f += W) {
        const int64_t bits = visible_bits(mask_vec(mrow + f, std::min(W, L - f)), skip);
        if (bits) { f += __builtin_ctzll(bits); break; }
      }
      f = std::min(f, L);
      for (; e > f; e -= W) {
        const int64_t start = std::max(f, e - W);
        const int64_t bits = visible_bits(mask_vec(mrow + start, e - start), skip);
        if (bits) { e = start + 64 - __builtin_clzll(bits); break; }
      }
      e = std::max(e, f);
    }
    first[i] = f; last[i] = e;
    offset_buf[i] = size;
    size += (e - f + W - 1) / W * W;
  }
  value_buf.resize(size);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t m = i % rows.Mm, h = i / rows.Mm % rows.Hm, b = i / (rows.Mm * rows.Hm);
    const int64_t f = first[i], e = last[i];
    float* row = value_buf.data() + offset_buf[i] - f;  // row[l]: slot l
    row_buf[i] = row;
    for (int64_t l0 = f; l0 < e; l0 += W) {
      const int64_t n = std::min(W, e - l0);
      (mp ? mask_vec(mp + b * mb + h * mh + m * mm + l0, n) : Vec::set(Vec(-kInf), Vec(0.f), n)).store(row + l0);
    }
  }
  rows.first = first;
  rows.last = last;
  rows.bias = row_buf.data();
  return rows;
}

// One (b, kv-head) at a time: every query row reading it runs attend_rows on its own.
template <typename T, typename MT>
void row_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const MT* mp,
                          int64_t mb, int64_t mh, int64_t mm, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2);
  const int64_t rep = H / Hkv;
  const int64_t R = rep * M;  // query rows reading one kv head
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float skip = -0.5f * std::numeric_limits<float>::max();
  const int64_t NV = (D + W - 1) / W;  // vectors per head row; the last holds D - (NV - 1) * W values
  const int64_t tail = D - (NV - 1) * W;
  const AttendRows<T> attend = attend_rows_for<T>(NV);
  const MaskRows masks = mask_rows(mp, B, H, M, L, mb, mh, mm, skip);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    // per-thread scratch, reused across calls (and reached through plain pointers in the loops below)
    thread_local std::vector<Vec> qv_buf, out_buf;
    thread_local std::vector<float> scores_buf;
    thread_local std::vector<int64_t> range_buf;
    thread_local std::vector<const float*> bias_buf;
    qv_buf.resize(R * NV); out_buf.resize(R * NV); range_buf.resize(2 * R); bias_buf.resize(R);
    Rows<T> x{R, NV, tail, qv_buf.data(), nullptr, scale, range_buf.data(), range_buf.data() + R, bias_buf.data(),
              skip, nullptr, nullptr, D, nullptr, 0, 0, out_buf.data()};
    Vec* qv = qv_buf.data();
    int64_t* first = range_buf.data();
    int64_t* last = first + R;
    const float** bias = bias_buf.data();
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    thread_local std::vector<__m512i> qb_buf;
    const int64_t NB = (NV + 1) / 2, rest = D - (NB - 1) * 2 * W;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      qb_buf.resize(R * NB);
      x.qb = qb_buf.data();
    }
#endif
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / Hkv, hk = bk % Hkv;
      int64_t lo = L, hi = 0;  // the slots any row sees lie in [lo, hi)
      for (int64_t r = 0; r < R; ++r) {  // row r: head hk * rep + r / M, query m = r % M
        const int64_t h = hk * rep + r / M, m = r % M;
        const T* qr = qp + ((b * H + h) * M + m) * D;
        for (int64_t j = 0; j < NV; ++j) qv[r * NV + j] = load_vec(qr + j * W, j + 1 < NV ? W : tail) * Vec(scale);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          for (int64_t j = 0; j < NB; ++j)
            qb_buf[r * NB + j] = j + 1 < NB ? _mm512_loadu_si512(qr + j * 2 * W)
                                            : _mm512_maskz_loadu_epi16(
                                                  static_cast<__mmask32>((uint64_t{1} << rest) - 1), qr + j * 2 * W);
        }
#endif
        const int64_t i = masks.index(b, h, m);
        first[r] = masks.first[i]; last[r] = masks.last[i]; bias[r] = masks.bias[i];
        if (first[r] < last[r]) { lo = std::min(lo, first[r]); hi = std::max(hi, last[r]); }
      }
      const int64_t span = std::max<int64_t>(hi - lo, 0);
      x.S = (span + W - 1) / W * W + W;  // a row's scores: its visible range, rounded up to vectors
      scores_buf.resize(R * x.S);
      x.sc = scores_buf.data();
      x.lo = lo;
      x.kf = kp + bk * L * D;
      x.vf = vp + bk * L * D;
      attend(x);
      Vec* ov = x.out;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = hk * rep + r / M, m = r % M;
        T* orow = op + ((b * H + h) * M + m) * D;
        for (int64_t j = 0; j < NV; ++j) store_vec(ov[r * NV + j], orow + j * W, j + 1 < NV ? W : tail);
      }
    }
  });
}

template <typename T>
void dispatch_mask(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                   float scale, at::Tensor& out) {
  if (!mask.has_value()) {
    row_attention_kernel<T, float>(q, k, v, nullptr, 0, 0, 0, scale, out);
    return;
  }
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.dim() == 4 && m.size(3) == k.size(2) && m.stride(3) == 1,
              "row_attention: the mask must be [B|1, H|1, M, L] with contiguous slots");
  const int64_t mb = m.size(0) == 1 ? 0 : m.stride(0), mh = m.size(1) == 1 ? 0 : m.stride(1);
  const int64_t mm = m.size(2) == 1 ? 0 : m.stride(2);
  switch (m.scalar_type()) {
    case at::kBool: row_attention_kernel<T, bool>(q, k, v, m.data_ptr<bool>(), mb, mh, mm, scale, out); break;
    case at::kFloat: row_attention_kernel<T, float>(q, k, v, m.data_ptr<float>(), mb, mh, mm, scale, out); break;
    case at::kBFloat16:
      row_attention_kernel<T, at::BFloat16>(q, k, v, m.data_ptr<at::BFloat16>(), mb, mh, mm, scale, out); break;
    case at::kHalf: row_attention_kernel<T, at::Half>(q, k, v, m.data_ptr<at::Half>(), mb, mh, mm, scale, out); break;
    default: TORCH_CHECK(false, "row_attention: a float32, bfloat16, float16 or bool mask, got ", m.scalar_type());
  }
}

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "row_attention: q, k, v must be [B, H, M|L, D]");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "row_attention: query heads must be a multiple of key heads");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "row_attention: q, k, v must share a dtype");
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {  // float32 arithmetic: float64 stays with PyTorch's kernels
    case at::kFloat: dispatch_mask<float>(qc, kc, vc, mask, s, out); break;
    case at::kBFloat16: dispatch_mask<at::BFloat16>(qc, kc, vc, mask, s, out); break;
    case at::kHalf: dispatch_mask<at::Half>(qc, kc, vc, mask, s, out); break;
    default: TORCH_CHECK(false, "row_attention: float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("row_attention", &row_attention); }
