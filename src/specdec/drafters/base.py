"""The drafter interface: everything that proposes tokens for the target to verify.

A round of the decode loop is ``drafter.propose`` → ``target.score`` → ``verify`` → ``commit``. A drafter
sees the committed context (prompt + generated tokens, a 1-D LongTensor view, never copied), proposes up to
γ tokens, and is told afterwards how many were accepted so it can roll its own state back or learn.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specdec.core.sampling import SamplingConfig
from specdec.errors import ProposalError


@dataclass(frozen=True)
class Proposal:
    """Draft tokens [γ'] (γ' <= γ, may be 0) and, for sampling drafters, their warped probabilities [γ', V].

    `draft_probs=None` means the proposal is deterministic (a point mass on each token), as for n-gram
    lookup or an argmax drafter; verification then uses q(x) = 1.

    A tree: `parents[i]` is the index of node i's parent among the N tokens (−1 = the root, the last
    committed token), nodes topologically ordered (parents[i] < i); `parents=None` is a chain
    ([−1, 0, 1, ...]). draft_probs[i] is exactly the distribution node i was drawn from (for siblings drawn
    without replacement: q with the earlier siblings removed); a one-hot row or None is a point mass.

    `selection` is how the verifier picks among a node's sibling children at T > 0 (at T = 0 it is ignored):
    "sequential" (default: try them in order, r ← norm(max(0, r − q)) after each rejection; covers i.i.d.,
    without-replacement and point-mass children through each node's q) or "spectr" (SpecTr's k-sequential
    selection: the siblings are i.i.d. draws from one q, the rows of draft_probs; see verify.verify_kseq).
    """

    tokens: torch.Tensor  # [N] long
    draft_probs: torch.Tensor | None = None  # [N, V] float, rows sum to 1
    parents: torch.Tensor | None = None  # [N] long, −1 = root; None = chain
    selection: str = "sequential"

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ProposalError(f"Proposal.selection must be one of {', '.join(map(repr, SELECTIONS))}, got "
                                f"{self.selection!r}")
        if self.selection == "spectr" and self.draft_probs is None and len(self):
            raise ProposalError("Proposal.selection='spectr' needs draft_probs (the q its i.i.d. siblings were drawn "
                                "from); a deterministic proposal uses the default selection='sequential'")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


#: Sibling selection rules the tree verifier knows (Proposal.selection).
SELECTIONS = ("sequential", "spectr")


class Drafter(ABC):
    """Proposes tokens; owns whatever state (a KV cache, an n-gram index) it needs between rounds."""

    #: Width of `draft_probs` rows (must equal the target's); None for drafters without a vocabulary.
    vocab_size: int | None = None

    #: True for drafters that read the target's final hidden states (EAGLE, Medusa). The decoder then
    #: calls `reset(prompt_ids, hidden=[n-1, H])` (features of prompt_ids[:-1]) and, after each round,
    #: `commit(context, num_accepted, hidden=[k+1, H])` (features of the root and the accepted drafts,
    #: i.e. of the tokens context[n_old-1 : n_new-1]); features of rejected drafts are never passed.
    needs_hidden: bool = False

    def reset(self, prompt_ids: torch.Tensor) -> None:
        """Start a new request whose prompt is prompt_ids [n]. Default: nothing to reset."""

    @abstractmethod
    def propose(
        self,
        context: torch.Tensor,
        gamma: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Propose at most `gamma` tokens continuing context [n].

        At temperature 0 propose the most likely tokens (a point mass); at T > 0 either sample from
        `sampling.warp(...)` of your distribution and return it as `draft_probs`, or propose
        deterministically with `draft_probs=None`. Both keep decoding exact.
        """

    def fork(self) -> Drafter:
        """A drafter for another request decoded at the same time (batched decoding keeps one per row): the
        same weights and settings, its own per-request state; `reset` it before use. Default: a shallow copy,
        which is a proper fork for drafters whose `reset` rebinds all their per-request state (PromptLookup,
        Bigram); drafters holding a cache or features across `reset` override it."""
        return copy.copy(self)

    def match_target_vocab(self, target_vocab_size: int) -> bool:
        """Prepare to draft for a target whose logits are `target_vocab_size` wide; False if this drafter's
        tokens cannot be the target's. Default: the widths must be equal (or the drafter has none)."""
        return self.vocab_size is None or self.vocab_size == target_vocab_size

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        """The round is over: context [n'] is the new committed context, whose last token is the
        recovered or bonus token and whose `num_accepted` tokens before it are accepted drafts.
        Anything cached beyond context[:n'-1] is stale. Default: nothing to update."""

    @property
    def forwards(self) -> int:
        """Model forward passes spent drafting in the current request (0 for model-free drafters)."""
        return 0

    @property
    def name(self) -> str:
        return type(self).__name__
