"""What one call of specdec::row_attention costs (one layer's attention in a pass) at a model's head shape, per cache
length and rows in the pass: a decoding step (1 row), a verification pass (γ + 1 rows), a long context.

    flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/attention_rows.py --models qwen2.5-1.5b \\
        --slots 128,1024,4096 --rows 1,5,8 --dtype bfloat16 --json out.json

Random queries, keys and values at the shape's heads, key-value heads and head size (benchmarks/size_ladder.py's
SHAPES), a causal mask over the last rows of the cache (row i of M sees slots 0 .. L - M + i), one thread; the
median of --repeats calls after a warm-up, and the bytes of keys and values a call reads once (each kv head's
slots), as GB/s. For an A/B of two versions of the kernel, run this under each tree's PYTHONPATH (each with its own
TORCH_EXTENSIONS_DIR), alternated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts below

from size_ladder import SHAPES  # noqa: E402
from specdec.bench.timing import median_ms  # noqa: E402
from specdec.runtime.rowwise import load_kernel, row_attention  # noqa: E402


def causal_mask(rows: int, slots: int) -> torch.Tensor:
    """[1, 1, rows, slots]: row i sees slots 0 .. slots - rows + i, as a slot cache's verification pass does."""
    seen = torch.arange(slots)[None, :] <= (slots - rows + torch.arange(rows))[:, None]
    return torch.where(seen, 0.0, float("-inf"))[None, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen2.5-1.5b,default-target")
    parser.add_argument("--slots", default="128,1024,4096", help="cache lengths")
    parser.add_argument("--rows", default="1,5,8", help="query rows per pass")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load_kernel()
    dtype = getattr(torch, args.dtype)
    results = []
    for name in args.models.split(","):
        _, hidden, _, _, heads, kv_heads, _, _ = SHAPES[name]
        dim = hidden // heads
        for slots in (int(s) for s in args.slots.split(",")):
            k, v = (torch.randn(1, kv_heads, slots, dim).to(dtype) for _ in range(2))  # [B, Hkv, L, D]
            for rows in (int(r) for r in args.rows.split(",")):
                q = torch.randn(1, heads, rows, dim).to(dtype)  # [B, H, M, D]
                mask = causal_mask(rows, slots).to(dtype)
                seconds = median_ms(lambda: row_attention(q, k, v, mask, dim**-0.5), args.repeats, warmup=2) / 1e3
                kv_bytes = 2 * k.numel() * k.element_size()
                results.append({"model": name, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "slots": slots,
                                "rows": rows, "dtype": args.dtype, "ms": seconds * 1e3,
                                "kv_gb_per_s": kv_bytes / seconds / 1e9})
                print(f"{name:>16} {heads}/{kv_heads} x {dim}  {slots:5d} slots  {rows:2d} rows  "
                      f"{seconds * 1e3:8.3f} ms  (keys and values {kv_bytes / 1e6:6.2f} MB, "
                      f"{kv_bytes / seconds / 1e9:6.1f} GB/s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "results": results}, indent=2))


if __name__ == "__main__":
    main()
