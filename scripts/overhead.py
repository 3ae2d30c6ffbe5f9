"""Per-round overhead of the decode loop: all work except the two models' forward passes, as a percentage
of one target forward. Usage: python scripts/overhead.py [--default] (default: random Llama pair of
realistic width; --default: the shipped default pair; --compile: on the fast path)."""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specdec
from specdec.decoding import SpeculativeDecoder


def random_pair():
    torch.manual_seed(0)
    common = dict(vocab_size=8192, max_position_embeddings=2048, num_attention_heads=8, num_key_value_heads=8)
    target = LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, **common))
    draft = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=1, **common))
    return target.eval(), draft.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--default", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true",
                        help="the fast path (the draft's warp/argmax then runs inside its compiled graph and "
                        "counts as draft forward time)")
    args = parser.parse_args()
    target, draft = (specdec.load_default()[:2]) if args.default else random_pair()
    prompt = list(range(10, 110))
    for temperature, extra in ((0.0, {}), (1.0, {"top_k": 50, "top_p": 0.9})):
        pct, per_round_ms, fwd_ms = [], [], []
        for r in range(args.repeats + 1):
            drafter = specdec.DraftModel(draft)
            dec = SpeculativeDecoder(target, drafter, gamma=4, max_new_tokens=128, temperature=temperature,
                                     seed=r, eos_token_id=[], compile=args.compile, **extra)
            list(dec.stream(prompt))
            s = dec.stats
            forwards_s = s.prefill_s + dec.target.forward_s + drafter.lm.forward_s + drafter.lm.prefill_s
            overhead = (s.wall_s - forwards_s) / s.rounds
            one_target = dec.target.forward_s / dec.target.forwards
            if r:  # first run is warm-up
                pct.append(100 * overhead / one_target)
                per_round_ms.append(1e3 * overhead)
                fwd_ms.append(1e3 * one_target)
        print(f"T={temperature} {extra}: overhead/round {statistics.median(per_round_ms):.3f} ms = "
              f"{statistics.median(pct):.1f}% of one target forward ({statistics.median(fwd_ms):.2f} ms)")


if __name__ == "__main__":
    main()
