// specdec::argmax_finite: every row's argmax and whether every value is finite, in one read of the logits.
//
//   argmax_finite(logits [..., V] float32 | bfloat16 | float16) -> (best [...] int64, finite [] bool)
//
// best[r] is the first index of row r's maximum, torch.argmax's answer for finite rows (equal values, -0 and +0
// among them, go to the earlier index); where `finite` is false the indices are unspecified, and a pass that reads
// them raises instead (runtime/static_lm.py). It replaces torch.isfinite(logits).all() and logits.argmax(-1) in
// the fast path's graphs, two reductions inductor runs over the logits one after the other, at about a tenth of
// their time on a verification pass (8 rows x 8192 bfloat16 logits: ~47 us -> ~5 us in inductor's kernel
// profile, AMD EPYC Zen 5, one thread).
//
// Each lane keeps the first index of its own maximum over the columns it sees (a strictly greater value replaces
// it); the row's answer is the smallest index among the lanes holding the row's maximum.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t LANES = 16;
constexpr int ACC = 4;  // independent (maximum, index) accumulators: a block is ACC * LANES columns

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<T, at::Half>) return _mm512_cvtph_ps(x);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));  // bfloat16, exactly
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t LANES = 8;
constexpr int ACC = 4;  // independent (maximum, index) accumulators: a block is ACC * LANES columns

template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<T, at::Half>) return _mm256_cvtph_ps(x);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));  // bfloat16, exactly
  }
}
#endif

// Row x [V]: the first index of its maximum (ties to the earlier index); `bad` set if any value is not finite.
template <typename T>
int64_t row_argmax(const T* x, int64_t V, bool& bad) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t index = 0;
  int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const int64_t whole = V / (ACC * LANES) * (ACC * LANES);
  if (whole) {
    __m512 top[ACC];
    __m512i at[ACC];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int a = 0; a < ACC; ++a) {
      top[a] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      at[a] = _mm512_setzero_si512();
    }
    __mmask16 nonfinite = 0;
    for (; c < whole; c += ACC * LANES) {
      for (int a = 0; a < ACC; ++a) {
        const __m512 v = load16(x + c + a * LANES);
        // quiet NaN (0x01), +inf (0x08), -inf (0x10), signalling NaN (0x80)
        nonfinite |= _mm512_fpclass_ps_mask(v, 0x99);
        const __mmask16 up = _mm512_cmp_ps_mask(v, top[a], _CMP_GT_OQ);
        top[a] = _mm512_mask_blend_ps(up, top[a], v);
        at[a] = _mm512_mask_blend_epi32(up, at[a], _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(c + a * LANES))));
      }
    }
    bad = bad || nonfinite;
    __m512 m = top[0];
    for (int a = 1; a < ACC; ++a) m = _mm512_max_ps(m, top[a]);
    best = _mm512_reduce_max_ps(m);
    const __m512 bv = _mm512_set1_ps(best);
    __m512i first = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
    for (int a = 0; a < ACC; ++a)  // the smallest index among the lanes that hold the maximum
      first = _mm512_mask_min_epi32(first, _mm512_cmp_ps_mask(top[a], bv, _CMP_EQ_OQ), first, at[a]);
    index = _mm512_reduce_min_epi32(first);
    if (index == std::numeric_limits<int32_t>::max()) index = 0;  // no lane above -inf: every value -inf (or NaN)
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const int64_t whole = V / (ACC * LANES) * (ACC * LANES);
  if (whole) {
    __m256 top[ACC];
    __m256i at[ACC];
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i exponent = _mm256_set1_epi32(0x7F800000);
    for (int a = 0; a < ACC; ++a) {
      top[a] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      at[a] = _mm256_setzero_si256();
    }
    __m256i nonfinite = _mm256_setzero_si256();
    for (; c < whole; c += ACC * LANES) {
      for (int a = 0; a < ACC; ++a) {
        const __m256 v = load8(x + c + a * LANES);
        // all exponent bits set: an infinity or a NaN
        nonfinite = _mm256_or_si256(nonfinite, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), exponent),
                                                                  exponent));
        const __m256 up = _mm256_cmp_ps(v, top[a], _CMP_GT_OQ);
        top[a] = _mm256_blendv_ps(top[a], v, up);
        at[a] = _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(at[a]),
            _mm256_castsi256_ps(_mm256_add_epi32(lane, _mm256_set1_epi32(int32_t(c + a * LANES)))), up));
      }
    }
    bad = bad || !_mm256_testz_si256(nonfinite, nonfinite);
    __m256 m = top[0];
    for (int a = 1; a < ACC; ++a) m = _mm256_max_ps(m, top[a]);
    alignas(32) float lanes_max[LANES];
    _mm256_store_ps(lanes_max, m);
    best = lanes_max[0];
    for (int i = 1; i < LANES; ++i) best = std::max(best, lanes_max[i]);
    const __m256 bv = _mm256_set1_ps(best);
    __m256i first = _mm256_set1_epi32(std::numeric_limits<int32_t>::max());
    for (int a = 0; a < ACC; ++a)  // the smallest index among the lanes that hold the maximum
      first = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(first),
                                                   _mm256_castsi256_ps(_mm256_min_epi32(first, at[a])),
                                                   _mm256_cmp_ps(top[a], bv, _CMP_EQ_OQ)));
    alignas(32) int32_t lanes_first[LANES];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes_first), first);
    index = lanes_first[0];
    for (int i = 1; i < LANES; ++i) index = std::min<int64_t>(index, lanes_first[i]);
    if (index == std::numeric_limits<int32_t>::max()) index = 0;  // no lane above -inf: every value -inf (or NaN)
  }
#endif
  for (; c < V; ++c) {  // the columns past the last whole block (every column on the generic tier)
    const float v = as_float(x[c]);
    bad = bad || !std::isfinite(v);
    if (v > best) {
      best = v;
      index = c;
    }
  }
  return index;
}

template <typename T>
void argmax_finite_kernel(const T* x, int64_t rows, int64_t V, int64_t* best, bool& finite) {
  bool bad = false;
  for (int64_t r = 0; r < rows; ++r) best[r] = row_argmax(x + r * V, V, bad);
  finite = !bad;
}

std::tuple<at::Tensor, at::Tensor> argmax_finite(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() >= 1 && logits.size(-1) > 0, "argmax_finite: logits [..., V] with V > 0");
  TORCH_CHECK(logits.size(-1) <= std::numeric_limits<int32_t>::max(), "argmax_finite: V must fit in int32");
  const at::Tensor x = logits.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  at::Tensor best = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  at::Tensor finite = at::empty({}, x.options().dtype(at::kBool));
  bool ok = true;
  switch (x.scalar_type()) {
    case at::kFloat: argmax_finite_kernel(x.const_data_ptr<float>(), rows, V, best.mutable_data_ptr<int64_t>(), ok); break;
    case at::kBFloat16:
      argmax_finite_kernel(x.const_data_ptr<at::BFloat16>(), rows, V, best.mutable_data_ptr<int64_t>(), ok); break;
    case at::kHalf: argmax_finite_kernel(x.const_data_ptr<at::Half>(), rows, V, best.mutable_data_ptr<int64_t>(), ok); break;
    default: TORCH_CHECK(false, "argmax_finite: float32, bfloat16 or float16 logits, got ", x.scalar_type());
  }
  finite.fill_(ok);
  return {best, finite};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) { m.def("argmax_finite(Tensor logits) -> (Tensor, Tensor)"); }
TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("argmax_finite", &argmax_finite); }
