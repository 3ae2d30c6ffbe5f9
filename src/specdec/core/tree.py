"""Token trees: the shape of a tree proposal and the attention pattern that scores it in one pass.

A tree proposal has N nodes; `parents[i]` is the index of node i's parent (−1 = the root, i.e. the last
committed token) and nodes are topologically ordered (parents[i] < i). The target scores the root and the
N nodes together, M = N + 1 rows: row 0 is the root, row i+1 is node i. Each row attends to the committed
context and to its own ancestors (itself included), at position id `length_before + depth`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.masks import additive_mask
from specdec.errors import ProposalError


@dataclass(frozen=True)
class TreeMask:
    """Who sees whom among the M rows of a tree pass (row 0 = the root)."""

    depths: torch.Tensor  # [M] long, root 0
    ancestors: torch.Tensor  # [M, M] bool, row i: True at i and at each ancestor of i

    @property
    def size(self) -> int:
        return int(self.depths.shape[0])

    @staticmethod
    def from_parents(parents: torch.Tensor) -> TreeMask:
        """parents [N] long (−1 = root, topologically ordered) -> the mask of the N+1 rows root + nodes."""
        rows = [-1] + [int(p) + 1 for p in parents.tolist()]  # parent row of each row; root has none
        m = len(rows)
        ancestors = torch.eye(m, dtype=torch.bool)  # [M, M]
        depths = [0] * m
        for i in range(1, m):
            ancestors[i] |= ancestors[rows[i]]
            depths[i] = depths[rows[i]] + 1
        return TreeMask(torch.tensor(depths, dtype=torch.long), ancestors)

    def additive(self, past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The 4D additive mask [1, 1, M, past + M] for a model call after `past` cached tokens."""
        allowed = torch.cat([torch.ones(self.size, past, dtype=torch.bool), self.ancestors], dim=1)  # [M, past+M]
        return additive_mask(allowed, dtype)[None, None].to(device)


def is_chain(parents: torch.Tensor | None) -> bool:
    """True when parents is None or [−1, 0, 1, ...]."""
    if parents is None:
        return True
    n = parents.shape[0]
    return bool(torch.equal(parents.cpu(), torch.arange(-1, n - 1)))


def children(parents: torch.Tensor) -> list[list[int]]:
    """children[u + 1] = the nodes whose parent is u (u = −1 for the root), in node order."""
    out: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for i, p in enumerate(parents.tolist()):
        out[p + 1].append(i)
    return out


def first_branch(parents: torch.Tensor) -> torch.Tensor:
    """The path that always takes the first child: node indices [d] (a valid chain proposal of any tree,
    since a first child is drawn from the unmodified q at its node)."""
    kids = children(parents)
    path, node = [], -1
    while kids[node + 1]:
        node = kids[node + 1][0]
        path.append(node)
    return torch.tensor(path, dtype=torch.long)


def validate_proposal(tokens: torch.Tensor, draft_probs: torch.Tensor | None, parents: torch.Tensor | None,
                      vocab_size: int, room: int | None = None, atol: float = 1e-4) -> None:
    """Raise `ProposalError` unless the proposal is well formed; runs before any target pass.

    Checks: token ids in the vocabulary; parents in [−1, i) for node i (no cycles, topological order);
    at most `room` nodes; each draft_probs row sums to 1 and gives the drafted token positive probability.
    """
    n = tokens.shape[0]
    if tokens.dim() != 1 or tokens.dtype.is_floating_point:
        raise ProposalError(f"proposal tokens must be a 1-D integer tensor, got shape {tuple(tokens.shape)} "
                            f"and dtype {tokens.dtype}; return Proposal(torch.tensor([...], dtype=torch.long))")
    if n and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ProposalError(f"the drafter proposed a token id outside the target's vocabulary [0, {vocab_size}); "
                            "draft with the target's tokenizer")
    if room is not None and n > room:
        raise ProposalError(f"the drafter proposed {n} nodes but only {room} fit (the round's gamma / the "
                            "remaining max_new_tokens / the model's context); lower max_nodes or depth")
    if parents is not None:
        if parents.dim() != 1 or parents.shape[0] != n or parents.dtype.is_floating_point:
            raise ProposalError(f"Proposal.parents must be a 1-D integer tensor with one entry per token "
                                f"({n}), got shape {tuple(parents.shape)}; use -1 for children of the root")
        bad = [i for i, p in enumerate(parents.tolist()) if not -1 <= p < i]
        if bad:
            i = bad[0]
            raise ProposalError(
                f"Proposal.parents[{i}] = {int(parents[i])} is not in [-1, {i}): every node's parent must be the "
                "root (-1) or an earlier node, so the tree has no cycles and is topologically ordered; "
                "list parents before their children")
    if draft_probs is not None:
        if draft_probs.dim() != 2 or draft_probs.shape[0] != n or draft_probs.shape[1] != vocab_size:
            raise ProposalError(f"draft_probs must have shape [{n}, {vocab_size}] (one row per drafted token), "
                                f"got {tuple(draft_probs.shape)}")
        sums = draft_probs.double().sum(dim=-1)  # [N]
        off = (sums - 1).abs() > atol
        if bool(off.any()) or bool((draft_probs < 0).any()):
            i = int(off.nonzero()[0]) if bool(off.any()) else int((draft_probs < 0).any(dim=-1).nonzero()[0])
            raise ProposalError(f"draft_probs row {i} is not a distribution (sums to {float(sums[i]):.6g}); "
                                "return the warped probabilities the token was drawn from (softmax, rows sum to 1)")
        q = draft_probs.gather(1, tokens.view(-1, 1).to(draft_probs.device)).view(-1)  # [N]
        zero = q <= 0
        if bool(zero.any()):
            i = int(zero.nonzero()[0])
            raise ProposalError(f"draft_probs row {i} gives probability 0 to its own token {int(tokens[i])}: the "
                                "drafter reports a distribution it did not sample from; return exactly the "
                                "distribution each token was drawn from (or None for a deterministic proposal)")
