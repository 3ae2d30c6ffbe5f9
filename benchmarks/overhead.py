"""Per-round overhead of the decode loop: all work except the two models' forward passes, as a percentage
of one target forward. Usage: python benchmarks/overhead.py [--default] (default: random Llama pair of
realistic width; --default: the shipped default pair; --compile: on the fast path).

On the fast path at T > 0 the target's pass also runs the warp and the rejection rule in its graph
(`StaticCausalLM.score_and_verify`), so by the definition above their cost counts as target forward time.
With --compile the script also times that pass against the plain pass of the same shape (interleaved) and
prints the overhead with the difference counted as overhead, against the plain pass.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specdec
from specdec.engine.decoding import SpeculativeDecoder


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
    parser.add_argument("--unfused", action="store_true",
                        help="with --compile, also run T = 1 with the target's warp and rejection rule eager "
                        "after a plain pass (as before they ran in its graph), interleaved with the fused runs")
    args = parser.parse_args()
    target, draft = (specdec.load_default()[:2]) if args.default else random_pair()
    prompt = list(range(10, 110))
    sampled = {"temperature": 1.0, "top_k": 50, "top_p": 0.9}
    arms = {"T=0.0 {}": ({"temperature": 0.0}, True), f"T=1.0 {sampled}": (sampled, True)}
    if args.compile and args.unfused:
        arms[f"T=1.0 {sampled}, unfused"] = (sampled, False)
    runs = {name: ([], [], []) for name in arms}  # % of a target pass, ms/round, ms/target pass
    decoders = {}
    for r in range(args.repeats + 1):  # the arms interleaved, repeat by repeat
        for name, (options, fused) in arms.items():
            drafter = specdec.DraftModel(draft)
            dec = SpeculativeDecoder(target, drafter, gamma=4, max_new_tokens=128, seed=r, eos_token_id=[],
                                     compile=args.compile, **options)
            dec.fused_verify = dec.fused_verify and fused
            list(dec.stream(prompt))
            s = dec.stats
            forwards_s = s.prefill_s + dec.target.forward_s + drafter.lm.forward_s + drafter.lm.prefill_s
            overhead = (s.wall_s - forwards_s) / s.rounds
            one_target = dec.target.forward_s / dec.target.forwards
            if r:  # first run is warm-up
                for values, value in zip(runs[name], (100 * overhead / one_target, 1e3 * overhead, 1e3 * one_target)):
                    values.append(value)
            decoders[name] = dec
    for name, (pct, per_round_ms, fwd_ms) in runs.items():
        print(f"{name}: overhead/round {statistics.median(per_round_ms):.3f} ms = "
              f"{statistics.median(pct):.1f}% of one target forward ({statistics.median(fwd_ms):.2f} ms)")
        dec = decoders[name]
        if args.compile and not dec.sampling.greedy and dec.fused_verify:
            fused_ms, plain_ms = fused_pass_cost(dec)
            with_rule = statistics.median(per_round_ms) + fused_ms - plain_ms
            print(f"  verifying pass {fused_ms:.3f} ms vs plain pass {plain_ms:.3f} ms (interleaved medians): "
                  f"counting the difference as overhead, {with_rule:.3f} ms = {100 * with_rule / plain_ms:.1f}% "
                  "of one plain target pass")


def fused_pass_cost(dec, calls: int = 60) -> tuple[float, float]:
    """Median ms of the target's verifying pass (warp + rejection rule in its graph) and of its plain pass
    over the same γ+1 rows, interleaved, on the decoder's warm target adapter (both shapes compiled)."""
    target, gamma = dec.target, 4
    length = target.length
    ids = torch.arange(10, 10 + gamma + 1)
    with torch.inference_mode():
        draft_probs = torch.full((gamma, target.vocab_size), 1.0 / target.vocab_size)  # [γ, V]
    fused, plain = [], []
    for _ in range(calls):
        t = time.perf_counter()
        target.score_and_verify(ids, draft_probs, dec.sampling, dec.generator)
        fused.append(time.perf_counter() - t)
        target.crop(length)
        t = time.perf_counter()
        target.score(ids)
        plain.append(time.perf_counter() - t)
        target.crop(length)
    return 1e3 * statistics.median(fused), 1e3 * statistics.median(plain)


if __name__ == "__main__":
    main()
