"""`PerRow`: a drafter over a batch's rows with one drafter per row, each driven as a lone request's.

Every row gets its own `Drafter.fork()` when it joins (the drafter's weights and settings, its own per-request
state: an n-gram index, a draft cache, pending features) and drops it when it leaves; each round every drafting
row's fork proposes for that row alone. A lone request is the batch of one row whose drafter is the drafter
itself (`PerRow.alone`), so the single-request loop and the batched one drive drafters through the same calls:

    join:   drafter.reset(prompt, [hidden=prompt features], [encoder_inputs=, encoder_input_ids=])
    round:  drafter.propose(context, γ, sampling, generator)               (rows with γ > 0 only)
    commit: drafter.commit(context, k, [hidden=features of the root and the accepted drafts])

with the keyword arguments passed as the drafter's capabilities ask (`DrafterCapabilities.needs_hidden`,
`accepts_encoder_inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.drafters.base import BatchSetting, Drafter, DraftRow, Proposal


class PerRow:
    """One drafter per row: forks of `drafter` (or, `alone`, the drafter itself for a batch of one)."""

    def __init__(self, drafter: Drafter, fork: bool = True, setting: BatchSetting | None = None):
        # setting: unused (each row's drafter drafts as it does alone, on its own path)
        self.drafter = drafter
        self.fork = fork
        capabilities = drafter.capabilities
        self.hidden = capabilities.needs_hidden
        self.encoder = capabilities.accepts_encoder_inputs

    @classmethod
    def alone(cls, drafter: Drafter) -> PerRow:
        """A lone request's drafter: the drafter itself drives the one row."""
        return cls(drafter, fork=False)

    def precompile(self, rows: Sequence[int]) -> None:
        """Nothing batched to compile: each row's drafter drafts on its own."""

    def add_rows(self, rows: Sequence[DraftRow], features: Sequence[torch.Tensor | None] | None) -> None:
        for i, row in enumerate(rows):
            row.drafter = self.drafter.fork() if self.fork else self.drafter
            self._start(row, None if features is None else features[i])

    def _start(self, row: DraftRow, hidden: torch.Tensor | None) -> None:
        """The row's drafter starts its request: the prompt, and what its capabilities ask for."""
        kwargs = {}
        if self.hidden:
            kwargs["hidden"] = hidden
        if self.encoder and row.encoder_inputs is not None:
            kwargs.update(encoder_inputs=row.encoder_inputs, encoder_input_ids=row.source_ids)
        row.drafter.reset(row.context[: row.n], **kwargs)

    def remove_rows(self, keep: Sequence[int]) -> None:
        """Nothing to do: a row's drafter leaves with the row."""

    def propose(self, rows: Sequence[DraftRow], gammas: Sequence[int]) -> list[Proposal]:
        return [row.drafter.propose(row.context[: row.n], gamma, row.sampling, row.generator) if gamma
                else Proposal(row.context[:0]) for row, gamma in zip(rows, gammas)]

    def commit(self, rows: Sequence[DraftRow], accepted: Sequence[int | None],
               features: Sequence[torch.Tensor | None] | None) -> None:
        for i, (row, k) in enumerate(zip(rows, accepted)):
            if k is None:  # the row failed this round
                continue
            context = row.context[: row.n]
            if self.hidden:
                row.drafter.commit(context, k, hidden=features[i])
            else:
                row.drafter.commit(context, k)
            row.stats.draft_forwards = row.drafter.forwards
