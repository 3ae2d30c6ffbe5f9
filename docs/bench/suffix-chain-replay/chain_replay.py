"""SuffixDecoding's trees cut to one path, by offline replay (benchmarks/suffix_replay.py's rounds: at T = 0 a round
accepts the longest proposed path that spells the target's greedy output): τ and nodes a round against prompt lookup
and the tree, on `agent` and `edit` (8 held-out prompts, seed 1, 128 tokens, the requests in order through one
drafter). A chain verifies in passes as narrow as prompt lookup's; would its τ carry it to 1.3x prompt lookup?

    python docs/bench/suffix-chain-replay/chain_replay.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import specdec  # noqa: E402
from specdec.bench.workloads import load_workload  # noqa: E402
from specdec.drafters.base import Proposal  # noqa: E402
from specdec.drafters.suffix import SuffixDecoding  # noqa: E402
from suffix_replay import replay  # noqa: E402


class Chain:
    """A SuffixDecoding whose trees are cut to one path: from the root, each node's first child (the trees are grown
    best first, so the first child is the best-scored one)."""

    def __init__(self, inner: SuffixDecoding):
        self.inner = inner

    def use_fast_path(self, fast: bool) -> None:
        self.inner.use_fast_path(fast)

    def reset(self, context: torch.Tensor) -> None:
        self.inner.reset(context)

    def commit(self, context: torch.Tensor, accepted: int) -> None:
        self.inner.commit(context, accepted)

    def propose(self, context, gamma, sampling, state):
        proposal = self.inner.propose(context, gamma, sampling, state)
        if proposal is None or proposal.parents is None:
            return proposal
        parents, path, node = proposal.parents.tolist(), [], -1
        while (child := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
            path.append(child)
            node = child
        return Proposal(tokens=proposal.tokens[path])


torch.set_num_threads(1)
target, _, tokenizer = specdec.load_default()
for workload in ("agent", "edit"):
    prompts = load_workload(workload, tokenizer, 8, seed=1)
    requests = [(p.ids, specdec.generate(target, p.ids, max_new_tokens=128, eos_token_id=[]).tokens) for p in prompts]
    for name, make, gamma, fast in [
        ("PromptLookup γ=4", specdec.PromptLookup, 4, False),
        ("PromptLookup γ=6", specdec.PromptLookup, 6, False),
        ("SuffixDecoding() (the tree), fast path", SuffixDecoding, 15, True),
        ("SuffixDecoding() cut to one path", lambda: Chain(SuffixDecoding()), 15, True),
        ("SuffixDecoding(max_nodes=15, max_spec_offset=4) cut to one path",
         lambda: Chain(SuffixDecoding(max_nodes=15, max_spec_offset=4)), 15, True),
        ("SuffixDecoding(max_nodes=31, max_depth=24, max_spec_offset=0) cut to one path (vLLM-like)",
         lambda: Chain(SuffixDecoding(max_nodes=31, max_depth=24, max_spec_offset=0)), 24, True),
    ]:
        tau, per_round = replay(make(), gamma, requests, fast)
        print(f"{workload} | {name} | τ {tau:.2f} | {per_round:.1f} nodes a round", flush=True)
