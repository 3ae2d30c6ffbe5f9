"""A round's proposals made ready for the target's pass, one rule for every row: a chain is cut to γ; a tree is
validated before any pass (a ProposalError names what is wrong), capped at depth γ, scored as a chain when it
is chain-shaped, and as its first branch (exact, fewer tokens per pass) where the target cannot score it now."""

from __future__ import annotations

from collections.abc import Callable

from specdec.core.tree import TreeMask, first_branch, is_chain, validate_proposal
from specdec.drafters.base import Proposal
from specdec.errors import ProposalError


def ready(proposal: Proposal, gamma: int, vocab_size: int, room: int | None,
          scores_tree: Callable[[int], bool]) -> tuple[Proposal, TreeMask | None, bool]:
    """The proposal the target scores, its tree mask (None: a chain), and whether a tree fell back to its first
    branch. room: cache slots left after the root; scores_tree(rows): can the target score a tree of that many
    rows (root included) in one pass now."""
    if proposal.parents is None:
        if len(proposal) <= gamma:
            return proposal, None, False
        probs = proposal.draft_probs[:gamma] if proposal.draft_probs is not None else None
        return Proposal(proposal.tokens[:gamma], probs), None, False
    tree = checked_tree(proposal, gamma, vocab_size, room)
    if tree is None:
        return Proposal(proposal.tokens, proposal.draft_probs), None, False
    if scores_tree(len(proposal) + 1):
        return proposal, tree, False
    return first_branch_proposal(proposal), None, True


def checked_tree(proposal: Proposal, gamma: int, vocab_size: int, room: int | None) -> TreeMask | None:
    """Validate a tree proposal before any target pass (`room`: cache slots left after the root) and build its
    mask [N+1] rows (root and nodes); None when the proposal is a chain."""
    validate_proposal(proposal.tokens, proposal.draft_probs, proposal.parents, vocab_size, room)
    tree = TreeMask.from_parents(proposal.parents)
    depth = int(tree.depths.max())
    if depth > gamma:
        raise ProposalError(
            f"the drafter proposed a tree {depth} deep but this round allows {gamma} tokens (gamma, capped by "
            "the remaining max_new_tokens); a tree drafter must cap its depth at the gamma it is given"
        )
    return None if is_chain(proposal.parents) else tree


def first_branch_proposal(proposal: Proposal) -> Proposal:
    """A tree proposal's first branch, as a chain (for a target that cannot score the tree)."""
    first = first_branch(proposal.parents)  # [d] node indices
    probs = proposal.draft_probs[first] if proposal.draft_probs is not None else None
    return Proposal(proposal.tokens[first], probs)
