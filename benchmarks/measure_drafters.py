"""α, τ and speedup at T = 0 per drafter on the default trained pair, on held-out prompts; what gamma="auto" and
transformers' heuristic chose.

    python benchmarks/measure_drafters.py [n_prompts] [prompt_tokens] [max_new_tokens]
"""
import argparse
import collections
import time

import torch

import specdec
from specdec.engine.adaptive import HeuristicGamma
from specdec.training.corpus import heldout_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n_prompts", type=int, nargs="?", default=6)
    parser.add_argument("prompt_tokens", type=int, nargs="?", default=128)
    parser.add_argument("max_new_tokens", type=int, nargs="?", default=128)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    n, ptoks, new = args.n_prompts, args.prompt_tokens, args.max_new_tokens
    target, draft, tok = specdec.load_default()
    prompts = heldout_prompts(tok, n, ptoks, seed=0)
    L = len(target.model.layers) if hasattr(target, "model") else len(target.transformer.h)
    t0 = time.perf_counter()
    bigram = specdec.Bigram.from_model(target)
    print(f"Bigram.from_model {time.perf_counter()-t0:.1f}s")

    def run(make, gamma):
        a = d = nt = tf = 0
        wall = 0.0
        gam = collections.Counter()
        for p in prompts:
            out = specdec.generate(target, p, drafter=make() if make else None,
                                   gamma=gamma() if callable(gamma) else gamma, max_new_tokens=new, eos_token_id=[])
            s = out.stats
            a += s.accepted
            d += s.drafted
            nt += s.new_tokens
            tf += s.target_forwards
            wall += s.wall_s - s.prefill_s
            gam.update(s.gammas)
        return a / max(d, 1), nt / tf, nt / wall, dict(sorted(gam.items()))

    run(None, 1)
    base = run(None, 1)[2]
    print(f"plain: {base:.1f} tok/s  (target {L} layers, {len(prompts)} prompts x {ptoks} tokens, {new} new)")
    makers = {"draft-model": lambda: specdec.DraftModel(draft), "prompt-lookup": specdec.PromptLookup,
              "bigram": lambda: bigram, f"layer-skip {L//2}/{L}": lambda: specdec.LayerSkip(target, L // 2),
              f"layer-skip {L-1}/{L}": lambda: specdec.LayerSkip(target, L - 1)}
    for name, make in makers.items():
        for g in (2, 4, "auto", "heur"):
            al, tau, tps, gam = run(make, HeuristicGamma if g == "heur" else g)
            extra = f"  γ' per round {gam}" if g in ("auto", "heur") else ""
            print(f"{name:18s} γ={g!s:5s} α={al:.3f} τ={tau:.2f} speedup={tps / base:.2f}{extra}", flush=True)


if __name__ == "__main__":
    main()
