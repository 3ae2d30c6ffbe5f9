"""Speculative decoding at the sizes users run, with a controlled acceptance: the oracle harness.

A model of a published shape with random weights (benchmarks/size_ladder.py builds it) accepts nothing
meaningful, so a real drafter's acceptance there says nothing. Here the drafter is an oracle: it knows the target's
greedy continuation (decoded beforehand) and proposes it with each token replaced by a wrong one with probability
1 - α, so acceptance is what we set. It pays a real drafter's cost: each round it runs `SelfDraft` (the target's own
int8 or int4 copy; with --draft-vocab, also over a reduced vocabulary) for the same γ steps and throws its tokens
away. Everything else is the library's own loop on the
fast path's slot cache and kernels (`compile="static"`: no inductor, whose compile at these sizes takes tens of
minutes on a 2-core CPU), greedy, and every output is checked to be the target's greedy continuation.

Per (draft format, α, γ): tokens/s against plain decoding of the same target in the same process (the decoding
rounds, as `DecodeStats.tokens_per_s`; and end to end, with the prefill: on the slot cache the self-draft reads the
target's cache and prefills nothing of its own),
and beside it the paper's projection τ / (γc + v) with τ, c (draft step ÷ one-row target pass) and v (verification
pass ÷ one-row pass) measured in that run. The α values to try: the self-draft's measured acceptance on the default
target (docs/quantization.md: int8 1.00, int4 0.99) and llama.cpp's published top-1 agreement with fp16 on
Llama-3-8B (q8_0 0.977, q4_K_M 0.919; ../shared/research/self-draft.md), which is closer to what a user's model
keeps.

    python benchmarks/oracle_speedup.py --model qwen2.5-1.5b --target-weights bfloat16 --drafts int8,int4 \
        --alphas 0.919,0.977,0.99 --gammas 3,5 --json oracle.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import specdec  # noqa: E402
from specdec.runtime.weights import pack_model  # noqa: E402


class Oracle(specdec.Drafter):
    """Proposes `reference` (the target's greedy continuation of `prompt`) with each token wrong with probability
    1 - alpha, after running `inner`'s proposal for its cost; `inner` keeps its own state as if its tokens had been
    proposed (its cache holds as many positions either way)."""

    def __init__(self, inner: specdec.Drafter, prompt: list[int], reference: list[int], alpha: float, vocab_size: int,
                 seed: int = 0):
        self.inner, self.prompt, self.reference, self.alpha = inner, prompt, reference, alpha
        self.vocab_size = vocab_size
        self.rng = torch.Generator().manual_seed(seed)
        self.steps, self.propose_s = 0, 0.0  # the rounds' drafting (DecodeStats.draft_s also holds its prefill)

    @property
    def capabilities(self):
        return dataclasses.replace(self.inner.capabilities, batched=None)  # one request: its propose, not a form

    def use_fast_path(self, mode):
        self.inner.use_fast_path(mode)

    def plan(self, target):
        return self.inner.plan(target)

    def ensure_capacity(self, tokens):
        self.inner.ensure_capacity(tokens)

    def reset(self, prompt_ids, **kwargs):
        self.inner.reset(prompt_ids, **kwargs)

    def propose(self, context, gamma, sampling, generator):
        start = time.perf_counter()
        paid = self.inner.propose(context, gamma, sampling, generator)  # the real draft's cost, tokens unused
        self.propose_s += time.perf_counter() - start
        self.steps += len(paid)
        done = context.shape[0] - len(self.prompt)  # tokens of the continuation committed so far
        truth = torch.tensor(self.reference[done : done + len(paid)], dtype=torch.long)
        wrong = torch.rand(len(truth), generator=self.rng) >= self.alpha
        shift = torch.randint(1, self.vocab_size, (len(truth),), generator=self.rng)
        return specdec.Proposal(tokens=torch.where(wrong, (truth + shift) % self.vocab_size, truth))

    def commit(self, context, num_accepted, **kwargs):
        self.inner.commit(context, num_accepted, **kwargs)

    @property
    def forwards(self):
        return self.inner.forwards


def main() -> None:
    from size_ladder import SHAPES, build, experts_per_token, weight_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--target-weights", default="bfloat16", help="the target's packed format")
    parser.add_argument("--drafts", default="int8,int4", help="SelfDraft formats")
    parser.add_argument("--draft-vocab", default="0",
                        help="comma list of draft vocabulary sizes N (0: the whole vocabulary): each SelfDraft format "
                             "also over N tokens (ids 0..N-1; the oracle's proposals do not depend on them)")
    parser.add_argument("--alphas", default="0.919,0.977,0.99")
    parser.add_argument("--gammas", default="3,5")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="load the target saved there (size_ladder.py's checkpoint of --model) as a user loads it, "
                             "streamed onto --target-weights, and make the self-drafts from that (a model too large "
                             "to build in float32 in memory: OLMoE-1B-7B's shape)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gammas = [int(g) for g in args.gammas.split(",")]

    start = time.perf_counter()
    if args.checkpoint:  # packed as it is read; the self-drafts quantized from its packed (float) weights
        from specdec.hub.loading import load_model

        target = load_model(args.checkpoint, dtype=torch.float32, weights=args.target_weights)
    else:
        target = build(args.model, torch.float32)
    drafts = {}  # copied before packing
    for fmt in args.drafts.split(","):
        for n in (int(v) for v in args.draft_vocab.split(",")):
            drafts[fmt if n == 0 else f"{fmt}/vocab{n}"] = specdec.SelfDraft(
                target, fmt, draft_vocab=None if n == 0 else torch.arange(n))
    if not args.checkpoint:
        pack_model(target, args.target_weights)
    vocab = target.config.vocab_size
    report = {"model": args.model, "target_weights": args.target_weights, "threads": args.threads,
              "target_weight_bytes": weight_bytes(target, experts_per_token(args.model)),
              "build_s": time.perf_counter() - start,
              "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "runs": []}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]

    def decode(prompt, drafter=None, gamma=None, new=args.new_tokens):
        return specdec.generate(target, prompt, drafter=drafter, gamma=gamma, max_new_tokens=new, temperature=0.0,
                                eos_token_id=[], compile="static")

    references, plain = [], []
    for prompt in prompts:
        out = decode(prompt, new=args.new_tokens + max(gammas) + 1)  # the oracle's continuation, with room past
        references.append(out.tokens)
        plain.append(out.stats)
    one_row_ms = statistics.median(s.target_s / s.target_forwards * 1e3 for s in plain)
    plain_tps = statistics.median(s.tokens_per_s for s in plain)
    # end to end (prefill included) over the same number of new tokens as the speculative runs
    plain_e2e = statistics.median(args.new_tokens / (s.prefill_s + (s.wall_s - s.prefill_s) * args.new_tokens
                                                     / s.new_tokens) for s in plain)
    report["plain"] = {"tokens_per_s": [s.tokens_per_s for s in plain], "one_row_ms": one_row_ms,
                       "prefill_s": [s.prefill_s for s in plain]}
    print(f"{args.model} target {args.target_weights} ({report['target_weight_bytes'] / 1e9:.2f} GB of linear "
          f"weights): plain {plain_tps:.2f} tok/s, one-row pass {one_row_ms:.0f} ms", flush=True)

    for fmt, draft in drafts.items():
        for gamma in gammas:
            for alpha in (float(a) for a in args.alphas.split(",")):
                stats, step_ms = [], []
                for i, (prompt, reference) in enumerate(zip(prompts, references)):
                    oracle = Oracle(draft, prompt, reference, alpha, vocab, seed=i)
                    out = decode(prompt, oracle, gamma)
                    assert out.tokens == reference[: args.new_tokens], "speculative != plain decoding"
                    stats.append(out.stats)
                    step_ms.append(oracle.propose_s / oracle.steps * 1e3)
                tau = statistics.median(s.new_tokens / s.rounds for s in stats)
                c = statistics.median(step_ms) / one_row_ms
                v = statistics.median(s.target_s / s.target_forwards * 1e3 for s in stats) / one_row_ms
                speedups = [s.tokens_per_s / plain_tps for s in stats]
                with_prefill = [s.new_tokens / s.wall_s / plain_e2e for s in stats]
                run = {"draft": fmt, "gamma": gamma, "alpha": alpha,
                       "alpha_realized": statistics.median(s.estimated_alpha for s in stats), "tau": tau, "c": c,
                       "v": v, "projected": tau / (gamma * c + v), "speedup": speedups,
                       "end_to_end": with_prefill, "tokens_per_s": [s.tokens_per_s for s in stats],
                       "prefill_s": [s.prefill_s for s in stats]}
                report["runs"].append(run)
                print(f"  SelfDraft {fmt} γ {gamma} α {alpha:.3f} (realized {run['alpha_realized']:.3f}): "
                      f"τ {tau:.2f}, c {c:.3f}, v {v:.2f} -> projected {run['projected']:.2f}x, measured "
                      f"{statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f}); "
                      f"with the prefills {statistics.median(with_prefill):.2f}x", flush=True)
    report["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
