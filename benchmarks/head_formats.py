"""The LM head of a ladder shape packed int8 (weight-only, float32 in the inner loop) and w8a8 (int8 inputs, integer
sums), timed alternately in one process on bfloat16 rows of 1, 2, 4 and 8: what w4a8's head costs in each format
(`weights.head_format`).

    flock /tmp/specdec-bench.lock taskset -c 1 python benchmarks/head_formats.py --shape qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script below

from size_ladder import SHAPES  # noqa: E402
from specdec.runtime import rowwise  # noqa: E402
from specdec.runtime.weights import DEFAULT_GROUP, PackedLinear  # noqa: E402

FORMATS = ("int8", "w8a8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rowwise.load_kernel()
    _, hidden, _, _, _, _, vocab, _ = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    heads = {f: PackedLinear.pack(linear, f, DEFAULT_GROUP) for f in FORMATS}
    nbytes = heads["int8"].packed.numel() * heads["int8"].packed.element_size()
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
        times: dict[str, list[float]] = {f: [] for f in heads}
        for head in heads.values():
            head(x)
        for _ in range(args.repeats):
            for f, head in heads.items():
                start = time.perf_counter()
                head(x)
                times[f].append(time.perf_counter() - start)
        ms = {f: statistics.median(v) * 1e3 for f, v in times.items()}
        print(f"{args.shape} head {vocab}x{hidden} ({nbytes / 1e6:.0f} MB) {rows} rows: int8 {ms['int8']:.2f} ms, "
              f"w8a8 {ms['w8a8']:.2f} ms, w8a8 / int8 {ms['w8a8'] / ms['int8']:.3f}  [{rowwise.kernel_tier()}]",
              flush=True)


if __name__ == "__main__":
    main()
