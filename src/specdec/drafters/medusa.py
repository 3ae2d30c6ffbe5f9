"""`Medusa`: draft with Medusa heads on the target's last feature.

After a round the decoder hands over the target's features of the root and the accepted path; only the
last one, f_{n-2} (the feature whose LM-head prediction is the just-committed token context[n-1]), is
kept. Head k reads it and ranks candidates for token n-1+k. A chain proposes each head's argmax; a tree
(`tree=` a list of rank paths, as Medusa's `medusa_choices`) proposes, for each path (r_1, ..., r_d),
head d's rank-r_d token under the node of path (r_1, ..., r_{d-1}). Both are deterministic functions of
the committed context (point masses), hence exact at any temperature: no typical acceptance.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal
from specdec.drafters.batched_heads import BatchedMedusa
from specdec.errors import ConfigError
from specdec.heads import MedusaHeads

#: A small static tree for 4 heads: wide at the first head, narrow below (rank paths, 0 = argmax).
DEFAULT_TREE = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1),
)


def tree_parents(tree: Sequence[Sequence[int]], num_heads: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """Sorted rank paths and each one's parent index (-1 = root); ConfigError unless every prefix is present."""
    paths = sorted({tuple(int(r) for r in p) for p in tree}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(paths)}
    parents = []
    for p in paths:
        if not p or len(p) > num_heads or min(p) < 0:
            raise ConfigError(f"Medusa tree path {p} must have 1..{num_heads} non-negative ranks (one per head)")
        if len(p) > 1 and p[:-1] not in index:
            raise ConfigError(f"Medusa tree path {p} has no parent {p[:-1]} in the tree; add every prefix")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return paths, parents


class Medusa(Drafter):
    """Medusa drafter: `tree=None` proposes a chain of the heads' argmaxes; a tree needs tree verification."""

    def __init__(self, target, heads: MedusaHeads, tree: Sequence[Sequence[int]] | None = None):
        model: PreTrainedModel = target if isinstance(target, PreTrainedModel) else target.model  # or an adapter
        if not isinstance(heads, MedusaHeads):
            raise ConfigError(f"Medusa needs specdec.MedusaHeads, got {type(heads).__name__}; build them with "
                              "specdec.MedusaHeads.init(target) or load with specdec.MedusaHeads.load(path, target)")
        from specdec.heads.common import check_target

        check_target(heads.signature, model, "the given MedusaHeads")
        self.heads = heads.eval()
        self.lm_head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()  # (its weight: the features' dtype; the head may be packed)
        self.vocab_size = int(self.lm_head.out_features)
        self.tree = None
        if tree is not None:
            self.tree, parents = tree_parents(tree, heads.num_heads)
            self._parents = torch.tensor(parents, dtype=torch.long)
            self._depth = torch.tensor([len(p) - 1 for p in self.tree])  # head index of each node
            self._rank = torch.tensor([p[-1] for p in self.tree])
            self._width = max(p[-1] for p in self.tree) + 1
        self.feature: torch.Tensor | None = None
        self._forwards = 0

    @property
    def capabilities(self) -> DrafterCapabilities:
        """Reads the target's last hidden state (an encoder-decoder target's decoder's too: the source is not
        needed); a chain or a static tree; batched with one heads pass for every row (`BatchedMedusa`)."""
        return DrafterCapabilities(tree=self.tree is not None, needs_hidden=True, batched=BatchedMedusa,
                                   accepts_encoder_inputs=True)

    @property
    def forwards(self) -> int:
        return self._forwards

    def fork(self) -> Medusa:
        """Another request's drafter over the same heads (its own last feature)."""
        twin = copy.copy(self)
        twin.reset(torch.zeros(1, dtype=torch.long))
        return twin

    def reset(self, prompt_ids: torch.Tensor, *, hidden: torch.Tensor | None = None, encoder_inputs=None,
              encoder_input_ids=None) -> None:
        self.feature = hidden[-1] if hidden is not None and hidden.shape[0] else None  # [H]
        self._forwards = 0

    def commit(self, context: torch.Tensor, num_accepted: int, *, hidden: torch.Tensor | None = None) -> None:
        if hidden is not None and hidden.shape[0]:
            self.feature = hidden[-1]

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        if self.feature is None:
            return Proposal(context.new_empty(0))
        self._forwards += 1
        logits = self.lm_head(self.heads(self.feature.to(self.embed.weight.dtype)))  # [K, V]
        return self.proposal(logits, gamma, context.device)

    def proposal(self, logits: torch.Tensor, gamma: int, device: torch.device) -> Proposal:
        """The chain or tree that the heads' logits [K, V] propose, at most γ deep (batched decoding runs
        the heads once for every row's feature and hands each row its slice)."""
        if self.tree is None:
            return Proposal(logits[:gamma].argmax(-1).to(device))  # [min(K, γ)]
        ranked = logits.topk(self._width, dim=-1).indices  # [K, width]
        keep = self._depth < gamma  # no deeper than γ levels
        tokens = ranked[self._depth, self._rank][keep]
        return Proposal(tokens.to(device), None, self._parents[keep].to(device))
