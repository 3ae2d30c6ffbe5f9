// specdec's instruction-set tiers: the few float32 vector operations the packed kernels need, once per tier.
//
// A kernel written against this header (packed_core.h) is the same loops on every CPU; the tier only sets how many
// float32 lanes a vector has and which instructions move them. The tier is the compiler's target
// (runtime/rowwise.py builds one library per tier with its flags):
//
//   avx512_amx   avx512_bf16's + AMX-TILE and AMX-BF16 (bfloat16 pairs by AMX's tile dot product, every pass)
//   avx512_bf16  AVX-512 F/BW/VL/DQ + AVX512_BF16 + AVX512_VNNI (16 lanes; bfloat16 pairs by the bf16 dot
//                product, W4A8's integer sums by the int8 one)
//   avx512       AVX-512 F/BW/VL/DQ (16 lanes)
//   avx2_vnni    AVX2 + FMA + F16C + AVX-VNNI (8 lanes; W4A8's integer sums by the int8 dot product)
//   avx2         AVX2 + FMA + F16C (8 lanes)
//   neon_dotprod aarch64 Advanced SIMD + the dot product extension (4 lanes; W4A8's integer sums by sdot)
//   neon         aarch64 Advanced SIMD (4 lanes)
//   generic      any C++17 compiler: 8 lanes in plain arrays, std::fma (slow; correct everywhere)
//
// Every operation here is exact or rounds once as IEEE float32 does, the same on every tier: a widening (bfloat16,
// int8, int4 to float32) is exact, a multiply, an add or a fused multiply-add rounds once, and a float32 to bfloat16
// narrowing rounds to nearest even (NaN to 0x7FC0, PyTorch's rule). So a kernel that performs the same sequence of
// operations on each output gives the same bits on every tier, whatever its lane count (tests: kernels/test/).
//
// The integer dot product (packed_core.h's W4A8) adds a few integer operations, each vector LANES outputs:
// `load_nibbles` splits 4 * LANES bytes (4 per output, two 4-bit weights each) into their low and high nibbles
// (VB); `dot_nibbles` adds to each output's partial sums (VS) its 4 low nibbles times the 4 int8 inputs of one word
// plus its 4 high nibbles times those of another; `widen_add` adds the partial sums into int32 (VI). Integer sums
// are exact, so they too are the same on every tier. The bounds: a nibble <= 15 and an input in [-127, 127] make
// one dot_nibbles at most 7620 in a 16-bit partial sum, so a VS holds DOTS_PER_WIDEN = 4 of them (30480 < 32768).
// Where the CPU has a dot product into int32 (AVX512_VNNI, AVX-VNNI: vpdpbusd; Arm's sdot), dot_nibbles is two of
// those instructions, the partial sums are int32 already, and DOTS_PER_WIDEN only sets how often they are added up.
//
// W8A8 (int8 weights on int8 inputs) has its own two: `load_bytes` reads 4 * LANES bytes (4 int8 weights per
// output, k in order) and `dot_bytes` adds to each output's int32 sums (VI) its 4 weights times the 4 int8 inputs of
// one word. Where the dot product multiplies unsigned bytes by signed ones (vpdpbusd), the weights go in offset to
// unsigned (q ^ 0x80 = q + 128) and the sums then hold DOT_BYTES_BIAS = 128 times the inputs' sum in excess, which
// the kernel subtracts (exact: at most 4 * 255 * 127 a step). Elsewhere |q| meets the inputs carrying q's sign
// (vpmaddubsw's 16-bit pairs then hold at most 2 * 127 * 127 < 32768; Arm's products are signed already), and
// DOT_BYTES_BIAS = 0. Either way the sum is exactly that of q * x.
//
// No ATen here: the header compiles on its own, so each tier's kernels can be built and tested from any machine
// (the aarch64 ones with a cross compiler, run under user-mode emulation).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

// Prefetches are always inlined: GCC 12 drops a call to a plain inline function whose only statement is a
// prefetch (it has no side effects, so the call is dead) when the call is inside an always_inline function, such as
// the packed kernel's steps; the prefetch never reached the code (packed_core.h's bfloat16 pairs had none). With it,
// the default target's linears in bfloat16 pairs, one row, one thread, Xeon with AMX: 1.32-1.33 -> 1.18-1.21 ms.
#define SPECDEC_PREFETCH __attribute__((always_inline)) inline

namespace specdec::simd {

// float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (c10::detail::round_to_nearest_even).
inline uint16_t bf16_bits(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr const char* kTier = "avx512_amx";  // avx512_bf16's, with bfloat16 pairs on AMX tiles (packed_core.h)
#elif defined(__AVX512BF16__)
constexpr const char* kTier = "avx512_bf16";
#else
constexpr const char* kTier = "avx512";
#endif
constexpr int LANES = 16;
using V = __m512;

inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline __mmask16 first(int n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u); }
inline V load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline V widen_bf16(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }
inline V load_bf16(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V load_bf16_n(const uint16_t* p, int n) { return widen_bf16(_mm256_maskz_loadu_epi16(first(n), p)); }
inline V load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// LANES bytes at p, each (low nibble, high nibble) = two int4 weights q stored as q + 8: both q as floats, exactly.
// A nibble indexes a table of the 16 values (vpermps reads an index's low 4 bits): one instruction a half where a
// mask, a subtraction and a conversion took three. (A one-row weight-only INT4 pass over the Qwen2.5-1.5B shape's
// linears, one Zen 4 core: 0.86-0.89x the time, 0.90x at 2 rows, 0.96-0.99x at 4-8; the same at 0.5B;
// benchmarks/kernel_ab.py --weight-only --bits 4, docs/kernels.md.)
inline void load_q4(const uint8_t* p, V& low, V& high) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const V values = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f,  // the nibble q + 8 -> q
                                  0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  low = _mm512_permutexvar_ps(b, values);
  high = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
}
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline void store_n(float* p, V v, int n) { _mm512_mask_storeu_ps(p, first(n), v); }
inline __m256i narrow_bf16(V v) {  // round to nearest even, NaN -> 0x7FC0
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                     _mm512_set1_epi32(1)))), 16);
  const __m512i q = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(q);
}
inline void store_bf16_n(uint16_t* p, V v, int n) { _mm256_mask_storeu_epi16(p, first(n), narrow_bf16(v)); }
SPECDEC_PREFETCH void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
SPECDEC_PREFETCH void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

using VI = __m512i;
using VB = __m512i;
using VS = __m512i;
inline VI zero_i() { return _mm512_setzero_si512(); }
inline VS zero_s() { return _mm512_setzero_si512(); }
inline void load_nibbles(const uint8_t* p, VB& low, VB& high) {
  const __m512i w = _mm512_loadu_si512(p), m = _mm512_set1_epi8(15);
  low = _mm512_and_si512(w, m);
  high = _mm512_and_si512(_mm512_srli_epi16(w, 4), m);
}
#if defined(__AVX512VNNI__)
constexpr int DOTS_PER_WIDEN = 64;  // int32 sums: <= 64 * 15240
inline VS dot_nibbles(VB low, VB high, int32_t xa, int32_t xb, VS acc) {
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, low, _mm512_set1_epi32(xa)), high, _mm512_set1_epi32(xb));
}
inline VI widen_add(VS s, VI acc) { return _mm512_add_epi32(acc, s); }
#else
constexpr int DOTS_PER_WIDEN = 4;  // 16-bit sums, two per output (see the header)
inline VS dot_nibbles(VB low, VB high, int32_t xa, int32_t xb, VS acc) {  // u8 x s8 pairs: <= 3810 per i16
  return _mm512_add_epi16(acc, _mm512_add_epi16(_mm512_maddubs_epi16(low, _mm512_set1_epi32(xa)),
                                                _mm512_maddubs_epi16(high, _mm512_set1_epi32(xb))));
}
inline VI widen_add(VS s, VI acc) { return _mm512_add_epi32(acc, _mm512_madd_epi16(s, _mm512_set1_epi16(1))); }
#endif
inline V to_float(VI a, int32_t minus) { return _mm512_cvtepi32_ps(_mm512_sub_epi32(a, _mm512_set1_epi32(minus))); }
inline VB load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
#if defined(__AVX512VNNI__)
constexpr int32_t DOT_BYTES_BIAS = 128;
inline VI dot_bytes(VB w, int32_t x, VI acc) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(-128)), _mm512_set1_epi32(x));
}
#else
constexpr int32_t DOT_BYTES_BIAS = 0;
inline VI dot_bytes(VB w, int32_t x, VI acc) {  // |q| x (x with q's sign), pairs <= 32258 per i16
  const __m512i xv = _mm512_set1_epi32(x);
  const __m512i signed_x = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(w), _mm512_setzero_si512(), xv);
  const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w), signed_x);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#if defined(__AVXVNNI__)
constexpr const char* kTier = "avx2_vnni";
#else
constexpr const char* kTier = "avx2";
#endif
constexpr int LANES = 8;
using V = __m256;

inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i first(int n) {  // lanes [0, n) all ones
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V load_n(const float* p, int n) { return n >= 8 ? load(p) : _mm256_maskload_ps(p, first(n)); }
inline V widen_bf16(__m128i b) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)); }
inline V load_bf16(const uint16_t* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline V load_bf16_n(const uint16_t* p, int n) {
  if (n >= 8) return load_bf16(p);
  alignas(16) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(tmp, p, 2 * n);
  return load_bf16(tmp);
}
inline V load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void load_q4(const uint8_t* p, V& low, V& high) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i eight = _mm256_set1_epi32(8);
  low = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), eight));
  high = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight));
}
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline void store_n(float* p, V v, int n) {
  if (n >= 8) _mm256_storeu_ps(p, v); else _mm256_maskstore_ps(p, first(n), v);
}
inline __m128i narrow_bf16(V v) {  // round to nearest even, NaN -> 0x7FC0
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 8 x 32-bit (< 0x10000) -> 8 x 16-bit in order
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store_bf16_n(uint16_t* p, V v, int n) {
  const __m128i b = narrow_bf16(v);
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  } else {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), b);
    std::memcpy(p, tmp, 2 * n);
  }
}
SPECDEC_PREFETCH void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
SPECDEC_PREFETCH void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

using VI = __m256i;
using VB = __m256i;
using VS = __m256i;
inline VI zero_i() { return _mm256_setzero_si256(); }
inline VS zero_s() { return _mm256_setzero_si256(); }
inline void load_nibbles(const uint8_t* p, VB& low, VB& high) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), m = _mm256_set1_epi8(15);
  low = _mm256_and_si256(w, m);
  high = _mm256_and_si256(_mm256_srli_epi16(w, 4), m);
}
#if defined(__AVXVNNI__)
constexpr int DOTS_PER_WIDEN = 64;  // int32 sums: <= 64 * 15240
inline VS dot_nibbles(VB low, VB high, int32_t xa, int32_t xb, VS acc) {
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, low, _mm256_set1_epi32(xa)), high,
                                 _mm256_set1_epi32(xb));
}
inline VI widen_add(VS s, VI acc) { return _mm256_add_epi32(acc, s); }
#else
constexpr int DOTS_PER_WIDEN = 4;  // 16-bit sums, two per output (see the header)
inline VS dot_nibbles(VB low, VB high, int32_t xa, int32_t xb, VS acc) {  // u8 x s8 pairs: <= 3810 per i16
  return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_set1_epi32(xa)),
                                                _mm256_maddubs_epi16(high, _mm256_set1_epi32(xb))));
}
inline VI widen_add(VS s, VI acc) { return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1))); }
#endif
inline V to_float(VI a, int32_t minus) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(a, _mm256_set1_epi32(minus))); }
inline VB load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#if defined(__AVXVNNI__)
constexpr int32_t DOT_BYTES_BIAS = 128;
inline VI dot_bytes(VB w, int32_t x, VI acc) {
  return _mm256_dpbusd_avx_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), _mm256_set1_epi32(x));
}
#else
constexpr int32_t DOT_BYTES_BIAS = 0;
inline VI dot_bytes(VB w, int32_t x, VI acc) {  // |q| x (x with q's sign), pairs <= 32258 per i16
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_set1_epi32(x), w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

#elif defined(__aarch64__) && defined(__ARM_NEON)
#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kTier = "neon_dotprod";
#else
constexpr const char* kTier = "neon";
#endif
constexpr int LANES = 4;
using V = float32x4_t;

inline V zero() { return vdupq_n_f32(0.f); }
inline V set1(float x) { return vdupq_n_f32(x); }
inline V load(const float* p) { return vld1q_f32(p); }
inline V load_n(const float* p, int n) {
  if (n >= 4) return load(p);
  float tmp[4] = {0.f, 0.f, 0.f, 0.f};
  std::memcpy(tmp, p, 4 * n);
  return vld1q_f32(tmp);
}
inline V load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline V load_bf16_n(const uint16_t* p, int n) {
  if (n >= 4) return load_bf16(p);
  uint16_t tmp[4] = {0, 0, 0, 0};
  std::memcpy(tmp, p, 2 * n);
  return load_bf16(tmp);
}
inline V load_i8(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(word)));
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}
inline void load_q4(const uint8_t* p, V& low, V& high) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  const int32x4_t b = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(word))))));
  const int32x4_t eight = vdupq_n_s32(8);
  low = vcvtq_f32_s32(vsubq_s32(vandq_s32(b, vdupq_n_s32(15)), eight));
  high = vcvtq_f32_s32(vsubq_s32(vshrq_n_s32(b, 4), eight));
}
inline V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
inline V add(V a, V b) { return vaddq_f32(a, b); }
inline V mul(V a, V b) { return vmulq_f32(a, b); }
inline void store_n(float* p, V v, int n) {
  if (n >= 4) {
    vst1q_f32(p, v);
  } else {
    float tmp[4];
    vst1q_f32(tmp, v);
    std::memcpy(p, tmp, 4 * n);
  }
}
inline void store_bf16_n(uint16_t* p, V v, int n) {
  float tmp[4];
  vst1q_f32(tmp, v);
  for (int i = 0; i < n && i < 4; ++i) p[i] = bf16_bits(tmp[i]);
}
SPECDEC_PREFETCH void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
SPECDEC_PREFETCH void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

using VI = int32x4_t;
using VB = int8x16_t;
inline VI zero_i() { return vdupq_n_s32(0); }
inline void load_nibbles(const uint8_t* p, VB& low, VB& high) {
  const uint8x16_t w = vld1q_u8(p);
  low = vreinterpretq_s8_u8(vandq_u8(w, vdupq_n_u8(15)));
  high = vreinterpretq_s8_u8(vshrq_n_u8(w, 4));
}
#if defined(__ARM_FEATURE_DOTPROD)
using VS = int32x4_t;  // int32 sums: sdot adds 4 s8 x s8 products straight into each
constexpr int DOTS_PER_WIDEN = 64;  // <= 64 * 15240
inline VS zero_s() { return vdupq_n_s32(0); }
inline VS dot_nibbles(VB low, VB high, int32_t xa, int32_t xb, VS acc) {
  return vdotq_s32(vdotq_s32(acc, low, vreinterpretq_s8_s32(vdupq_n_s32(xa))), high,
                   vreinterpretq_s8_s32(vdupq_n_s32(xb)));
}
inline VI widen_add(VS s, VI acc) { return vaddq_s32(acc, s); }
#else
using VS = int16x8_t;  // 16-bit sums, two per output
constexpr int DOTS_PER_WIDEN = 4;
inline VS zero_s() { return vdupq_n_s16(0); }
inline VS dot_nibbles(VB low, VB high, int32_t xa, int32_t xb, VS acc) {  // products <= 1905
  const int8x16_t a = vreinterpretq_s8_s32(vdupq_n_s32(xa)), b = vreinterpretq_s8_s32(vdupq_n_s32(xb));
  const int16x8_t s0 =
      vaddq_s16(vmull_s8(vget_low_s8(low), vget_low_s8(a)), vmull_s8(vget_low_s8(high), vget_low_s8(b)));
  const int16x8_t s1 = vaddq_s16(vmull_high_s8(low, a), vmull_high_s8(high, b));
  return vaddq_s16(acc, vpaddq_s16(s0, s1));  // output i at elements 2i, 2i + 1
}
inline VI widen_add(VS s, VI acc) { return vpadalq_s16(acc, s); }
#endif
inline V to_float(VI a, int32_t minus) { return vcvtq_f32_s32(vsubq_s32(a, vdupq_n_s32(minus))); }
inline VB load_bytes(const uint8_t* p) { return vreinterpretq_s8_u8(vld1q_u8(p)); }
constexpr int32_t DOT_BYTES_BIAS = 0;
#if defined(__ARM_FEATURE_DOTPROD)
inline VI dot_bytes(VB w, int32_t x, VI acc) { return vdotq_s32(acc, w, vreinterpretq_s8_s32(vdupq_n_s32(x))); }
#else
inline VI dot_bytes(VB w, int32_t x, VI acc) {  // products <= 16129, two summed per i16
  const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(x));
  const int16x8_t pairs = vpaddq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(xv)), vmull_high_s8(w, xv));
  return vpadalq_s16(acc, pairs);  // output i's two pairs at elements 2i, 2i + 1
}
#endif

#else
constexpr const char* kTier = "generic";
constexpr int LANES = 8;
struct V {
  float x[LANES];
};

inline V zero() { return V{}; }
inline V set1(float a) {
  V v;
  for (float& x : v.x) x = a;
  return v;
}
inline V load(const float* p) {
  V v;
  std::memcpy(v.x, p, sizeof v.x);
  return v;
}
inline V load_n(const float* p, int n) {
  V v{};
  std::memcpy(v.x, p, 4 * (n < LANES ? n : LANES));
  return v;
}
inline V load_bf16_n(const uint16_t* p, int n) {
  V v{};
  for (int i = 0; i < n && i < LANES; ++i) v.x[i] = bf16_float(p[i]);
  return v;
}
inline V load_bf16(const uint16_t* p) { return load_bf16_n(p, LANES); }
inline V load_i8(const int8_t* p) {
  V v;
  for (int i = 0; i < LANES; ++i) v.x[i] = static_cast<float>(p[i]);
  return v;
}
inline void load_q4(const uint8_t* p, V& low, V& high) {
  for (int i = 0; i < LANES; ++i) {
    low.x[i] = static_cast<float>((p[i] & 15) - 8);
    high.x[i] = static_cast<float>((p[i] >> 4) - 8);
  }
}
inline V fma(V a, V b, V c) {
  for (int i = 0; i < LANES; ++i) c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
  return c;
}
inline V add(V a, V b) {
  for (int i = 0; i < LANES; ++i) a.x[i] += b.x[i];
  return a;
}
inline V mul(V a, V b) {
  for (int i = 0; i < LANES; ++i) a.x[i] *= b.x[i];
  return a;
}
inline void store_n(float* p, V v, int n) { std::memcpy(p, v.x, 4 * (n < LANES ? n : LANES)); }
inline void store_bf16_n(uint16_t* p, V v, int n) {
  for (int i = 0; i < n && i < LANES; ++i) p[i] = bf16_bits(v.x[i]);
}
SPECDEC_PREFETCH void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
SPECDEC_PREFETCH void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

struct VI {
  int32_t x[LANES];
};
using VS = VI;  // (exact in int32 already)
constexpr int DOTS_PER_WIDEN = 4;
struct VB {
  uint8_t b[4 * LANES];
};
inline VI zero_i() { return VI{}; }
inline VS zero_s() { return VS{}; }
inline void load_nibbles(const uint8_t* p, VB& low, VB& high) {
  for (int i = 0; i < 4 * LANES; ++i) {
    low.b[i] = p[i] & 15;
    high.b[i] = p[i] >> 4;
  }
}
inline VS dot_nibbles(const VB& low, const VB& high, int32_t xa, int32_t xb, VS acc) {
  int8_t a[4], b[4];
  std::memcpy(a, &xa, 4);
  std::memcpy(b, &xb, 4);
  for (int i = 0; i < LANES; ++i)
    for (int j = 0; j < 4; ++j) acc.x[i] += low.b[4 * i + j] * a[j] + high.b[4 * i + j] * b[j];
  return acc;
}
inline VI widen_add(const VS& s, VI acc) {
  for (int i = 0; i < LANES; ++i) acc.x[i] += s.x[i];
  return acc;
}
inline V to_float(const VI& a, int32_t minus) {
  V v;
  for (int i = 0; i < LANES; ++i) v.x[i] = static_cast<float>(a.x[i] - minus);
  return v;
}
inline VB load_bytes(const uint8_t* p) {
  VB v;
  std::memcpy(v.b, p, sizeof v.b);
  return v;
}
constexpr int32_t DOT_BYTES_BIAS = 0;
inline VI dot_bytes(const VB& w, int32_t x, VI acc) {
  int8_t a[4];
  std::memcpy(a, &x, 4);
  for (int i = 0; i < LANES; ++i)
    for (int j = 0; j < 4; ++j) acc.x[i] += static_cast<int8_t>(w.b[4 * i + j]) * a[j];
  return acc;
}
#endif

}  // namespace specdec::simd
