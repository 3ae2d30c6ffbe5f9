// specdec::packed_linear: y = x w^T (+ bias) on weights packed once, for every instruction-set tier and weight format.
//
//   pack_weight(w [N, K] float32 | bfloat16, pairs=True) -> packed weights (float32: [panels, K, PANEL]; bfloat16:
//       [panels, K, PANEL], or with pairs on AVX512_BF16 [panels, ceil(K / 2), PANEL, 2] for its dot product,
//       which serves bfloat16 passes only);
//   pack_quantized(q [N, K] int8, scales [N, ceil(K / G)] float32, bits 8 | 4, G, dot=False) -> packed weights
//       (int8 for 8 bits, uint8 for 4: [panels, groups, bytes of a group: its scales, then its weights]; with dot,
//       for the integer dot product: 4 bits and G a multiple of 8, W4A8: uint8 [panels, groups, 1 + G / 8,
//       4 * PANEL], the scales' row then one row per 8 values of k; 8 bits and G a multiple of 4, W8A8: int8
//       [panels, groups, 1 + G / 4, 4 * PANEL], the scales' row then one row per 4 values of k);
//   packed_linear(x [..., K] float32 | bfloat16, packed, bias [N] | None, N) -> [..., N] in x's dtype;
//   panel_width() -> PANEL (outputs per panel on this build's tier).
//
// The loops and the arithmetic are packed_core.h's (one header for every tier, see simd.h): each output is one
// sequence of fused multiply-adds over k in order, in float32 (int8 and int4: per group over q, then one with the
// group's scale), whatever the number of rows, their block, the panels beside it or the thread: row-invariant, and
// the same bits on every tier (AVX512_BF16's bfloat16 pairs, and int8 and int4 in a bfloat16 pass there, excepted:
// the instruction's own order). The format is the packed tensor's dtype (and, for bfloat16, its rank); the weight
// format and the input dtype are independent: int8 and int4 weights serve float32 and bfloat16 passes alike, and
// bfloat16 weights serve float32 passes (bfloat16 storage with float32 activations). W4A8 and W8A8 quantize each
// row of the input to int8 per group (packed_core.h's quantize_inputs) and compute in integers.
//
// Packing is per weight, never per pass, so every pass of a path gives a row the same bits
// (runtime/fuse_linears.py packs a compiled pass's constant weights; runtime/weights.py packs int8 and int4).
// Measured on the default target's linears, one thread (AMD EPYC Zen 5, AVX512_BF16): a one-row pass 1.47 -> 1.17 ms
// in float32 against row_linear.cpp, 0.68 -> 0.57 ms in bfloat16 (docs/fastpath.md).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "packed_core.h"

namespace {

using specdec::packed::Fmt;
namespace pk = specdec::packed;

// AMX's tiles need the Linux kernel's leave per process (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), asked once.
// runtime/cpuinfo.py asks the same before choosing the tier, so this only fails where that was bypassed.
void require_tiles() {
#if defined(__AMX_TILE__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  TORCH_CHECK(granted, "packed_linear: the kernels were built for AMX (tier avx512_amx) but Linux does not let this "
              "process use AMX tiles; set SPECDEC_KERNEL_TIER=avx512_bf16");
#endif
}

at::Tensor pack_weight(const at::Tensor& weight, bool pairs) {
  require_tiles();
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_weight: a bfloat16 or float32 [N, K] weight");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = pk::panels(N);
  if (w.scalar_type() == at::kFloat) {
    at::Tensor out = at::empty({P, K, pk::PANEL}, w.options());
    pk::pack_plain(w.const_data_ptr<float>(), N, K, out.mutable_data_ptr<float>());
    return out;
  }
  const auto* bits = reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>());
  if (pairs && pk::has_pairs_format()) {
    at::Tensor out = at::empty({P, pk::pair_rows(K), pk::PANEL, 2}, w.options());
    pk::pack_pairs(bits, N, K, reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>()));
    return out;
  }
  at::Tensor out = at::empty({P, K, pk::PANEL}, w.options());
  pk::pack_plain(bits, N, K, reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>()));
  return out;
}

// pack_weight's result without its values (a Meta tensor): the layout of this build's tier, for fake tensors (a
// compiled graph's passes see the packed copies they insert before freezing computes them).
at::Tensor pack_weight_meta(const at::Tensor& weight, bool pairs) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_weight: a bfloat16 or float32 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1), P = pk::panels(N);
  if (weight.scalar_type() == at::kBFloat16 && pairs && pk::has_pairs_format()) {
    return at::empty({P, pk::pair_rows(K), pk::PANEL, 2}, weight.options());
  }
  return at::empty({P, K, pk::PANEL}, weight.options());
}

at::Tensor pack_quantized(const at::Tensor& q, const at::Tensor& scales, int64_t bits, int64_t group, bool dot) {
  TORCH_CHECK(bits == 8 || bits == 4, "pack_quantized: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(!dot || (group <= 4096 && group % (bits == 4 ? 8 : 4) == 0),
              "pack_quantized: the dot product formats take groups of at most 4096 inputs, a multiple of 8 for 4 "
              "bits and of 4 for 8 bits");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_quantized: q must be an int8 [N, K] tensor");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(group > 0 && (bits == 8 || group % 2 == 0), "pack_quantized: the group must be positive (even for int4)");
  const int64_t groups = (K + group - 1) / group;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == groups && scales.scalar_type() == at::kFloat,
              "pack_quantized: scales must be float32 [N, ceil(K / group)]");
  const Fmt f = dot ? (bits == 8 ? Fmt::W8A8 : Fmt::W4A8) : bits == 8 ? Fmt::INT8 : Fmt::INT4;
  const int64_t stride = pk::panel_bytes(f, K, group);
  const auto dtype = q.options().dtype(bits == 8 ? at::kChar : at::kByte);
  at::Tensor out = dot ? at::empty({pk::panels(N), groups, 1 + group / (bits == 8 ? 4 : 8), 4 * pk::PANEL}, dtype)
                       : at::empty({pk::panels(N), groups, groups ? stride / groups : 0}, dtype);
  const at::Tensor qc = q.contiguous(), sc = scales.contiguous();
  pk::pack_quantized(qc.const_data_ptr<int8_t>(), sc.const_data_ptr<float>(), N, K, group, static_cast<int>(bits),
                     static_cast<uint8_t*>(out.data_ptr()), dot);
  return out;
}

// The format of a packed tensor, and its group (integer formats) for inputs of K.
Fmt format_of(const at::Tensor& packed, int64_t K, int64_t& G) {
  G = 0;
  switch (packed.scalar_type()) {
    case at::kFloat:
      TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == pk::PANEL,
                  "packed_linear: float32 weights packed for another input size or tier");
      return Fmt::F32;
    case at::kBFloat16:
      if (packed.dim() == 4) {
        TORCH_CHECK(pk::has_pairs_format() && packed.size(1) == pk::pair_rows(K) && packed.size(2) == pk::PANEL,
                    "packed_linear: bfloat16 pairs packed for another input size or tier");
        return Fmt::BF16_PAIRS;
      }
      TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == pk::PANEL,
                  "packed_linear: bfloat16 weights packed for another input size or tier");
      return Fmt::BF16;
    case at::kByte:
      if (packed.dim() == 4) {
        G = 8 * (packed.size(2) - 1);
        TORCH_CHECK(packed.size(3) == 4 * pk::PANEL && G > 0 && (packed.size(1) - 1) * G < K && K <= packed.size(1) * G,
                    "packed_linear: W4A8 weights packed for another input size or tier");
        return Fmt::W4A8;
      }
      [[fallthrough]];
    case at::kChar: {
      const bool int8 = packed.scalar_type() == at::kChar;
      if (int8 && packed.dim() == 4) {
        G = 4 * (packed.size(2) - 1);
        TORCH_CHECK(packed.size(3) == 4 * pk::PANEL && G > 0 && (packed.size(1) - 1) * G < K && K <= packed.size(1) * G,
                    "packed_linear: W8A8 weights packed for another input size or tier");
        return Fmt::W8A8;
      }
      TORCH_CHECK(packed.dim() == 3 && packed.size(1) > 0, "packed_linear: quantized weights must be pack_quantized's");
      const int64_t body = packed.size(2) - 4 * pk::PANEL;
      G = int8 ? body / pk::PANEL : 2 * body / pk::PANEL;
      TORCH_CHECK(body > 0 && body % pk::PANEL == 0 && (packed.size(1) - 1) * G < K && K <= packed.size(1) * G,
                  "packed_linear: quantized weights packed for another input size or tier");
      return int8 ? Fmt::INT8 : Fmt::INT4;
    }
    default: TORCH_CHECK(false, "packed_linear: no packed format of dtype ", packed.scalar_type());
  }
  return Fmt::F32;
}

// bfloat16 -> float32, exactly (into a reused buffer)
const float* widen(const at::BFloat16* p, int64_t n, std::vector<float>& buf) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  const auto* b = reinterpret_cast<const uint16_t*>(p);
  for (int64_t i = 0; i < n; ++i) buf[i] = specdec::simd::bf16_float(b[i]);
  return buf.data();
}

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t N) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "packed_linear: float32 or bfloat16 input");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->numel() == N),
              "packed_linear: bias must be [N] in the input's dtype");
  const int64_t K = input.size(-1);
  int64_t G = 0;
  const Fmt fmt = format_of(packed, K, G);
  TORCH_CHECK(packed.size(0) == pk::panels(N), "packed_linear: the packed weights do not have N outputs");
  TORCH_CHECK(fmt != Fmt::BF16_PAIRS || dtype == at::kBFloat16, "packed_linear: bfloat16 pairs need bfloat16 input");
  const at::Tensor x = input.is_contiguous() ? input : input.contiguous();
  const at::Tensor w = packed.is_contiguous() ? packed : packed.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  c10::SmallVector<int64_t, 4> sizes(input.sizes().begin(), input.sizes().end());
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, input.options());
  thread_local std::vector<float> xbuf, xtbuf, bbuf, xsbuf;
  thread_local std::vector<int8_t> xqbuf;
  thread_local std::vector<uint16_t> xabuf;
  thread_local std::vector<int32_t> xsumbuf;
  const bool bf16 = dtype == at::kBFloat16;
  const bool bf16_rows = fmt == Fmt::BF16_PAIRS || pk::weight_only_pairs(fmt, bf16);  // the kernel reads xb alone
  const float* xf = bf16 ? (bf16_rows ? nullptr : widen(x.const_data_ptr<at::BFloat16>(), M * K, xbuf))
                         : x.const_data_ptr<float>();
  const float* bf = nullptr;
  if (bias.has_value()) {
    const at::Tensor b = bias->contiguous();
    bf = bf16 ? widen(b.const_data_ptr<at::BFloat16>(), N, bbuf) : b.const_data_ptr<float>();
  }
  pk::Args args{fmt, xf, bf16 ? reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>()) : nullptr,
                M, K, N, static_cast<const uint8_t*>(w.const_data_ptr()), w.numel() * w.element_size() / w.size(0),
                G, bf, out.mutable_data_ptr(), bf16, pk::streams(fmt, w.numel() * w.element_size())};
  args.huge = pk::is_huge(w.numel() * w.element_size());
  if (M == 0 || N == 0) return out;
  const float* xt = nullptr;  // the rows interleaved for the kernel's blocks
  if (pk::int8_inputs(fmt)) {  // the rows quantized instead
    const int64_t groups = (K + G - 1) / G;
    if (static_cast<int64_t>(xqbuf.size()) < M * groups * G) xqbuf.resize(M * groups * G);
    if (static_cast<int64_t>(xsbuf.size()) < M * groups) xsbuf.resize(M * groups), xsumbuf.resize(M * groups);
    pk::quantize_inputs(xf, M, K, G, xqbuf.data(), xsbuf.data(), xsumbuf.data());
    args.xq = xqbuf.data(), args.xs = xsbuf.data(), args.xsum = xsumbuf.data();
  } else if (fmt == Fmt::BF16_PAIRS && pk::AMX) {  // the rows in whole tiles
    require_tiles();
    const int64_t n = pk::tile_rows_padded(M) * pk::pair_rows(K) * 2;
    if (static_cast<int64_t>(xabuf.size()) < n) xabuf.resize(n);
    pk::pad_tile_rows(args.xb, M, K, xabuf.data());
    args.xa = xabuf.data();
  } else if (!bf16_rows) {
    if (static_cast<int64_t>(xtbuf.size()) < M * K) xtbuf.resize(M * K);
    pk::interleave(xf, M, K, xtbuf.data());
    xt = xtbuf.data();
  }
  const int64_t grain = pk::panel_grain(M, fmt, args.stream), P = w.size(0), units = (P + grain - 1) / grain;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    pk::run(args, xt, begin * grain, std::min(P, end * grain));
  });
  return out;
}

int64_t panel_width() { return pk::PANEL; }

// How many threads the kernels' at::parallel_for splits work among now: torch's count where the kernels were built
// with OpenMP (runtime/rowwise.py's openmp_flags), 1 where they were not.
int64_t parallel_threads() {
  std::atomic<int64_t> parts{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { parts.fetch_add(1); });
  return parts.load();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("pack_weight(Tensor weight, bool pairs=True) -> Tensor");
  m.def("pack_quantized(Tensor q, Tensor scales, int bits, int group, bool dot=False) -> Tensor");
  m.def("packed_linear(Tensor input, Tensor packed, Tensor? bias, int N) -> Tensor");
  m.def("panel_width() -> int");
  m.def("parallel_threads() -> int");
}
TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("pack_quantized", &pack_quantized);
  m.impl("packed_linear", &packed_linear);
}
TORCH_LIBRARY_IMPL(specdec, Meta, m) {
  m.impl("pack_weight", &pack_weight_meta);
}
TORCH_LIBRARY_IMPL(specdec, CompositeExplicitAutograd, m) {
  m.impl("panel_width", &panel_width);
  m.impl("parallel_threads", &parallel_threads);
}
