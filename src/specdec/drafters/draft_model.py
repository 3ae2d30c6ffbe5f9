"""`DraftModel`: a smaller causal LM proposes γ tokens autoregressively.

With the target's tokenizer this is the drafter itself. Given the draft's and the target's tokenizers
(`DraftModel(draft, tokenizer=..., target_tokenizer=...)`) that differ, construction returns a
`CrossVocabDraft` (drafters/cross_vocab.py), which translates between the two vocabularies.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig, sample
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal
from specdec.drafters.batched import BatchedDraftModel
from specdec.hub.vocab import check_tokenizer_fits, padded_widths_match, same_vocabulary
from specdec.runtime.causal_lm import CachedCausalLM
from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, is_encoder_decoder
from specdec.runtime.static_lm import StaticCausalLM, fast_adapter

#: DraftModel(method=...) for a draft with another tokenizer: pick by the shared vocabulary, token-level
#: intersection (TLI), or string-level exact match (SLEM).
CROSS_VOCAB_METHODS = ("auto", "tli", "slem")


class DraftModel(Drafter):
    """Draft with a separate (small) Hugging Face causal LM that keeps its own KV cache.

    At temperature 0 it proposes its argmax (a point mass); at T > 0 it samples from its warped
    distribution and hands those probabilities to verification.

    compile: None (default) follows the decoder: `generate(..., compile=True)` switches this drafter to the
    fast path (a slot cache, and its γ draft steps as one compiled graph) and compile=False back to the eager
    adapter. True / "static" / False pin it (see docs/fastpath.md).

    tokenizer / target_tokenizer / method: see docs/cross_vocab.md. One tokenizer for both models lets the
    LM heads differ in width (padding rows are never drafted).
    """

    # Rows of the target's logits when its LM head is padded to another width (None: same width), and the
    # real vocabulary size when the shared tokenizer is known (rows past it are padding).
    _width: int | None = None
    _tokens: int | None = None

    def __new__(cls, *args, **kwargs):
        if cls is not DraftModel:  # subclasses (LayerSkip, CrossVocabDraft...) build themselves
            return super().__new__(cls)
        tokenizer, target_tokenizer = kwargs.get("tokenizer"), kwargs.get("target_tokenizer")
        method = kwargs.get("method", "auto")
        if tokenizer is not None or target_tokenizer is not None:
            if method not in CROSS_VOCAB_METHODS:
                from specdec.errors import ConfigError

                raise ConfigError(f"method must be one of {CROSS_VOCAB_METHODS}, got {method!r}")
            if tokenizer is None or target_tokenizer is None or not same_vocabulary(tokenizer, target_tokenizer):
                from specdec.drafters.cross_vocab import CrossVocabDraft

                return super().__new__(CrossVocabDraft)
        return super().__new__(cls)

    def __init__(self, model: PreTrainedModel, compile: bool | str | None = None, *, tokenizer=None,
                 target_tokenizer=None, method: str = "auto"):
        self.model = model
        self.compile = compile
        self._adapters: dict[object, object] = {}
        self.lm = self._adapter(compile or False)
        self.vocab_size = self.lm.vocab_size
        self._width = self._tokens = None
        if tokenizer is not None:  # one tokenizer for both models (DraftModel.__new__ checked)
            check_tokenizer_fits(tokenizer, self.lm.vocab_size, "draft")
            self._tokens = len(tokenizer)

    def match_target_vocab(self, target_vocab_size: int) -> bool:
        """Same width, or within LM-head padding (or one tokenizer given for both): fit rows to the target's."""
        if target_vocab_size == self.lm.vocab_size and self._tokens is None:
            self._width = None
            return True
        if self._tokens is not None or padded_widths_match(self.lm.vocab_size, target_vocab_size):
            self._width = target_vocab_size
            return True
        return False

    @property
    def capabilities(self) -> DrafterCapabilities:
        """A chain drafter; batched as one draft model over every row (`BatchedDraftModel`)."""
        return DrafterCapabilities(batched=BatchedDraftModel, encoder_decoder=self.is_encoder_decoder,
                                   accepts_encoder_inputs=self.is_encoder_decoder)

    def fit_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_draft] -> [..., V_target] (the target's LM-head width, once `match_target_vocab`
        set it): padding rows of either head get -inf."""
        if self._width is None:
            return logits
        width, rows = self._width, logits.shape[-1]
        fitted = logits[..., :width] if rows >= width else torch.nn.functional.pad(logits, (0, width - rows),
                                                                                value=float("-inf"))
        if self._tokens is not None and self._tokens < width:
            fitted = fitted.clone()
            fitted[..., self._tokens :] = float("-inf")
        return fitted

    def _adapter(self, mode: bool | str):
        if is_encoder_decoder(self.model):  # a seq2seq draft: one eager adapter (the target warns about compile)
            mode = False
            if mode not in self._adapters:
                self._adapters[mode] = CachedSeq2SeqLM(self.model)
        if mode not in self._adapters:
            self._adapters[mode] = fast_adapter(self.model, mode)
        return self._adapters[mode]

    @property
    def is_encoder_decoder(self) -> bool:
        """An encoder-decoder draft (T5, BART, Whisper...): it runs its own encoder once per request."""
        return isinstance(self.lm, CachedSeq2SeqLM)

    def use_fast_path(self, mode: bool | str) -> None:
        """Called by the decoder with its `compile` setting; a drafter built with compile=... keeps its own."""
        if self.compile is None:
            self.lm = self._adapter(mode)

    def ensure_capacity(self, tokens: int) -> None:
        """On the fast path: the draft's slot cache sized for the request (plus its own round's room)."""
        if isinstance(self.lm, StaticCausalLM):
            self.lm.ensure_capacity(tokens + self.capabilities.draft_room)

    def precompile(self, gammas, sampling: SamplingConfig, context: torch.Tensor) -> None:
        """On the fast path: the catch-up passes and the draft graph of every γ in `gammas`, compiled now."""
        if isinstance(self.lm, StaticCausalLM):
            self.lm.precompile(self.lm.catch_up_sizes, gammas, sampling, context)

    @property
    def forwards(self) -> int:
        return self.lm.forwards

    def reset(self, prompt_ids: torch.Tensor, *, encoder_inputs=None, encoder_input_ids=None) -> None:
        # An encoder-decoder draft encodes the request's source itself (encoder_inputs: as the target's).
        self.lm.reset(**({} if encoder_inputs is None else {"encoder_inputs": encoder_inputs}))
        self.lm.prefill(prompt_ids[:-1])  # the last prompt token is fed by the first propose

    def propose(
        self,
        context: torch.Tensor,
        gamma: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        n = context.shape[0]
        if isinstance(self.lm, StaticCausalLM) and gamma > 0 and n >= 2 and self._width is None:
            if self.lm.length < n - 2:  # tokens skipped in plain rounds: at most two compiled shapes
                self.lm.catch_up(context[self.lm.length : n - 2])
            tokens, draft_probs = self.lm.draft_steps(context, gamma, sampling, generator)  # [γ], [γ, V] | None
            return Proposal(tokens=tokens.to(context.device),
                            draft_probs=draft_probs.to(context.device) if draft_probs is not None else None)
        # Catch up on committed tokens the cache has not seen: the last one, plus the final draft token
        # after a fully accepted round (the draft never fed its own last proposal).
        logits = self.fit_logits(self.lm.forward(context[self.lm.length :], last_only=True))  # [1, V]
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
                logits = self.fit_logits(self.lm.forward(token, last_only=True))  # [1, V]
        return Proposal(
            tokens=torch.cat(tokens).to(context.device),  # [γ]
            draft_probs=torch.cat(probs).to(context.device) if probs else None,  # [γ, V]
        )

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        # The cache holds the old context plus the first γ-1 drafts; only context[:-1] is still valid.
        self.lm.crop(min(self.lm.length, context.shape[0] - 1))
