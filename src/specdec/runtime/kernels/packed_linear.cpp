// specdec::packed_linear: y = x w^T (+ bias) on weights packed once: every pass of float32, a prefill's in bfloat16.
//
//   pack_weight(w [N, K]) -> packed weights (zeros pad N and K):
//     bfloat16: [ceil(N / 16), ceil(K / 2), 16, 2]: output n's weights in lane n % 16 of its block, k in pairs;
//     float32:  [ceil(N / 64), K, 64]: a panel of 64 outputs, n's weights in element n % 64 of each k's row;
//   packed_linear(x [..., K], packed, bias [N] | None, N) -> [..., N].
//
// row_linear (row_linear.cpp) reduces each output over k inside one vector and sums the lanes at the end. Here each
// output lives in one lane of an accumulator instead: for each k (each pair of k in bfloat16), a row's input
// (broadcast) meets sixteen outputs' weights in one fused multiply-add (one AVX512_BF16 dot product), accumulated
// in float32 in k order; then the bias is added and the sum rounded to the output's dtype once.
//  - bfloat16, a prefill chunk: compute-bound, and there row_linear's lane sums and scattered stores cost;
//  - float32, every pass: its weights do not fit in the last-level cache (the default target's are 55 MB), so a
//    decoding pass streams them from memory. A float32 panel is one sequential stream (64 outputs x k in order),
//    where row_linear reads a few weight rows at once and sums their lanes; a one-row pass of the default target's
//    linears reads ~1.4x faster (benchmarks/op_classes.py, docs/fastpath.md).
//
// Row-invariant by construction too: an output is the same sequence of multiply-adds whatever the number of rows,
// the row's block or its neighbours. It is not row_linear's order, so the fast path uses it for whole passes only
// (runtime/fuse_linears.py packs a compiled pass's constant weights: every float32 pass, a bfloat16 prefill), never
// for some rows of a pass. Built on first use with the other kernels (specdec.runtime.rowwise); needs AVX-512
// (bfloat16: AVX512_BF16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#if defined(CPU_CAPABILITY_AVX512) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 64;  // float32: outputs per panel (four vectors)

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_weight: a bfloat16 or float32 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  if (weight.scalar_type() == at::kFloat) {
    const int64_t Np = (N + PANEL - 1) / PANEL * PANEL;
    at::Tensor padded = at::zeros({Np, K}, weight.options());
    padded.narrow(0, 0, N).copy_(weight);
    return padded.view({Np / PANEL, PANEL, K}).transpose(1, 2).contiguous();  // [N/64, K, 64]
  }
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

#if defined(CPU_CAPABILITY_AVX512)
constexpr int V = PANEL / 16;  // float32: vectors per panel
constexpr int RB32 = 8;  // float32: rows per block (up to 32 accumulators: a verification pass in one)
constexpr int64_t PREFETCH_K = 32;  // float32: weights prefetched this many k ahead (8 KiB)

// Rows [0, R) of x (row stride ldx) against one float32 panel (K x 64 outputs from n0), into out [R, N] with bias.
template <int R>
__attribute__((noinline)) void panel_f32(const float* x, int64_t ldx, const float* panel, int64_t K, int64_t n0,
                                         const float* bias, float* out, int64_t N) {
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * PANEL;
    __m512 wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      wv[v] = _mm512_loadu_ps(w + v * 16);
      _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_K * PANEL + v * 16), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const int64_t n = n0 + v * 16;
    if (n >= N) break;
    const int64_t cnt = std::min<int64_t>(16, N - n);
    const __mmask16 mask = cnt == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cnt) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * N + n, mask, bias ? _mm512_add_ps(acc[r][v], bv) : acc[r][v]);
  }
}

template <int R>
void rows_f32(int r, const float* x, int64_t K, const float* panel, int64_t n0, const float* bias, float* out,
              int64_t N) {
  if constexpr (R > 0) {
    if (r == R) {
      panel_f32<R>(x, K, panel, K, n0, bias, out, N);
      return;
    }
    rows_f32<R - 1>(r, x, K, panel, n0, bias, out, N);
  }
}

at::Tensor packed_linear_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor out, int64_t M,
                             int64_t K, int64_t N) {
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  const int64_t panels = w.size(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)  // a panel against every block of rows (it stays in cache between them)
      for (int64_t m = 0; m < M; m += RB32)
        rows_f32<RB32>(static_cast<int>(std::min<int64_t>(RB32, M - m)), xp + m * K, K, wp + g * K * PANEL,
                       g * PANEL, bp, op + m * N, N);
  });
  return out;
}
#endif

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK(packed.scalar_type() == dtype && (!bias.has_value() || bias->scalar_type() == dtype),
              "packed_linear: input, packed weights and bias must share a dtype");
  const int64_t K = input.size(-1);
  const at::Tensor x = input.contiguous();
  const at::Tensor w = packed.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t M = K ? x.numel() / K : 0;
  c10::SmallVector<int64_t, 4> sizes(input.sizes().begin(), input.sizes().end());
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, input.options());
  if (dtype == at::kFloat) {
#if defined(CPU_CAPABILITY_AVX512)
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(0) * PANEL >= N &&
                    packed.size(0) * PANEL < N + PANEL, "packed_linear: shapes differ");
    return packed_linear_f32(x, w, b, out, M, K, N);
#else
    TORCH_CHECK(false, "packed_linear needs AVX-512 for float32");
#endif
  }
#if defined(__AVX512BF16__)
  TORCH_CHECK(dtype == at::kBFloat16 && packed.dim() == 4, "packed_linear: bfloat16 or float32 input and a pack_weight result");
  const int64_t pairs = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(pairs == (K + 1) / 2 && blocks * 16 >= N && blocks * 16 < N + 16, "packed_linear: shapes differ");
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
  TORCH_CHECK(false, "packed_linear needs AVX512_BF16 for bfloat16");
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
