// The packed kernel's tests on one instruction-set tier, without PyTorch: built and run by tests/test_kernel_tiers.py
// once per tier this machine can build (the aarch64 tier with a cross compiler, run under qemu-aarch64).
//
// For every weight format, float32 and bfloat16 outputs, with and without bias, odd sizes (N and K below, at and
// past a panel and a group) and passes of 1 to 33 rows, each output must equal, bit for bit, the scalar reference:
// its weights made float32 as packed_core.h says, acc = fma(x[k], w[k], acc) over k in order, plus the bias, rounded
// once (INT8, INT4: each group's sum over q from zero, then one fma with its scale; W4A8, W8A8: the inputs quantized
// per row and group as written out below, integer sums, then one fma per group).
// That one check is the kernel's contract on every tier: the same bits whatever the tier, the number of rows,
// their blocking and the split of the panels among threads (also checked: every pass split into two ranges of
// panels, and each with the streaming blocking, Args::stream, both ways of DotStreaming). Exit status 0 and a line
// "ok <tier> <cases>" when every case passes.
#include <cmath>
#include <cstdint>
#include <cstdio>
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cstring>
#include <random>
#include <vector>

#include "../packed_core.h"

using namespace specdec;
using packed::Fmt;

namespace {

std::mt19937 rng(1234);

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// AVX512_BF16's dot product on one lane: the odd product added, then the even one, each rounded to nearest even,
// inputs and results flushed to zero when denormal. The products are exact wherever they are normal, as in every
// case here; below that the Xeon model 207 rounds a product with its sum, once (docs/kernels.md), not as this does.
float flush(float f) { return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.f, f) : f; }
float dot_pair(float acc, uint16_t x0, uint16_t x1, uint16_t w0, uint16_t w1) {
  const float a = flush(acc);
  const float p1 = flush(simd::bf16_float(x1)) * flush(simd::bf16_float(w1));
  const float s = flush(a + p1);
  const float p0 = flush(simd::bf16_float(x0)) * flush(simd::bf16_float(w0));
  return flush(s + p0);
}

struct Case {
  Fmt fmt;
  int64_t M, N, K, G;
  bool bias, out_bf16;
  bool extreme = false;  // W4A8 / W8A8 at their integer sums' bounds: every weight at an end, every input +-max
  bool bf16_rows = false;  // INT8 / INT4 in a bfloat16 pass on AVX512_BF16 (weight_only_pairs): the rows as xb
};

int failures = 0;

void check(const Case& c) {
  const int64_t M = c.M, N = c.N, K = c.K, G = c.G;
  // inputs: bfloat16-representable where the format reads bfloat16 inputs
  std::vector<float> x(M * K);
  std::vector<uint16_t> xb(M * K);
  for (int64_t i = 0; i < M * K; ++i) {
    float v = uniform(-2.f, 2.f);
    if (i % 97 == 5) v = 1e-39f;  // a denormal
    if (packed::int8_inputs(c.fmt) && i % 89 == 7) v = 0.f;  // and (with K = 1) a group of zeros
    if (c.extreme) v = (i / K) % 2 ? -1.5f : 1.5f;
    xb[i] = simd::bf16_bits(v);
    x[i] = c.fmt == Fmt::F32 ? v : simd::bf16_float(xb[i]);
  }
  // weights, made float32 as the format defines (w), and packed
  std::vector<float> w(N * K), bias(N);
  for (float& b : bias) b = uniform(-1.f, 1.f);
  const int bits_q = c.fmt == Fmt::INT8 || c.fmt == Fmt::W8A8 ? 8 : 4;
  const bool dot = packed::int8_inputs(c.fmt);
  const int64_t groups = G > 0 ? (K + G - 1) / G : 0;
  std::vector<int8_t> q(N * K);
  std::vector<float> scales(N * groups);
  std::vector<uint16_t> wb(N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const float v = uniform(-1.f, 1.f);
      wb[n * K + k] = simd::bf16_bits(v);
      w[n * K + k] = c.fmt == Fmt::F32 ? v : simd::bf16_float(wb[n * K + k]);
    }
  if (c.fmt == Fmt::INT8 || c.fmt == Fmt::INT4 || dot) {
    const int lo = bits_q == 8 ? -127 : -8, hi = bits_q == 8 ? 127 : 7;
    for (float& s : scales) s = uniform(1e-3f, 2e-2f);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        q[n * K + k] = static_cast<int8_t>(std::uniform_int_distribution<int>(lo, hi)(rng));
        if (c.extreme) q[n * K + k] = static_cast<int8_t>(n % 2 ? lo : hi);
        w[n * K + k] = static_cast<float>(q[n * K + k]) * scales[n * groups + k / G];
      }
  }
  const int64_t stride = packed::panel_bytes(c.fmt, K, G), P = packed::panels(N);
  std::vector<uint8_t> buf(P * stride + 64);
  switch (c.fmt) {
    case Fmt::F32: packed::pack_plain(w.data(), N, K, reinterpret_cast<float*>(buf.data())); break;
    case Fmt::BF16: packed::pack_plain(wb.data(), N, K, reinterpret_cast<uint16_t*>(buf.data())); break;
    case Fmt::BF16_PAIRS: packed::pack_pairs(wb.data(), N, K, reinterpret_cast<uint16_t*>(buf.data())); break;
    default: packed::pack_quantized(q.data(), scales.data(), N, K, G, bits_q, buf.data(), dot); break;
  }
  // W4A8's and W8A8's inputs: each row's groups rounded to int8 at 127 / max|x|, and the kernel's own quantization
  std::vector<int> xq_ref(M * K);
  std::vector<float> xs_ref(M * groups);
  for (int64_t m = 0; dot && m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0.f;
      for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) amax = std::max(amax, std::fabs(x[m * K + k]));
      for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k)
        xq_ref[m * K + k] = amax > 0.f ? static_cast<int>(std::nearbyint(x[m * K + k] * 127.f / amax)) : 0;
      xs_ref[m * groups + g] = amax / 127.f;
    }
  std::vector<int8_t> xq(M * groups * G + 1);
  std::vector<float> xs(M * groups + 1);
  std::vector<int32_t> xsum(M * groups + 1);
  if (dot) packed::quantize_inputs(x.data(), M, K, G, xq.data(), xs.data(), xsum.data());
  // BF16_PAIRS on AMX: the rows in whole tiles (for the whole pass, and for each row alone)
  const bool amx = packed::AMX && c.fmt == Fmt::BF16_PAIRS;
  const int64_t Kp = packed::pair_rows(K) * 2;
  std::vector<uint16_t> xa(amx ? packed::tile_rows_padded(M) * Kp : 0), xa1(amx ? Kp : 0);
  if (amx) packed::pad_tile_rows(xb.data(), M, K, xa.data());
  // the reference
  std::vector<uint32_t> want(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      if (dot) {
        for (int64_t g = 0; g < groups; ++g) {
          int32_t isum = 0;
          for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k) isum += q[n * K + k] * xq_ref[m * K + k];
          acc = std::fma(static_cast<float>(isum), scales[n * groups + g] * xs_ref[m * groups + g], acc);
        }
      } else if (amx) {  // AMX's own arithmetic: the row alone, a pass of one row (checked against float32 below)
        packed::pad_tile_rows(xb.data() + m * K, 1, K, xa1.data());
        std::vector<float> row(N);
        packed::Args one{c.fmt, nullptr, xb.data() + m * K, 1, K, N, buf.data(), stride, G, nullptr, row.data(), false};
        one.xa = xa1.data();
        packed::run(one, nullptr, n / packed::PANEL, n / packed::PANEL + 1);  // the panel holding output n
        acc = row[n];
        double ref = 0, scale = 0;  // float32's value, and the bound of any order's rounding
        for (int64_t k = 0; k < K; ++k) {
          ref += double(x[m * K + k]) * w[n * K + k];
          scale += std::fabs(double(x[m * K + k]) * w[n * K + k]);
        }
        if (!(std::fabs(acc - ref) <= scale * 1e-5 + 1e-30)) {
          if (failures++ < 10)
            std::printf("FAIL %s AMX M=%lld N=%lld K=%lld at [%lld, %lld]: %.9g, float32 %.9g\n", simd::kTier,
                        (long long)M, (long long)N, (long long)K, (long long)m, (long long)n, acc, ref);
        }
      } else if (c.fmt == Fmt::BF16_PAIRS) {
        for (int64_t k = 0; k < K; k += 2) {
          const bool pair = k + 1 < K;
          acc = dot_pair(acc, xb[m * K + k], pair ? xb[m * K + k + 1] : 0, wb[n * K + k], pair ? wb[n * K + k + 1] : 0);
        }
      } else if (c.bf16_rows) {  // weight_only_pairs: per group the dot product's pairs of k from zero, then the scale
        for (int64_t g = 0; g < groups; ++g) {
          float sum = 0.f;
          for (int64_t k = g * G; k < std::min(K, (g + 1) * G); k += 2) {
            const bool pair = k + 1 < K;
            sum = dot_pair(sum, xb[m * K + k], pair ? xb[m * K + k + 1] : 0, simd::bf16_bits(float(q[n * K + k])),
                           pair ? simd::bf16_bits(float(q[n * K + k + 1])) : 0);
          }
          acc = std::fma(sum, scales[n * groups + g], acc);
        }
      } else if (c.fmt == Fmt::INT8 || c.fmt == Fmt::INT4) {
        for (int64_t g = 0; g < groups; ++g) {
          float sum = 0.f;
          for (int64_t k = g * G; k < std::min(K, (g + 1) * G); ++k)
            sum = std::fma(x[m * K + k], static_cast<float>(q[n * K + k]), sum);
          acc = std::fma(sum, scales[n * groups + g], acc);
        }
      } else {
        for (int64_t k = 0; k < K; ++k) acc = std::fma(x[m * K + k], w[n * K + k], acc);
      }
      const float y = c.bias ? acc + bias[n] : acc;
      want[m * N + n] = c.out_bf16 ? simd::bf16_bits(y) : bits(y);
    }
  // the kernel: the whole pass, then the same pass as two ranges of panels
  std::vector<float> xt(M * K);
  packed::interleave(x.data(), M, K, xt.data());
  // split 2 and 3: the same with the streaming blocking, the weights taken as huge; 4 and 5: streaming as the other
  // DotStreaming streams (the software prefetch and the one row as two turned the other way)
  for (int split = 0; split < 6; ++split) {
    std::vector<float> of(M * N, -7.f);
    std::vector<uint16_t> ob(M * N, 0xBEEF);
    const uint16_t* rows_b = c.fmt == Fmt::BF16_PAIRS || c.bf16_rows ? xb.data() : nullptr;  // a bfloat16 pass's
    packed::Args a{c.fmt, x.data(), rows_b, M, K, N, buf.data(), stride, G, c.bias ? bias.data() : nullptr,
                   c.out_bf16 ? static_cast<void*>(ob.data()) : static_cast<void*>(of.data()), c.out_bf16,
                   split >= 2, xq.data(), xs.data(), xsum.data()};
    if (amx) a.xa = xa.data();
    if (split >= 4) a.dot = packed::DotStreaming{!a.dot.prefetch, !a.dot.twin_row};
    a.huge = split >= 2;  // (so the float and weight-only blocks run both ways too: DotStreaming)
    if (split % 2 == 0) {
      packed::run(a, xt.data(), 0, P);
    } else {
      const int64_t cut = P / 2;
      packed::run(a, xt.data(), cut, P);
      packed::run(a, xt.data(), 0, cut);
    }
    for (int64_t i = 0; i < M * N; ++i) {
      const uint32_t got = c.out_bf16 ? ob[i] : bits(of[i]);
      if (got != want[i]) {
        if (failures++ < 10)
          std::printf("FAIL %s fmt=%d M=%lld N=%lld K=%lld G=%lld bias=%d bf16=%d split=%d at [%lld, %lld]: %08x != %08x\n",
                      simd::kTier, static_cast<int>(c.fmt), (long long)M, (long long)N, (long long)K, (long long)G,
                      c.bias, c.out_bf16, split, (long long)(i / N), (long long)(i % N), got, want[i]);
        break;
      }
    }
  }
}

}  // namespace

int main() {
#if defined(__AMX_TILE__)
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    std::printf("the kernel does not let this process use AMX tiles\n");
    return 1;
  }
#endif
  std::vector<Fmt> formats = {Fmt::F32, Fmt::BF16, Fmt::INT8, Fmt::INT4, Fmt::W4A8, Fmt::W8A8};
  if (packed::has_pairs_format()) formats.push_back(Fmt::BF16_PAIRS);
  const int64_t sizes[][2] = {{1, 1}, {3, 7}, {packed::PANEL, 64}, {packed::PANEL + 1, 33}, {2 * packed::PANEL + 5, 130},
                              {67, 255}, {130, 97}};
  int cases = 0;
  for (Fmt f : formats)
    for (const auto& nk : sizes)
      for (int64_t M = 1; M <= 33; ++M) {
        const bool q = f == Fmt::INT8 || f == Fmt::INT4;
        const int64_t G = f == Fmt::W4A8 ? (M % 3 == 0 ? 32 : M % 3 == 1 ? 64 : 8)
                          : f == Fmt::W8A8 ? (M % 3 == 0 ? 32 : M % 3 == 1 ? 64 : 4)
                          : q ? (M % 3 == 0 ? 32 : M % 3 == 1 ? 64 : 2) : 0;
        check({f, M, nk[0], nk[1], G, M % 2 == 0, M % 4 >= 2});
        ++cases;
        if (q && packed::has_pairs_format()) {  // and in a bfloat16 pass
          check({f, M, nk[0], nk[1], G, M % 2 == 0, M % 4 >= 2, false, true});
          ++cases;
        }
      }
  for (int64_t M = 1; M <= 13; ++M) {  // the integer sums' bounds (the 16-bit partial sums most of all)
    check({Fmt::W4A8, M, 2 * packed::PANEL + 3, 200, M % 2 ? 64 : 128, false, false, true});
    check({Fmt::W8A8, M, 2 * packed::PANEL + 3, 200, M % 2 ? 64 : 128, false, false, true});
    cases += 2;
  }
  if (failures) {
    std::printf("%d failures on %s\n", failures, simd::kTier);
    return 1;
  }
  std::printf("ok %s %d\n", simd::kTier, cases);
  return 0;
}
