// specdec::row_linear: y = x w^T (+ bias), every output element reduced in one fixed order.
//
//   out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])        x [M, K], w [N, K] (nn.Linear's layout), out [M, N]
//
// Row-invariant by construction: out[m, n] is always the same sequence of vector multiply-adds over k (in steps of
// one vector, the tail zero-padded) followed by the same horizontal sum, whatever M is, which block the row falls in
// or how many threads split the outputs (a thread owns whole outputs). Library GEMMs choose other kernels, and so
// other reduction orders, for one row (a GEMV) and for several. Blocks of up to 4 rows x 4 outputs share each load
// of x and w, so a verification pass of a few rows reads the weights about once, as a one-row pass does.
//
// bfloat16 uses the CPU's bf16 dot-product instruction (AVX512_BF16: pairs of products accumulated in float32)
// where the build has it; float32 and float16 (and bfloat16 elsewhere) accumulate float32 fused multiply-adds.
// Built on first use with row_attention.cpp (specdec.runtime.rowwise).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t RB = 4;  // rows per block
constexpr int64_t NB = 4;  // outputs per block
constexpr int64_t MC = 32;  // rows per chunk (see row_linear_kernel)
// Weight rows ahead to prefetch: the weights stream from memory once per pass, so loads are issued early enough to
// overlap the multiply-adds of several-row passes (a harmless hint past the end of the weights).
constexpr int64_t PREFETCH_ROWS = 16;

template <typename T>
inline Vec load_f(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return n == W ? Vec::loadu(p) : Vec::loadu(p, n);
  } else {
    return at::vec::convert<float>(n == W ? at::vec::Vectorized<T>::loadu(p, W) : at::vec::Vectorized<T>::loadu(p, n));
  }
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// A block of R rows x C outputs (R, C <= 4), float32 multiply-adds over k in steps of W.
template <typename T, int R, int C>
void block_fma(const T* x, int64_t ldx, const T* w, int64_t K, float* sums) {
  Vec acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = Vec(0.f);
  for (int64_t k = 0; k < K; k += W) {
    const int64_t n = std::min(W, K - k);
    Vec wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = load_f(w + c * K + k, n);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Vec xv = load_f(x + r * ldx + k, n);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = at::vec::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r * NB + c] = hsum(acc[r][c]);
}

#if defined(__AVX512BF16__)
// The same block for bfloat16 with the bf16 dot-product instruction: 32 values of k per step, pairs of products
// added into float32 lanes; the tail is zero-masked (zero products add nothing).
template <int R, int C>
void block_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t K, float* sums) {
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t n = std::min<int64_t>(32, K - k);
    const __mmask32 mask = n == 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1u);
    __m512bh wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      wv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + c * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (c + PREFETCH_ROWS) * K + k), _MM_HINT_T0);  // a later block
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) sums[r * NB + c] = _mm512_reduce_add_ps(acc[r][c]);
}
#endif

template <typename T, int R, int C>
inline void block(const T* x, int64_t ldx, const T* w, int64_t K, float* sums) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    block_bf16<R, C>(x, ldx, w, K, sums);
    return;
  }
#endif
  block_fma<T, R, C>(x, ldx, w, K, sums);
}

// Dispatch a block of r rows x c outputs (1..4 each) to its unrolled instance.
template <typename T, int R>
inline void block_rows(int c, const T* x, int64_t ldx, const T* w, int64_t K, float* sums) {
  switch (c) {
    case 4: block<T, R, 4>(x, ldx, w, K, sums); break;
    case 3: block<T, R, 3>(x, ldx, w, K, sums); break;
    case 2: block<T, R, 2>(x, ldx, w, K, sums); break;
    default: block<T, R, 1>(x, ldx, w, K, sums); break;
  }
}

template <typename T>
void row_linear_kernel(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t blocks = (N + NB - 1) / NB;
  // float32 sums [M, N] first; then bias and the rounding to T in whole vectors
  thread_local std::vector<float> sums_buf;
  sums_buf.resize(M * N);
  float* sums_all = sums_buf.data();
  // Rows in chunks of MC: a chunk's inputs stay in cache while the weights stream past them once, so a prefill of
  // many rows reads the weights M / MC times, not M / RB times. (The order of any row's own sums is unchanged.)
  for (int64_t mc = 0; mc < M; mc += MC) {
   const int64_t mend = std::min(M, mc + MC);
   at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    float sums[RB * NB];
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * NB;
      const int c = static_cast<int>(std::min<int64_t>(NB, N - n0));
      for (int64_t m0 = mc; m0 < mend; m0 += RB) {
        const int r = static_cast<int>(std::min<int64_t>(RB, mend - m0));
        const T* xb = xp + m0 * K;
        const T* wb = wp + n0 * K;
        switch (r) {
          case 4: block_rows<T, 4>(c, xb, K, wb, K, sums); break;
          case 3: block_rows<T, 3>(c, xb, K, wb, K, sums); break;
          case 2: block_rows<T, 2>(c, xb, K, wb, K, sums); break;
          default: block_rows<T, 1>(c, xb, K, wb, K, sums); break;
        }
        for (int i = 0; i < r; ++i)
          for (int j = 0; j < c; ++j) sums_all[(m0 + i) * N + n0 + j] = sums[i * NB + j];
      }
    }
   });
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
  const auto x = input.reshape({-1, input.size(-1)}).contiguous();
  const auto w = weight.contiguous();
  const auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto sizes = input.sizes().vec();
  sizes.back() = weight.size(0);
  auto out = at::empty({x.size(0), weight.size(0)}, input.options().memory_format(at::MemoryFormat::Contiguous));
  switch (input.scalar_type()) {
    case at::kFloat: row_linear_kernel<float>(x, w, b.defined() ? b.data_ptr<float>() : nullptr, out); break;
    case at::kBFloat16:
      row_linear_kernel<at::BFloat16>(x, w, b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, out); break;
    case at::kHalf: row_linear_kernel<at::Half>(x, w, b.defined() ? b.data_ptr<at::Half>() : nullptr, out); break;
    default: TORCH_CHECK(false, "row_linear: float32, bfloat16 or float16 only, got ", input.scalar_type());
  }
  return out.view(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) { m.def("row_linear(Tensor input, Tensor weight, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("row_linear", &row_linear); }
