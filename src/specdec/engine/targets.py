"""The target as the round sees it: a `RowTarget` scores every row of a batch in one pass.

Batch size 1 is a batch: `OneRow` wraps a lone request's fast single-row adapter (`CachedCausalLM`,
`StaticCausalLM`, `CachedSeq2SeqLM`), so a lone request runs the same round as a batch's rows and pays nothing for
a batched cache (its passes are the adapter's own, in-graph verification included; the round sees [1, W, ...]
views of them). `ManyRows` wraps the batched adapters (`BatchedCausalLM`, `StaticBatchedCausalLM`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import PreTrainedModel

from specdec.core.tree import TreeMask
from specdec.core.verify import Verdict
from specdec.drafters.base import Proposal
from specdec.engine.request import Row, check_prompt_fits
from specdec.errors import SpecdecError
from specdec.runtime.base import ModelAdapter, Scores, check_finite
from specdec.runtime.batch_static import no_features
from specdec.runtime.causal_lm import CachedCausalLM, context_length, sliding_window
from specdec.runtime.rowwise import all_finite


class RowTarget(Protocol):
    """The target's side of the round, over rows. Row i's inputs are its root (last committed token) and drafts;
    logits and features come back as [B, W, ...], row i's meaningful at [i, :len(inputs[i])]."""

    model: PreTrainedModel
    vocab_size: int
    device: torch.device
    hidden: bool | tuple[int, ...]  # the features its passes return besides logits (what the drafter reads)
    verifies_in_graph: bool  # can `score_and_verify` verify a chain inside the pass

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise a PromptError before any work unless a request of this size fits."""

    def add_rows(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
        """Prefill each new row's context[:n-1]; each row's features of those tokens [n-1, F] (or None)."""

    def remove_rows(self, keep: Sequence[int]) -> None:
        """Keep only the rows at indices `keep`, in that order."""

    def room(self, row: Row) -> int | None:
        """Cache slots left after the row's root (None: no fixed bound)."""

    def scores_tree(self, row: Row, num_rows: int) -> bool:
        """Can the row's tree of `num_rows` rows (root included) be scored in one pass now?"""

    def score(self, rows: Sequence[Row], inputs: Sequence[torch.Tensor],
              trees: Sequence[TreeMask | None]) -> Scores:
        """Append inputs[i] [m_i] to row i (a chain, or trees[i]'s root and nodes): logits [B, W, V]."""

    def score_and_verify(self, rows: Sequence[Row], inputs: Sequence[torch.Tensor],
                         proposals: Sequence[Proposal]) -> tuple[Scores, list[Verdict]]:
        """`score` chains and verify them inside the pass (where `verifies_in_graph`)."""

    def row_errors(self, rows: Sequence[Row], scores: Scores, widths: Sequence[int]) -> list[SpecdecError | None]:
        """Per row, the error that fails it after a pass (non-finite logits in its real columns), or None."""

    def commit(self, rows: Sequence[Row], keeps: Sequence[Sequence[int]], trees: Sequence[TreeMask | None]) -> None:
        """Each row keeps columns keeps[i] of its inputs in the last pass (its root and accepted drafts; none: a
        failed row rolls the pass back)."""


class OneRow:
    """A lone request's target: a single-row adapter as a batch of one row (`RowTarget`)."""

    def __init__(self, adapter: ModelAdapter, hidden: bool | tuple[int, ...] = False):
        self.adapter = adapter
        self.model = adapter.model
        self.vocab_size = adapter.vocab_size
        self.device = adapter.device
        self.hidden = hidden
        self.verifies_in_graph = adapter.verifies_in_graph

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        # The cache is position-exact: a model's sliding window is its own attention mask's business.
        check_prompt_fits(prompt_len, max_new_tokens, self.adapter.context_limit)

    def add_rows(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
        """The request's start: an encoder-decoder adapter runs its encoder here; the prefill; the row's source
        ids (text encoders) for drafters that look them up."""
        (row,) = rows
        encoder = {} if row.encoder_inputs is None else {"encoder_inputs": row.encoder_inputs}
        self.adapter.reset(**encoder)
        features = self.adapter.prefill(row.context[: row.n - 1], hidden=self.hidden)  # [n-1, F] | None
        if encoder:
            row.source_ids = self.adapter.encoder_input_ids
        return [features]

    def remove_rows(self, keep: Sequence[int]) -> None:
        """Nothing to drop: the next request resets the adapter."""

    def room(self, row: Row) -> int | None:
        capacity = self.adapter.capacity or self.adapter.context_limit
        return None if capacity is None else capacity - row.n

    def scores_tree(self, row: Row, num_rows: int) -> bool:
        return self.adapter.supports_tree(num_rows)

    def score(self, rows: Sequence[Row], inputs: Sequence[torch.Tensor],
              trees: Sequence[TreeMask | None]) -> Scores:
        scores = self.adapter.score(inputs[0], tree=trees[0], hidden=self.hidden)  # [M, V], [M, F] | None
        return _one(scores)

    def score_and_verify(self, rows: Sequence[Row], inputs: Sequence[torch.Tensor],
                         proposals: Sequence[Proposal]) -> tuple[Scores, list[Verdict]]:
        row = rows[0]
        scores, verdict = self.adapter.score_and_verify(inputs[0], proposals[0].draft_probs, row.sampling,
                                                        row.generator, hidden=self.hidden)
        return _one(scores), [verdict]

    def row_errors(self, rows: Sequence[Row], scores: Scores, widths: Sequence[int]) -> list[SpecdecError | None]:
        return [None]  # the adapter raised a NumericalError inside its pass already

    def commit(self, rows: Sequence[Row], keeps: Sequence[Sequence[int]], trees: Sequence[TreeMask | None]) -> None:
        start, keep = rows[0].n - 1, keeps[0]  # the pass began at the root's slot
        if trees[0] is None:
            self.adapter.crop(start + len(keep))  # a chain keeps a prefix: a crop
        else:
            self.adapter.commit(start, torch.tensor(keep))


def _one(scores: Scores) -> Scores:
    """A single row's scores as a batch of one: logits [1, M, V], hidden [1, M, F] | None."""
    return Scores(scores.logits[None], None if scores.hidden is None else scores.hidden[None])


class ManyRows:
    """A batch's target: a batched adapter (`BatchedCausalLM`, `StaticBatchedCausalLM`) over rows with their own
    lengths (`RowTarget`). Rows are scored in one pass; a row's tree is a block of its own in the pass's mask.

    A sliding attention window counts cache slots there, and a batch's rows leave holes in the slots, so a
    request is admitted only when prompt + max_new_tokens fits inside the window, and the cache is compacted
    before a pass whose slots would reach past it: every row's tokens and inputs then lie inside the window."""

    verifies_in_graph = False

    def __init__(self, adapter, hidden: bool | tuple[int, ...] = False):
        if hidden and not adapter.returns_features:
            no_features(hidden)  # one clear error before any work
        self.adapter = adapter
        self.model = adapter.model
        self.vocab_size = adapter.vocab_size
        self.device = adapter.device
        self.hidden = hidden
        self.limit = context_length(self.model)
        self.window = sliding_window(self.model)
        self._trees: bool | None = None  # does the model honour a tree's 4-D mask (probed on first use)
        self._width = 0  # the last pass's width (columns per row)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        check_prompt_fits(prompt_len, max_new_tokens, self.limit)
        if self.window is not None and (self.limit is None or self.window < self.limit):
            check_prompt_fits(prompt_len, max_new_tokens, self.window, "the target's sliding attention window",
                              "batched rows share cache slots, so the window cannot be passed: shorten the prompt, "
                              "lower max_new_tokens, or decode this request alone with specdec.generate")
        self.adapter.check_fits(prompt_len + max_new_tokens)

    def add_rows(self, rows: Sequence[Row]) -> list[torch.Tensor | None]:
        """Prefill the new rows together and splice them in (the other rows' caches untouched)."""
        features = self.adapter.add_rows([row.context[: row.n - 1] for row in rows], hidden=self.hidden)
        return features if features is not None else [None] * len(rows)

    def remove_rows(self, keep: Sequence[int]) -> None:
        self.adapter.remove_rows(keep)

    def room(self, row: Row) -> int | None:
        return None if self.limit is None else self.limit - row.n

    def scores_tree(self, row: Row | None, num_rows: int) -> bool:
        if self._trees is None:  # the probe is cached per model
            self._trees = CachedCausalLM(self.model).supports_tree(2)
        return self._trees

    def score(self, rows: Sequence[Row], inputs: Sequence[torch.Tensor],
              trees: Sequence[TreeMask | None]) -> Scores:
        width = max(x.shape[0] for x in inputs)
        if self.window is not None and self.adapter.slots + width > self.window:
            self.adapter.compact()  # every row's tokens and inputs then span prompt + new tokens <= window
        scores = self.adapter.score(inputs, trees=trees, hidden=self.hidden)  # [B, W, V], [B, W, F] | None
        self._width = scores.logits.shape[1]
        return scores

    def score_and_verify(self, rows, inputs, proposals):
        raise NotImplementedError("batched passes do not verify in their graph (verifies_in_graph is False)")

    def row_errors(self, rows: Sequence[Row], scores: Scores, widths: Sequence[int]) -> list[SpecdecError | None]:
        """One finiteness check for the whole pass; only if it fails, row by row over each row's real columns
        (a non-finite value may sit in padding)."""
        logits = scores.logits  # [B, W, V]
        if all_finite(logits):
            return [None] * len(rows)
        errors: list[SpecdecError | None] = []
        for i, (row, width) in enumerate(zip(rows, widths)):
            try:
                check_finite(logits[i, :width], self.model, f"for request {row.key!r}")
                errors.append(None)
            except SpecdecError as exc:
                errors.append(exc)
        return errors

    def commit(self, rows: Sequence[Row], keeps: Sequence[Sequence[int]], trees: Sequence[TreeMask | None]) -> None:
        """A tree row keeps its root and accepted path (the other nodes become holes); then every row is cropped
        to its kept length (its context but the last token)."""
        for i, (keep, tree) in enumerate(zip(keeps, trees)):
            if tree is not None and keep:
                self.adapter.keep_new(i, self._width, keep)
        self.adapter.crop([row.n - 1 + len(keep) for row, keep in zip(rows, keeps)])
