"""`ParallelDraft`: a draft LM that proposes γ tokens in one pass from γ − 1 mask tokens (PARD, arXiv 2504.18583).

The draft is an ordinary causal LM whose embedding table has ONE row more than the target's vocabulary: the mask
token, id V (the target's vocabulary size, i.e. the draft's last row; outside the tokenizer, which never produces
or decodes it). A round feeds the committed tokens the draft's cache has not seen (the root, and the accepted
drafts of the last round, which were fed as masks), then γ − 1 masks at the next positions:

    input   [x_c .. x_{n−1}, M, M, ..., M]        (causal, positions c .. n+γ−2)
    output  row of x_{n−1} -> token n;  row of the j-th M -> token n+j

all from ONE forward; the masks' cache rows are dropped right after it (the committed rows stay). Each row's
distribution is the draft's marginal of that position given the committed context: none depends on a drafted
token. The mask's logit (column V of the tied LM head) is cut off before anything else, so the mask has
probability 0 in every q and is never proposed: q lives on the target's V tokens exactly.

Proposal: at T = 0 each position's argmax (a point mass); at T > 0 each position's token drawn from
`sampling.warp` of its own marginal, which is its q. The target is any model of the same tokenizer (PARD's drafts
are target-independent): the draft reads tokens only.

A draft adapted this way: `ParallelDraft.adapt(draft)` (one more embedding row, untrained), then
`specdec distill --parallel` (training/distill.py) teaches it the masked rows. Fast path (compile=True /
"static"): the same pass on the draft's slot cache (`StaticCausalLM.forward`, padded to its buckets).
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig, sample
from specdec.drafters.base import DrafterCapabilities, Proposal
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.per_row import PerRow
from specdec.errors import ConfigError, IncompatibleModelsError
from specdec.runtime.weights import packed_formats

#: The chain length a request drafts when it names no γ.
DEFAULT_PARALLEL_GAMMA = 6


class ParallelDraft(DraftModel):
    """PARD drafting with `model`, a causal LM whose last embedding row is the mask token (`adapt`). `max_gamma`:
    the most tokens a round proposes (the masks it was trained with, plus one)."""

    def __init__(self, model: PreTrainedModel, compile: bool | str | None = None, *, max_gamma: int = 8,
                 gamma: int = DEFAULT_PARALLEL_GAMMA):
        for name, value in (("max_gamma", max_gamma), ("gamma", gamma)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ParallelDraft {name} must be an integer >= 1, got {value!r}")
        super().__init__(model, compile)
        self.mask_token_id = self.vocab_size - 1  # the draft's last row
        self.vocab_size = self.mask_token_id  # q's width: the target's tokens, the mask cut off
        self._mode: bool | str = compile or False  # the adapter `lm` is (use_fast_path)
        self.max_gamma = max_gamma
        self.gamma = min(gamma, max_gamma)

    @staticmethod
    def adapt(draft: PreTrainedModel) -> PreTrainedModel:
        """A copy of `draft` with one more embedding row, the mask token (id = the draft's vocabulary size), set to
        the mean of the other rows; untrained: distil it with `specdec distill --parallel`. The LM head grows with
        it (a tied one shares the row); that row's logit is never read. A draft on packed weights cannot grow
        (ConfigError): adapt the float draft, then pack it."""
        if packed_formats(draft):
            raise ConfigError(f"ParallelDraft.adapt grows the draft's embedding and LM head, but its layers are packed "
                              f"({', '.join(sorted(packed_formats(draft)))}); adapt the draft loaded without "
                              "weights=, then pack it (pack_model, or save it and load it with weights=...)")
        model = copy.deepcopy(draft)
        rows = int(model.get_input_embeddings().weight.shape[0])
        model.resize_token_embeddings(rows + 1, mean_resizing=False)
        with torch.no_grad():
            embedding = model.get_input_embeddings().weight
            embedding[rows] = embedding[:rows].mean(0)
        return model

    def match_target_vocab(self, target_vocab_size: int) -> bool:
        """The draft's rows are the target's V tokens and the mask: V + 1 (IncompatibleModelsError otherwise)."""
        if self.vocab_size != target_vocab_size:
            raise IncompatibleModelsError(
                f"ParallelDraft needs a draft with exactly one embedding row more than the target's vocabulary (the "
                f"mask token, id {target_vocab_size}), but the draft has {self.vocab_size + 1} rows for a target of "
                f"{target_vocab_size}; adapt a draft of the target's tokenizer with ParallelDraft.adapt(draft) and "
                "distil it with `specdec distill --parallel`")
        return True

    def fit_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V + 1] -> [..., V]: the mask's column cut off (probability 0, never proposed)."""
        return logits[..., : self.mask_token_id]

    @property
    def capabilities(self) -> DrafterCapabilities:
        """A chain drafter (γ at most `max_gamma`); batched with one fork per row (its own draft cache); its cache
        needs room for a round's masks past the committed context."""
        return DrafterCapabilities(batched=PerRow, default_gamma=self.gamma, draft_room=2 * self.max_gamma + 2)

    def fork(self) -> ParallelDraft:
        """Another request's drafter over the same model: its own draft cache (and compiled-path adapter)."""
        twin = copy.copy(self)
        twin._adapters = {}
        twin.lm = twin._adapter(twin._mode)
        return twin

    def use_fast_path(self, mode: bool | str) -> None:
        """As `DraftModel`'s, remembering which adapter is in use (a fork takes its own of the same kind)."""
        super().use_fast_path(mode)
        if self.compile is None:
            self._mode = mode

    def precompile(self, gammas, sampling: SamplingConfig, context: torch.Tensor) -> None:
        """Nothing ahead of the first round: its pass sizes are the adapter's buckets, compiled on first use."""

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        n = context.shape[0]
        gamma = min(gamma, self.max_gamma)
        if gamma < 1:
            return Proposal(context.new_empty(0))
        start = self.lm.length  # the draft caches context[:start], start <= n − 1
        device = self.lm.device
        masks = torch.full((gamma - 1,), self.mask_token_id, dtype=torch.long, device=device)
        feed = torch.cat([context[start:n].to(device), masks])  # [n − start + γ − 1]
        logits = self.fit_logits(self.lm.forward(feed))[-gamma:]  # [γ, V]: the root's row, then each mask's
        self.lm.crop(n)  # the masks' rows leave the cache; the committed ones stay
        if sampling.greedy:
            return Proposal(logits.argmax(-1).to(context.device))
        probs = sampling.warp(logits)  # [γ, V] each position's own warped marginal
        return Proposal(sample(probs, generator).to(context.device), probs.to(context.device))
