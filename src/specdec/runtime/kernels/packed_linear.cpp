// specdec::packed_linear: y = x w^T (+ bias) on weights packed once, for every pass of the compiled fast path.
//
//   pack_weight(w [N, K]) -> packed weights, panels of 64 outputs (zeros pad N, and K in bfloat16):
//     float32:  [ceil(N / 64), K, 64]: output n's weight for k at element n % 64 of the panel's row k;
//     bfloat16: [ceil(N / 64), ceil(K / 2), 64, 2]: the same with k in pairs (an AVX512_BF16 dot product's);
//   packed_linear(x [..., K], packed, bias [N] | None, N) -> [..., N].
//
// Each output lives in one lane of an accumulator: for each k (each pair of k in bfloat16), a row's input
// (broadcast) meets sixteen outputs' weights in one fused multiply-add (one AVX512_BF16 dot product), accumulated
// in float32 in k order; then the bias is added and the sum rounded to the output's dtype once.
//
// A panel is one sequential stream of weights (64 outputs x k in order), read once for every row of a pass of a
// few rows (decoding, verification) and prefetched ahead; a prefill's rows go in blocks against each panel while it
// stays in cache. row_linear (row_linear.cpp) instead reads a few weight rows at once and sums each output's lanes
// at the end: more streams and a reduction per output. On the default target's linears, one thread (AMD EPYC Zen 5):
// a one-row pass 1.47 -> 1.17 ms in float32 (its 55 MB of weights stream from memory), 0.68 -> 0.57 ms in bfloat16;
// a 127-row prefill 19.6 -> 14.5 ms and 9.7 -> 7.2 ms (docs/fastpath.md).
//
// Row-invariant by construction: an output is the same sequence of multiply-adds whatever the number of rows, the
// row's block or its neighbours. It is not row_linear's order, so every pass of a path must use it for a weight or
// none (runtime/fuse_linears.py decides by the weight alone). Built on first use with the other kernels
// (specdec.runtime.rowwise); needs AVX-512 (bfloat16: AVX512_BF16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PANEL = 64;  // outputs per panel: four vectors
template <typename T>
constexpr int64_t K_PER_STEP = sizeof(T) == 2 ? 2 : 1;  // values of k per multiply-add (bfloat16: a pair)

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_weight: a bfloat16 or float32 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t step = weight.scalar_type() == at::kBFloat16 ? 2 : 1;  // k per multiply-add
  const int64_t Np = (N + PANEL - 1) / PANEL * PANEL, Kp = (K + step - 1) / step * step;
  at::Tensor padded = at::zeros({Np, Kp}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  const at::Tensor panels = padded.view({Np / PANEL, PANEL, Kp / step, step}).permute({0, 2, 1, 3}).contiguous();
  return step == 1 ? panels.view({Np / PANEL, Kp, PANEL}) : panels;  // [N/64, K, 64] or [N/64, K/2, 64, 2]
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int V = PANEL / 16;  // vectors per panel
constexpr int RB_MAX = 8;  // a pass of up to this many rows (decoding, verification) is one block: <= 32 accumulators
constexpr int RB = 6;  // otherwise (a prefill) blocks of this many rows (24 accumulators)
constexpr int64_t PREFETCH_STEPS = 32;  // weights prefetched this many steps of k ahead (8 KiB)

// One step of k for float32 (one k) or bfloat16 (a pair): a row's broadcast input times a vector of weights.
template <typename T>
struct Step;

template <>
struct Step<float> {
  using Weights = __m512;
  static Weights load(const void* p) { return _mm512_loadu_ps(p); }
  template <bool LAST>
  static __m512 input(const float* row, int64_t s) { return _mm512_set1_ps(row[s]); }
  static __m512 fma(__m512 acc, __m512 x, Weights w) { return _mm512_fmadd_ps(x, w, acc); }
  static void store(float* out, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(out, mask, v); }
  static __m512 bias(const float* b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }
};

#if defined(__AVX512BF16__)
template <>
struct Step<at::BFloat16> {
  using Weights = __m512bh;
  static Weights load(const void* p) { return (__m512bh)_mm512_loadu_si512(p); }
  template <bool LAST>  // the pair (k, k + 1); the LAST of an odd K: (k, 0)
  static __m512bh input(const at::BFloat16* row, int64_t s) {
    int32_t pair = 0;
    std::memcpy(&pair, row + 2 * s, LAST ? 2 : 4);
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static __m512 fma(__m512 acc, __m512bh x, Weights w) { return _mm512_dpbf16_ps(acc, x, w); }
  static void store(at::BFloat16* out, __mmask16 mask, __m512 v) {
    _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
  static __m512 bias(const at::BFloat16* b, __mmask16 mask) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, b)), 16));
  }
};
#endif

// Rows [0, R) of x [R, K] against one panel (`steps` steps of 64 outputs from n0), into out [R, N] with bias.
template <typename T, int R>
__attribute__((noinline)) void panel(const T* x, int64_t K, const T* weights, int64_t steps, int64_t n0,
                                     const T* bias, T* out, int64_t N) {
  using S = Step<T>;
  constexpr int64_t STEP = PANEL * K_PER_STEP<T>;  // elements of weights per step
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  auto step = [&](int64_t s, auto last) __attribute__((always_inline)) {
    const T* w = weights + s * STEP;
    typename S::Weights wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      wv[v] = S::load(w + v * STEP / V);
      _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH_STEPS * STEP + v * STEP / V), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const auto xb = S::template input<decltype(last)::value>(x + r * K, s);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = S::fma(acc[r][v], xb, wv[v]);
    }
  };
  const int64_t whole = K / K_PER_STEP<T>;  // steps with all their inputs (bfloat16: a whole pair)
  for (int64_t s = 0; s < whole; ++s) step(s, std::false_type{});
  if (whole < steps) step(whole, std::true_type{});
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const int64_t n = n0 + v * 16;
    if (n >= N) break;
    const int64_t cnt = std::min<int64_t>(16, N - n);
    const __mmask16 mask = cnt == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cnt) - 1u);
    const __m512 bv = bias ? S::bias(bias + n, mask) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) S::store(out + r * N + n, mask, bias ? _mm512_add_ps(acc[r][v], bv) : acc[r][v]);
  }
}

template <typename T, int R>
void rows(int r, const T* x, int64_t K, const T* weights, int64_t steps, int64_t n0, const T* bias, T* out,
          int64_t N) {
  if constexpr (R > 0) {
    if (r == R) {
      panel<T, R>(x, K, weights, steps, n0, bias, out, N);
      return;
    }
    rows<T, R - 1>(r, x, K, weights, steps, n0, bias, out, N);
  }
}

template <typename T>
void packed_linear_kernel(const T* xp, const T* wp, const T* bp, T* op, int64_t M, int64_t K, int64_t N,
                          int64_t panels, int64_t steps) {
  const int64_t rb = M <= RB_MAX ? M : RB;
  const int64_t panel_elems = steps * PANEL * K_PER_STEP<T>;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)  // a panel against every block of rows (it stays in cache between them)
      for (int64_t m = 0; m < M; m += rb)
        rows<T, RB_MAX>(static_cast<int>(std::min(rb, M - m)), xp + m * K, K, wp + g * panel_elems, steps,
                        g * PANEL, bp, op + m * N, N);
  });
}
#endif

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "packed_linear: float32 or bfloat16 input");
  TORCH_CHECK(packed.scalar_type() == dtype && (!bias.has_value() || bias->scalar_type() == dtype),
              "packed_linear: input, packed weights and bias must share a dtype");
  const int64_t K = input.size(-1), step = dtype == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(packed.dim() == (step == 1 ? 3 : 4) && packed.size(1) == (K + step - 1) / step &&
                  packed.size(0) * PANEL >= N && packed.size(0) * PANEL < N + PANEL,
              "packed_linear: the packed weights (pack_weight's) do not fit the input and N");
  const at::Tensor x = input.contiguous();
  const at::Tensor w = packed.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t M = K ? x.numel() / K : 0;
  c10::SmallVector<int64_t, 4> sizes(input.sizes().begin(), input.sizes().end());
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, input.options());
#if defined(CPU_CAPABILITY_AVX512)
  if (dtype == at::kFloat) {
    packed_linear_kernel<float>(x.const_data_ptr<float>(), w.const_data_ptr<float>(),
                                b.defined() ? b.const_data_ptr<float>() : nullptr, out.mutable_data_ptr<float>(), M, K,
                                N, packed.size(0), packed.size(1));
    return out;
  }
#if defined(__AVX512BF16__)
  packed_linear_kernel<at::BFloat16>(x.const_data_ptr<at::BFloat16>(), w.const_data_ptr<at::BFloat16>(),
                                     b.defined() ? b.const_data_ptr<at::BFloat16>() : nullptr,
                                     out.mutable_data_ptr<at::BFloat16>(), M, K, N, packed.size(0), packed.size(1));
  return out;
#endif
#endif
  TORCH_CHECK(false, "packed_linear needs AVX-512 (and AVX512_BF16 for bfloat16)");
  return out;
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
