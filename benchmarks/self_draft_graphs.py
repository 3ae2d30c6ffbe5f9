"""A/B of a SelfDraft's compiled draft graphs on the shipped default target: one graph of γ steps per γ ("chain",
what a small draft model uses) against one one-step graph called γ times ("step", `SelfDraft.per_step_graphs`).

Per variant and γ: the compile time the requests paid in this process, and the decode tokens/s (median, range)
over the held-out code prompts, every output checked identical to plain decoding on the compiled path. The variants
run in the order given, in one process, so the second finds the target's verification passes compiled:

    python benchmarks/self_draft_graphs.py --variants step,chain --num-prompts 8
"""

from __future__ import annotations

import argparse
import statistics

import torch

import specdec
from specdec.bench.workloads import code_prompts
from specdec.engine.decoding import SpeculativeDecoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="step,chain", help="comma-separated: step, chain (in this order)")
    parser.add_argument("--gammas", default="auto,5", help="comma-separated γ values: integers or auto")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--weights", default="w4a8", help="the self-draft's format")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, _, tokenizer = specdec.load_default(dtype=torch.bfloat16)
    prompts = [torch.tensor(p.ids) for p in code_prompts(tokenizer, args.num_prompts)]
    plain = SpeculativeDecoder(target, None, max_new_tokens=args.max_new_tokens, compile=True)
    expected = [list(plain.stream(p)) for p in prompts]
    for variant in args.variants.split(","):
        if variant not in ("step", "chain"):
            parser.error(f"--variants: {variant!r} is neither step nor chain")
        drafter = specdec.SelfDraft(target, args.weights)
        drafter.per_step_graphs = variant == "step"
        for gamma in args.gammas.split(","):
            gamma = gamma if gamma == "auto" else int(gamma)
            decoder = SpeculativeDecoder(target, drafter, gamma=gamma, max_new_tokens=args.max_new_tokens, compile=True)
            compiled, speeds = 0.0, []
            for prompt, want in zip(prompts, expected, strict=True):
                if list(decoder.stream(prompt)) != want:
                    raise SystemExit(f"{variant} γ={gamma}: output differs from plain decoding")
                compiled += decoder.stats.compile_s
                speeds.append(decoder.stats.tokens_per_s)
            print(f"{variant} γ={gamma}: compile {compiled:.1f} s, tokens/s median {statistics.median(speeds):.1f} "
                  f"({min(speeds):.0f}-{max(speeds):.0f}), {len(prompts)} prompts identical to plain", flush=True)


if __name__ == "__main__":
    main()
