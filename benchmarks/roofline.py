"""Roofline of the default pair's target on this machine: compiled (fast path) and eager forward times for 1
and γ+1 tokens against the floors set by weight bytes ÷ measured memory bandwidth and FLOPs ÷ measured GEMM
throughput. Also times the compiled draft's γ-step graph. Usage:
    flock /tmp/specdec-bench.lock python benchmarks/roofline.py [--gamma 4] [--threads 2] [--context 200]
"""

from __future__ import annotations

import argparse
import json
import logging

import torch

import specdec
from specdec.bench import timing
from specdec.core.sampling import SamplingConfig
from specdec.runtime.causal_lm import CachedCausalLM
from specdec.runtime.static_lm import StaticCausalLM


def median_ms(fn, repeats: int = 30) -> float:
    return timing.median_ms(fn, repeats, warmup=1)


def bandwidth_gb_s() -> float:
    """Read+write bandwidth of a 256 MB copy (well beyond the caches)."""
    src = torch.empty(64 * 1024 * 1024, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / (ms / 1e3) / 1e9


def gemm_gflop_s(m: int = 512) -> float:
    a, b = torch.randn(m, 384), torch.randn(384, 1024)
    ms = median_ms(lambda: a @ b, 50)
    return 2 * m * 384 * 1024 / (ms / 1e3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target, draft, _ = specdec.load_default()
    params = sum(p.numel() for p in target.parameters())
    weight_bytes = params * 4
    bw, gemm = bandwidth_gb_s(), gemm_gflop_s()
    prompt = torch.arange(10, 10 + args.context)
    out = {"threads": args.threads, "params": params, "bandwidth_GB_s": bw, "gemm_GFLOP_s": gemm}
    for n in (1, args.gamma + 1):
        fast = StaticCausalLM(target, compile=True)
        fast.buckets = (n,)
        fast.ensure_capacity(args.context + 2 * n + 8)
        fast.prefill(prompt)
        eager = CachedCausalLM(target)
        eager.prefill(prompt)
        ids = torch.arange(20, 20 + n)

        def run_fast():
            fast.crop(args.context)
            fast.forward(ids)

        def run_eager():
            eager.crop(args.context)
            eager.forward(ids)

        flops = 2 * params * n  # weights (embedding gather excluded: it is tied to the head, counted once)
        out[f"{n}_tokens"] = {
            "compiled_ms": median_ms(run_fast), "eager_ms": median_ms(run_eager),
            "floor_bytes_ms": weight_bytes / (bw * 1e9) * 1e3, "floor_flops_ms": flops / (gemm * 1e9) * 1e3,
        }
    lm = StaticCausalLM(draft, compile=True)
    lm.ensure_capacity(args.context + 16)
    lm.prefill(prompt[:-1])
    context = prompt.clone()

    def run_draft():
        lm.crop(args.context - 1)
        lm.draft_steps(context, args.gamma, SamplingConfig(), None)

    out["draft_graph_ms"] = {f"gamma_{args.gamma}": median_ms(run_draft)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
