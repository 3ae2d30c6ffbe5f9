"""Probe: the default target's batched pass, eager (`BatchedCausalLM`) vs compiled over a preallocated cache.

For each B and q: B rows with `--context` cached tokens each, one pass of q new tokens per row, rolled back
after every call; medians of `--calls` calls. The compiled pass uses `StaticBatchedCausalLM` (fixed B buckets).

    python benchmarks/batch_static_probe.py --batches 1,8,32 --queries 1,3,5
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import specdec
from specdec.bench.timing import median_ms
from specdec.runtime.batch_lm import BatchedCausalLM
from specdec.runtime.batch_static import StaticBatchedCausalLM


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--queries", default="1,3,5")
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    target, _, _ = specdec.load_default()
    g = torch.Generator().manual_seed(0)
    print("| B | q | eager ms | compiled ms | eager/compiled | compile s |")
    print("|---|---|---|---|---|---|")
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [torch.randint(0, 8000, (args.context,), generator=g) for _ in range(b)]
        eager = BatchedCausalLM(target)
        eager.add_rows(prompts)
        fast = StaticBatchedCausalLM(target, max_len=args.max_len)
        fast.add_rows(prompts)
        for q in [int(x) for x in args.queries.split(",")]:
            inputs = [torch.randint(0, 8000, (q,), generator=g) for _ in range(b)]
            lengths = eager.lengths.clone()

            def run(lm):
                lm.forward(inputs)
                lm.crop(lengths)

            t = time.perf_counter()
            run(fast)
            compile_s = time.perf_counter() - t
            te, tf = median_ms(lambda: run(eager), args.calls), median_ms(lambda: run(fast), args.calls)
            print(f"| {b} | {q} | {te:.2f} | {tf:.2f} | {te / tf:.2f}x | {compile_s:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
