"""Where does speculation stop paying as the batch grows? generate_batch over B code prompts x γ (0 = plain).

Prints aggregate tokens/s per (B, γ) on the default pair (float32, greedy) and the best γ per batch size:
the crossover the server's goodput policy should find by itself.

    python scripts/batch_sweep.py --batches 1,4,8,16,32 --gammas 0,2,4 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import specdec
from specdec.bench.workloads import code_prompts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--gammas", default="0,2,4")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats (medians reported)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = specdec.load_default()
    batches = [int(b) for b in args.batches.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    prompts = [p.ids for p in code_prompts(tokenizer, max(batches), 128)]
    specdec.generate_batch(target, prompts[:2], drafter=specdec.DraftModel(draft), max_new_tokens=8)  # warm-up
    runs: dict[tuple[int, int], list[float]] = {}
    alphas: dict[tuple[int, int], float] = {}
    for _ in range(args.repeats):  # every (B, γ) once per repeat, so slow phases of a shared machine hit all
        for b in batches:
            for g in gammas:
                drafter = specdec.DraftModel(draft) if g else None
                start = time.perf_counter()
                outs = specdec.generate_batch(target, prompts[:b], drafter=drafter, gamma=max(g, 1),
                                              max_new_tokens=args.max_new_tokens, eos_token_id=[])
                wall = time.perf_counter() - start
                runs.setdefault((b, g), []).append(sum(len(o.tokens) for o in outs) / wall)
                alphas[(b, g)] = sum(o.stats.accepted for o in outs) / max(1, sum(o.stats.drafted for o in outs))
    table = {key: statistics.median(values) for key, values in runs.items()}
    for b in batches:
        for g in gammas:
            print(json.dumps({"batch": b, "gamma": g, "tokens_per_s": round(table[(b, g)], 1),
                              "runs": [round(x, 1) for x in runs[(b, g)]], "alpha": round(alphas[(b, g)], 3)}))
        best = max(gammas, key=lambda g: table[(b, g)])
        print(json.dumps({"batch": b, "best_gamma": best, "vs_batch_1_plain": round(table[(b, 0)] / table[(batches[0], 0)], 2),
                          "speculative_vs_plain": round(max(table[(b, g)] for g in gammas if g) / table[(b, 0)], 2)}))
    print(json.dumps({"load": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
