"""`SelfDraft`: a draft for any model, with no second model and no training: the target's own weights, quantized.

`SelfDraft(target, weights="int4")` drafts with a copy of the target whose linear layers are quantized to int4 (or
int8, or w4a8: int4 computed on int8 activations) and run on specdec's packed kernels (runtime/weights.py): the same layers, the same tokenizer, nothing to
download or train. Its embeddings, norms and biases are the target's own tensors (shared, not copied); its linear
layers hold a packed copy at a quarter (int8) or an eighth (int4) of float32's bytes, so a draft step reads that
much less memory than a target step. How close the copy stays to the target is what acceptance measures
(docs/quantization.md has the figures on the default target). A target loaded on packed float weights
(`load(weights="bfloat16")`, a float32 model reading half the bytes: the fast form on a CPU without bfloat16
arithmetic) is copied from those weights, read back from its panels; a target on quantized weights cannot be.

Exact at every temperature: q is the quantized copy's own warped distribution, the one its tokens are drawn from,
and verification is the usual rule against the target. It is a `DraftModel` over that copy, so it batches, runs on
the fast path, takes `draft_vocab` (its reduced head quantized like the rest) and `gamma="auto"` like any draft.

On the fast path a lone request's self-draft keeps no cache of its own: it drafts in the target's slot cache
(`StaticCausalLM.share_cache`), reading the keys and values the target wrote for the committed tokens, and writes
only the ≤ γ slots past them, which the target's verification pass overwrites before it reads them. So the draft
never prefills the prompt (a prefill of the whole model, at int8 or int4) and never catches up, and the target's
cache, hence its output, is the bits it would be without a draft. The draft's q is then the quantized copy's
distribution given the target's keys and values: still exactly what its tokens are drawn from. Batched on the fast
path its form (`BatchedSelfDraft`) drafts in the batch's cache the same way. Eagerly (no slot cache), and for a
target other than the one it was made from, it keeps its own cache as any draft does.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig
from specdec.drafters.base import BatchSetting, DraftRow, DrafterCapabilities, Proposal
from specdec.drafters.batched import BatchedDraftModel
from specdec.drafters.draft_model import DraftModel
from specdec.errors import ConfigError
from specdec.runtime.batch_static import StaticBatchedCausalLM, bucket
from specdec.runtime.slot_cache import kv_layout
from specdec.runtime.static_lm import StaticCausalLM
from specdec.runtime.weights import DEFAULT_GROUP, QUANTIZED, PackedLinear, head_format, quantized_copy


class SelfDraft(DraftModel):
    """Draft with the target's own weights quantized to `weights` ("int4", "int8" or "w4a8"), in `group`s of inputs per
    scale. compile / draft_vocab: as DraftModel's."""

    def __init__(self, target: PreTrainedModel, weights: str = "int4", *, group: int = DEFAULT_GROUP,
                 compile: bool | str | None = None, draft_vocab: Sequence[int] | torch.Tensor | None = None):
        if weights not in QUANTIZED:
            raise ConfigError(f"SelfDraft(weights={weights!r}): choose {', '.join(map(repr, QUANTIZED))}, the "
                              "precision of the target's quantized copy that drafts")
        self.weights, self.group = weights, group
        self._source = weakref.ref(target)  # the model it copies: the target whose cache it may share
        self._host: weakref.ref | None = None  # this request's target adapter, when it drafts in its cache
        twin = quantized_copy(target, weights, group, head=draft_vocab is None)
        super().__init__(twin, compile=compile, draft_vocab=draft_vocab)
        if draft_vocab is not None:  # the reduced head (DraftModel made it from the shared float head): quantize it
            head = self.model.get_output_embeddings()
            if isinstance(head, PackedLinear):  # a target on packed float weights: its rows' weights read back
                head = head.as_linear()
            self.model.set_output_embeddings(PackedLinear.pack(head, head_format(weights), group))

    #: Its step is a pass of the target's size: one compiled graph per step serves every γ (γ-step graphs compiled
    #: 94 s for γ 4 and 7 on the default target, and grow with γ and the layers).
    per_step_graphs = True

    @property
    def name(self) -> str:
        return f"SelfDraft({self.weights})"

    @property
    def capabilities(self) -> DrafterCapabilities:
        """DraftModel's, batched by `batched_self_draft` (in the batch's cache on the batched fast path)."""
        return dataclasses.replace(super().capabilities, batched=batched_self_draft)

    def can_share(self, target_model, draft_model) -> bool:
        """May a cache of `target_model`'s keys and values serve this draft (`draft_model`: its model on that path)?
        Only the model it was made from, with the same cache layout."""
        return target_model is self._source() and kv_layout(target_model) == kv_layout(draft_model)

    # -- drafting in the target's cache ----------------------------------------------------------------------
    @property
    def shares_cache(self) -> bool:
        """Does the current request draft in the target's slot cache (see the module's docstring)?"""
        return self._host is not None and self._host() is not None

    def plan(self, target: object) -> tuple[int, ...]:
        """Before each request: draft in `target`'s cache when it is the fast path's adapter of the model this
        draft was made from, with the same cache layout (the draft on the fast path too)."""
        self._host = None
        if (isinstance(target, StaticCausalLM) and isinstance(self.lm, StaticCausalLM)
                and self.can_share(target.model, self.lm.model)):
            self._host = weakref.ref(target)
        return super().plan(target)

    def ensure_capacity(self, tokens: int) -> None:
        if not self.shares_cache:  # else the target's cache, sized for the request, has the draft's room
            super().ensure_capacity(tokens)

    def reset(self, prompt_ids: torch.Tensor, **kwargs) -> None:
        if not self.shares_cache:
            return super().reset(prompt_ids, **kwargs)
        self.lm.reset()
        self.lm.share_cache(self._host())  # the target has prefilled prompt_ids[:-1]: nothing to prefill

    def precompile(self, gammas, sampling: SamplingConfig, context: torch.Tensor) -> None:
        if not self.shares_cache:
            return super().precompile(gammas, sampling, context)
        self.lm.precompile((), gammas, sampling, context, vocab=self.draft_vocab, feed=1, per_step=self.per_step_graphs)

    def propose(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        if not self.shares_cache or gamma < 1:
            return super().propose(context, gamma, sampling, generator)
        # The target's cache holds context[:n-1], its own keys and values: feed the root alone, write past it.
        self.lm.length = context.shape[0] - 1
        return self._draft_steps(context, gamma, sampling, generator, feed=1)


def batched_self_draft(drafter: SelfDraft, setting: BatchSetting | None = None) -> BatchedDraftModel:
    """`SelfDraft`'s batched form (`DrafterCapabilities.batched`): `BatchedSelfDraft` in the batch's cache on the
    batched fast path (the batch's target a `StaticBatchedCausalLM` of the model the self-draft was made from),
    else `BatchedDraftModel`, with a cache of its own."""
    setting = setting or BatchSetting()
    host = setting.target
    if isinstance(host, StaticBatchedCausalLM) and drafter.can_share(host.model, drafter.lm.model):
        return BatchedSelfDraft(drafter, host)
    return BatchedDraftModel(drafter, setting)


class BatchedSelfDraft(BatchedDraftModel):
    """A self-draft over a batch's rows, drafting in the target's cache `host` as a lone request's self-draft does:
    each round it reads the rows' committed keys and values where the target wrote them, feeds the roots and its
    drafts at the columns the target's next pass writes first (made room for before it drafts), and keeps nothing:
    no cache, no prefill when rows join, nothing to crop."""

    def __init__(self, drafter: SelfDraft, host: StaticBatchedCausalLM):
        self.drafter, self.host = drafter, host
        # the draft's passes over the target's cache: its own compiled shapes, never a cache of its own
        self.lm = StaticBatchedCausalLM(drafter.lm.model, compile=host.compile, max_len=host.max_len)
        self.lm.query_buckets = (1,)  # a draft step feeds one token a row: the root, then each draft

    def add_rows(self, rows: Sequence[DraftRow], features=None) -> None:
        for row in rows:
            row.drafter = None  # the target's prefill is the draft's too

    def remove_rows(self, keep: Sequence[int]) -> None:
        """Nothing to do: the rows' keys and values are the target's."""

    def precompile(self, rows: Sequence[int]) -> None:
        if self.host.cache is not None:
            self.lm.max_len = self.host.max_len
            self.lm.precompile(rows, (1,))

    def commit(self, rows: Sequence[DraftRow], accepted: Sequence[int], features=None) -> None:
        """Nothing to roll back: the target's commit keeps what it accepted."""

    def _catch_up_long(self, rows: Sequence[DraftRow]) -> list[int]:
        """Nothing to catch up; each row's cache holds its context but the root (the target's)."""
        return [row.n - 1 for row in rows]

    def propose(self, rows: Sequence[DraftRow], gammas: Sequence[int]) -> list[Proposal]:
        """Room made in the target's cache for its next pass (γ + 1 columns, its query bucket), so that it compacts
        or grows nothing after the draft wrote there; the draft's passes then read the target's cache and write
        those columns. Then `BatchedDraftModel.propose`, which feeds each row its root."""
        if max(gammas, default=0) == 0:
            return [Proposal(row.context[:0]) for row in rows]
        host, lm = self.host, self.lm
        host.make_room(bucket(max(gammas) + 1, host.query_buckets))
        lm.cache, lm.max_len, lm.valid = host.cache, host.max_len, host.valid.clone()
        held = host.lengths.tolist()
        if held != [row.n - 1 for row in rows]:
            raise RuntimeError(f"internal: the target's cache holds {held} tokens of rows whose contexts are "
                               f"{[row.n for row in rows]} long (it should hold all but each root)")
        return super().propose(rows, gammas)
