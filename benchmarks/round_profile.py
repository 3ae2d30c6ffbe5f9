"""Where a fast-path round's time goes: wall time per round of `specdec.generate(..., compile=True)` with the
default pair, split into the draft graph, the draft's catch-up, the target's verification graph, the host
work around each graph call (padding, slot tensors, the finite-logits sync), verify, commit, stats and γ
policy, and the decode loop's own Python; then the same graph calls timed alone, with the inputs a round
gives them, and the target's one-token pass (what plain compiled decoding pays per token).

    flock /tmp/specdec-bench.lock python benchmarks/round_profile.py --gamma 3,6 [--prompts 4] [--threads 1]

Timings are perf_counter around each call (no profiler hooks inside the graphs, so nothing is perturbed
beyond the wrappers' own ~1 µs). Each phase's total over all rounds is divided by the number of rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict

import torch

import specdec
from specdec.bench import timing
from specdec.bench.workloads import load_workload
from specdec.core.sampling import SamplingConfig
from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime import draft_graphs, slot_cache
from specdec.runtime.static_lm import StaticCausalLM


class Clock:
    """Accumulates seconds per phase name; `wrap` times a callable under a name."""

    def __init__(self):
        self.s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed


def instrument(dec: SpeculativeDecoder, clock: Clock) -> None:
    """Wrap every piece of a round on this decoder's objects (instance attributes only: nothing global)."""
    target, drafter = dec.target, dec.drafter
    draft_lm = drafter.lm

    def graphs(lm: StaticCausalLM, prefix: str):
        original = lm._fn

        def fn(key, f, symbolic=False):
            if not lm.compile or key[0] == "prefill":  # not part of a round
                return original(key, f, symbolic)
            return clock.wrap(f"{prefix} graph {key[0]}", original(key, f, symbolic))
        lm._fn = fn

    graphs(target, "target")
    graphs(draft_lm, "draft")
    target.score = clock.wrap("target.score (all)", target.score)
    target.score_and_verify = clock.wrap("target.score (all)", target.score_and_verify)  # chains verify in the pass
    target.crop = clock.wrap("target.crop", target.crop)
    drafter.propose = clock.wrap("drafter.propose (all)", drafter.propose)
    draft_lm.catch_up = clock.wrap("draft catch_up", draft_lm.catch_up)
    drafter.commit = clock.wrap("drafter.commit", drafter.commit)
    dec.verify_fn = clock.wrap("verify", dec.verify_fn)
    dec.gamma_policy.choose = clock.wrap("γ policy", dec.gamma_policy.choose)
    dec.gamma_policy.update = clock.wrap("γ policy", dec.gamma_policy.update)


def median_ms(fn, repeats: int = 40) -> float:
    return timing.median_ms(fn, repeats, warmup=3)


def guard_ms(fn, repeats: int = 20) -> float:
    """Mean milliseconds per call that the profiler books as Dynamo's cache lookup (guard
    evaluation before a compiled graph runs) for `fn`, one compiled call."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    total = sum(e.cpu_time_total for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup")
    return total / 1e3 / repeats


def alone(target, draft, context: torch.Tensor, gamma: int) -> dict[str, float]:
    """The round's graph calls timed alone, after `context` (cache as a round finds it), and the host-side
    wrappers around them (`score`, `draft_steps`) against the bare compiled callables."""
    out = {}
    n = context.shape[0]
    sampling = SamplingConfig()
    tgt = StaticCausalLM(target, compile=True)
    tgt.buckets = (gamma + 1,)
    tgt.ensure_capacity(n + 128 + gamma + 1)
    tgt.prefill(context[:-1])
    ids = context[-gamma - 1:].clone()

    def score():
        tgt.crop(n - 1)
        tgt.score(ids)
    out["target score(γ+1) via adapter"] = median_ms(score)
    fn = tgt._fn(("pass", gamma + 1, tgt.max_len, False, False), slot_cache.run_model)
    slots = torch.arange(n - 1, n + gamma)
    inputs = (ids.clone()[None], slots.clone()[None], slots, None, tgt.cache, False, 0)
    with torch.inference_mode():
        out["target graph(γ+1) bare"] = median_ms(lambda: fn(target, *inputs))
        out["target graph(γ+1): Dynamo cache lookup"] = guard_ms(lambda: fn(target, *inputs))
    tgt.buckets = (1,)
    one = context[-1:].clone()

    def score1():
        tgt.crop(n - 1)
        tgt.forward(one)
    out["target pass(1) via adapter"] = median_ms(score1)
    fn1 = tgt._fn(("pass", 1, tgt.max_len, False, False), slot_cache.run_model)
    s1 = torch.tensor([n - 1])
    with torch.inference_mode():
        out["target graph(1) bare"] = median_ms(lambda: fn1(target, one[None], s1[None], s1, None, tgt.cache, False,
                                                            0))
        out["target graph(1): Dynamo cache lookup"] = guard_ms(
            lambda: fn1(target, one[None], s1[None], s1, None, tgt.cache, False, 0))

    lm = StaticCausalLM(draft, compile=True)
    lm.ensure_capacity(n + 128 + gamma + 1)
    lm.prefill(context[:-1])

    def steps():
        lm.crop(n - 2)
        lm.draft_steps(context, gamma, sampling, None)
    out[f"draft steps(γ={gamma}) via adapter"] = median_ms(steps)
    dfn = lm._fn(("draft", gamma, sampling, lm.max_len, None, 2), draft_graphs.draft_chain)  # `_draft_key`'s
    two, slot0, u = context[n - 2:].clone(), torch.tensor(n - 2), torch.zeros(gamma, dtype=torch.float64)
    with torch.inference_mode():
        out[f"draft graph(γ={gamma}) bare"] = median_ms(lambda: dfn(draft, two, slot0, lm.cache, u, gamma, sampling))
        out[f"draft graph(γ={gamma}): Dynamo cache lookup"] = guard_ms(
            lambda: dfn(draft, two, slot0, lm.cache, u, gamma, sampling))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gamma", default="3,6")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target, draft, tokenizer = specdec.load_default(dtype=getattr(torch, args.dtype))
    prompts = load_workload("code", tokenizer, args.prompts)
    report = {}
    for gamma in (int(g) for g in args.gamma.split(",")):
        clock = Clock()
        rounds = tokens = 0
        wall = 0.0
        plain_wall = plain_tokens = 0.0
        for rep in range(args.repeats + 1):
            for p in prompts:
                # plain compiled decoding interleaved with the speculative run: the reference per token
                plain = SpeculativeDecoder(target, None, max_new_tokens=args.max_new_tokens, eos_token_id=[],
                                           compile=True)
                start = time.perf_counter()
                list(plain.stream(p.ids))
                pw = time.perf_counter() - start - plain.stats.prefill_s
                drafter = specdec.DraftModel(draft)  # its own adapter: the wrappers below never nest
                dec = SpeculativeDecoder(target, drafter, gamma=gamma, max_new_tokens=args.max_new_tokens,
                                         eos_token_id=[], compile=True)
                if rep:
                    instrument(dec, clock)
                start = time.perf_counter()
                list(dec.stream(p.ids))
                w = time.perf_counter() - start - dec.stats.prefill_s
                if rep:  # the first pass over the prompts compiles and warms up
                    wall += w
                    rounds += dec.stats.rounds
                    tokens += dec.stats.new_tokens
                    plain_wall += pw
                    plain_tokens += plain.stats.new_tokens
        per_round = {k: 1e3 * v / rounds for k, v in clock.s.items()}
        named = sum(v for k, v in per_round.items() if "(all)" not in k and "graph" not in k
                    and k not in ("draft catch_up",))
        tg = per_round.get("target graph pass", 0.0) + per_round.get("target graph verify", 0.0)
        dg = per_round.get("draft graph draft", 0.0)
        breakdown = {
            "draft graph (γ steps + 2-token catch-up)": dg,
            "draft catch_up (after plain rounds)": per_round.get("draft catch_up", 0.0),
            "draft host work (propose minus graphs)": per_round.get("drafter.propose (all)", 0.0) - dg
            - per_round.get("draft catch_up", 0.0),
            "target verification graph": tg,
            "target host work (score minus graph)": per_round.get("target.score (all)", 0.0) - tg,
            "verify": per_round.get("verify", 0.0),
            "target crop": per_round.get("target.crop", 0.0),
            "drafter commit": per_round.get("drafter.commit", 0.0),
            "γ policy": per_round.get("γ policy", 0.0),
        }
        breakdown["decode loop Python (rest)"] = 1e3 * wall / rounds - (
            per_round.get("drafter.propose (all)", 0.0) + per_round.get("target.score (all)", 0.0) + named)
        context = torch.tensor(prompts[0].ids + list(range(50, 50 + 64)))
        report[f"gamma={gamma}"] = {
            "rounds": rounds, "tokens_per_round": tokens / rounds,
            "round_ms": 1e3 * wall / rounds, "breakdown_ms": breakdown,
            "plain_ms_per_token": 1e3 * plain_wall / plain_tokens,
            "spec_ms_per_token": 1e3 * wall / tokens,
            "speedup_vs_plain_compiled_decode": (plain_wall / plain_tokens) / (wall / tokens),
            "alone_ms": alone(target, draft, context, gamma),
        }
        print(json.dumps({f"gamma={gamma}": report[f"gamma={gamma}"]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
