"""`SelfDraft`: a draft for any model, with no second model and no training: the target's own weights, quantized.

`SelfDraft(target, weights="int4")` drafts with a copy of the target whose linear layers are quantized to int4 (or
int8, or w4a8: int4 computed on int8 activations) and run on specdec's packed kernels (runtime/weights.py): the same layers, the same tokenizer, nothing to
download or train. Its embeddings, norms and biases are the target's own tensors (shared, not copied); its linear
layers hold a packed copy at a quarter (int8) or an eighth (int4) of float32's bytes, so a draft step reads that
much less memory than a target step. How close the copy stays to the target is what acceptance measures
(docs/quantization.md has the figures on the default target).

Exact at every temperature: q is the quantized copy's own warped distribution, the one its tokens are drawn from,
and verification is the usual rule against the target. It is a `DraftModel` over that copy, so it batches, runs on
the fast path, takes `draft_vocab` (its reduced head quantized like the rest) and `gamma="auto"` like any draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from specdec.drafters.draft_model import DraftModel
from specdec.errors import ConfigError
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
        twin = quantized_copy(target, weights, group, head=draft_vocab is None)
        super().__init__(twin, compile=compile, draft_vocab=draft_vocab)
        if draft_vocab is not None:  # the reduced head (DraftModel made it from the shared float head): quantize it
            head = self.model.get_output_embeddings()
            self.model.set_output_embeddings(
                PackedLinear.pack(head, head_format(weights), group))

    @property
    def name(self) -> str:
        return f"SelfDraft({self.weights})"
