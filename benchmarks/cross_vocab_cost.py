"""Per-round cost of translating between vocabularies, next to a target pass (issue: drafts with another
tokenizer). Decodes the `code` workload prompts with the default target and a draft with its own tokenizer,
and reports, per method, the time spent in the mapping per round (TLI: placing the draft's logits at the
target's ids; both: re-syncing the draft's token stream; SLEM: re-tokenising the draft's text) against the
target's time per forward pass, plus α and τ.

    python benchmarks/cross_vocab_cost.py --draft DRAFT_DIR [--gamma 3] [--num-prompts 4] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import specdec
from specdec.bench.workloads import load_workload
from specdec.hub.loading import load
from specdec.hub.vocab import vocab_mapping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    target, _, target_tok = specdec.load_default()
    draft, draft_tok = load(args.draft, dtype=torch.float32)
    prompts = load_workload("code", target_tok, args.num_prompts)
    mapping = vocab_mapping(draft_tok, target_tok)
    print(f"intersection: {mapping.summary()}")
    for method in ("tli", "slem"):
        per_round, per_pass, alphas, taus = [], [], [], []
        for prompt in prompts:
            drafter = specdec.DraftModel(draft, tokenizer=draft_tok, target_tokenizer=target_tok, method=method)
            decoder = specdec.SpeculativeDecoder(target, drafter, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
                                                 temperature=args.temperature, eos_token_id=[], seed=0)
            list(decoder.stream(prompt.ids))
            s = decoder.stats
            per_round.append(1e3 * drafter.mapping_s / s.rounds)
            per_pass.append(1e3 * decoder.target.forward_s / decoder.target.forwards)
            alphas.append(s.acceptance_rate)
            taus.append(s.mean_accepted_tokens)
        mr, tp = statistics.median(per_round), statistics.median(per_pass)
        print(f"{method}: mapping {mr:.3f} ms/round, target pass {tp:.2f} ms, ratio {mr / tp:.1%}; "
              f"α={statistics.mean(alphas):.3f} τ={statistics.mean(taus):.2f}")


if __name__ == "__main__":
    main()
