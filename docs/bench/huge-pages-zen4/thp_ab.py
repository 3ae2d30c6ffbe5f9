"""Run from the repository root: HUGE=0 or 1 python docs/bench/huge-pages-zen4/thp_ab.py [SHAPE].

A one-row (and 8-row) bfloat16 pass over the shape's linears (pairs, packed here), on torch's allocator (HUGE=0) or
copied onto empty_on_huge_pages (HUGE=1)."""
import statistics, sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "benchmarks"))
from linears_pass import linears
from specdec.runtime import rowwise
from specdec.runtime.heap import empty_on_huge_pages
import os
HUGE = os.environ.get('HUGE') == '1'
torch.set_num_threads(1); rowwise.load_kernel()
gen = torch.Generator().manual_seed(0); block = torch.randn(1 << 22, generator=gen) * 0.02
packs, nbytes = [], 0
for i, (n, k) in enumerate(linears(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-0.5b")):
    idx = (torch.arange(n * k) + i * 1_000_003) % block.numel()
    w = block[idx].view(n, k).to(torch.bfloat16)
    p = torch.ops.specdec.pack_weight(w, True)
    if HUGE:
        q = empty_on_huge_pages(tuple(p.shape), p.dtype); q.copy_(p); p = q
    packs.append((p, n, k)); nbytes += n * k * 2
xs = {}
def run(m=1):
    t = time.perf_counter()
    for p, n, k in packs:
        x = xs.setdefault((m, k), torch.randn(m, k).to(torch.bfloat16))
        torch.ops.specdec.packed_linear(x, p, None, n)
    return time.perf_counter() - t
run(); ts = [run() for _ in range(9)]; t8 = statistics.median([run(8) for _ in range(5)]) * 1e3
huge = [l for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")][0].split()[1]
ms = statistics.median(ts) * 1e3
print(f"HUGE={int(HUGE)}: {ms:.1f} ms {nbytes / ms / 1e6:.1f} GB/s, AnonHugePages {int(huge) // 1024} MB; "
      f"8 rows {t8:.1f} ms")
