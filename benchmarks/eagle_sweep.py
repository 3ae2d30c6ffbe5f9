"""Sweep Eagle's tree settings (top_k, depth, max_nodes) on the default pair, eager and compiled, side by side.

    python benchmarks/eagle_sweep.py [--head DIR | --heads eagle=default,eagle3=DIR,eagle3-v2048=DIR:2048]
                                  [--configs 4:8:24,3:6:12,1:6:6] [--modes eager,compiled]
                                  [--num-prompts 4] [--max-new-tokens 128] [--temperature 0] [--no-time]

`--heads` compares several heads in one interleaved run: NAME=DIR ("default" = the shipped EAGLE head,
"default3" = the shipped EAGLE-3 head); DIR:N gives an EAGLE-3 head sharing the target's LM head a reduced
draft vocabulary of the N most frequent tokens of the training split (`EagleHead.with_draft_vocab`).

Every (config, mode) decodes the same held-out `code` prompts; prompts are the outer loop, so configs are
interleaved in time (ratios are side by side). One warm-up request per (config, mode) first (compiles).
Prints τ (new tokens per target forward), tok/s, the draft's share of wall time, and the machine load.
Greedy outputs are checked token-identical to plain decoding. `top_k` 1 is the chain of `depth` tokens.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import specdec
from specdec.bench.workloads import code_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", default=None, help="EAGLE head directory (default: the shipped one)")
    p.add_argument("--heads", default=None, help="NAME=DIR[:N],... several heads side by side (see above)")
    p.add_argument("--configs", default="4:8:24,4:6:16,3:6:12,1:6:6", help="top_k:depth:max_nodes, comma list")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--draft", action="store_true", help="also the draft model, compiled, γ = --draft-gamma")
    p.add_argument("--draft-gamma", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    target, draft, tokenizer = specdec.load_default()
    heads = _heads(args, target, tokenizer)
    prompts = code_prompts(tokenizer, args.num_prompts)
    modes = {"eager": False, "compiled": True}
    runs = []
    for head_name, head in heads.items():
        for spec in args.configs.split(","):
            top_k, depth, max_nodes = (int(x) for x in spec.split(":"))
            for mode in args.modes.split(","):
                runs.append((f"{head_name} {top_k}:{depth}:{max_nodes} {mode}",
                             lambda h=head, k=top_k, d=depth, m=max_nodes: specdec.Eagle(target, h, top_k=k, depth=d,
                                                                                         max_nodes=m),
                             depth, modes[mode]))
    if args.draft:
        runs.append((f"draft γ={args.draft_gamma} compiled", lambda: specdec.DraftModel(draft), args.draft_gamma, True))
    runs.append(("plain compiled", lambda: None, 1, True))
    greedy = args.temperature == 0
    refs = {}
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              seed=0)
    print("load before:", os.getloadavg())
    for name, make, gamma, compile in runs:  # warm-up: compiles every shape outside the timings
        t = time.perf_counter()
        specdec.generate(target, prompts[0].ids, drafter=make(), gamma=gamma, compile=compile, **kw)
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
    totals = {name: [0, 0, 0.0, 0.0] for name, *_ in runs}  # tokens, target forwards, wall, draft
    for prompt in prompts:
        if greedy:
            refs[prompt.name] = specdec.generate(target, prompt.ids, max_new_tokens=args.max_new_tokens).tokens
        for name, make, gamma, compile in runs:
            out = specdec.generate(target, prompt.ids, drafter=make(), gamma=gamma, compile=compile, **kw)
            if greedy:
                assert out.tokens == refs[prompt.name], f"{name} differs from plain decoding on {prompt.name}"
            s = out.stats
            tot = totals[name]
            tot[0] += s.new_tokens
            tot[1] += s.target_forwards
            tot[2] += s.wall_s
            tot[3] += s.draft_s
    print("load after:", os.getloadavg())
    base = totals["plain compiled"][0] / totals["plain compiled"][2]
    print(f"| method | τ | tok/s | vs plain compiled | draft share |\n|:---|---:|---:|---:|---:|")
    for name, (tokens, forwards, wall, draft_s) in totals.items():
        print(f"| {name} | {tokens / forwards:.2f} | {tokens / wall:.1f} | {tokens / wall / base:.2f}x | "
              f"{draft_s / wall:.0%} |")


def _heads(args, target, tokenizer) -> dict:
    """{name: EagleHead} from --heads (or the single --head / the shipped head, named "eagle")."""
    if args.heads is None:
        head = specdec.EagleHead.load(args.head, target) if args.head else specdec.load_default_heads(target)["eagle"]
        return {"eagle": head}
    out = {}
    for item in args.heads.split(","):
        name, spec = item.split("=", 1)
        path, _, size = spec.partition(":")
        shipped = {"default": "eagle", "default3": "eagle3"}
        head = (specdec.load_default_heads(target)[shipped[path]] if path in shipped
                else specdec.EagleHead.load(path, target))
        if size:
            head = head.with_draft_vocab(target, frequent_tokens(tokenizer, int(size)))
        out[name] = head
    return out


def frequent_tokens(tokenizer, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the stdlib corpus's train split (EAGLE-3's draft vocabulary)."""
    from pathlib import Path

    from specdec.training.data import cached_tokens
    from specdec.training.heads import draft_vocabulary

    return draft_vocabulary(cached_tokens(tokenizer, "train", Path("runs/cache")), size, len(tokenizer))


if __name__ == "__main__":
    main()
