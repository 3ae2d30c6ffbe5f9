#!/usr/bin/env bash
# The weight-only INT8 / INT4 formats' one-row pass: what their arithmetic costs (same-process A/Bs of the packed
# kernel, benchmarks/kernel_ab.py), one thread pinned to core 1, under the bench lock. Writes log.md beside it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/bench/weight-only-arithmetic-zen4/log.md
ab() { echo; echo "\$ python benchmarks/kernel_ab.py $*"; echo '```'
       flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/kernel_ab.py "$@" 2>&1; echo '```'; }
# INT4's nibbles as the kernel unpacked them before the table lookup (mask, subtract 8, convert)
OLD_Q4='{ const __m512i b_ = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + v * LANES))); const __m512i e_ = _mm512_set1_epi32(8); even = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b_, _mm512_set1_epi32(15)), e_)); odd = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b_, 4), e_)); }'
{
  lscpu | grep -E '^(Model name|CPU family|Model|L3 cache):'
  grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_vnni|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  echo "code of $(git rev-parse --short HEAD) (+ the working tree), $(date -u '+%F %H:%M') UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo
  echo "1. INT4: the table lookup (B, as shipped) against the old unpacking (A). Same bits (tests/test_rowwise.py,"
  echo "   tests/test_kernel_tiers.py: INT4 = float32 on the dequantized weights)."
  ab --weight-only --bits 4 --shape qwen2.5-1.5b --rows 1,2,4,8 --repeats 15 --a "simd::load_q4(s + v * LANES, even, odd);=>$OLD_Q4"
  ab --weight-only --bits 4 --shape qwen2.5-0.5b --rows 1,2,4,8 --repeats 15 --a "simd::load_q4(s + v * LANES, even, odd);=>$OLD_Q4"
  echo
  echo "2. What the scale's multiply costs: B drops it (wrong outputs: an upper bound on what factoring the scale out of"
  echo "   the inner loop, a format of other bits, could gain)."
  ab --weight-only --bits 8 --shape qwen2.5-1.5b --rows 1,2,4,8 --repeats 15 \
     --b 'simd::mul(simd::load_i8(s + v * LANES), simd::load(scale[p] + v * LANES))=>simd::load_i8(s + v * LANES)'
  ab --weight-only --bits 4 --shape qwen2.5-1.5b --rows 1,2,4,8 --repeats 15 \
     --b 'fma_one(acc, x + 2 * i * R, p * PV + v, simd::mul(even, sc));=>fma_one(acc, x + 2 * i * R, p * PV + v, even);' \
     --b 'fma_one(acc, x + (2 * i + 1) * R, p * PV + v, simd::mul(odd, sc));=>fma_one(acc, x + (2 * i + 1) * R, p * PV + v, odd);'
  echo "load $(cut -d' ' -f1-3 /proc/loadavg) at the end"
} > "$out"
