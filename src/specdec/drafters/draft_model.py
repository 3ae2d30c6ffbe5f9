"""`DraftModel`: a smaller causal LM with the target's vocabulary proposes γ tokens autoregressively."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec.drafters.base import Drafter, Proposal
from specdec.models.causal_lm import CachedCausalLM
from specdec.models.static_lm import StaticCausalLM, fast_adapter
from specdec.sampling import SamplingConfig, sample


class DraftModel(Drafter):
    """Draft with a separate (small) Hugging Face causal LM that keeps its own KV cache.

    At temperature 0 it proposes its argmax (a point mass); at T > 0 it samples from its warped
    distribution and hands those probabilities to verification.

    compile: None (default) follows the decoder: `generate(..., compile=True)` switches this drafter to the
    fast path (a slot cache, and its γ draft steps as one compiled graph) and compile=False back to the eager
    adapter. True / "static" / False pin it (see docs/fastpath.md).
    """

    def __init__(self, model: PreTrainedModel, compile: bool | str | None = None):
        self.model = model
        self.compile = compile
        self._adapters: dict[object, object] = {}
        self.lm = self._adapter(compile or False)
        self.vocab_size = self.lm.vocab_size

    def _adapter(self, mode: bool | str):
        if mode not in self._adapters:
            self._adapters[mode] = fast_adapter(self.model, mode)
        return self._adapters[mode]

    def use_fast_path(self, mode: bool | str) -> None:
        """Called by the decoder with its `compile` setting; a drafter built with compile=... keeps its own."""
        if self.compile is None:
            self.lm = self._adapter(mode)

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
        n = context.shape[0]
        if isinstance(self.lm, StaticCausalLM) and gamma > 0 and n >= 2:
            if self.lm.length < n - 2:
                self.lm.forward(context[self.lm.length : n - 2])
            tokens, draft_probs = self.lm.draft_steps(context, gamma, sampling, generator)  # [γ], [γ, V] | None
            return Proposal(tokens=tokens.to(context.device),
                            draft_probs=draft_probs.to(context.device) if draft_probs is not None else None)
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
