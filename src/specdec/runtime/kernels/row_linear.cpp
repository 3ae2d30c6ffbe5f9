// specdec::row_linear: y = x w^T (+ bias), every output element reduced in one fixed order.
//
//   out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])        x [M, K], w [N, K] (nn.Linear's layout), out [M, N]
//
// Row-invariant by construction: out[m, n] is always the same sequence of vector multiply-adds over k into one
// vector accumulator (in steps of one vector, the tail zero-padded) followed by the same sum of its lanes, whatever M
// is, which block the row falls in or how many threads split the outputs (a thread owns whole outputs). Library GEMMs
// choose other kernels, and so other reduction orders, for one row (a GEMV) and for several. Blocks of a few rows x a
// few outputs share each load of x and w, so a verification pass of a few rows reads the weights about once, as a
// one-row pass does.
//
// The lanes of a block's accumulators are summed together (with AVX-512): sixteen accumulators are transposed and
// added into one vector of sixteen sums, each by the same fixed tree of its own lanes (the halving tree of a
// one-vector horizontal sum, so the bits are those of summing each accumulator alone), and a sum does not depend on
// which accumulators it was reduced beside. Elsewhere each accumulator is summed on its own.
//
// Since no output's bits depend on the block shape, each pass picks its own: a pass of up to RB_MAX rows (decoding,
// verification) is one block of rows against a few outputs at a time, the weights streamed from memory once with
// software prefetch; a longer pass (prefill) goes in chunks of rows, blocks of RB x NB.
//
// bfloat16 uses the CPU's bf16 dot-product instruction (AVX512_BF16: pairs of products accumulated in float32)
// where the build has it; float32 and float16 (and bfloat16 elsewhere) accumulate float32 fused multiply-adds.
// Built on first use with row_attention.cpp (specdec.runtime.rowwise).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
// How far ahead in the weights to prefetch (at least, in whole blocks of outputs): a pass of a few rows streams the
// weights from memory once, so their loads are issued early enough to overlap the multiply-adds (into L1; a
// harmless hint past the end of the weights).
constexpr int64_t PREFETCH_BYTES = 8192;

template <typename T>
__attribute__((always_inline)) inline void prefetch(const T* p) {  // (simd.h's SPECDEC_PREFETCH says why)
  __builtin_prefetch(p, 0, 3);
}

template <typename T>
inline Vec load_f(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return n == W ? Vec::loadu(p) : Vec::loadu(p, n);
  } else {
    return at::vec::convert<float>(n == W ? at::vec::Vectorized<T>::loadu(p, W) : at::vec::Vectorized<T>::loadu(p, n));
  }
}

// dst[r * ldo + j] = the sum of acc[r * C + j]'s lanes, for r < R and j < c (c <= C valid outputs).
#if defined(CPU_CAPABILITY_AVX512)
using Acc = __m512;  // an accumulator (a plain vector: kept in registers through the k loop)

// Sixteen accumulators at a time, transposed into one vector; every sum is the same tree of its own lanes:
//   q_j = (v[j] + v[j+8]) + (v[j+4] + v[j+12])   (j = 0..3),   sum = (q_0 + q_2) + (q_1 + q_3)
// (missing accumulators are zeros, which only feed the lanes of sums nobody reads). Lane i of the result holds v[i].
template <int NV>
__attribute__((always_inline)) inline __m512 reduce_group(const Acc* v) {
  const __m512 z = _mm512_setzero_ps();
  __m512 s1[8], s2[4], s3[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    if (2 * i < NV) {
      const __m512 a = v[2 * i], b = 2 * i + 1 < NV ? v[2 * i + 1] : z;
      s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    } else {
      s1[i] = z;
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    if (4 * i < NV) {
      s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0xDD));
    } else {
      s2[i] = z;
    }
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0xEE));
  // lane 4 L + t holds the sum of v[4 t + L]: back to lane i for v[i]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

// Sums of accumulators [16 g, 16 g + 16) (fewer in a last group), lane i for accumulator 16 g + i.
template <int NV>
__attribute__((always_inline)) inline __m512 group_sums(const Acc* acc, int g) {
  constexpr int FULL = NV >= 16 ? 16 : NV, LAST = NV % 16 ? NV % 16 : FULL;
  return NV - g * 16 >= 16 ? reduce_group<FULL>(acc + g * 16) : reduce_group<LAST>(acc + g * 16);
}

template <int R, int C>
__attribute__((always_inline)) inline void store_sums(const Acc* acc, float* dst, int64_t ldo, int c) {
  constexpr int NV = R * C;
  if constexpr (16 % C == 0) {  // whole rows in each group of sixteen
    constexpr int RG = 16 / C;  // rows per group
    const __mmask16 valid = static_cast<__mmask16>((1u << c) - 1u);
#pragma GCC unroll 4
    for (int g = 0; g * 16 < NV; ++g) {
      const __m512 v = group_sums<NV>(acc, g);
#pragma GCC unroll 16
      for (int rr = 0; rr < RG; ++rr) {
        if (g * RG + rr >= R) break;
        const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(rr * C));
        _mm512_mask_storeu_ps(dst + (g * RG + rr) * ldo, valid, rr == 0 ? v : _mm512_permutexvar_ps(idx, v));
      }
    }
  } else {
    alignas(64) float sums[(NV + 15) / 16 * 16];
#pragma GCC unroll 4
    for (int g = 0; g * 16 < NV; ++g) _mm512_store_ps(sums + g * 16, group_sums<NV>(acc, g));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < c; ++j) dst[r * ldo + j] = sums[r * C + j];
  }
}
#else
using Acc = Vec;
template <int R, int C>
inline void store_sums(const Acc* acc, float* dst, int64_t ldo, int c) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < c; ++j)
      dst[r * ldo + j] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r * C + j]);
}
#endif

// A block of R rows x C outputs (w: the C weight rows), float32 multiply-adds over k in steps of W; the sums of the
// first c outputs go to dst [R, ldo]. PF: prefetch the weights `ahead` elements on.
template <typename T, int R, int C, bool PF>
__attribute__((noinline)) void block_fma(const T* x, int64_t ldx, const T* const* w, int64_t K, int64_t ahead,
                                         float* dst, int64_t ldo, int c) {
  Acc acc[R * C];
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i] = Vec(0.f);
  for (int64_t k = 0; k < K; k += W) {
    const int64_t n = std::min(W, K - k);
    Vec xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = load_f(x + r * ldx + k, n);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const Vec wv = load_f(w[c] + k, n);
      if constexpr (PF) prefetch(w[c] + k + ahead);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r * C + c] = at::vec::fmadd(xv[r], wv, Vec(acc[r * C + c]));
    }
  }
  store_sums<R, C>(acc, dst, ldo, c);
}

#if defined(__AVX512BF16__)
// The same block for bfloat16 with the bf16 dot-product instruction: 32 values of k per step, pairs of products
// added into float32 lanes; the tail is zero-masked (zero products add nothing).
template <int R, int C, bool PF>
__attribute__((noinline)) void block_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* const* w, int64_t K,
                                          int64_t ahead, float* dst, int64_t ldo, int c) {
  __m512 acc[R * C];
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t n = std::min<int64_t>(32, K - k);
    const __mmask32 mask = n == 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1u);
    __m512bh xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[c] + k);
      if constexpr (PF) prefetch(w[c] + k + ahead);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r * C + c] = _mm512_dpbf16_ps(acc[r * C + c], xv[r], wv);
    }
  }
  store_sums<R, C>(acc, dst, ldo, c);
}
#endif

template <typename T, int R, int C, bool PF>
inline void block(const T* x, int64_t ldx, const T* const* w, int64_t K, int64_t ahead, float* dst, int64_t ldo,
                  int c) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    block_bf16<R, C, PF>(x, ldx, w, K, ahead, dst, ldo, c);
    return;
  }
#endif
  block_fma<T, R, C, PF>(x, ldx, w, K, ahead, dst, ldo, c);
}

// Outputs per block for a pass of R <= RB_MAX rows: up to 24 accumulators (and the rows' inputs) in registers; the
// weight rows a block reads at once stay few (float32's are twice as long) so they and their prefetches share L1.
template <typename T>
constexpr int cols_for(int R) {
  if constexpr (sizeof(T) == 4) {
    return R <= 6 ? 4 : 3;
  } else {
    return R <= 3 ? 8 : R == 4 ? 6 : R <= 6 ? 4 : 3;
  }
}
constexpr int RB_MAX = 8;  // a pass of up to this many rows is one block of rows
constexpr int RB = 6;  // otherwise, rows per block in a chunk of MC rows ...
constexpr int NB = 4;  // ... and outputs per block
constexpr int64_t MC = 36;  // rows per chunk (see row_linear_kernel)

// Rows [m0, m0 + R) x outputs [n_begin, n_end) in blocks of C outputs, into sums_all [M, N].
template <typename T, int R, int C, bool PF>
void row_block(const T* xp, const T* wp, int64_t K, int64_t N, int64_t m0, int64_t n_begin, int64_t n_end,
               float* sums_all) {
  // prefetch whole blocks ahead, at least PREFETCH_BYTES
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(T));
  const int64_t ahead = C * std::max<int64_t>(1, (PREFETCH_BYTES + C * row_bytes - 1) / (C * row_bytes)) * K;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += C) {
    const int c = static_cast<int>(std::min<int64_t>(C, n_end - n0));
    // a last block of fewer than C outputs repeats its last output (computed alike, then dropped)
    const T* wb[C];
#pragma GCC unroll 16
    for (int j = 0; j < C; ++j) wb[j] = wp + (n0 + std::min(j, c - 1)) * K;
    block<T, R, C, PF>(xp + m0 * K, K, wb, K, ahead, sums_all + m0 * N + n0, N, c);
  }
}

template <typename T, int R>
void small_pass(const T* xp, const T* wp, int64_t K, int64_t N, float* sums_all) {
  constexpr int C = cols_for<T>(R);
  const int64_t blocks = (N + C - 1) / C;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    row_block<T, R, C, true>(xp, wp, K, N, 0, begin * C, std::min(N, end * C), sums_all);
  });
}

template <typename T, int R>
void chunk_rows(int r_tail, const T* xp, const T* wp, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1,
                float* sums_all) {
  if constexpr (R > 0) {
    if (r_tail == R) {
      row_block<T, R, NB, false>(xp, wp, K, N, m0, n0, n1, sums_all);
      return;
    }
    chunk_rows<T, R - 1>(r_tail, xp, wp, K, N, m0, n0, n1, sums_all);
  }
}

template <typename T>
void row_linear_kernel(const T* xp, const T* wp, const T* bias, T* op, int64_t M, int64_t K, int64_t N) {
  // float32 sums [M, N] first; then bias and the rounding to T in whole vectors
  thread_local std::vector<float> sums_buf;
  if (sums_buf.size() < static_cast<size_t>(M * N)) sums_buf.resize(M * N);  // only grows: no zero-fill per call
  float* sums_all = sums_buf.data();
  if (M <= RB_MAX) {
    // a decoding or verification pass: one block of rows, the weights streamed from memory once (prefetched)
    switch (M) {
      case 8: small_pass<T, 8>(xp, wp, K, N, sums_all); break;
      case 7: small_pass<T, 7>(xp, wp, K, N, sums_all); break;
      case 6: small_pass<T, 6>(xp, wp, K, N, sums_all); break;
      case 5: small_pass<T, 5>(xp, wp, K, N, sums_all); break;
      case 4: small_pass<T, 4>(xp, wp, K, N, sums_all); break;
      case 3: small_pass<T, 3>(xp, wp, K, N, sums_all); break;
      case 2: small_pass<T, 2>(xp, wp, K, N, sums_all); break;
      case 1: small_pass<T, 1>(xp, wp, K, N, sums_all); break;
      default: break;
    }
  } else {
    // Rows in chunks of MC: a chunk's inputs stay in cache while the weights stream past them once, so a prefill of
    // many rows reads the weights M / MC times, not M / RB times. (The order of any row's own sums is unchanged.)
    const int64_t blocks = (N + NB - 1) / NB;
    for (int64_t mc = 0; mc < M; mc += MC) {
      const int64_t mend = std::min(M, mc + MC);
      at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
        for (int64_t nb = begin; nb < end; ++nb) {
          const int64_t n0 = nb * NB, n1 = std::min(N, n0 + NB);
          int64_t m0 = mc;
          if (m0 + RB <= mend) {
            row_block<T, RB, NB, true>(xp, wp, K, N, m0, n0, n1, sums_all);
            m0 += RB;
          }
          for (; m0 + RB <= mend; m0 += RB) row_block<T, RB, NB, false>(xp, wp, K, N, m0, n0, n1, sums_all);
          if (m0 < mend) chunk_rows<T, RB - 1>(static_cast<int>(mend - m0), xp, wp, K, N, m0, n0, n1, sums_all);
        }
      });
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* row = sums_all + m * N;
    T* orow = op + m * N;
    for (int64_t n = 0; n < N; n += W) {
      const int64_t cnt = std::min(W, N - n);
      Vec v = cnt == W ? Vec::loadu(row + n) : Vec::loadu(row + n, cnt);
      if (bias) v = v + load_f(bias + n, cnt);
      if constexpr (std::is_same_v<T, float>) {
        if (cnt == W) v.store(orow + n); else v.store(orow + n, cnt);
      } else {
        at::vec::convert<T>(v).store(orow + n, cnt);
      }
    }
  }
}

at::Tensor row_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2, "row_linear: weight must be [N, K]");
  TORCH_CHECK(input.size(-1) == weight.size(1), "row_linear: input's last dim must equal weight's K");
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), "row_linear: input and weight must share a dtype");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == weight.scalar_type() && bias->numel() == weight.size(0)),
              "row_linear: bias must be [N] in the weight's dtype");
  // Raw pointers over contiguous data: no reshaped or viewed tensors (each costs a dispatch and an allocation, and
  // a pass makes ~50 of these calls). The output is allocated in its final shape.
  const at::Tensor x = input.is_contiguous() ? input : input.contiguous();
  const at::Tensor w = weight.is_contiguous() ? weight : weight.contiguous();
  const at::Tensor b = !bias.has_value() ? at::Tensor() : bias->is_contiguous() ? *bias : bias->contiguous();
  const int64_t K = weight.size(1), N = weight.size(0), M = K ? x.numel() / K : 0;
  c10::SmallVector<int64_t, 4> sizes(input.sizes().begin(), input.sizes().end());
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, input.options());
  switch (input.scalar_type()) {
    case at::kFloat:
      row_linear_kernel<float>(x.const_data_ptr<float>(), w.const_data_ptr<float>(),
                               b.defined() ? b.const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>(), M, K, N);
      break;
    case at::kBFloat16:
      row_linear_kernel<at::BFloat16>(x.const_data_ptr<at::BFloat16>(), w.const_data_ptr<at::BFloat16>(),
                                      b.defined() ? b.const_data_ptr<at::BFloat16>() : nullptr,
                                      out.mutable_data_ptr<at::BFloat16>(), M, K, N);
      break;
    case at::kHalf:
      row_linear_kernel<at::Half>(x.const_data_ptr<at::Half>(), w.const_data_ptr<at::Half>(),
                                  b.defined() ? b.const_data_ptr<at::Half>() : nullptr, out.mutable_data_ptr<at::Half>(),
                                  M, K, N);
      break;
    default: TORCH_CHECK(false, "row_linear: float32, bfloat16 or float16 only, got ", input.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) { m.def("row_linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("row_linear", &row_linear); }
