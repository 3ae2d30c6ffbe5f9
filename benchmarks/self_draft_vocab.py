"""What a reduced draft vocabulary costs `SelfDraft` in acceptance: α and τ of the default target's own quantized
copy over its whole vocabulary and over the default pair's N most frequent tokens (`draft_vocab`, FR-Spec), on the
bench's held-out `code` and `edit` prompts. Not a timing: the cost side (a draft step's bytes) is
benchmarks/oracle_speedup.py's --draft-vocab at the ladder's sizes.

    python benchmarks/self_draft_vocab.py [--formats w4a8,int8] [--vocabs 0,2048,1024] [--prompts 8] [--json OUT]

Per format, vocabulary, workload and temperature (T = 0; T = 1 with top-k 50 / top-p 0.9, seed = prompt index):
pooled α (accepted ÷ drafted tokens that were tested), τ (new tokens ÷ target passes) and, at T = 0, the share of the
target's own greedy tokens inside the vocabulary (the most a reduced draft can propose), and inside the N lowest
token ids instead (a BPE tokenizer numbers its tokens in merge order, roughly by frequency: a vocabulary for a model
that ships no ranking). γ 4, 128 new tokens, EOS
ignored, the eager path in the default target's dtype; each speculative output at T = 0 is checked against plain
decoding.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import specdec
from specdec.bench.workloads import load_workload
from specdec.engine.decoding import SpeculativeDecoder
from specdec.hub.default_pair import frequent_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="w4a8,int8", help="SelfDraft formats")
    parser.add_argument("--vocabs", default="0,2048,1024", help="draft vocabulary sizes (0: the whole vocabulary)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, _, tok = specdec.load_default()
    workloads = {w: load_workload(w, tok, args.prompts) for w in ("code", "edit")}
    plain = {w: [specdec.generate(target, p.ids, max_new_tokens=args.new_tokens, eos_token_id=[]).tokens
                 for p in prompts] for w, prompts in workloads.items()}
    rows = []
    for fmt in args.formats.split(","):
        for n in (int(v) for v in args.vocabs.split(",")):
            ids = None if n == 0 else frequent_tokens(n)
            drafter = specdec.SelfDraft(target, fmt, draft_vocab=ids)
            for w, prompts in workloads.items():
                inside = lowest = None
                if ids is not None:
                    kept = set(ids.tolist())
                    greedy = [t for out in plain[w] for t in out]
                    inside = sum(t in kept for t in greedy) / len(greedy)
                    lowest = sum(t < n for t in greedy) / len(greedy)  # a BPE tokenizer's ids: its merge order
                for temperature in (0.0, 1.0):
                    accepted = tested = tokens = passes = 0
                    for i, p in enumerate(prompts):
                        kw = dict(temperature=1.0, top_k=50, top_p=0.9) if temperature else {}
                        dec = SpeculativeDecoder(target, drafter, gamma=args.gamma, max_new_tokens=args.new_tokens,
                                                 eos_token_id=[], seed=i, **kw)
                        out = list(dec.stream(p.ids))
                        if not temperature:
                            assert out == plain[w][i], (fmt, n, w, i)
                        s = dec.stats
                        accepted, tested = accepted + s.accepted, tested + s.accepted + s.recovered
                        tokens, passes = tokens + s.new_tokens, passes + s.target_forwards
                    row = {"format": fmt, "vocab": n or None, "workload": w, "temperature": temperature,
                           "alpha": accepted / tested, "tau": tokens / passes,
                           "greedy_inside": inside if not temperature else None,
                           "greedy_in_lowest_ids": lowest if not temperature else None}
                    rows.append(row)
                    share = ("" if row["greedy_inside"] is None else
                             f", greedy tokens inside {inside:.3f} (in the {n} lowest ids {lowest:.3f})")
                    print(f"SelfDraft {fmt} vocab {n or 'whole'} {w} T={temperature:g}: α {row['alpha']:.3f} "
                          f"τ {row['tau']:.2f}{share}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"gamma": args.gamma, "new_tokens": args.new_tokens,
                                               "prompts": args.prompts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
