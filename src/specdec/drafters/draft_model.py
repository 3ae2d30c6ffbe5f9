"""`DraftModel`: a smaller causal LM proposes γ tokens autoregressively.

With the target's tokenizer this is the drafter itself. Given the draft's and the target's tokenizers
(`DraftModel(draft, tokenizer=..., target_tokenizer=...)`) that differ, construction returns a
`CrossVocabDraft` (drafters/cross_vocab.py), which translates between the two vocabularies.

`DraftModel(draft, draft_vocab=ids)` drafts from a reduced vocabulary (FR-Spec, Zhao et al. 2025): the draft's LM
head computes only the rows `ids` (typically the most frequent tokens of its training data), so a draft step reads
a fraction of the head, which dominates a small draft's step. Exactness does not depend on it: the draft's
distribution q is its softmax over those tokens (zero elsewhere), the tokens are drawn from q, and verification
sees that q.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig, sample
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal
from specdec.drafters.batched import BatchedDraftModel
from specdec.hub.vocab import check_tokenizer_fits, padded_widths_match, same_vocabulary
from specdec.runtime.causal_lm import CachedCausalLM, vocab_size
from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, is_encoder_decoder
from specdec.runtime.static_lm import StaticCausalLM, fast_adapter
from specdec.runtime.weights import PackedLinear

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

    #: On the fast path, draft with a one-step graph called γ times (one compile for every γ) rather than one graph
    #: of γ steps per γ: for a draft whose step is long beside a compiled call's overhead (SelfDraft's).
    per_step_graphs = False

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
                if kwargs.get("draft_vocab") is not None:
                    from specdec.errors import ConfigError

                    raise ConfigError("draft_vocab needs a draft with the target's tokenizer; a draft with another "
                                      "tokenizer drafts from its whole vocabulary (drop draft_vocab)")
                from specdec.drafters.cross_vocab import CrossVocabDraft

                return super().__new__(CrossVocabDraft)
        return super().__new__(cls)

    def __init__(self, model: PreTrainedModel, compile: bool | str | None = None, *, tokenizer=None,
                 target_tokenizer=None, method: str = "auto", draft_vocab: Sequence[int] | torch.Tensor | None = None):
        self.vocab_size = vocab_size(model)  # the width of the draft's own LM head
        self.draft_vocab = (None if draft_vocab is None else  # [N] | None, on the model's device
                            _draft_vocab(draft_vocab, self.vocab_size).to(next(model.parameters()).device))
        self.model = model if self.draft_vocab is None else reduced_head(model, self.draft_vocab)
        self.compile = compile
        self._adapters: dict[object, object] = {}
        self.lm = self._adapter(compile or False)
        self._width = self._tokens = None
        if tokenizer is not None:  # one tokenizer for both models (DraftModel.__new__ checked)
            check_tokenizer_fits(tokenizer, self.vocab_size, "draft")
            self._tokens = len(tokenizer)
            if self.draft_vocab is not None and int(self.draft_vocab[-1]) >= self._tokens:
                from specdec.errors import ConfigError

                raise ConfigError(f"draft_vocab names token ids past the tokenizer's {self._tokens} tokens")

    def match_target_vocab(self, target_vocab_size: int) -> bool:
        """Same width, or within LM-head padding (or one tokenizer given for both): fit rows to the target's."""
        if self.draft_vocab is not None and int(self.draft_vocab[-1]) >= target_vocab_size:
            return False
        if target_vocab_size == self.vocab_size and self._tokens is None:
            self._width = None
            return True
        if self._tokens is not None or padded_widths_match(self.vocab_size, target_vocab_size):
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
        set it): padding rows of either head get -inf. With a reduced vocabulary: logits [..., N] over
        `draft_vocab` -> [..., V_target], -inf outside it."""
        if self.draft_vocab is not None:
            return _spread(logits, self.draft_vocab, self._width or self.vocab_size, float("-inf"))
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
            self.lm.precompile(self.lm.catch_up_sizes, gammas, sampling, context, vocab=self.draft_vocab,
                               per_step=self.per_step_graphs)

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
            return self._draft_steps(context, gamma, sampling, generator, feed=2)
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

    def _draft_steps(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                     generator: torch.Generator | None, feed: int) -> Proposal:
        """On the fast path: γ steps of the compiled draft graph, which first feeds the last `feed` committed
        tokens (`StaticCausalLM.draft_steps`)."""
        tokens, draft_probs = self.lm.draft_steps(context, gamma, sampling, generator, vocab=self.draft_vocab,
                                                  feed=feed, per_step=self.per_step_graphs)  # [γ], [γ, V | N] | None
        if draft_probs is not None and self.draft_vocab is not None:  # [γ, N] -> [γ, V], 0 outside the vocab
            draft_probs = _spread(draft_probs, self.draft_vocab, self.vocab_size, 0.0)
        return Proposal(tokens=tokens.to(context.device),
                        draft_probs=draft_probs.to(context.device) if draft_probs is not None else None)

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        # The cache holds the old context plus the first γ-1 drafts; only context[:-1] is still valid.
        self.lm.crop(min(self.lm.length, context.shape[0] - 1))


def _spread(values: torch.Tensor, ids: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """values [..., N] over the token ids `ids` [N] -> [..., width], `fill` at every other id."""
    return values.new_full((*values.shape[:-1], width), fill).index_copy(-1, ids, values)


def _draft_vocab(token_ids, width: int) -> torch.Tensor:
    """The draft vocabulary as token ids [N] int64, unique and ascending (argmax ties go to the lower id, as over
    the whole vocabulary); ConfigError unless they lie in 0..width−1."""
    from specdec.errors import ConfigError

    try:
        ids = torch.as_tensor(token_ids).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"draft_vocab must be a sequence of token ids, got {type(token_ids).__name__}") from e
    if ids.numel() < 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ConfigError("draft_vocab must be a non-empty sequence of integer token ids")
    ids = ids.long().unique().sort().values
    if int(ids[0]) < 0 or int(ids[-1]) >= width:
        raise ConfigError(f"draft_vocab ids must lie in 0..{width - 1} (the draft's LM head has {width} rows)")
    return ids


#: model -> {draft vocabulary (its ids' bytes): the model with that reduced head}: one copy per model and
#: vocabulary, so that every DraftModel built on them shares the copy's compiled graphs.
_REDUCED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reduced_head(model: PreTrainedModel, token_ids: torch.Tensor) -> PreTrainedModel:
    """`model` with an LM head of the rows `token_ids` [N] only: a shallow copy sharing every other module (no
    weights copied but those rows); the model itself is left as it was. Its logits are [..., N]. Built once per
    model and vocabulary (the head's rows are read then)."""
    from specdec.errors import ConfigError

    known = _REDUCED.setdefault(model, {})
    key = token_ids.cpu().numpy().tobytes()
    if key in known:
        return known[key]
    head = model.get_output_embeddings()
    if isinstance(head, PackedLinear):  # load(weights=...): those rows packed as the head's are
        rows = head.outputs(token_ids.cpu())
    elif isinstance(head, torch.nn.Linear):
        ids = token_ids.to(head.weight.device)
        rows = torch.nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None, device=head.weight.device,
                               dtype=head.weight.dtype)
        with torch.no_grad():
            rows.weight.copy_(head.weight.index_select(0, ids))
            if head.bias is not None:
                rows.bias.copy_(head.bias.index_select(0, ids))
        rows.requires_grad_(False)
    else:
        raise ConfigError(f"draft_vocab needs a draft whose LM head is a linear layer; "
                          f"{type(model).__name__} has {type(head).__name__}")
    reduced = copy.copy(model)
    reduced._modules = dict(model._modules)  # its own module table: replacing the head leaves `model` untouched
    reduced.set_output_embeddings(rows)
    known[key] = reduced
    return reduced
