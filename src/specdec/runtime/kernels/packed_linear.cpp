// specdec::packed_linear: y = x w^T (+ bias) for a prefill pass (many rows) in bfloat16, on weights packed once.
//
//   pack_weight(w [N, K]) -> packed [ceil(N / 16), ceil(K / 2), 16, 2]: output n's weights in lane n % 16 of its
//   block, k in pairs (zeros pad N and K);
//   packed_linear(x [..., K], packed, bias [N] | None, N) -> [..., N].
//
// row_linear (row_linear.cpp) reduces each output over k inside one vector and sums the lanes at the end: right for
// the few rows of a decoding pass, where the weights stream past once. A prefill chunk is compute-bound instead, and
// there the lane sums and the scattered stores cost. Here each output lives in one lane of an accumulator: for each
// pair of k, a row's pair of inputs (broadcast) meets sixteen outputs' pairs of weights in one AVX512_BF16 dot
// product, accumulated in float32 in k order, then the bias is added and the sum rounded to bfloat16 once.
//
// Row-invariant by construction too: an output is the same sequence of dot products whatever the number of rows,
// the row's block or its neighbours. It is not row_linear's order, so the fast path uses it for whole passes only
// (compiled prefill passes: runtime/fuse_linears.py packs their constant weights), never for some rows of a pass.
// Built on first use with the other kernels (specdec.runtime.rowwise); needs AVX512_BF16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_weight: a bfloat16 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t Np = (N + 15) / 16 * 16, Kp = (K + 1) / 2 * 2;
  at::Tensor padded = at::zeros({Np, Kp}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({Np / 16, 16, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();  // [N/16, K/2, 16, 2]
}

#if defined(__AVX512BF16__)
constexpr int RB = 8;  // rows per block
constexpr int NB = 3;  // 16-output blocks per block: 24 accumulators
constexpr int64_t PREFETCH_PAIRS = 32;  // weights prefetched this many pairs of k ahead (2 KiB a block)

// Rows [0, R) of x (row stride ldx, K / 2 pairs) against output blocks [b0, b0 + nb) of the packed weights, into
// out [R, N] (row stride N) with bias.
template <int R, int C>
__attribute__((noinline)) void block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* packed, int64_t pairs,
                                     int64_t b0, const at::BFloat16* bias, at::BFloat16* out, int64_t N) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int b = 0; b < C; ++b) acc[r][b] = _mm512_setzero_ps();
  const int32_t* w = reinterpret_cast<const int32_t*>(packed) + b0 * pairs * 16;  // one int32 = a pair
  const int64_t whole = ldx / 2;  // pairs of two inputs; with K odd, a last pair of the last input and a zero
  auto step = [&](int64_t p, auto input_pair) __attribute__((always_inline)) {
    __m512bh wv[C];
#pragma GCC unroll 3
    for (int b = 0; b < C; ++b) {
      wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + p) * 16);
      _mm_prefetch(reinterpret_cast<const char*>(w + (b * pairs + p + PREFETCH_PAIRS) * 16), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(input_pair(x + r * ldx + 2 * p));
#pragma GCC unroll 3
      for (int b = 0; b < C; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xb, wv[b]);
    }
  };
  for (int64_t p = 0; p < whole; ++p)
    step(p, [](const at::BFloat16* xr) {
      int32_t pair;
      std::memcpy(&pair, xr, 4);
      return pair;
    });
  if (whole < pairs)
    step(whole, [](const at::BFloat16* xr) {
      uint16_t lo;
      std::memcpy(&lo, xr, 2);
      return static_cast<int32_t>(lo);
    });
#pragma GCC unroll 3
  for (int b = 0; b < C; ++b) {
    const int64_t n0 = (b0 + b) * 16;
    const int64_t cnt = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = cnt == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cnt) - 1u);
    __m512 bv = _mm512_setzero_ps();
    if (bias) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0);
      bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 v = bias ? _mm512_add_ps(acc[r][b], bv) : acc[r][b];
      _mm256_mask_storeu_epi16(out + r * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int R, int C>
void rows(int r, const at::BFloat16* x, int64_t K, const at::BFloat16* packed, int64_t pairs, int64_t b0,
          const at::BFloat16* bias, at::BFloat16* out, int64_t N) {
  if constexpr (R > 0) {
    if (r == R) {
      block<R, C>(x, K, packed, pairs, b0, bias, out, N);
      return;
    }
    rows<R - 1, C>(r, x, K, packed, pairs, b0, bias, out, N);
  }
}

template <int C>
void cols(int c, int r, const at::BFloat16* x, int64_t K, const at::BFloat16* packed, int64_t pairs, int64_t b0,
          const at::BFloat16* bias, at::BFloat16* out, int64_t N) {
  if constexpr (C > 0) {
    if (c == C) {
      rows<RB, C>(r, x, K, packed, pairs, b0, bias, out, N);
      return;
    }
    cols<C - 1>(c, r, x, K, packed, pairs, b0, bias, out, N);
  }
}
#endif

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && packed.dim() == 4,
              "packed_linear: bfloat16 input and a pack_weight result");
  const int64_t K = input.size(-1), pairs = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(pairs == (K + 1) / 2 && blocks * 16 >= N && blocks * 16 < N + 16, "packed_linear: shapes differ");
  const at::Tensor x = input.contiguous();
  const at::Tensor w = packed.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t M = K ? x.numel() / K : 0;
  c10::SmallVector<int64_t, 4> sizes(input.sizes().begin(), input.sizes().end());
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, input.options());
  const at::BFloat16* xp = x.const_data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.const_data_ptr<at::BFloat16>();
  const at::BFloat16* bp = b.defined() ? b.const_data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.mutable_data_ptr<at::BFloat16>();
  const int64_t groups = (blocks + NB - 1) / NB;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {  // a group of output blocks against every block of rows
      const int64_t b0 = g * NB;
      const int nb = static_cast<int>(std::min<int64_t>(NB, blocks - b0));
      for (int64_t m = 0; m < M; m += RB) {
        const int r = static_cast<int>(std::min<int64_t>(RB, M - m));
        cols<NB>(nb, r, xp + m * K, K, wp, pairs, b0, bp, op + m * N, N);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "packed_linear needs AVX512_BF16");
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor input, Tensor packed, Tensor? bias, int N) -> Tensor");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("packed_linear", &packed_linear);
}
