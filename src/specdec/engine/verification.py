"""Verification of a round, row by row, one way for a lone request and a batch: each row gets its verdict from
its own slice of the target's pass with its own generator (`core/verify.py` holds the arithmetic):

- a chain, greedy, default rule: `greedy_verdict` on one argmax taken over the whole pass;
- a chain otherwise: `verify_fn(draft_tokens [γ], draft_probs [γ, V] | None, target_logits [γ+1, V], sampling,
  generator)` (default `verify_round`);
- a tree: `tree_verify_fn(proposal, target_logits [N+1, V], sampling, generator)` (default `verify_tree`);
- fused: a target that verifies a chain inside its own pass (`verifies_in_graph`, the fast path) returns the
  verdict with the scores; only for the default rule (a custom verify_fn always gets the logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.core.sampling import SamplingConfig
from specdec.core.tree import TreeMask
from specdec.core.verify import Verdict, greedy_verdict, verify_greedy, verify_sampled, verify_tree
from specdec.drafters.base import Proposal
from specdec.errors import SpecdecError
from specdec.runtime.rowwise import argmax

#: verify_fn(draft_tokens [γ], draft_probs [γ, V] | None, target_logits [γ+1, V], sampling, generator)
VerifyFn = Callable[
    [torch.Tensor, "torch.Tensor | None", torch.Tensor, SamplingConfig, "torch.Generator | None"], Verdict]
#: tree_verify_fn(proposal (tokens [N], draft_probs [N, V] | None, parents [N]), target_logits [N+1, V], sampling,
#: generator) -> Verdict with the accepted path
TreeVerifyFn = Callable[[Proposal, torch.Tensor, SamplingConfig, "torch.Generator | None"], Verdict]


def verify_round(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> Verdict:
    """Greedy: accept the prefix matching the target's argmax. Sampling: the rejection rule on warped probs."""
    if sampling.greedy:
        return verify_greedy(draft_tokens, target_logits)
    target_probs = sampling.warp(target_logits)  # [γ+1, V]
    return verify_sampled(draft_tokens, draft_probs, target_probs, generator)


@dataclass(frozen=True)
class Verified:
    """One row's verification: its verdict, the accepted draft tokens [k], and the columns of its pass to keep
    (the root and the accepted drafts: 0..k for a chain, 0 and 1 + each node of the path for a tree)."""

    verdict: Verdict
    accepted: list[int]
    keep: list[int]

    @classmethod
    def of(cls, proposal: Proposal, tree: TreeMask | None, verdict: Verdict) -> Verified:
        if tree is None:
            k = verdict.num_accepted
            return cls(verdict, proposal.tokens.tolist()[:k], list(range(k + 1)))  # (one list, not a slice op)
        path = list(verdict.path)  # [k] node indices
        return cls(verdict, proposal.tokens[path].tolist(), [0] + [node + 1 for node in path])


class Verifier:
    """The round's verification: `verify_fn` for chains, `tree_verify_fn` for trees; `fused`: let a target that
    can verify inside its own pass do so (the default rule only)."""

    def __init__(self, verify_fn: VerifyFn = verify_round, tree_verify_fn: TreeVerifyFn = verify_tree,
                 fused: bool = True):
        self.verify_fn = verify_fn
        self.tree_verify_fn = tree_verify_fn
        self.default = verify_fn is verify_round
        self.fused = fused and self.default

    def fuses(self, rows: Sequence, trees: Sequence[TreeMask | None], target) -> bool:
        """Does this pass verify inside the target's graph: chains, the default rule, a target that can."""
        return self.fused and target.verifies_in_graph and all(tree is None for tree in trees)

    def verify(self, rows: Sequence, proposals: Sequence[Proposal], trees: Sequence[TreeMask | None],
               logits: torch.Tensor, errors: Sequence[SpecdecError | None]) -> list[Verified | SpecdecError]:
        """Each row's verification from the pass's logits [B, W, V] (row i scored its root and drafts at
        [i, :len+1]), or the error that failed the row (errors[i], or one raised verifying it)."""
        greedy = [self.default and tree is None and row.sampling.greedy for row, tree in zip(rows, trees)]
        best = argmax(logits).tolist() if any(greedy) else None  # [B, W]: one argmax for the pass
        out: list[Verified | SpecdecError] = []
        for i, (row, proposal, tree) in enumerate(zip(rows, proposals, trees)):
            if errors[i] is not None:
                out.append(errors[i])
                continue
            try:
                if greedy[i]:
                    verdict = greedy_verdict(proposal.tokens.tolist(), best[i])
                elif tree is None:
                    verdict = self.verify_fn(proposal.tokens, proposal.draft_probs, logits[i, : len(proposal) + 1],
                                             row.sampling, row.generator)
                else:
                    verdict = self.tree_verify_fn(proposal, logits[i, : len(proposal) + 1], row.sampling,
                                                  row.generator)
                out.append(Verified.of(proposal, tree, verdict))
            except SpecdecError as exc:
                out.append(exc)
        return out
