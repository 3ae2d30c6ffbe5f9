"""A pass over every linear layer of a ladder shape, as a model reads them: each packed weight once per pass, in
layer order, through `torch.ops.specdec.packed_linear` (the fast path's op, on torch's threads), at 1 to 16 rows.
Per weight format: the pass time (median), the bytes it reads and the GB/s that implies, and each width's time over
the one-row pass (what a verification pass of γ + 1 rows costs against a decoded token's). Random weights, no model:
the kernel and its memory traffic alone.

    flock /tmp/specdec-bench.lock python benchmarks/linears_pass.py --shape qwen2.5-0.5b --formats bfloat16,int8 \\
        --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script below

from size_ladder import SHAPES  # noqa: E402
from specdec.runtime import rowwise  # noqa: E402
from specdec.runtime.weights import DEFAULT_GROUP, PackedLinear, head_format  # noqa: E402


def linears(shape: str) -> list[tuple[int, int]]:
    """(out, in) of every linear a one-token pass reads, in order: per layer q, k, v, o, gate, up, down; the head."""
    _, hidden, inter, layers, heads, kv, vocab, _ = SHAPES[shape]
    head_dim = hidden // heads
    layer = [(hidden, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden), (hidden, hidden),
             (inter, hidden), (inter, hidden), (hidden, inter)]
    return layer * layers + [(vocab, hidden)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--formats", default="bfloat16,int8,w4a8")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rowwise.load_kernel()
    gen = torch.Generator().manual_seed(0)
    block = torch.randn(1 << 22, generator=gen) * 0.02
    results = []
    for fmt in args.formats.split(","):
        layers, nbytes, shapes = [], 0, linears(args.shape)
        for i, (n, k) in enumerate(shapes):
            weight = block.repeat(-(-n * k // block.numel()))[: n * k].view(n, k).to(torch.bfloat16)
            linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            packed = PackedLinear.pack(linear, head_format(fmt) if i == len(shapes) - 1 else fmt, DEFAULT_GROUP)
            layers.append(packed)
            nbytes += packed.packed.numel() * packed.packed.element_size()
        row = {"shape": args.shape, "format": fmt, "threads": args.threads, "kernel_tier": rowwise.kernel_tier(),
               "bytes": nbytes, "ms": {}}
        for rows in map(int, args.rows.split(",")):
            x = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {p.in_features for p in layers}}

            def one_pass():
                for layer in layers:
                    layer(x[layer.in_features])

            one_pass()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                one_pass()
                times.append(time.perf_counter() - start)
            row["ms"][rows] = statistics.median(times) * 1e3
        one = row["ms"][min(row["ms"])]
        print(f"{args.shape} {fmt:9s} {nbytes / 1e6:7.0f} MB  " + "  ".join(
            f"{r} rows {ms:7.2f} ms ({ms / one:4.2f}x)" for r, ms in row["ms"].items())
            + f"  one row {nbytes / one / 1e6:5.1f} GB/s  [{row['kernel_tier']}, {args.threads} thread(s)]", flush=True)
        results.append(row)
        del layers
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
