"""Where does speculation stop paying as the batch grows? generate_batch over B code prompts x γ (0 = plain).

Prints aggregate tokens/s per (B, γ) on the default pair (float32, greedy) and the best γ per batch size:
the crossover the server's goodput policy should find by itself.

    python benchmarks/batch_sweep.py --batches 1,4,8,16,32 --gammas 0,2,4 --max-new-tokens 48
    python benchmarks/batch_sweep.py --batches 1,8,32,64 --gammas 0,4 --paths eager,compiled   # the fast path too

`--paths eager,compiled` runs each (B, γ) on `BatchedCausalLM` and on the batched fast path
(`StaticBatchedCausalLM`, compiled; its query buckets cut to 1 and γ+1 so that few shapes compile, every
shape compiled before the timed runs), interleaved.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import torch

import specdec
from specdec.bench.workloads import code_prompts
from specdec.engine.batch import BatchDecoder


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--gammas", default="0,2,4")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats (medians reported)")
    parser.add_argument("--paths", default="eager", help="eager and/or compiled (the batched fast path)")
    parser.add_argument("--max-len", type=int, default=512, help="the fast path's cache columns")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = specdec.load_default()
    batches = [int(b) for b in args.batches.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    prompts = [p.ids for p in code_prompts(tokenizer, max(batches), 128)]
    specdec.generate_batch(target, prompts[:2], drafter=specdec.DraftModel(draft), max_new_tokens=8)  # warm-up
    logging.basicConfig(level=logging.INFO, format="[specdec] %(message)s")
    paths = args.paths.split(",")
    widths = sorted({1} | {g + 1 for g in gammas if g})
    runs: dict[tuple[int, int, str], list[float]] = {}
    alphas: dict[tuple[int, int, str], float] = {}

    def decode(b: int, g: int, path: str) -> float:
        drafter = specdec.DraftModel(draft) if g else None
        decoder = BatchDecoder(target, drafter, compile=path == "compiled", max_len=args.max_len)
        if path == "compiled":
            decoder.target.query_buckets = tuple(widths)
            decoder.target.precompile([b], widths)  # a no-op once compiled (not timed)
        start = time.perf_counter()
        decoder.add_many([(i, p, dict(gamma=max(g, 1), max_new_tokens=args.max_new_tokens, eos_token_id=[]))
                          for i, p in enumerate(prompts[:b])])
        stats = [row.stats for row in decoder.rows]
        tokens = 0
        while len(decoder):
            tokens += sum(len(e.tokens) for e in decoder.step())
        wall = time.perf_counter() - start
        alphas[(b, g, path)] = sum(s.accepted for s in stats) / max(1, sum(s.drafted for s in stats))
        return tokens / wall

    for b in batches:  # compile first, outside the timed repeats
        for path in paths:
            if path == "compiled":
                decode(b, 0, path)
    for _ in range(args.repeats):  # every (B, γ, path) once per repeat, so slow phases of a shared machine hit all
        for b in batches:
            for g in gammas:
                for path in paths:
                    runs.setdefault((b, g, path), []).append(decode(b, g, path))
    table = {key: statistics.median(values) for key, values in runs.items()}
    for b in batches:
        for path in paths:
            for g in gammas:
                key = (b, g, path)
                print(json.dumps({"batch": b, "gamma": g, "path": path, "tokens_per_s": round(table[key], 1),
                                  "runs": [round(x, 1) for x in runs[key]], "alpha": round(alphas[key], 3)}))
            best = max(gammas, key=lambda g: table[(b, g, path)])
            print(json.dumps({"batch": b, "path": path, "best_gamma": best,
                              "vs_batch_1_plain": round(table[(b, 0, path)] / table[(batches[0], 0, path)], 2),
                              "speculative_vs_plain": round(max(table[(b, g, path)] for g in gammas if g)
                                                            / table[(b, 0, path)], 2)}))
        if "compiled" in paths and "eager" in paths:
            print(json.dumps({"batch": b, "compiled_vs_eager": {
                g: round(table[(b, g, "compiled")] / table[(b, g, "eager")], 2) for g in gammas}}))
    print(json.dumps({"load": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
