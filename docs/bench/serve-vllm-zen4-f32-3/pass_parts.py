"""The two kernels of a 32-row float32 decoding pass of the default target, one thread: `specdec::packed_linear`
over the target's linears (a layer's fused q/k/v 384x1152, o 384x384, fused gate/up 384x2048, down 1024x384, times
six layers, and the tied 384x8192 head) against `F.linear`, and `specdec::row_attention` over one layer's cache
(6 heads of 64, 512 slot columns, S of them visible to every row). Medians of 300 / 200 calls.

    flock /tmp/specdec-bench.lock taskset -c 1 python docs/bench/serve-vllm-zen4-f32-3/pass_parts.py
"""

import torch

from specdec.bench.timing import median_ms
from specdec.runtime import rowwise

rowwise.load_kernel()
torch.set_num_threads(1)
LINEARS = [(384, 1152, 6), (384, 384, 6), (384, 2048, 6), (1024, 384, 6), (384, 8192, 1)]  # (in, out, count)
for rows in (1, 8, 32):
    packed = library = flop = 0.0
    for k, n, count in LINEARS:
        weight, x = torch.randn(n, k), torch.randn(rows, k)
        panels = torch.ops.specdec.pack_weight(weight)
        packed += count * median_ms(lambda: torch.ops.specdec.packed_linear(x, panels, None, n), 300, warmup=10)
        library += count * median_ms(lambda: torch.nn.functional.linear(x, weight), 300, warmup=10)
        flop += count * 2 * rows * k * n
    print(f"linears, {rows} rows: packed_linear {packed:.2f} ms ({flop / packed / 1e6:.0f} GFLOP/s), "
          f"F.linear {library:.2f} ms ({flop / library / 1e6:.0f} GFLOP/s)", flush=True)
for visible in (130, 256, 500):
    q = torch.randn(32, 6, 1, 64)
    k, v = torch.randn(32, 6, 512, 64), torch.randn(32, 6, 512, 64)
    mask = torch.full((32, 1, 1, 512), float("-inf"))
    mask[..., :visible] = 0
    ms = median_ms(lambda: rowwise.row_attention(q, k, v, mask), 200, warmup=10)
    read = 2 * 32 * 6 * visible * 64 * 4  # the visible keys and values, bytes
    print(f"attention, 32 rows, S = {visible}: {1e3 * ms:.0f} us a layer, {6 * ms:.2f} ms for six "
          f"({read / ms / 1e6:.1f} GB/s of keys and values)", flush=True)
a = torch.randn(2048, 2048)
roof = 2 * 2048 ** 3 / median_ms(lambda: a @ a, 20, warmup=10) / 1e6
print(f"float32 2048x2048 matmul (torch): {roof:.0f} GFLOP/s")
