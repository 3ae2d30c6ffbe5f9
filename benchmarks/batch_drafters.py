"""Batched decoding with every drafter on the default pair: aggregate tokens/s at 1 and 8 rows, in-process.

    python benchmarks/batch_drafters.py --batches 1,8 --max-new-tokens 64 --repeats 2

Methods (greedy, float32, `code` prompts of 128 tokens): plain, the draft model (γ = 3), the shipped EAGLE head
(chain γ = 3; EAGLE-2 tree as `--drafter eagle`), the shipped Medusa heads (chain; static tree) and LayerSkip
(half the target's layers, γ = 3). `*-rowwise` runs the Medusa heads / the EAGLE head once per row
instead of once for the batch (the comparison behind batching them). Every (batch, method) runs once per
repeat, interleaved; each row's tokens are checked against plain decoding's (greedy: identical whatever the
drafter).
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
from specdec.drafters import EAGLE_TREE
from specdec.drafters.medusa import DEFAULT_TREE
from specdec.drafters.per_row import PerRow
from specdec.engine.batch import BatchDecoder
from specdec.hub.default_pair import load_default_heads


def draft_rowwise(heads) -> None:
    """Make `heads` (a BatchDecoder's BatchedEagle / BatchedMedusa) draft each row alone, one head pass per row
    and level (`PerRow.propose`): the baseline that shows what batching the head passes saves."""
    heads.propose = lambda rows, gammas: PerRow.propose(heads, rows, gammas)


def run(target, drafter, prompts, max_new_tokens: int, gamma: int, rowwise: bool = False):
    """(tokens per row, wall seconds, decoder) of one batched generation, rows all added at the start."""
    decoder = BatchDecoder(target, drafter)
    if rowwise:
        draft_rowwise(decoder.drafters)
    start = time.perf_counter()
    decoder.add_many([(i, p, dict(gamma=gamma, max_new_tokens=max_new_tokens, eos_token_id=[]))
                      for i, p in enumerate(prompts)])
    stats = [row.stats for row in decoder.rows]
    tokens = {i: [] for i in range(len(prompts))}
    draft_s = target_s = 0.0
    while len(decoder):
        before = decoder.rows[0].stats
        d0, t0 = before.draft_s, before.target_s
        for event in decoder.step():
            tokens[event.key].extend(event.tokens)
        draft_s += before.draft_s - d0  # every row records the round's whole (batched) draft and target time
        target_s += before.target_s - t0
    wall = time.perf_counter() - start
    return [tokens[i] for i in range(len(prompts))], wall, stats, draft_s, target_s


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--methods", default="plain,draft,eagle-chain,eagle-chain-rowwise,eagle-tree,"
                        "eagle-tree-rowwise,medusa-chain,medusa-tree,medusa-tree-rowwise,layer-skip")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = specdec.load_default()
    heads = load_default_heads(target)
    makers = {
        "plain": lambda: None,
        "draft": lambda: specdec.DraftModel(draft),
        "eagle-chain": lambda: specdec.Eagle(target, heads["eagle"]),
        "eagle-chain-rowwise": lambda: specdec.Eagle(target, heads["eagle"]),
        "eagle-tree": lambda: specdec.Eagle(target, heads["eagle"], **EAGLE_TREE),
        "eagle-tree-rowwise": lambda: specdec.Eagle(target, heads["eagle"], **EAGLE_TREE),
        "medusa-chain": lambda: specdec.Medusa(target, heads["medusa"]),
        "medusa-tree": lambda: specdec.Medusa(target, heads["medusa"], tree=DEFAULT_TREE),
        "medusa-tree-rowwise": lambda: specdec.Medusa(target, heads["medusa"], tree=DEFAULT_TREE),
        "layer-skip": lambda: specdec.LayerSkip(target),
    }
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [p.ids for p in code_prompts(tokenizer, max(batches), 128)]
    for method in methods:  # warm-up: every code path once
        run(target, makers[method](), prompts[:2], 4, args.gamma, method.endswith("rowwise"))
    rates: dict[tuple[int, str], list[float]] = {}
    info: dict[tuple[int, str], dict] = {}
    reference: dict[int, list[list[int]]] = {}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for b in batches:
            for method in methods:
                tokens, wall, stats, draft_s, target_s = run(target, makers[method](), prompts[:b],
                                                             args.max_new_tokens, args.gamma,
                                                             method.endswith("rowwise"))
                reference.setdefault(b, tokens if method == "plain" else None)
                identical = reference[b] is None or tokens == reference[b]
                rates.setdefault((b, method), []).append(sum(map(len, tokens)) / wall)
                drafted = sum(s.drafted for s in stats)
                info[(b, method)] = {
                    "identical_to_plain": identical,
                    "alpha": round(sum(s.accepted for s in stats) / drafted, 3) if drafted else None,
                    "tau": round(sum(s.new_tokens for s in stats) / max(1, sum(s.target_forwards for s in stats)), 2),
                    "draft_share": round(draft_s / wall, 3), "target_share": round(target_s / wall, 3),
                }
        loads.append(os.getloadavg()[0])
    for b in batches:
        plain = statistics.median(rates[(b, "plain")]) if (b, "plain") in rates else None
        for method in methods:
            rate = statistics.median(rates[(b, method)])
            print(json.dumps({"batch": b, "method": method, "tokens_per_s": round(rate, 1),
                              "runs": [round(x, 1) for x in rates[(b, method)]],
                              "vs_plain": round(rate / plain, 2) if plain else None, **info[(b, method)]}))
    print(json.dumps({"load_1min": [round(x, 2) for x in loads]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
