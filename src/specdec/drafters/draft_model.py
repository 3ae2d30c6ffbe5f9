"""`DraftModel`: a smaller causal LM with the target's vocabulary proposes γ tokens autoregressively."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec.drafters.base import Drafter, Proposal
from specdec.models.causal_lm import CachedCausalLM
from specdec.sampling import SamplingConfig, sample


class DraftModel(Drafter):
    """Draft with a separate (small) Hugging Face causal LM that keeps its own KV cache.

    At temperature 0 it proposes its argmax (a point mass); at T > 0 it samples from its warped
    distribution and hands those probabilities to verification.
    """

    def __init__(self, model: PreTrainedModel):
        self.lm = CachedCausalLM(model)
        self.vocab_size = self.lm.vocab_size

    @property
    def forwards(self) -> int:
        return self.lm.forwards

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.lm.reset()
        self.lm.prefill(prompt_ids[:-1])  # the last prompt token is fed by the first propose

    def propose(
        self,
        context: torch.Tensor,
        gamma: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        # Catch up on committed tokens the cache has not seen: the last one, plus the final draft token
        # after a fully accepted round (the draft never fed its own last proposal).
        logits = self.lm.forward(context[self.lm.length :], last_only=True)  # [1, V]
        tokens, probs = [], []
        for i in range(gamma):
            if sampling.greedy:
                token = logits.argmax(dim=-1)  # [1]
            else:
                dist = sampling.warp(logits)  # [1, V]
                token = sample(dist, generator)  # [1]
                probs.append(dist)
            tokens.append(token)
            if i + 1 < gamma:
                logits = self.lm.forward(token, last_only=True)  # [1, V]
        return Proposal(
            tokens=torch.cat(tokens).to(context.device),  # [γ]
            draft_probs=torch.cat(probs).to(context.device) if probs else None,  # [γ, V]
        )

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        # The cache holds the old context plus the first γ-1 drafts; only context[:-1] is still valid.
        self.lm.crop(min(self.lm.length, context.shape[0] - 1))
