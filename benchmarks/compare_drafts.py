"""Two drafts for the same target, side by side on the fast path: τ, per-token α and tokens/s on held-out
`code` and `edit` prompts, greedy (and T = 1 with --temperature 1), interleaved prompt by prompt. Usage:
    flock /tmp/specdec-bench.lock python benchmarks/compare_drafts.py NEW_DRAFT_DIR [--old DIR] [--gammas 3,4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

import specdec
from specdec.bench.workloads import load_workload
from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime.static_lm import StaticCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("new")
    parser.add_argument("--old", default=None, help="default: the shipped draft")
    parser.add_argument("--gammas", default="3,4")
    parser.add_argument("--workloads", default="code,edit")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--compile", default="true", choices=["true", "false"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, old, tokenizer = specdec.load_default()
    if args.old:
        old = AutoModelForCausalLM.from_pretrained(args.old, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(args.new, dtype=torch.float32).eval()
    compiled = args.compile == "true"
    adapter = StaticCausalLM(target, compile=compiled)
    drafters = {"old": specdec.DraftModel(old), "new": specdec.DraftModel(new)}
    sampling = dict(temperature=args.temperature, top_k=50, top_p=0.9) if args.temperature > 0 else {}
    gammas = [int(g) for g in args.gammas.split(",")]
    rows = {}
    for workload in args.workloads.split(","):
        prompts = load_workload(workload, tokenizer, args.num_prompts)
        for gamma in gammas:
            for name, drafter in drafters.items():  # warm-up: compiles, outside the timings
                list(SpeculativeDecoder(adapter, drafter, gamma=gamma, max_new_tokens=args.max_new_tokens,
                                        eos_token_id=[], seed=0, compile=compiled, **sampling).stream(prompts[0].ids))
            for i, prompt in enumerate(prompts):
                for name in (("old", "new") if i % 2 == 0 else ("new", "old")):
                    dec = SpeculativeDecoder(adapter, drafters[name], gamma=gamma, max_new_tokens=args.max_new_tokens,
                                             eos_token_id=[], seed=i, compile=compiled, **sampling)
                    start = time.perf_counter()
                    n = len(list(dec.stream(prompt.ids)))
                    wall = time.perf_counter() - start
                    s = dec.stats
                    rows.setdefault((workload, gamma, name), []).append(
                        dict(tps=n / wall, tau=s.mean_accepted_tokens, accepted=s.accepted,
                             tested=s.accepted + s.recovered, drafted=s.drafted))
    out = {}
    for (workload, gamma, name), runs in rows.items():
        out[f"{workload} γ={gamma} {name}"] = {
            "tok_s_median": round(statistics.median(r["tps"] for r in runs), 1),
            "tau_mean": round(statistics.fmean(r["tau"] for r in runs), 3),
            "alpha_per_token": round(sum(r["accepted"] for r in runs) / max(1, sum(r["tested"] for r in runs)), 3),
        }
        print(f"{workload:5s} γ={gamma} {name}: {out[f'{workload} γ={gamma} {name}']}", flush=True)
    for workload in args.workloads.split(","):
        for gamma in gammas:
            ratios = [n["tps"] / o["tps"] for o, n in zip(rows[(workload, gamma, "old")], rows[(workload, gamma, "new")])]
            print(f"{workload:5s} γ={gamma} new/old tok/s per prompt: median {statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
