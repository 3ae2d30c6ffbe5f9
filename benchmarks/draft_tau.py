"""Pooled τ and per-token α of the shipped draft and a new one on the bench's held-out `code` and `edit` prompts
(8 each, 128 new tokens, γ 3 and 4, T = 0 and T = 1 with top-k 50 / top-p 0.9; eager path, seed = prompt index).
Not a timing. Usage: python benchmarks/draft_tau.py NEW_DRAFT_DIR [OLD_DRAFT_DIR (default: the shipped draft)]"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

import specdec
from specdec.bench.workloads import load_workload
from specdec.engine.decoding import SpeculativeDecoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", help="the new draft's directory")
    parser.add_argument("old", nargs="?", default=None, help="the draft to compare with (default: the shipped one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, old, tok = specdec.load_default()
    new = AutoModelForCausalLM.from_pretrained(args.new, dtype=torch.float32).eval()
    if args.old is not None:
        old = AutoModelForCausalLM.from_pretrained(args.old, dtype=torch.float32).eval()
    res = {}
    for temp in (0.0, 1.0):
        for w in ("code", "edit"):
            prompts = load_workload(w, tok, 8)
            for g in (3, 4):
                for name, d in (("old", old), ("new", new)):
                    acc = tested = toks = passes = 0
                    for i, p in enumerate(prompts):
                        kw = dict(temperature=1.0, top_k=50, top_p=0.9) if temp else {}
                        dec = SpeculativeDecoder(target, specdec.DraftModel(d), gamma=g, max_new_tokens=128,
                                                 eos_token_id=[], seed=i, **kw)
                        list(dec.stream(p.ids))
                        s = dec.stats
                        acc += s.accepted
                        tested += s.accepted + s.recovered
                        toks += s.new_tokens
                        passes += s.target_forwards
                    res[f"T={temp} {w} γ={g} {name}"] = dict(tau=round(toks / passes, 3),
                                                             alpha_token=round(acc / tested, 3))
                    print(f"T={temp} {w} γ={g} {name}", res[f"T={temp} {w} γ={g} {name}"], flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
