"""One-pass block drafters on the default pair: `BlockDraft` (DFlash head) and `ParallelDraft` (PARD) against the
draft model's chain, on the fast path, in one `specdec bench` run (interleaved, rotated).

    python benchmarks/block_drafters.py [--head DIR] [--parallel DIR] [--gamma 4,6,7,8,10] [--num-prompts 8]
                                        [--out docs/bench/cpu-code-block]

--head: a DFlash head (default: the shipped one); --parallel: a draft adapted by `specdec distill --parallel`
(default: the shipped one, if any; else the parallel methods are left out). Prints, per method and γ: tokens/s,
τ, the drafting time per round (ms) and tokens/s against the best draft-model chain (draft / draft-vocab, eager or
compiled, whichever of them --methods names).
"""

from __future__ import annotations

import argparse

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default=None, help="a DFlash head directory (default: the shipped one)")
    parser.add_argument("--parallel", default=None, help="an adapted PARD draft directory (default: the shipped one)")
    parser.add_argument("--gamma", default="4,6,7,8,10")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--methods", default="plain-compiled,draft-compiled,draft-vocab-compiled,dflash-compiled,"
                        "dflash-tree-compiled,parallel-compiled")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write results.json and plots here")
    args = parser.parse_args(argv)

    import specdec
    from specdec.bench import run as run_bench
    from specdec.bench.runner import BenchSettings, parse_gammas
    from specdec.bench.workloads import load_workload
    from specdec.hub.default_pair import parallel_shipped

    torch.set_num_threads(args.threads)
    target, draft, tokenizer = specdec.load_default()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    options: dict = {}
    if args.head is not None:
        options["dflash"] = options["dflash-tree"] = {"head_path": args.head}
    if args.parallel is not None:
        options["parallel"] = {"parallel_draft": args.parallel}
    elif not parallel_shipped():
        methods = [m for m in methods if not m.startswith("parallel")]
    prompts = load_workload("code", tokenizer, args.num_prompts, seed=0)
    settings = BenchSettings(methods=methods, gammas=parse_gammas(args.gamma), max_new_tokens=args.max_new_tokens,
                             repeats=args.repeats, warmup=1, forward_costs=False, drafter_options=options)
    results = run_bench(target, draft, prompts, settings, out=args.out, workload="code", progress=False)
    summaries = results["configs"]
    chains = [s for s in summaries if s["method"].removesuffix("-compiled") in ("draft", "draft-vocab")]
    best = max(chains, key=lambda s: s["tokens_per_s"]) if chains else None
    print(f"{'method':24s} {'γ':>3s} {'tok/s':>8s} {'τ':>6s} {'draft ms/round':>15s} {'vs best chain':>14s} same")
    for s in summaries:
        rounds = s["drafted"] / s["mean_drafted_per_round"] if s["mean_drafted_per_round"] else 0
        per_round = 1e3 * s["draft_s"] / rounds if rounds else 0.0
        ratio = s["tokens_per_s"] / best["tokens_per_s"] if best else float("nan")
        print(f"{s['method']:24s} {s['gamma'] if s['gamma'] is not None else '-':>3} {s['tokens_per_s']:8.1f} "
              f"{s['tau']:6.2f} {per_round:15.3f} {ratio:13.2f}x {s['identical_to_plain']}")
    if best is not None:
        print(f"best draft-model chain: {best['label']} at {best['tokens_per_s']:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
