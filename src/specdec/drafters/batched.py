"""`BatchedDraftModel`: `DraftModel.propose` for every row of a batch at once.

The draft model gets its own `BatchedCausalLM` (rows join, leave and roll back with the target's rows). Each
round: one ragged catch-up forward (the committed tokens its cache has not seen: 1 or 2 per row, none for
rows not drafting), then one batched forward per draft position. A row drafting fewer tokens feeds padding
and samples nothing, so every row makes exactly the draws of the same request decoded alone; greedy rows
share one argmax per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdec.core.sampling import sample
from specdec.drafters.base import DraftRow, Proposal
from specdec.runtime.batch_lm import BatchedCausalLM

if TYPE_CHECKING:
    from specdec.drafters.draft_model import DraftModel


class BatchedDraftModel:
    """`DraftModel`'s form over a batch's rows (`DrafterCapabilities.batched`, a `RowDrafters`)."""

    def __init__(self, drafter: DraftModel):
        self.drafter = drafter
        self.lm = BatchedCausalLM(drafter.lm.model)

    def add_rows(self, rows: Sequence[DraftRow], features=None) -> None:
        """New rows: the draft caches their committed context but the last token (the first round's root)."""
        for row in rows:
            row.drafter = None  # the rows share this batched draft model
        self.lm.add_rows([row.context[: row.n - 1] for row in rows])

    def remove_rows(self, keep: Sequence[int]) -> None:
        self.lm.remove_rows(keep)

    def commit(self, rows: Sequence[DraftRow], accepted: Sequence[int], features=None) -> None:
        """After a round: the draft cache may cover at most context[:n−1] of each row (it catches up when it
        next proposes), as `DraftModel.commit` for one request."""
        lengths = self.lm.lengths.tolist()
        self.lm.crop([min(length, row.n - 1) for length, row in zip(lengths, rows)])

    def propose(self, rows: Sequence[DraftRow], gammas: Sequence[int]) -> list[Proposal]:
        """rows: the batch's rows (context, n, sampling, generator, stats); gammas[i]: row i's draft length.
        The draft's logits are fitted to the target's width as `DraftModel` fits them (LM-head padding)."""
        lm = self.lm
        fit = self.drafter.fit_logits
        lengths = lm.lengths.tolist()
        # Catch up on committed tokens the draft cache has not seen (rows not drafting feed nothing).
        inputs = [row.context[length : row.n] if g else row.context[:0] for row, length, g in zip(rows, lengths, gammas)]
        logits = fit(lm.forward(inputs))  # [B, W, V]
        last = torch.stack([logits[i, max(0, x.shape[0] - 1)] for i, x in enumerate(inputs)])  # [B, V]
        tokens: list[list[torch.Tensor]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        any_greedy = any(row.sampling.greedy for row in rows)
        for step in range(max(gammas)):
            feed = []
            best = last.argmax(dim=-1, keepdim=True) if any_greedy else None  # [B, 1]: one argmax for all rows
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
