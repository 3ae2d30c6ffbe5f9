"""Run from the repository root: python docs/bench/bf16-dot-xeon-m207/pairs_ab.py [SHAPE] [ROWS].

bf16 activations on bf16 weights: BF16_PAIRS (vdpbf16ps) against BF16 plain (widen + fp32 fma), passes alternated."""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # linears_pass.py
from linears_pass import linears
from specdec.runtime import rowwise
shape = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-0.5b"
rows = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8").split(",")]
torch.set_num_threads(1); rowwise.load_kernel()
gen = torch.Generator().manual_seed(0); block = (torch.randn(1 << 22, generator=gen) * 0.02)
packs = {"pairs": [], "plain": []}; nbytes = 0
for i, (n, k) in enumerate(linears(shape)):
    idx = (torch.arange(n * k) + i * 1_000_003) % block.numel()
    w = block[idx].view(n, k).to(torch.bfloat16)
    packs["pairs"].append((torch.ops.specdec.pack_weight(w, True), n, k))
    packs["plain"].append((torch.ops.specdec.pack_weight(w, False), n, k))
    nbytes += n * k * 2
print(shape, "%.2f GB" % (nbytes / 1e9), "pairs rank", packs["pairs"][0][0].dim(), "plain rank", packs["plain"][0][0].dim(), flush=True)
def run(layers, m):
    xs = {}
    t = time.perf_counter()
    for p, n, k in layers:
        x = xs.get(k)
        if x is None: x = xs[k] = torch.randn(m, k).to(torch.bfloat16)
        torch.ops.specdec.packed_linear(x, p, None, n)
    return time.perf_counter() - t
for m in rows:
    t = {"pairs": [], "plain": []}
    for rep in range(7):
        for name in ("pairs", "plain") if rep % 2 == 0 else ("plain", "pairs"):
            t[name].append(run(packs[name], m))
    a, b = statistics.median(t["pairs"]), statistics.median(t["plain"])
    print(f"{m} rows: pairs {a*1e3:.1f} ms ({nbytes/a/1e9:.1f} GB/s)  plain {b*1e3:.1f} ms ({nbytes/b/1e9:.1f} GB/s)  plain/pairs {b/a:.3f}", flush=True)
# same bits? (no: the arithmetic differs) - check closeness
p0, n0, k0 = packs["pairs"][0]; q0 = packs["plain"][0][0]
x = torch.randn(8, k0).to(torch.bfloat16)
ya, yb = torch.ops.specdec.packed_linear(x, p0, None, n0), torch.ops.specdec.packed_linear(x, q0, None, n0)
print("max |pairs - plain|", (ya.float() - yb.float()).abs().max().item(), "equal", torch.equal(ya, yb))
