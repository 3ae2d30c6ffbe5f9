"""Replay γ policies on recorded greedy acceptance, with a cost model: no timing noise from the machine.

At T = 0 every policy's rounds are fixed by one sequence per prompt: m[t] = 1 when the draft's argmax after
the true prefix equals the target's greedy token t. A round drafting γ at position t accepts the leading run of
ones in m[t:t+γ] and then emits one target token. This script records m for the default pair's `code`
prompts (teacher-forced: one target generation and one draft pass per prompt), then drives each policy through
`choose` / `update` with synthetic `DecodeStats`. A round's cost is the target pass over γ+1 tokens plus γ draft
forwards, taken from a `specdec bench` results.json (`forward_costs`), times lognormal noise.

    python benchmarks/replay_gamma_policies.py --costs docs/bench/forward-costs-float32/results.json \
        --num-prompts 16 --noise 0.2 --seeds 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import numpy as np
import torch

import specdec
from specdec.bench.workloads import load_workload
from specdec.core.stats import DecodeStats
from specdec.engine.adaptive import AdaptiveGamma, HeuristicGamma
from specdec.engine.policies import FixedGamma


def record_traces(num_prompts: int, new_tokens: int) -> list[list[int]]:
    target, draft, tokenizer = specdec.load_default()
    traces = []
    for prompt in load_workload("code", tokenizer, num_prompts, seed=0):
        out = specdec.generate(target, prompt.ids, max_new_tokens=new_tokens, eos_token_id=[])
        full = torch.tensor(prompt.ids + out.tokens)[None]  # [1, n0 + N]
        with torch.inference_mode():
            draft_logits = draft(full).logits[0]  # [n0 + N, V]
        n0 = len(prompt.ids)
        guesses = draft_logits[n0 - 1 : n0 - 1 + new_tokens].argmax(-1).tolist()  # [N]
        traces.append([int(g == t) for g, t in zip(guesses, out.tokens)])
    return traces


def replay(trace, policy, target_ms, draft_ms, noise, rng, other_ms=0.1) -> float:
    """Tokens per second of one request replayed under `policy`."""
    stats, clock, t, total = DecodeStats(), [0.0], 0, 0.0
    if hasattr(policy, "clock"):
        policy.clock = lambda: clock[0]
    while t < len(trace):
        gamma = min(policy.choose(stats), len(trace) - t - 1)
        k = 0
        while k < gamma and trace[t + k]:
            k += 1
        jitter = (lambda: rng.lognormvariate(0.0, noise)) if noise else (lambda: 1.0)
        pass_ms = target_ms[gamma + 1] * jitter()
        drafting_ms = gamma * draft_ms * jitter()
        stats.target_s += pass_ms / 1000
        stats.draft_s += drafting_ms / 1000
        clock[0] += (pass_ms + drafting_ms + other_ms) / 1000
        total += pass_ms + drafting_ms + other_ms
        stats.record_round(gamma, k, "bonus" if k == gamma else "recovered")
        policy.update(stats)
        clock[0] += 0.05  # the consumer's time between rounds
        t += k + 1
    return len(trace) / total * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", required=True, help="a specdec bench results.json with forward_costs")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--noise", type=float, default=0.2, help="lognormal σ of every timing")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--draft-overhead", type=float, default=1.35,
                        help="in-loop draft cost per token over a bare draft forward (catch-up, sampling)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    costs = json.load(open(args.costs))["forward_costs"]
    measured = {int(n): ms for n, ms in costs["target_ms"].items()}
    sizes = sorted(measured)
    # Token counts 1..64: measured, else linear between neighbours, else the last two points' slope onwards.
    target_ms = {n: float(np.interp(n, sizes, [measured[k] for k in sizes])) for n in range(1, sizes[-1] + 1)}
    slope = max(0.0, (measured[sizes[-1]] - measured[sizes[-2]]) / (sizes[-1] - sizes[-2]))
    target_ms.update({n: measured[sizes[-1]] + slope * (n - sizes[-1]) for n in range(sizes[-1] + 1, 65)})
    draft_ms = costs["draft_ms"]["1"] * args.draft_overhead
    traces = record_traces(args.num_prompts, args.new_tokens)
    shared = {"markov": AdaptiveGamma(), "iid": AdaptiveGamma(burst_aware=False)}
    policies = {"plain": lambda: FixedGamma(0), **{f"fixed γ={g}": (lambda g=g: FixedGamma(g)) for g in range(1, 8)},
                "heuristic (+2/-1)": HeuristicGamma,
                "auto, new policy per request": AdaptiveGamma,
                "auto, i.i.d. model, new per request": lambda: AdaptiveGamma(burst_aware=False),
                "auto, one policy across requests (gamma='auto')": shared["markov"].fork,
                "auto, i.i.d. model, across requests": shared["iid"].fork}
    speed = {}
    for name, make in policies.items():
        runs = [[] for _ in traces]
        for s in range(args.seeds):  # prompts in a different order each pass, as requests would come
            order = list(range(len(traces)))
            random.Random(s).shuffle(order)
            for i in order:
                runs[i].append(replay(traces[i], make(), target_ms, draft_ms, args.noise, random.Random(s * 1000 + i)))
        speed[name] = [statistics.mean(r) for r in runs]
    print(f"{len(traces)} prompts x {args.seeds} noise seeds, σ = {args.noise}; speedup over plain per prompt:")
    print("| policy | median | mean | min |\n|:---|---:|---:|---:|")
    for name, values in speed.items():
        ratios = [v / p for v, p in zip(values, speed["plain"])]
        print(f"| {name} | {statistics.median(ratios):.3f} | {statistics.mean(ratios):.3f} | {min(ratios):.3f} |")


if __name__ == "__main__":
    main()
