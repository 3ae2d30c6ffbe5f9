// kernel_ab.py's harness: two variants of packed_core.h (kernel_a.h, kernel_b.h: namespaces specdec::kernel_a and
// specdec::kernel_b) over the same packed weights, passes alternated in one process. argv: rows, repeats, format
// (W8A8, W4A8, BF16_PAIRS on bfloat16 inputs, or on float32 inputs the weight-only INT8, INT4 and the float formats
// F32, BF16; INT4_BF16 / INT8_BF16: INT4 / INT8 in a bfloat16 pass, given the rows both ways, as bfloat16 and
// interleaved float32, each variant reading what it reads), then the linears as N K pairs. Prints one line per side:
// median ms and GB/s; then B / A.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "simd.h"
#include "kernel_a.h"
#include "kernel_b.h"

namespace {

struct Linear {
  int64_t N, K, stride;
  std::vector<uint8_t> packed;
  bool stream;  // as the op takes it (packed_core.h's `streams`)
  bool huge;    // the same (`is_huge`)
};

template <typename NS_Args, typename Fmt, typename Quantize, typename Interleave, typename Run>
double pass(std::vector<Linear>& ls, int64_t M, int64_t G, Fmt fmt, std::vector<float>& x, std::vector<float>& xt,
            const std::vector<uint16_t>& xb, std::vector<int8_t>& xq, std::vector<float>& xs,
            std::vector<int32_t>& xsum, std::vector<float>& out, Quantize quantize, Interleave interleave, Run run,
            int64_t panel) {
  const auto t = std::chrono::steady_clock::now();
  for (Linear& l : ls) {
    if (xq.size()) quantize(x.data(), M, l.K, G, xq.data(), xs.data(), xsum.data());
    if (xt.size()) interleave(x.data(), M, l.K, xt.data());  // the float formats' inputs, as the op gives them
    NS_Args a{fmt, x.data(), xb.empty() ? nullptr : xb.data(), M, l.K, l.N, l.packed.data(), l.stride, G, nullptr,
              out.data(), false, l.stream,
              xq.data(), xs.data(), xsum.data()};
    a.huge = l.huge;
    run(a, xt.size() ? xt.data() : nullptr, 0, (l.N + panel - 1) / panel);
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace specdec;
  const int64_t M = std::atoll(argv[1]), G = 64;
  const int repeats = std::atoi(argv[2]);
  const std::string format = argv[3];
  using F = kernel_a::Fmt;
  const std::pair<const char*, F> formats[] = {
      {"BF16_PAIRS", F::BF16_PAIRS}, {"INT8", F::INT8}, {"INT4", F::INT4}, {"W4A8", F::W4A8}, {"W8A8", F::W8A8},
      {"F32", F::F32},       {"BF16", F::BF16},  {"INT4_BF16", F::INT4}, {"INT8_BF16", F::INT8}};
  const auto* found = std::find_if(std::begin(formats), std::end(formats),
                                   [&](const auto& entry) { return format == entry.first; });
  if (found == std::end(formats)) {
    std::fprintf(stderr,
                 "kernel_ab: format %s is not one of BF16_PAIRS, INT8, INT4, INT4_BF16, INT8_BF16, W4A8, W8A8, F32, "
                 "BF16\n",
                 argv[3]);
    return 2;
  }
  const F fa = found->second;
  const auto fb = static_cast<kernel_b::Fmt>(fa);  // the same enum in both variants' namespaces
  const bool pairs = fa == kernel_a::Fmt::BF16_PAIRS, dot = kernel_a::int8_inputs(fa);
  const bool bf16_rows = format == "INT4_BF16" || format == "INT8_BF16";
  const int bits = fa == kernel_a::Fmt::INT4 || fa == kernel_a::Fmt::W4A8 ? 4 : 8;
  std::mt19937 rng(0);
  std::vector<Linear> ls;
  double bytes = 0;
  int64_t widest = 0;
  auto bf16 = [](float v) {  // v's top 16 bits (a bfloat16 of v, truncated)
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  for (int i = 4; i + 1 < argc; i += 2) {
    const int64_t N = std::atoll(argv[i]), K = std::atoll(argv[i + 1]), groups = (K + G - 1) / G;
    std::vector<int8_t> q(N * K);
    const int levels = bits == 8 ? 255 : 16, low = bits == 8 ? -127 : -8;  // q in [-127, 127] or [-8, 7]
    for (int8_t& v : q) v = static_cast<int8_t>(static_cast<int>(rng() % levels) + low);
    std::vector<float> scales(N * groups, 0.01f);
    Linear l{N, K, kernel_a::panel_bytes(fa, K, G), {}, false, false};
    l.packed.resize(kernel_a::panels(N) * l.stride + 64);
    l.stream = kernel_a::streams(fa, kernel_a::panels(N) * l.stride);
    l.huge = kernel_a::is_huge(kernel_a::panels(N) * l.stride);
    if (fa == kernel_a::Fmt::F32) {  // weights in (-0.05, 0.05)
      std::vector<float> w(N * K);
      for (size_t j = 0; j < w.size(); ++j) w[j] = static_cast<float>(q[j]) * 4e-4f;
      kernel_a::pack_plain(w.data(), N, K, reinterpret_cast<float*>(l.packed.data()));
    } else if (fa == kernel_a::Fmt::BF16 || pairs) {  // the same bfloat16 weights, in either layout
      std::vector<uint16_t> w(N * K);
      for (size_t j = 0; j < w.size(); ++j) w[j] = bf16(static_cast<float>(q[j]) * 4e-4f);
      auto* out = reinterpret_cast<uint16_t*>(l.packed.data());
      if (pairs) kernel_a::pack_pairs(w.data(), N, K, out);  // one layout for both variants
      else kernel_a::pack_plain(w.data(), N, K, out);
    } else {
      kernel_a::pack_quantized(q.data(), scales.data(), N, K, G, bits, l.packed.data(), dot);
    }
    bytes += static_cast<double>(l.packed.size());
    widest = std::max({widest, N, K});
    ls.push_back(std::move(l));
  }
  std::vector<float> x(M * widest), out(M * widest);
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.f;
  std::vector<uint16_t> xb;
  if (pairs || bf16_rows)
    for (float& v : x) {
      xb.push_back(bf16(v));
      if (bf16_rows) {  // the float32 rows are the bfloat16 ones, widened
        const uint32_t u = uint32_t(xb.back()) << 16;
        std::memcpy(&v, &u, 4);
      }
    }
  std::vector<int8_t> xq(dot ? M * (widest + G) : 0);  // the integer formats' quantized inputs (none: float32's)
  std::vector<float> xt(dot || pairs ? 0 : M * widest);  // float32 inputs, interleaved (INT8, INT4, F32, BF16)
  std::vector<float> xs(M * (widest / G + 2));
  std::vector<int32_t> xsum(M * (widest / G + 2));
  auto run_a = [&] {
    return pass<kernel_a::Args>(ls, M, G, fa, x, xt, xb, xq, xs, xsum, out, kernel_a::quantize_inputs,
                                kernel_a::interleave, kernel_a::run, kernel_a::PANEL);
  };
  auto run_b = [&] {
    return pass<kernel_b::Args>(ls, M, G, fb, x, xt, xb, xq, xs, xsum, out, kernel_b::quantize_inputs,
                                kernel_b::interleave, kernel_b::run, kernel_b::PANEL);
  };
  run_a();
  run_b();
  std::vector<double> ta, tb;
  for (int r = 0; r < repeats; ++r) {
    ta.push_back(run_a());
    tb.push_back(run_b());
  }
  const double a = median(ta), b = median(tb);
  std::printf("A %.2f ms %.1f GB/s\nB %.2f ms %.1f GB/s\nB/A %.3f\n", a, bytes / a / 1e6, b, bytes / b / 1e6, b / a);
}
