"""`BatchedDraftModel`: `DraftModel.propose` for every row of a batch at once.

The draft model gets its own batched LM (rows join, leave and roll back with the target's rows), on the path the
batch's target takes (`BatchSetting`: compiled over a slot cache on the fast path, else `BatchedCausalLM`). Each
round: one ragged catch-up forward (the committed tokens its cache has not seen: 1 or 2 per row, none for
rows not drafting), then one batched forward per draft position. A row drafting fewer tokens feeds padding
and samples nothing, so every row makes exactly the draws of the same request decoded alone; greedy rows
share one argmax per position.

After rounds with nothing drafted (γ = 0 under load) a row is further behind: it first catches up in passes of
at most `CATCH_UP` tokens until 1 or 2 are left, so on the fast path the draft's passes are three compiled
widths (`WIDTHS`) whatever the load did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.core.sampling import sample
from specdec.drafters.base import BatchSetting, DraftRow, Proposal
from specdec.runtime.batch_static import StaticBatchedCausalLM, batched_adapter
from specdec.runtime.rowwise import argmax
from specdec.runtime.static_lm import CATCH_UP_ROWS

if TYPE_CHECKING:
    from specdec.drafters.draft_model import DraftModel

#: Tokens a catch-up pass feeds a row at most (a row further behind takes several): the single-row fast path's.
CATCH_UP = CATCH_UP_ROWS
#: The draft's pass widths: a draft step, the usual catch-up (the root, or the bonus and the root), a long one.
WIDTHS = (1, 2, CATCH_UP)


class BatchedDraftModel:
    """`DraftModel`'s form over a batch's rows (`DrafterCapabilities.batched`, a `RowDrafters`)."""

    def __init__(self, drafter: DraftModel, setting: BatchSetting | None = None):
        self.drafter = drafter
        setting = setting or BatchSetting()
        # the draft runs as the batch's target runs: compiled over its own slot cache on the fast path
        self.lm = batched_adapter(drafter.lm.model, setting.compile, setting.max_len)
        if isinstance(self.lm, StaticBatchedCausalLM):
            self.lm.query_buckets = WIDTHS  # every pass pads to one of these

    def add_rows(self, rows: Sequence[DraftRow], features=None) -> None:
        """New rows: the draft caches their committed context but the last token (the first round's root)."""
        for row in rows:
            row.drafter = None  # the rows share this batched draft model
        self.lm.add_rows([row.context[: row.n - 1] for row in rows])

    def remove_rows(self, keep: Sequence[int]) -> None:
        self.lm.remove_rows(keep)

    def precompile(self, rows: Sequence[int]) -> None:
        """The draft's passes for batches of `rows` rows: each of `WIDTHS`."""
        self.lm.precompile(rows, WIDTHS)

    def commit(self, rows: Sequence[DraftRow], accepted: Sequence[int], features=None) -> None:
        """After a round: the draft cache may cover at most context[:n−1] of each row (it catches up when it
        next proposes), as `DraftModel.commit` for one request."""
        lengths = self.lm.lengths.tolist()
        self.lm.crop([min(length, row.n - 1) for length, row in zip(lengths, rows)])

    def _catch_up_long(self, rows: Sequence[DraftRow]) -> list[int]:
        """Feed every row more than 2 committed tokens behind up to `CATCH_UP` of them a pass (logits unused)
        until each has 1 or 2 left. Returns the rows' cached lengths."""
        lengths = self.lm.lengths.tolist()
        while any(row.n - length > 2 for row, length in zip(rows, lengths)):
            feed = [row.context[length : length + min(CATCH_UP, row.n - length - 2)] if row.n - length > 2
                    else row.context[:0] for row, length in zip(rows, lengths)]
            self.lm.forward(feed, last_only=True)
            lengths = [length + x.shape[0] for length, x in zip(lengths, feed)]
        return lengths

    def propose(self, rows: Sequence[DraftRow], gammas: Sequence[int]) -> list[Proposal]:
        """rows: the batch's rows (context, n, sampling, generator, stats); gammas[i]: row i's draft length.
        The draft's logits are fitted to the target's width as `DraftModel` fits them (LM-head padding)."""
        lm = self.lm
        fit = self.drafter.fit_logits
        lengths = self._catch_up_long(rows)
        # Catch up on committed tokens the draft cache has not seen (rows not drafting feed nothing).
        inputs = [row.context[length : row.n] if g else row.context[:0] for row, length, g in zip(rows, lengths, gammas)]
        logits = fit(lm.forward(inputs))  # [B, W, V]
        last = torch.stack([logits[i, max(0, x.shape[0] - 1)] for i, x in enumerate(inputs)])  # [B, V]
        tokens: list[list[torch.Tensor]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        any_greedy = any(row.sampling.greedy for row in rows)
        for step in range(max(gammas)):
            feed = []
            best = argmax(last)[:, None] if any_greedy else None  # [B, 1]: one argmax for all rows
            for i, row in enumerate(rows):
                if step >= gammas[i]:
                    feed.append(row.context[:0])
                    continue
                if row.sampling.greedy:
                    token = best[i]  # [1]
                else:
                    draft_probs = row.sampling.warp(last[i : i + 1])  # [1, V]
                    token = sample(draft_probs, row.generator)  # [1]
                    probs[i].append(draft_probs)
                tokens[i].append(token)
                feed.append(token if step + 1 < gammas[i] else row.context[:0])
            if step + 1 < max(gammas):
                last = fit(lm.forward(feed)[:, 0])  # [B, V]
        out = []
        for i, row in enumerate(rows):
            if not tokens[i]:
                out.append(Proposal(row.context[:0]))
                continue
            out.append(Proposal(torch.cat(tokens[i]), torch.cat(probs[i]) if probs[i] else None))  # [γ], [γ, V]
            row.stats.draft_forwards = row.stats.draft_forwards + gammas[i]
        return out
