// The packed linear kernel, y = x w^T (+ bias), on weights packed once: one set of loops for every instruction-set
// tier (simd.h) and every weight format. packed_linear.cpp binds it to PyTorch; kernels/test/ tests it on its own.
//
// Weights are packed in panels of PANEL outputs (PV vectors of the tier's lanes: 64 outputs on AVX-512, one
// vector elsewhere), each panel one sequential stream of bytes, in one of seven formats:
//
//   F32         float    [K][PANEL]                      output n's weight for k at element n % PANEL of row k
//   BF16        bfloat16 [K][PANEL]                      (widened to float32 where read)
//   BF16_PAIRS  bfloat16 [pair_rows(K)][PANEL][2]        k in pairs, for AVX512_BF16's dot product and AMX's
//               (pair_rows: ceil(K / 2); on AMX whole tiles of 16 pairs, ceil(K / 32) * 16)
//   INT8        per group of G values of k: float scale[PANEL], then int8 q[G][PANEL]        w = q * scale
//   INT4        per group of G (even): float scale[PANEL], then per pair of k (k even) PANEL bytes, each q + 8 (q in
//               [-8, 7]) in a nibble: byte n holds output n's q[k] (low nibble) and q[k + 1] (high); on AVX-512,
//               per half panel of 32 outputs 32 bytes, byte 2n + e holding q[k + e] of output n (low nibble) and
//               of output n + 16 (high), for one widening to 16 bits to give 16 outputs' pairs (`int4_slot`)
//                                                                                             w = q * scale
//   W4A8        int4 weights for an integer dot product with int8 inputs: per group of G (a multiple of 8) a
//               float scale[PANEL], then per 8 values of k, 4 bytes per output: byte j of output n holds
//               q[k + j] + 8 in its low nibble and q[k + 4 + j] + 8 in its high one
//   W8A8        int8 weights for an integer dot product with int8 inputs: per group of G (a multiple of 4) a
//               float scale[PANEL], then per 4 values of k, 4 bytes per output: byte j of output n holds q[k + j]
//               (q in [-127, 127])
//
// (zeros pad N to whole panels, and the last group of k.) The arithmetic of an output of F32 or BF16 weights, w
// made float32 exactly:
//
//   acc = 0;  for k = 0 .. K-1:  acc = fma(x[k], w[k], acc);   y = acc + bias   (rounded once to y's dtype)
//
// in k order, in one lane of one accumulator (BF16_PAIRS: the dot product instruction's pairs instead). INT8 and
// INT4 sum each group's products with the weights' integers q (exact as float32) from zero, then take the group's
// scale once:
//
//   acc = 0;  per group g, in order:  sum = 0;  for k in g, in order:  sum = fma(x[k], float(q[k]), sum);
//                                     acc = fma(sum, scale[g], acc);   y = acc + bias
//
// (a multiply by the scale per weight, which their float32 value q * scale would take, cost a vector instruction in
// every four or six of a one-row pass: docs/kernels.md). That is the same sequence of roundings whatever the tier, the
// number of rows in the pass, their blocking, the panels beside it or the thread that computes it: the kernel is
// row-invariant, and its bits are the same on every tier. BF16_PAIRS, the AVX512_BF16 tier's bfloat16, and INT8 and
// INT4 in a bfloat16 pass on a tier with AVX512_BF16 (`weight_only_pairs`: each group's sum by the same dot product)
// are the exceptions: the instruction's own order and flushing, still row-invariant. On the AVX512_AMX tier, AMX's
// tile dot product computes BF16_PAIRS for every pass, one row or many (`amx_pairs`): each output is one tile
// accumulator's TDPBF16PS over k in chunks of 32, in order, whatever the rows beside it. That is AMX's own arithmetic
// (it sums a chunk its own way, not as AVX512_BF16's pairs do), row-invariant.
//
// W4A8 computes in integers, as llama.cpp's Q4_0 and OpenVINO's INT4 do on a CPU: each row's inputs are quantized
// per group of G (`quantize_inputs`: xs = max|x| / 127, xq = x * 127 / max|x| rounded to nearest even), so the
// row's quantization depends on that row alone; then per group g, in order,
//
//   isum = sum over the group of (q + 8) * xq  -  8 * sum of xq   (exact, int32)
//   acc  = fma(float(isum), scale[g] * xs[g], acc);    y = acc + bias
//
// Row-invariant and the same bits on every tier (integer sums are exact), but not float32's value on the
// dequantized weight: the inputs are rounded to 8 bits too. W8A8 is the same with int8 weights (isum = sum of
// q * xq, exact in int32: at most G * 127 * 127), as llama.cpp's Q8_0 and OpenVINO's INT8 compute on a CPU.
//
// Loops: a pass of up to RMAX rows (decoding, verification) is one block of rows, which reads every panel once, P
// panels side by side (each with its own accumulators, so that one row still has P * PV independent sums in flight); a
// longer pass (a prefill) goes through each group of P_PF panels in blocks of R_PF rows while the group stays in cache.
// Each stream is prefetched into L2 one block ahead: the same place in the panel P panels on, which the next block
// reads (on an AMD AVX-512 core, a block of a few rows over a weight of 2 MB or more leaves it to the hardware:
// DotStreaming). (A stream prefetched 1 KB ahead within its panel left each block's other panels to start cold: with
// short panels, K = 896 as in a 0.5B model, a one-row pass streamed 20-35% slower than over the same bytes in K =
// 3072's longer panels, in every format; prefetched a block ahead the two are level. One core, AVX2 Zen 3, interleaved
// runs of each build.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"

namespace specdec::packed {

using simd::LANES;
using simd::V;

enum class Fmt : int { F32 = 0, BF16 = 1, BF16_PAIRS = 2, INT8 = 3, INT4 = 4, W4A8 = 5, W8A8 = 6 };

// The formats computed by the integer dot product on inputs quantized to int8 (Args::xq).
constexpr bool int8_inputs(Fmt f) { return f == Fmt::W4A8 || f == Fmt::W8A8; }

// The tier's blocking: vectors per panel (PV), the accumulator vectors a block may hold (ACC), the most panels a
// block reads side by side (MAXP; MAXP_STREAM for a float or INT8 weight streamed from memory: `Args::stream`),
// the widest pass that is one block of rows (RMAX), the widest block of float inputs that reads more than one panel
// (RSIDE; INT4's RSIDE_INT4), the fewest rows of a block that loads each step's weight vectors before its rows'
// inputs (W_FIRST), and a prefill's blocks.
#if defined(__AVX512F__)
constexpr int PV = 4, ACC = 32, MAXP = 1, MAXP_STREAM = 1, RMAX = 8, RSIDE = RMAX, RSIDE_INT4 = RSIDE,
              W_FIRST = RMAX + 1, R_PF = 6, P_PF = 1;
#elif defined(__AVX2__)
// MAXP_STREAM 4: a one-row bfloat16 pass over weights streamed from memory ran 7-18% slower on 8 panels side by
// side than on 4; in cache 8 are 7-10% faster. INT8 streamed takes 4 too: over the Qwen2.5-1.5B / 0.5B shapes'
// linears a one-row pass took 0.91x / 0.96x the time on 4 as on 8 (17.5 against 16.0 GB/s at 1.5B), and 1.54x on 2
// (one Zen 2 core, kernel_ab.py, alternated; docs/kernels.md). INT4, bound by its arithmetic, is level on 4 and 8
// (0.998x) and keeps 8, as in cache. A prefill as 12 x 1 blocks: 2.4x 6 x 2's.
// W_FIRST 4, RSIDE 6: a block of 4 to 6 rows loads each step's weight vectors into registers first (W_FIRST,
// Block::step) and then broadcasts each row's input once against all of them, so it holds P weights beside its sums
// rather than R inputs, and reads as many panels as its 12 sums allow: 3 at 4 rows, 2 at 5 and 6 (panels_for).
// Loaded as used instead, a vector against every row, a block keeps every row's input for the next panel's vector:
// at 6 rows on two panels that outgrew AVX2's 16 vector registers and spilled (over the Qwen2.5-1.5B shape's linears
// an INT8 pass took 444 ms against one panel's 339), and on one panel a 6-row block is bound by its loads (a weight
// vector and 6 inputs a step for 6 multiply-adds). Weights first, 6 rows over that shape's linears took 0.78x the
// time of one panel's in F32 (18 GB/s, the core's read), 0.71x in BF16 and 0.85x in INT8; 4 rows on 3 panels 0.91x /
// 0.92x / 0.93x the time of 2 (on 3 loaded as used BF16 took 1.54x); 5 rows level either way. 1 to 3 rows are faster
// loaded as used (BF16 at 3 rows on 4 panels: 1.41x the time weights first, whose 4 vectors and 12 sums spill), and
// 7 rows or more read one panel either way (8 rows as a block of 6 and one of 2 over each pair of panels:
// 1.08-1.15x). INT4's step is two k, twice the weight vectors, and it keeps the old blocking: on two panels its 6 rows
// took 1.20-1.22x one panel's time either way (RSIDE_INT4 5). One Zen 2 core, benchmarks/kernel_ab.py, both variants
// in one process, alternated (docs/kernels.md).
constexpr int PV = 1, ACC = 12, MAXP = 8, MAXP_STREAM = 4, RMAX = 12, RSIDE = 6, RSIDE_INT4 = 5, W_FIRST = 4,
              R_PF = 12, P_PF = 1;
#elif defined(__aarch64__) && defined(__ARM_NEON)
constexpr int PV = 1, ACC = 24, MAXP = 8, MAXP_STREAM = 8, RMAX = 12, RSIDE = RMAX, RSIDE_INT4 = RSIDE,
              W_FIRST = RMAX + 1, R_PF = 6, P_PF = 4;
#else
constexpr int PV = 1, ACC = 8, MAXP = 8, MAXP_STREAM = 8, RMAX = 8, RSIDE = RMAX, RSIDE_INT4 = RSIDE,
              W_FIRST = RMAX + 1, R_PF = 4, P_PF = 2;
#endif
constexpr int PANEL = PV * LANES;
// The integer formats' widest block of rows (W8A8's, W4A8's) and the accumulator vectors such a block may hold: a
// wider pass goes through a few panels at a time in blocks of at most that many rows, as even as they can be. A block
// holds each row's int32 sums and float32 accumulators (W4A8 on a CPU without VNNI: 16-bit sums too) for every vector
// it computes. On AVX-512 (32 registers) a block of 8 rows over a 64-output panel held 64 and spilled at every step:
// blocks of 4 rows (W8A8) and 2 (W4A8) made an 8-row pass over the Qwen2.5-0.5B shape's linears 0.72x / 0.66x the
// time and a 128-row pass 0.59x / 0.57x, one to five rows level within 6% (one Zen 4 core, benchmarks/kernel_ab.py:
// both variants in one process, alternated; docs/kernels.md). On AVX2, whose non-VNNI dot product is bound by its
// arithmetic, 8 rows was as fast as any. (In cache, one thread, AVX2 Zen 3: 8 rows as one block 1.0-1.1 ms where
// two blocks of 4 took 1.0-1.3 and 8 rows widening every step 1.3-1.7.)
//
// How W4A8, W8A8 and BF16_PAIRS (and the other formats' narrow blocks: below) stream a weight from memory is a
// property of the core, not of the tier
// (`DotStreaming`, in Args::dot; the bits are the same either way, as a prefetch or a dropped copy computes nothing
// a row reads):
//
// prefetch: whether their streams are prefetched a block ahead (the header comment's loops). On AVX-512 a block
// reads one panel (MAXP 1), so the next block's is the next in memory, which the hardware's own prefetch streams:
// on a Zen 4 core, without the software prefetch a pass over the Qwen2.5-0.5B / 1.5B shapes' linears took 0.91x /
// 0.92x the time at one row in W8A8 (20.5-20.9 GB/s, of 23.7 a plain read reaches), 0.81x / 0.72x in W4A8,
// 0.69-0.71x at 2-4 rows and 0.80-0.86x at 8. On a core of the Xeon model 207 (no AMX) it is the other way round:
// with the prefetch, W8A8's pass over the 0.5B shape's linears took 0.85x / 0.81x / 0.78x / 0.84x the time at 1 / 2
// / 4 / 8 rows, W4A8's 0.77x / 0.74x / 0.78x / 0.83x (benchmarks/kernel_ab.py; docs/kernels.md). AVX2 reads up to 8
// panels side by side, which the header comment's measurements needed prefetched.
//
// twin_row: a one-row W8A8 pass over a weight that streams from memory (Args::stream) is computed as a block of two
// rows, the row and a copy of it, the copy's outputs dropped. On a Zen 4 core a block of one row streamed slower
// than a block of two: over the Qwen2.5-0.5B shape's linears, one row as two took 0.90-0.94x the time of one row
// alone (0.85x over its MLP weights, 0.82x over its head), 0.88-0.97x at 1.5B, with the same bits (the copy is the
// row, and each row's sums are its own). In cache the copy cost 14-16%, so only a streamed weight takes it. Why the
// wider block streams faster there is not known. On the Xeon model 207, with the prefetch, one row alone took 0.93x
// the time of one row as two; on AVX2 the one-row block reads up to 8 panels side by side and two rows were slower
// (1.06-1.20x).
//
// BF16_PAIRS (AVX512_BF16's dot product) takes the same prefetch choice: on a Zen 4 core, without its prefetch 8 KB
// ahead, a pass over the Qwen2.5-0.5B shape's linears took 0.96-0.99x the time at one row, 0.87x at 4 to 8 rows
// (a verification pass's widths), 1.00x at 16 (benchmarks/kernel_ab.py --bits 16; docs/kernels.md). It takes the
// twin row too: on a Zen 4 core a one-row pass over the Qwen2.5-1.5B shape's linears took 0.94x the time with its
// streamed weights' blocks run as two rows (28.3 against 26.6 GB/s), 0.985x over the 0.5B shape's, whose streamed
// weights are fewer (the same A/B, 15 and 21 alternated rounds).
//
// The float and weight-only formats (Block: F32, BF16, INT8, INT4) take the prefetch choice in their blocks of up to
// R_UNPREFETCHED rows; wider blocks always prefetch. On a Zen 4 core, without the software prefetch, a pass over the
// Qwen2.5-0.5B / 1.5B shapes' linears took 0.92x / 0.95x the time at one row in F32, 0.63x / 0.88x in INT8 and
// 0.80x / 0.86x in INT4 (the 1.5B shape's one-row INT8 pass 20.3 GB/s against 17.9), 0.70-1.00x at 2-4 rows
// (benchmarks/kernel_ab.py, 11 alternated rounds; docs/kernels.md). Without it at 5-8 rows too, the default target's
// F32 linears, mostly in cache, took 1.06-1.17x the time there (within the noise at 1-4 rows), the 1.5B shape's
// 1.00-1.02x. And only over a weight of HUGE_BYTES or more (Args::huge), which runtime/heap.py maps on huge pages:
// without the prefetch over every weight, the default pair's compiled plain decoding in float32 (its target's layers
// of 0.6 and 1.6 MB, on 4 KB pages; its head 12.6 MB) ran at 0.89x the speed, with the prefetch kept over weights
// under 4 MB at 1.02x (5 rounds of separate processes alternated, medians of 8 prompts each); the Qwen2.5-0.5B
// shape's 2.2 MB INT4 weights lost their gain with that 4 MB bound (1.13-1.20x at 1-4 rows), hence 2 MB.
//
// So on AVX-512 an AMD core streams as the Zen 4 measured best, any other as the Xeon did; elsewhere with the
// prefetch, and one row alone (the twin block is built on AVX-512 only: TWIN_BUILT; a block without the prefetch,
// only for the dot formats: R_UNPREFETCHED 0). (Zen 5 and the Xeons with AMX are not measured for this: they take
// their vendor's.)
#if defined(__AVX512F__)
constexpr int R_DOT8 = 4, R_DOT4 = 2, ACC_DOT = 24, R_UNPREFETCHED = 4;
constexpr bool TWIN_BUILT = true;  // the block of one row as two exists (DotStreaming::twin_row chooses it)
#else
constexpr int R_DOT8 = 8, R_DOT4 = 8, ACC_DOT = ACC, R_UNPREFETCHED = 0;
constexpr bool TWIN_BUILT = false;
#endif
struct DotStreaming {
  bool prefetch = true, twin_row = false;
};
inline DotStreaming cpu_dot_streaming() {
#if defined(__AVX512F__) && (defined(__x86_64__) || defined(__i386__))
  static const DotStreaming choice = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? DotStreaming{false, true} : DotStreaming{true, false};
  }();
  return choice;
#else
  return DotStreaming{};
#endif
}
constexpr int r_dot(Fmt f) { return f == Fmt::W8A8 ? R_DOT8 : R_DOT4; }

// Panels a block of R rows reads side by side: as many as the accumulators allow, 1, 2, 4 or 8 (any count for a block
// that loads its weights first: below). (An output's sums are one dependent chain over k, so a row needs several
// panels in flight to keep the multiply-adds busy.)
// `stream`: fewer (MAXP_STREAM) for a float or INT8 weight that streams from memory.
constexpr int panels_for(int R, Fmt f, bool stream) {
  // W4A8: 16-bit, int32 and float32 sums each; W8A8: int32 and float32
  const int side = f == Fmt::INT4 ? RSIDE_INT4 : RSIDE;
  const int p = int8_inputs(f) ? ACC_DOT / (R * PV * (f == Fmt::W4A8 ? 3 : 2)) : R > side ? 1 : ACC / (R * PV);
  const int most = stream && (f == Fmt::F32 || f == Fmt::BF16 || f == Fmt::INT8) ? MAXP_STREAM : MAXP;
  // A block that loads each step's weights first (Block::step: F32, BF16, INT8) holds its P weight vectors, not its R
  // inputs, beside its sums, so it takes every panel its accumulators allow (3 at 4 rows on AVX2).
  if (R >= W_FIRST && (f == Fmt::F32 || f == Fmt::BF16 || f == Fmt::INT8)) return std::min(most, p);
  return std::min(most, p >= 8 ? 8 : p >= 4 ? 4 : p >= 2 ? 2 : 1);
}

// A weight of at least this many packed bytes is taken to stream from memory (the caller's call: Args::stream, by
// `streams`): a model's larger matrices. The shipped default pair's (6 MB at most) stay in cache. W8A8's is lower,
// for the twin row (DotStreaming): streamed in a pass of Qwen2.5 shapes, one row as two took 0.98x the time over
// 0.8 MB weights, 0.90x over 2.4 MB and 0.85x over 4.6 MB ones; the default pair's largest W8A8 weight, 3.3 MB of 7 MB
// in all, stays out.
constexpr int64_t STREAM_BYTES = int64_t(8) << 20, DOT_STREAM_BYTES = int64_t(4) << 20;
inline bool streams(Fmt f, int64_t bytes) { return bytes >= (f == Fmt::W8A8 ? DOT_STREAM_BYTES : STREAM_BYTES); }

// A weight of at least HUGE_BYTES packed bytes (runtime/heap.py's HUGE_PAGE: a weight it maps on huge pages) lets the
// float and weight-only formats' narrow blocks leave its prefetch to the hardware where the core's DotStreaming says
// so (the caller's call: Args::huge, by `is_huge`).
constexpr int64_t HUGE_BYTES = int64_t(2) << 20;
inline bool is_huge(int64_t bytes) { return bytes >= HUGE_BYTES; }

inline bool has_pairs_format() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// INT8 and INT4 in a bfloat16 pass, on a tier with AVX512_BF16: computed by its dot product (WeightOnlyPairsBlock),
// from the rows as bfloat16 (Args::xb; the caller interleaves no float32 rows for it).
inline bool weight_only_pairs(Fmt f, bool bf16_inputs) {
  return (f == Fmt::INT8 || f == Fmt::INT4) && bf16_inputs && has_pairs_format();
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool AMX = true;
#else
constexpr bool AMX = false;
#endif
// AMX's tiles: 16 rows of 64 bytes (the A tile: 16 rows x 32 bfloat16 inputs; B: 16 pairs of k x 16 outputs).
constexpr int TILE_ROWS = 16, TILE_K = 32;

// The pairs of k a BF16_PAIRS panel holds for K inputs.
inline int64_t pair_rows(int64_t K) { return AMX ? (K + TILE_K - 1) / TILE_K * (TILE_K / 2) : (K + 1) / 2; }

// The bytes of one group of G values of k in a panel of the integer formats: its scales, then its weights (a byte
// each in INT8 and W8A8, half a byte in INT4 and W4A8).
constexpr int64_t group_bytes(Fmt f, int64_t G) {
  return PANEL * 4 + (f == Fmt::INT8 || f == Fmt::W8A8 ? G : G / 2) * PANEL;
}

// The bytes of one panel of a weight of K inputs (G: the group of the integer formats).
inline int64_t panel_bytes(Fmt f, int64_t K, int64_t G) {
  const int64_t groups = G > 0 ? (K + G - 1) / G : 0;
  switch (f) {
    case Fmt::F32: return K * PANEL * 4;
    case Fmt::BF16: return K * PANEL * 2;
    case Fmt::BF16_PAIRS: return pair_rows(K) * PANEL * 4;
    case Fmt::INT8:
    case Fmt::W8A8:
    case Fmt::INT4:
    case Fmt::W4A8: return groups * group_bytes(f, G);
  }
  return 0;
}

// Where INT4 keeps output j's (j < PANEL) q[k + e] (e 0 or 1) within its pair of k's PANEL bytes: the byte, and 0
// for the low nibble or 4 for the high one (the layout the format's comment above gives).
inline void int4_slot(int64_t j, int e, int64_t& byte, int& shift) {
#if defined(__AVX512F__)
  static_assert(PANEL == 64);
  byte = j / 32 * 32 + j % 16 * 2 + e;
  shift = j % 32 / 16 * 4;
#else
  byte = j;
  shift = 4 * e;
#endif
}

// What one call computes: out [M, N] = x [M, K] w^T + bias, x as float32 (bfloat16 inputs are widened exactly by the
// caller; BF16_PAIRS and `weight_only_pairs` read xb instead), out float32 or bfloat16.
struct Args {
  Fmt fmt;
  const float* x;          // [M, K]
  const uint16_t* xb;      // [M, K] bfloat16, for BF16_PAIRS and `weight_only_pairs` (null in a float32 pass)
  int64_t M, K, N;
  const uint8_t* packed;   // [panels][panel_bytes]
  int64_t panel_stride;    // bytes
  int64_t G;               // the integer formats' group
  const float* bias;       // [N] or null
  void* out;               // [M, N]
  bool out_bf16;
  bool stream = false;     // the weights stream from memory (STREAM_BYTES): blocks of fewer panels (the same bits)
  // W4A8's and W8A8's inputs, quantized by quantize_inputs: xq [M, groups * G] int8 (zeros past K), xs and xsum
  // [M, groups]
  const int8_t* xq = nullptr;
  const float* xs = nullptr;
  const int32_t* xsum = nullptr;
  // BF16_PAIRS on AMX: the rows as bfloat16, zero padded (pad_tile_rows) to whole tiles of rows and of k
  const uint16_t* xa = nullptr;
  DotStreaming dot = cpu_dot_streaming();  // how a weight streams from memory (DotStreaming; the same bits)
  bool huge = false;  // the weights are HUGE_BYTES or more (`is_huge`; DotStreaming; the same bits)
};

// Whether a block of R_UNPREFETCHED rows or fewer of the float and weight-only formats leaves this pass's weight to
// the hardware's prefetch: on a core whose DotStreaming says so, over a weight of HUGE_BYTES or more.
inline bool hardware_prefetches(const Args& a) { return !a.dot.prefetch && a.huge; }

// BF16_PAIRS on AMX reads its inputs in tiles: xb [M, K] bfloat16 into xa [tile_rows_padded(M), pair_rows(K) * 2],
// zeros past each row's K and in the padding rows. A pass of up to TILE_ROWS rows is one tile of M rows.
inline int64_t amx_rows(int64_t M) { return M < TILE_ROWS ? M : TILE_ROWS; }
inline int64_t tile_rows_padded(int64_t M) { return M == 0 ? 0 : (M + amx_rows(M) - 1) / amx_rows(M) * amx_rows(M); }
inline void pad_tile_rows(const uint16_t* xb, int64_t M, int64_t K, uint16_t* xa) {
  const int64_t Kp = pair_rows(K) * 2, Mp = tile_rows_padded(M);
  for (int64_t m = 0; m < Mp; ++m)
    for (int64_t k = 0; k < Kp; ++k) xa[m * Kp + k] = m < M && k < K ? xb[m * K + k] : uint16_t(0);
}

// W4A8's and W8A8's inputs: each row's groups of G, quantized on their own (xq, xs, xsum as Args says). A group with a
// non-finite input gets xs = NaN and xq = 0, so its outputs are NaN as float32's would be non-finite.
inline void quantize_inputs(const float* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* xs,
                            int32_t* xsum) {
  const int64_t groups = (K + G - 1) / G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * K + g * G;
      const int64_t n = std::min(G, K - g * G);
      float amax = 0.f;
      bool finite = true;
      for (int64_t i = 0; i < n; ++i) {
        finite = finite && std::isfinite(xg[i]);
        amax = std::max(amax, std::fabs(xg[i]));
      }
      int8_t* q = xq + m * groups * G + g * G;
      int32_t sum = 0;
      for (int64_t i = 0; i < G; ++i) {
        const float v = i < n && amax > 0.f ? std::nearbyint(xg[i] * 127.f / amax) : 0.f;
        q[i] = finite ? static_cast<int8_t>(std::max(-127.f, std::min(127.f, v))) : int8_t(0);
        sum += q[i];
      }
      xs[m * groups + g] = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
      xsum[m * groups + g] = sum;
    }
}

namespace detail {

#define SPECDEC_UNROLL _Pragma("GCC unroll 16")

// Prefetch into L2 what the next block reads where this one reads s: every cache line of this step's BYTES,
// `ahead` bytes on. (One prefetch a step covered only the first line of a step wider than a line: AVX-512's bfloat16
// steps are 2 lines, W4A8's 4. With every line, a one-row bfloat16 pass over a Qwen2.5-0.5B-shaped model's linears,
// 988 MB, two threads, Xeon with AMX: 77-80 -> 69-70 ms; float32, int8 and W4A8 level; interleaved runs.)
template <int64_t BYTES>
__attribute__((always_inline)) inline void prefetch_next_block(const uint8_t* s, int64_t ahead) {
  SPECDEC_UNROLL for (int64_t l = 0; l < BYTES; l += 64) simd::prefetch_l2(s + ahead + l);
}

// Output row m's outputs [n, n + cnt): acc plus the bias b (where the call has one), rounded once to out's dtype.
__attribute__((always_inline)) inline void put(const Args& a, int64_t m, int64_t n, int cnt, V acc, V b) {
  const V y = a.bias ? simd::add(acc, b) : acc;
  if (a.out_bf16) simd::store_bf16_n(static_cast<uint16_t*>(a.out) + m * a.N + n, y, cnt);
  else simd::store_n(static_cast<float*>(a.out) + m * a.N + n, y, cnt);
}

// One step of k (two for INT4) of P panels: their weights as float32 vectors, each row's input times them into the
// row's accumulators. The rows' inputs come interleaved, xt[k * R + r], so one pointer serves every row.
template <Fmt F, int R, int P, bool Prefetch = true>
struct Block {
  static constexpr int NV = P * PV;  // accumulators per row

  // rows [m0, m0 + R) (inputs xt [K][R]) x panels [p0, p0 + P)
  static void run(const Args& a, const float* xt, int64_t m0, int64_t p0) {
    V acc[R][NV];
    SPECDEC_UNROLL for (int r = 0; r < R; ++r)
      SPECDEC_UNROLL for (int j = 0; j < NV; ++j) acc[r][j] = simd::zero();
    const uint8_t* base[P];
    SPECDEC_UNROLL for (int p = 0; p < P; ++p) base[p] = a.packed + (p0 + p) * a.panel_stride;
    const int64_t K = a.K;
    if constexpr (F == Fmt::F32 || F == Fmt::BF16) {
      constexpr int64_t STEP = PANEL * (F == Fmt::F32 ? 4 : 2);  // bytes of one k
      for (int64_t k = 0; k < K; ++k)
        step(acc, xt + k * R, [&](int p, int v) {
          const uint8_t* s = base[p] + k * STEP;
          if (Prefetch && v == 0) prefetch_next_block<STEP>(s, P * a.panel_stride);
          if constexpr (F == Fmt::F32) return simd::load(reinterpret_cast<const float*>(s) + v * LANES);
          else return simd::load_bf16(reinterpret_cast<const uint16_t*>(s) + v * LANES);
        });
    } else {  // INT8, INT4: group by group, each a header of scales then its weights
      const int64_t G = a.G;
      const int64_t gb = group_bytes(F, G);
      for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
        const int64_t kn = std::min(G, K - k0);
        const uint8_t* q[P];
        SPECDEC_UNROLL for (int p = 0; p < P; ++p) q[p] = base[p] + g * gb + PANEL * 4;
        V sum[R][NV];  // the group's sums, over q as float32
        SPECDEC_UNROLL for (int r = 0; r < R; ++r)
          SPECDEC_UNROLL for (int j = 0; j < NV; ++j) sum[r][j] = simd::zero();
        const float* x = xt + k0 * R;
        if constexpr (F == Fmt::INT8) {
          for (int64_t i = 0; i < kn; ++i)
            step(sum, x + i * R, [&](int p, int v) {
              const int8_t* s = reinterpret_cast<const int8_t*>(q[p] + i * PANEL);
              if (Prefetch && v == 0) simd::prefetch_l2(s + P * a.panel_stride);
              return simd::load_i8(s + v * LANES);
            });
        } else {
          const int64_t pairs = kn / 2;
          for (int64_t i = 0; i < pairs; ++i) {
            SPECDEC_UNROLL for (int p = 0; p < P; ++p) {
              const uint8_t* s = q[p] + i * PANEL;
              if constexpr (Prefetch) simd::prefetch_l2(s + P * a.panel_stride);
              SPECDEC_UNROLL for (int v = 0; v < PV; ++v) {
                V even, odd;
                load_pair(s, v, even, odd);
                fma_one(sum, x + 2 * i * R, p * PV + v, even);
                fma_one(sum, x + (2 * i + 1) * R, p * PV + v, odd);
              }
            }
          }
          if (kn % 2) {  // the last k of an odd K: the low nibbles only
            SPECDEC_UNROLL for (int p = 0; p < P; ++p)
              SPECDEC_UNROLL for (int v = 0; v < PV; ++v) {
                V even, odd;
                load_pair(q[p] + pairs * PANEL, v, even, odd);
                fma_one(sum, x + (kn - 1) * R, p * PV + v, even);
              }
          }
        }
        // acc = fma(sum, scale, acc): each panel's scales for this group, at its head
        SPECDEC_UNROLL for (int p = 0; p < P; ++p)
          SPECDEC_UNROLL for (int v = 0; v < PV; ++v) {
            const V sc = simd::load(reinterpret_cast<const float*>(base[p] + g * gb) + v * LANES);
            SPECDEC_UNROLL for (int r = 0; r < R; ++r)
              acc[r][p * PV + v] = simd::fma(sum[r][p * PV + v], sc, acc[r][p * PV + v]);
          }
      }
    }
    store(a, acc, m0, p0);
  }

  // INT4: vector v's outputs' q[k] and q[k + 1] as float32, from their pair of k's bytes s (`int4_slot`)
  __attribute__((always_inline)) static inline void load_pair(const uint8_t* s, int v, V& even, V& odd) {
#if defined(__AVX512F__)
    // the half panel's 32 bytes widened to 16 bits, a byte pair (q[k], q[k + 1]) of output n (and n + 16) a lane;
    // vpermps reads an index's low 4 bits, so shifts pick the nibble
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + v / 2 * 32)));
    const V values = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f,
                                    6.f, 7.f);
    const __m512i e = v % 2 ? _mm512_srli_epi32(b, 4) : b;
    even = _mm512_permutexvar_ps(e, values);
    odd = _mm512_permutexvar_ps(_mm512_srli_epi32(e, 8), values);
#else
    simd::load_q4(s + v * LANES, even, odd);
#endif
  }

  // every row's accumulator j += x[r] * w
  __attribute__((always_inline)) static inline void fma_one(V (&acc)[R][NV], const float* x, int j, V w) {
    SPECDEC_UNROLL for (int r = 0; r < R; ++r) acc[r][j] = simd::fma(simd::set1(x[r]), w, acc[r][j]);
  }

  // One k: acc[r][p * PV + v] += x[r] * weight(p, v) for every row, panel and vector. A block of W_FIRST rows or
  // more loads the step's NV weight vectors first, then each row's input once; a narrower one uses each vector as
  // soon as it is loaded. The same multiply-adds in the same order for every sum, so the same bits either way.
  template <typename Weight>
  __attribute__((always_inline)) static inline void step(V (&acc)[R][NV], const float* x, Weight weight) {
    if constexpr (R >= W_FIRST) {
      V w[NV];
      SPECDEC_UNROLL for (int p = 0; p < P; ++p)
        SPECDEC_UNROLL for (int v = 0; v < PV; ++v) w[p * PV + v] = weight(p, v);
      SPECDEC_UNROLL for (int r = 0; r < R; ++r) {
        const V xr = simd::set1(x[r]);
        SPECDEC_UNROLL for (int j = 0; j < NV; ++j) acc[r][j] = simd::fma(xr, w[j], acc[r][j]);
      }
    } else {
      SPECDEC_UNROLL for (int p = 0; p < P; ++p)
        SPECDEC_UNROLL for (int v = 0; v < PV; ++v) fma_one(acc, x, p * PV + v, weight(p, v));
    }
  }

  static void store(const Args& a, V (&acc)[R][NV], int64_t m0, int64_t p0) {
    SPECDEC_UNROLL for (int j = 0; j < NV; ++j) {
      const int64_t n = p0 * PANEL + j * LANES;
      if (n >= a.N) break;
      const int cnt = static_cast<int>(std::min<int64_t>(LANES, a.N - n));
      const V b = a.bias ? simd::load_n(a.bias + n, cnt) : simd::zero();
      SPECDEC_UNROLL for (int r = 0; r < R; ++r) put(a, m0 + r, n, cnt, acc[r][j], b);
    }
  }
};

// A value the compiler must take as unknown (`opaque`) or must compute though nothing reads it (`keep`).
template <typename T>
__attribute__((always_inline)) inline void opaque(T& v) { asm("" : "+r"(v)); }
template <typename T>
__attribute__((always_inline)) inline void keep(const T& v) { asm volatile("" : : "v"(v)); }

#if defined(__AVX512BF16__)
// One row's bfloat16 inputs (k, k + 1) from x (the last of an odd count: (k, 0)), in every lane, for the dot product.
__attribute__((always_inline)) inline __m512bh pair_of(const uint16_t* x, bool last) {
  int32_t pair = 0;
  std::memcpy(&pair, x, last ? 2 : 4);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// BF16_PAIRS: AVX512_BF16's dot product, 64 outputs x one pair of k per step (the tier's own arithmetic). Prefetch:
// each step asks for the line 8 KB on in its panel (DotStreaming::prefetch chooses, as for W4A8 and W8A8).
// Twin (DotStreaming::twin_row, R 2): row m0 alone, computed as two rows, as ByteDotBlock's twin.
template <int R, bool Prefetch, bool Twin = false>
struct PairsBlock {
  static_assert(!Twin || R == 2, "a twin block is one row computed as two");

  static void run(const Args& a, const float*, int64_t m0, int64_t p0) {
    static_assert(PV == 4);
    __m512 acc[R][PV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < PV; ++v) acc[r][v] = _mm512_setzero_ps();
    const uint8_t* w = a.packed + p0 * a.panel_stride;
    const int64_t K = a.K, whole = K / 2;
    const uint16_t* x[R];  // each row's bfloat16 inputs
    for (int r = 0; r < R; ++r) x[r] = a.xb + (m0 + (Twin ? 0 : r)) * K;
    if constexpr (Twin) opaque(x[1]);
    auto step = [&](int64_t s, bool last) __attribute__((always_inline)) {
      const uint8_t* ws = w + s * PANEL * 4;
      __m512bh wv[PV];
      for (int v = 0; v < PV; ++v) {
        wv[v] = (__m512bh)_mm512_loadu_si512(ws + v * 64);
        if constexpr (Prefetch) simd::prefetch(ws + 8192 + v * 64);
      }
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = pair_of(x[r] + 2 * s, last);
        for (int v = 0; v < PV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, wv[v]);
      }
    };
    for (int64_t s = 0; s < whole; ++s) step(s, false);
    if (K % 2) step(whole, true);
    if constexpr (Twin) {
      for (int v = 0; v < PV; ++v) keep(acc[1][v]);
      Block<Fmt::F32, 1, 1>::store(a, reinterpret_cast<__m512 (&)[1][PV]>(acc), m0, p0);
    } else {
      Block<Fmt::F32, R, 1>::store(a, acc, m0, p0);
    }
  }
};
#endif

#if defined(__AVX512BF16__)
// INT8 and INT4 in a bfloat16 pass (`weight_only_pairs`): per group of G, in order,
//
//   sum = 0;  per pair of k, in order:  sum = dpbf16(sum, (x[k], x[k + 1]), (q[k], q[k + 1]));
//   acc = fma(sum, scale[g], acc);    y = acc + bias
//
// (AVX512_BF16's dot product: the instruction's order and flushing, as BF16_PAIRS; a last k of an odd group pairs
// with zeros). Each q is exact in bfloat16. INT4's bytes hold pairs of k: a half panel's 32 bytes widened to 16 bits
// are 16 outputs' pairs in their low nibbles and 16 others' in their high ones (`int4_slot`), looked up in a table of
// 32 (`vpermw` reads an index's low 5 bits): per 32 bytes of weights a widening, a shift, two lookups and two dot
// products a row, where float32's group sums take a widening, three shifts, four lookups and four multiply-adds a
// row. INT8's rows of k are made float32 (exact), and a pair's bfloat16 is the high half of each: per 16 outputs and
// two k, two widenings, two conversions and a byte shuffle that merges them, then a dot product a row, where float32
// takes a multiply-add per k a row (docs/kernels.md). R rows of one panel, NVB of its vectors at a time, each group's
// weights made bfloat16 once for all R rows (the same sums in the same order whatever NVB); Prefetch as Block's
// (DotStreaming).
template <Fmt F, int R, bool Prefetch>
struct WeightOnlyPairsBlock {
  static constexpr int NVB = R <= 4 ? PV : 2;  // (R_WEIGHT_ONLY_PAIRS says why)
  static void run(const Args& a, int64_t m0, int64_t p0) {
    static_assert(PV == 4 && PV % NVB == 0 && NVB % 2 == 0);
    const __m512i table = _mm512_set_epi16(  // index i -> q = (i & 15) - 8 as bfloat16 (elements 31 .. 0)
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, -0x4080, -0x4000, -0x3FC0, -0x3F80, -0x3F60,
        -0x3F40, -0x3F20, -0x3F00, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, -0x4080, -0x4000,
        -0x3FC0, -0x3F80, -0x3F60, -0x3F40, -0x3F20, -0x3F00);
    __m512 acc[R][PV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < PV; ++v) acc[r][v] = _mm512_setzero_ps();
    const uint8_t* w = a.packed + p0 * a.panel_stride;
    const int64_t K = a.K, G = a.G, gb = group_bytes(F, G);
    const uint16_t* x[R];  // each row's bfloat16 inputs
    for (int r = 0; r < R; ++r) x[r] = a.xb + (m0 + r) * K;
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, ++g) {
      const int64_t kn = std::min(G, K - k0), whole = kn / 2;
      const uint8_t* q = w + g * gb + PANEL * 4;
      const float* scale = reinterpret_cast<const float*>(w + g * gb);
      SPECDEC_UNROLL for (int vb = 0; vb < PV; vb += NVB) {
        __m512 sum[R][NVB];
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < NVB; ++j) sum[r][j] = _mm512_setzero_ps();
        auto step = [&](int64_t i, bool last) __attribute__((always_inline)) {
          __m512bh wv[NVB];
          if constexpr (F == Fmt::INT4) {
            const uint8_t* s = q + i * PANEL;
            if (Prefetch && vb == 0) simd::prefetch_l2(s + a.panel_stride);
            for (int h = 0; h < NVB / 2; ++h) {  // a half panel's 32 bytes widened: a lane a pair, low then high
              const __m512i b = _mm512_cvtepu8_epi16(
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32 * (vb / 2 + h))));
              wv[2 * h] = (__m512bh)_mm512_permutexvar_epi16(b, table);
              wv[2 * h + 1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
            }
          } else {  // INT8: the rows of k and k + 1 (none past an odd group's end: zeros)
            const uint8_t* s = q + 2 * i * PANEL;
            if (Prefetch && vb == 0) {
              simd::prefetch_l2(s + a.panel_stride);
              simd::prefetch_l2(s + PANEL + a.panel_stride);
            }
            auto row = [&](const uint8_t* r) __attribute__((always_inline)) {  // 16 outputs' q as float32 bits
              return _mm512_castps_si512(
                  _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)))));
            };
            // bytes 2 and 3 of each lane to bytes 0 and 1 (vpshufb indexes within 16 bytes): one instruction for
            // what a shift and a merge took, 0.95-0.99x the time at 1-128 rows (docs/kernels.md)
            const __m512i down = _mm512_set4_epi32(0x0F0E, 0x0B0A, 0x0706, 0x0302);
            for (int j = 0; j < NVB; ++j) {
              const int v = vb + j;
              const __m512i even = row(s + v * LANES), odd = last ? _mm512_setzero_si512() : row(s + PANEL + v * LANES);
              // odd's high half above even's: each float32's high half is its bfloat16, exactly
              wv[j] = (__m512bh)_mm512_mask_shuffle_epi8(odd, 0x3333333333333333ull, even, down);
            }
          }
          for (int r = 0; r < R; ++r) {
            const __m512bh xv = pair_of(x[r] + k0 + 2 * i, last);
            for (int j = 0; j < NVB; ++j) sum[r][j] = _mm512_dpbf16_ps(sum[r][j], xv, wv[j]);
          }
        };
        for (int64_t i = 0; i < whole; ++i) step(i, false);
        if (kn % 2) step(whole, true);
        for (int j = 0; j < NVB; ++j) {
          const __m512 sc = _mm512_loadu_ps(scale + (vb + j) * LANES);
          for (int r = 0; r < R; ++r) acc[r][vb + j] = _mm512_fmadd_ps(sum[r][j], sc, acc[r][vb + j]);
        }
      }
    }
    Block<Fmt::F32, R, 1>::store(a, acc, m0, p0);
  }
};

// WeightOnlyPairsBlock's widest block: a wider pass goes through each panel in blocks as even as they can be. A row
// of a block that sums a panel's 4 vectors at once holds 8 registers (its sums and accumulators), so 3 rows fit in 32
// with the weights and the table; but blocks of up to 6 rows, which spill, made INT4 passes over the Qwen2.5-1.5B
// shape's linears take 0.68x the time at 4 rows, 0.80x at 5 and 8, 0.84x at 6 and 0.75x at 128 against blocks of up
// to 3. A block of 5 to 8 rows sums 2 vectors at a time (NVB; its accumulators spill, read and written once a group):
// an 8-row pass is one block, which makes each weight bfloat16 once, where two blocks of 4 made it twice. Against
// blocks of up to 6 over the whole panel, INT8 passes over that shape's linears took 0.90x / 0.85x / 0.84x / 0.83x
// the time at 5 / 6 / 7 / 8 rows and 0.85x at 128 (the 0.5B shape's 0.83-0.91x), INT4's 0.97-1.03x; a vector at a
// time, INT8's 1.03-1.09x the time of 2 (one Zen 4 core, benchmarks/kernel_ab.py --bf16-rows; docs/kernels.md).
constexpr int R_WEIGHT_ONLY_PAIRS = 8;

template <Fmt F, bool Prefetch>
void weight_only_pairs_rows(int r, const Args& a, int64_t m0, int64_t p) {
  switch (r) {
    case 1: WeightOnlyPairsBlock<F, 1, Prefetch>::run(a, m0, p); break;
    case 2: WeightOnlyPairsBlock<F, 2, Prefetch>::run(a, m0, p); break;
    case 3: WeightOnlyPairsBlock<F, 3, Prefetch>::run(a, m0, p); break;
    case 4: WeightOnlyPairsBlock<F, 4, Prefetch>::run(a, m0, p); break;
    case 5: WeightOnlyPairsBlock<F, 5, Prefetch>::run(a, m0, p); break;
    case 6: WeightOnlyPairsBlock<F, 6, Prefetch>::run(a, m0, p); break;
    case 7: WeightOnlyPairsBlock<F, 7, Prefetch>::run(a, m0, p); break;
    default: WeightOnlyPairsBlock<F, 8, Prefetch>::run(a, m0, p); break;
  }
}

// Panels [p0, p1) of a `weight_only_pairs` pass: each panel against every block of rows while it stays in cache.
template <Fmt F>
inline void weight_only_pairs_pass(const Args& a, int64_t p0, int64_t p1) {
  const int64_t blocks = (a.M + R_WEIGHT_ONLY_PAIRS - 1) / R_WEIGHT_ONLY_PAIRS;
  const int64_t base = a.M / blocks, wider = a.M % blocks;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t b = 0, m = 0; b < blocks; ++b) {
      const int r = static_cast<int>(base + (b < wider ? 1 : 0));
      // a block of a few rows over a huge weight leaves its prefetch to the hardware where DotStreaming says so
      if (r <= R_UNPREFETCHED && hardware_prefetches(a)) weight_only_pairs_rows<F, false>(r, a, m, p);
      else weight_only_pairs_rows<F, true>(r, a, m, p);
      m += r;
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// BF16_PAIRS on AMX, panels [p0, p1) for every row of the pass: per panel and tile of rows, four accumulator tiles
// (16 outputs each) over k in chunks of TILE_K, then bias and output as the other blocks do. One tile
// configuration per call (a pass's tiles of rows are all amx_rows(M) high, the last one zero padded). No software
// prefetch: a one-row pass over a Qwen2.5-0.5B shape's linears took 98-112 ms on one core with every line of the
// next panel prefetched (as the other blocks do), 88-91 without, 86-90 with the stream 16 KB ahead; on two cores
// 47-52 either way (Xeon with AMX).
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_pairs(const Args& a, int64_t p0, int64_t p1) {
  static_assert(PANEL == 4 * 16);
  const int64_t Kp = pair_rows(a.K) * 2, chunks = Kp / TILE_K, rows = amx_rows(a.M);
  alignas(64) TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;  // C0..C3, A
  for (int t = 5; t < 7; ++t) cfg.rows[t] = TILE_K / 2, cfg.colsb[t] = 64;                     // B
  _tile_loadconfig(&cfg);
  alignas(64) float c[TILE_ROWS * PANEL];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* w = a.packed + p * a.panel_stride;
    for (int64_t m0 = 0; m0 < a.M; m0 += rows) {
      const uint16_t* x = a.xa + m0 * Kp;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const uint8_t* b = w + ch * (TILE_K / 2) * PANEL * 4;  // 16 pairs of k x PANEL outputs
        _tile_loadd(4, x + ch * TILE_K, Kp * 2);
        _tile_loadd(5, b, PANEL * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 64, PANEL * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b + 128, PANEL * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, b + 192, PANEL * 4);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, c, PANEL * 4);
      _tile_stored(1, c + 16, PANEL * 4);
      _tile_stored(2, c + 32, PANEL * 4);
      _tile_stored(3, c + 48, PANEL * 4);
      const int64_t live = std::min(rows, a.M - m0);
      for (int v = 0; v < PV; ++v) {
        const int64_t n = p * PANEL + v * LANES;
        if (n >= a.N) break;
        const int cnt = static_cast<int>(std::min<int64_t>(LANES, a.N - n));
        const V bias = a.bias ? simd::load_n(a.bias + n, cnt) : simd::zero();
        for (int64_t r = 0; r < live; ++r) put(a, m0 + r, n, cnt, simd::load(c + r * PANEL + v * LANES), bias);
      }
    }
  }
  _tile_release();
}
#endif

// W4A8 and W8A8, after a group's integer sums: acc = fma(float(isum - bias * sum of the row's xq), scale * xs, acc)
// for every row and output (`bias`: what each input's weight held in excess of q). Twin: every row is row m0.
template <int R, int P, bool Twin = false>
__attribute__((always_inline)) inline void add_group(const Args& a, V (&acc)[R][P * PV], simd::VI (&isum)[R][P * PV],
                                                     int64_t m0, int64_t p0, int64_t g, int64_t gb,
                                                     int32_t bias) {
  const int64_t groups = (a.K + a.G - 1) / a.G;
  SPECDEC_UNROLL for (int p = 0; p < P; ++p) {
    const float* scale = reinterpret_cast<const float*>(a.packed + (p0 + p) * a.panel_stride + g * gb);
    SPECDEC_UNROLL for (int v = 0; v < PV; ++v) {
      const V sc = simd::load(scale + v * LANES);
      SPECDEC_UNROLL for (int r = 0; r < R; ++r) {
        const int64_t rg = (m0 + (Twin ? 0 : r)) * groups + g;
        acc[r][p * PV + v] = simd::fma(simd::to_float(isum[r][p * PV + v], bias * a.xsum[rg]),
                                       simd::mul(sc, simd::set1(a.xs[rg])), acc[r][p * PV + v]);
      }
    }
  }
}

// W4A8: per group, each row's integer sums over the group's k (8 at a time: two words of 4 inputs against the low
// and high nibbles), then the group's scales into the row's float32 accumulators (packed_core's header comment).
template <int R, int P, bool Prefetch>
struct DotBlock {
  static constexpr int NV = P * PV;

  static void run(const Args& a, int64_t m0, int64_t p0) {
    V acc[R][NV];
    SPECDEC_UNROLL for (int r = 0; r < R; ++r)
      SPECDEC_UNROLL for (int j = 0; j < NV; ++j) acc[r][j] = simd::zero();
    const int64_t G = a.G, groups = (a.K + G - 1) / G, gb = group_bytes(Fmt::W4A8, G);
    const int8_t* x[R];  // each row's quantized inputs
    SPECDEC_UNROLL for (int r = 0; r < R; ++r) x[r] = a.xq + (m0 + r) * groups * G;
    for (int64_t g = 0; g < groups; ++g) {
      simd::VI isum[R][NV];
      SPECDEC_UNROLL for (int r = 0; r < R; ++r)
        SPECDEC_UNROLL for (int j = 0; j < NV; ++j) isum[r][j] = simd::zero_i();
      const uint8_t* q[P];
      SPECDEC_UNROLL for (int p = 0; p < P; ++p)
        q[p] = a.packed + (p0 + p) * a.panel_stride + g * gb + PANEL * 4;
      constexpr int D = simd::DOTS_PER_WIDEN;
      for (int64_t i0 = 0; i0 < G; i0 += 8 * D) {  // 16-bit partial sums of D steps, then int32
        simd::VS part[R][NV];
        SPECDEC_UNROLL for (int r = 0; r < R; ++r)
          SPECDEC_UNROLL for (int j = 0; j < NV; ++j) part[r][j] = simd::zero_s();
        for (int64_t i = i0; i < std::min(G, i0 + 8 * D); i += 8) {
          int32_t lo[R], hi[R];  // inputs k .. k+3 and k+4 .. k+7 of each row
          SPECDEC_UNROLL for (int r = 0; r < R; ++r) {
            std::memcpy(&lo[r], x[r] + g * G + i, 4);
            std::memcpy(&hi[r], x[r] + g * G + i + 4, 4);
          }
          SPECDEC_UNROLL for (int p = 0; p < P; ++p) {
            const uint8_t* s = q[p] + i / 2 * PANEL;
            if constexpr (Prefetch) prefetch_next_block<4 * PANEL>(s, P * a.panel_stride);
            SPECDEC_UNROLL for (int v = 0; v < PV; ++v) {
              simd::VB low, high;
              simd::load_nibbles(s + v * 4 * LANES, low, high);
              SPECDEC_UNROLL for (int r = 0; r < R; ++r)
                part[r][p * PV + v] = simd::dot_nibbles(low, high, lo[r], hi[r], part[r][p * PV + v]);
            }
          }
        }
        SPECDEC_UNROLL for (int r = 0; r < R; ++r)
          SPECDEC_UNROLL for (int j = 0; j < NV; ++j) isum[r][j] = simd::widen_add(part[r][j], isum[r][j]);
      }
      add_group<R, P>(a, acc, isum, m0, p0, g, gb, 8);  // the nibbles are q + 8
    }
    Block<Fmt::F32, R, P>::store(a, acc, m0, p0);
  }
};

// W8A8: per group, each row's int32 sums over the group's k (4 at a time: one word of 4 inputs against 4 weight
// bytes per output), then the group's scales into the row's float32 accumulators, as W4A8.
// Twin (DotStreaming::twin_row, R 2): row m0 alone, computed as two rows, the second a copy of the first whose
// outputs are computed and dropped (the compiler is kept from merging the two: `opaque`, `keep`).
template <int R, int P, bool Prefetch, bool Twin = false>
struct ByteDotBlock {
  static constexpr int NV = P * PV;
  static_assert(!Twin || R == 2, "a twin block is one row computed as two");

  static void run(const Args& a, int64_t m0, int64_t p0) {
    V acc[R][NV];
    SPECDEC_UNROLL for (int r = 0; r < R; ++r)
      SPECDEC_UNROLL for (int j = 0; j < NV; ++j) acc[r][j] = simd::zero();
    const int64_t G = a.G, groups = (a.K + G - 1) / G, gb = group_bytes(Fmt::W8A8, G);
    const int8_t* x[R];  // each row's quantized inputs
    SPECDEC_UNROLL for (int r = 0; r < R; ++r) x[r] = a.xq + (m0 + (Twin ? 0 : r)) * groups * G;
    if constexpr (Twin) opaque(x[1]);
    for (int64_t g = 0; g < groups; ++g) {
      simd::VI isum[R][NV];
      SPECDEC_UNROLL for (int r = 0; r < R; ++r)
        SPECDEC_UNROLL for (int j = 0; j < NV; ++j) isum[r][j] = simd::zero_i();
      const uint8_t* q[P];
      SPECDEC_UNROLL for (int p = 0; p < P; ++p)
        q[p] = a.packed + (p0 + p) * a.panel_stride + g * gb + PANEL * 4;
      for (int64_t i = 0; i < G; i += 4) {
        int32_t word[R];  // inputs k .. k+3 of each row
        SPECDEC_UNROLL for (int r = 0; r < R; ++r) std::memcpy(&word[r], x[r] + g * G + i, 4);
        SPECDEC_UNROLL for (int p = 0; p < P; ++p) {
          const uint8_t* s = q[p] + i * PANEL;
          if constexpr (Prefetch) prefetch_next_block<4 * PANEL>(s, P * a.panel_stride);
          SPECDEC_UNROLL for (int v = 0; v < PV; ++v) {
            const simd::VB w = simd::load_bytes(s + v * 4 * LANES);
            SPECDEC_UNROLL for (int r = 0; r < R; ++r)
              isum[r][p * PV + v] = simd::dot_bytes(w, word[r], isum[r][p * PV + v]);
          }
        }
      }
      add_group<R, P, Twin>(a, acc, isum, m0, p0, g, gb, simd::DOT_BYTES_BIAS);
    }
    if constexpr (Twin) {
      SPECDEC_UNROLL for (int j = 0; j < NV; ++j) keep(acc[1][j]);
      Block<Fmt::F32, 1, P>::store(a, reinterpret_cast<V (&)[1][NV]>(acc), m0, p0);
    } else {
      Block<Fmt::F32, R, P>::store(a, acc, m0, p0);
    }
  }
};

template <Fmt F, int R, int P>
void block(const Args& a, const float* xt, int64_t m0, int64_t p0) {
  if constexpr (F == Fmt::W4A8) {
    a.dot.prefetch ? DotBlock<R, P, true>::run(a, m0, p0) : DotBlock<R, P, false>::run(a, m0, p0);
    return;
  }
  if constexpr (F == Fmt::W8A8) {
    a.dot.prefetch ? ByteDotBlock<R, P, true>::run(a, m0, p0) : ByteDotBlock<R, P, false>::run(a, m0, p0);
    return;
  }
#if defined(__AVX512BF16__)
  if constexpr (F == Fmt::BF16_PAIRS && !AMX) {  // (on AMX, run_format sends every BF16_PAIRS pass to amx_pairs)
    a.dot.prefetch ? PairsBlock<R, true>::run(a, xt, m0, p0) : PairsBlock<R, false>::run(a, xt, m0, p0);
    return;
  }
#endif
  if constexpr (F != Fmt::BF16_PAIRS && !int8_inputs(F)) {
    if constexpr (R <= R_UNPREFETCHED) {
      if (hardware_prefetches(a)) {
        Block<F, R, P, false>::run(a, xt, m0, p0);
        return;
      }
    }
    Block<F, R, P>::run(a, xt, m0, p0);
  }
}

// block<F, r, P> for a run-time r in [1, R]
template <Fmt F, int R, int P>
void rows(int r, const Args& a, const float* xt, int64_t m0, int64_t p0) {
  if constexpr (R > 0) {
    if (r == R) {
      block<F, R, P>(a, xt, m0, p0);
      return;
    }
    rows<F, R - 1, P>(r, a, xt, m0, p0);
  }
}

// A pass of r <= RMAX rows: block<F, r, panels_for(r, F, Stream)> over the panels, the last few one at a time
template <Fmt F, int R, bool Stream>
void small(int r, const Args& a, const float* xt, int64_t p0, int64_t p1) {
  if constexpr (R > 0) {
    if (r == R) {
      constexpr int P = panels_for(R, F, Stream);
      int64_t p = p0;
      for (; p + P <= p1; p += P) block<F, R, P>(a, xt, 0, p);
      for (; p < p1; ++p) block<F, R, 1>(a, xt, 0, p);
      return;
    }
    small<F, R - 1, Stream>(r, a, xt, p0, p1);
  }
}

// The formats whose one-row pass over a streamed weight can run as two rows (DotStreaming::twin_row): W8A8, and
// AVX512_BF16's pairs (on AMX, run_format sends every BF16_PAIRS pass to amx_pairs)
constexpr bool has_twin(Fmt f) {
#if defined(__AVX512BF16__)
  if (f == Fmt::BF16_PAIRS) return !AMX;
#endif
  return f == Fmt::W8A8 && TWIN_BUILT;
}

// A one-row W8A8 or BF16_PAIRS pass as blocks of two rows, the row and its copy (DotStreaming::twin_row)
template <Fmt F, bool Prefetch>
void one_row_as_two(const Args& a, int64_t p0, int64_t p1) {
#if defined(__AVX512BF16__)
  if constexpr (F == Fmt::BF16_PAIRS) {  // a panel a block
    for (int64_t p = p0; p < p1; ++p) PairsBlock<2, Prefetch, true>::run(a, nullptr, 0, p);
    return;
  }
#endif
  if constexpr (F == Fmt::W8A8) {
    constexpr int P = panels_for(2, Fmt::W8A8, false);
    int64_t p = p0;
    for (; p + P <= p1; p += P) ByteDotBlock<2, P, Prefetch, true>::run(a, 0, p);
    for (; p < p1; ++p) ByteDotBlock<2, 1, Prefetch, true>::run(a, 0, p);
  }
}

template <Fmt F>
void run_format(const Args& a, const float* xt, int64_t p0, int64_t p1) {
#if defined(__AVX512BF16__)
  if constexpr (F == Fmt::INT4 || F == Fmt::INT8) {
    if (a.xb) {  // a bfloat16 pass: `weight_only_pairs`
      weight_only_pairs_pass<F>(a, p0, p1);
      return;
    }
  }
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (F == Fmt::BF16_PAIRS) {  // every pass, one row or many: the same arithmetic
    amx_pairs(a, p0, p1);
    return;
  }
#endif
  if constexpr (int8_inputs(F)) {
    constexpr int R_DOT = r_dot(F);
    if (a.M > R_DOT) {  // each group of panels against every block of R_DOT rows while the group stays in cache
      constexpr int P = panels_for(R_DOT, F, false);
      // blocks as even as R_DOT allows (5 rows in blocks of at most 4: 3 + 2, not 4 + 1, whose one row rereads
      // each panel)
      const int64_t blocks = (a.M + R_DOT - 1) / R_DOT, base = a.M / blocks, wider = a.M % blocks;
      for (int64_t p = p0; p < p1; p += P)
        for (int64_t b = 0, m = 0; b < blocks; ++b) {
          const int r = static_cast<int>(base + (b < wider ? 1 : 0));
          if (p + P <= p1) {
            rows<F, R_DOT, P>(r, a, xt, m, p);
          } else {
            for (int64_t q = p; q < p1; ++q) rows<F, R_DOT, 1>(r, a, xt, m, q);
          }
          m += r;
        }
      return;
    }
  }
  if constexpr (has_twin(F)) {
    if (a.dot.twin_row && a.M == 1 && a.stream) {
      a.dot.prefetch ? one_row_as_two<F, true>(a, p0, p1) : one_row_as_two<F, false>(a, p0, p1);
      return;
    }
  }
  if (a.M <= RMAX) {
    if constexpr (MAXP_STREAM != MAXP) {  // (a tier without a streaming blocking compiles one)
      if (a.stream) {
        small<F, RMAX, true>(static_cast<int>(a.M), a, xt, p0, p1);
        return;
      }
    }
    small<F, RMAX, false>(static_cast<int>(a.M), a, xt, p0, p1);
    return;
  }
  // a prefill: each group of P_PF panels against every block of R_PF rows while the group stays in cache
  for (int64_t p = p0; p < p1; p += P_PF) {
    const bool whole = p + P_PF <= p1;
    for (int64_t m = 0; m < a.M; m += R_PF) {
      const int r = static_cast<int>(std::min<int64_t>(R_PF, a.M - m));
      const float* x = xt + m * a.K;  // this block's rows, interleaved
      if (whole) {
        rows<F, R_PF, P_PF>(r, a, x, m, p);
      } else {
        for (int64_t q = p; q < p1; ++q) rows<F, R_PF, 1>(r, a, x, m, q);
      }
    }
  }
}

}  // namespace detail

// The inputs x [M, K] interleaved for the blocks of rows `run` uses: each block of r rows (all M rows in one block
// when M <= RMAX, else blocks of R_PF) as [K][r], the blocks in row order (M * K floats in all).
inline void interleave(const float* x, int64_t M, int64_t K, float* xt) {
  const int64_t rb = M <= RMAX ? M : R_PF;
  for (int64_t m0 = 0; m0 < M; m0 += rb) {
    const int64_t r = std::min(rb, M - m0);
    float* out = xt + m0 * K;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t k = 0; k < K; ++k) out[k * r + i] = x[(m0 + i) * K + k];
  }
}

// Panels [p0, p1) of the weights (outputs [p0 * PANEL, p1 * PANEL) ∩ [0, N)), with the inputs interleaved by
// `interleave` (xt; unused by BF16_PAIRS, and by W4A8 and W8A8, which read Args::xq): any split of the panels among
// threads gives the same bits.
inline void run(const Args& a, const float* xt, int64_t p0, int64_t p1) {
  switch (a.fmt) {
    case Fmt::F32: detail::run_format<Fmt::F32>(a, xt, p0, p1); break;
    case Fmt::BF16: detail::run_format<Fmt::BF16>(a, xt, p0, p1); break;
    case Fmt::BF16_PAIRS: detail::run_format<Fmt::BF16_PAIRS>(a, xt, p0, p1); break;
    case Fmt::INT8: detail::run_format<Fmt::INT8>(a, xt, p0, p1); break;
    case Fmt::INT4: detail::run_format<Fmt::INT4>(a, xt, p0, p1); break;
    case Fmt::W4A8: detail::run_format<Fmt::W4A8>(a, xt, p0, p1); break;
    case Fmt::W8A8: detail::run_format<Fmt::W8A8>(a, xt, p0, p1); break;
  }
}

// Panels a thread should take at a time for a pass of M rows (its blocks' width).
inline int64_t panel_grain(int64_t M, Fmt f, bool stream) {
  if (int8_inputs(f) && M > r_dot(f)) return panels_for(r_dot(f), f, stream);
  return M <= RMAX ? panels_for(static_cast<int>(M), f, stream) : P_PF;
}

// Packing: w [N, K] row-major (nn.Linear's layout) into panels (`out`: panels(N) * panel_bytes, zero padded).
inline int64_t panels(int64_t N) { return (N + PANEL - 1) / PANEL; }

template <typename T>  // float (F32) or uint16_t bfloat16 bits (BF16): [K][PANEL] per panel
void pack_plain(const T* w, int64_t N, int64_t K, T* out) {
  for (int64_t p = 0; p < panels(N); ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < PANEL; ++j) {
        const int64_t n = p * PANEL + j;
        out[(p * K + k) * PANEL + j] = n < N ? w[n * K + k] : T(0);
      }
}

// bfloat16 bits [N, K] -> BF16_PAIRS: [pair_rows(K)][PANEL][2] per panel
inline void pack_pairs(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  const int64_t S = pair_rows(K);
  for (int64_t p = 0; p < panels(N); ++p)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t j = 0; j < PANEL; ++j)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t n = p * PANEL + j, k = 2 * s + h;
          out[((p * S + s) * PANEL + j) * 2 + h] = n < N && k < K ? w[n * K + k] : uint16_t(0);
        }
}

// Quantized weights q [N, K] (int8: [-127, 127]; int4: [-8, 7]) with scales [N, ceil(K / G)] -> INT8 or INT4
// (bits 8 or 4), or for the integer dot product (`dot`) W8A8 (bits 8, G a multiple of 4) or W4A8 (bits 4, G a
// multiple of 8).
inline void pack_quantized(const int8_t* q, const float* scales, int64_t N, int64_t K, int64_t G, int bits,
                           uint8_t* out, bool dot = false) {
  const int64_t groups = (K + G - 1) / G;
  const Fmt f = dot ? (bits == 8 ? Fmt::W8A8 : Fmt::W4A8) : bits == 8 ? Fmt::INT8 : Fmt::INT4;
  const int64_t stride = panel_bytes(f, K, G), gb = group_bytes(f, G);
  for (int64_t p = 0; p < panels(N); ++p)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* h = out + p * stride + g * gb;
      for (int64_t j = 0; j < PANEL; ++j) {
        const int64_t n = p * PANEL + j;
        const float s = n < N ? scales[n * groups + g] : 0.f;
        std::memcpy(h + 4 * j, &s, 4);
      }
      uint8_t* body = h + PANEL * 4;
      auto value = [&](int64_t n, int64_t k) -> int { return n < N && k < K ? q[n * K + k] : 0; };
      if (f == Fmt::W8A8) {  // per 4 values of k: 4 bytes per output, byte b = k + b
        for (int64_t i = 0; i < G / 4; ++i)
          for (int64_t j = 0; j < PANEL; ++j)
            for (int64_t b = 0; b < 4; ++b)
              body[(i * PANEL + j) * 4 + b] =
                  static_cast<uint8_t>(static_cast<int8_t>(value(p * PANEL + j, g * G + 4 * i + b)));
        continue;
      }
      if (dot) {  // per 8 values of k: 4 bytes per output, byte b = (k + b, k + 4 + b)
        for (int64_t i = 0; i < G / 8; ++i)
          for (int64_t j = 0; j < PANEL; ++j)
            for (int64_t b = 0; b < 4; ++b) {
              const int64_t n = p * PANEL + j, k = g * G + 8 * i + b;
              body[(i * PANEL + j) * 4 + b] = static_cast<uint8_t>((value(n, k) + 8) | ((value(n, k + 4) + 8) << 4));
            }
        continue;
      }
      if (bits == 4) std::memset(body, 0, G / 2 * PANEL);  // (each byte is or'd from its two nibbles below)
      for (int64_t i = 0; i < (bits == 8 ? G : G / 2); ++i)
        for (int64_t j = 0; j < PANEL; ++j) {
          const int64_t n = p * PANEL + j;
          if (bits == 8) {
            body[i * PANEL + j] = static_cast<uint8_t>(static_cast<int8_t>(value(n, g * G + i)));
          } else {
            for (int e = 0; e < 2; ++e) {
              int64_t byte;
              int shift;
              int4_slot(j, e, byte, shift);
              body[i * PANEL + byte] |= static_cast<uint8_t>((value(n, g * G + 2 * i + e) + 8) << shift);
            }
          }
        }
    }
}

}  // namespace specdec::packed
