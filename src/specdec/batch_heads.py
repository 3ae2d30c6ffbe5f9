"""`BatchedHeads`: drafters that read the target's features (`Eagle`, `Medusa`) over the rows of a batch.

Every row owns a fork of the drafter (`Drafter.fork`: the head's weights shared, its own head KV cache and
pending features), created when the row joins and dropped when it leaves. The batched target's passes return
per-row features, and each row's fork is fed exactly what a lone request's drafter is fed:

    join:   the prompt's features [n-1, H] from the batched prefill          -> fork.reset(prompt, hidden=)
    round:  fork.propose                                                      -> the row's chain or tree
    commit: the features of the root and the accepted path [k+1, H] only     -> fork.commit(context, k, hidden=)

so features of rejected drafts (chain tails, tree nodes off the path) never reach a head, and every row
proposes what the same request decoded alone proposes. Medusa's heads run once for all rows (one stacked
[R, H] feature through the residual blocks and the LM head); an EAGLE head drafts per row (its levels attend
to the row's own head cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.medusa import Medusa


class BatchedHeads:
    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.hidden = drafter.needs_hidden  # what the target's passes must return (True, or layer indices)
        self.rowwise = False  # True: run Medusa's heads once per row too (for measuring what batching them saves)

    def add_rows(self, rows, features: Sequence[torch.Tensor | None]) -> None:
        """New rows (prefilled): each gets its own fork, reset with its prompt's features (None: a one-token
        prompt has none yet)."""
        for row, hidden in zip(rows, features):
            row.drafter = fork = self.drafter.fork()
            if hasattr(fork, "use_fast_path"):
                fork.use_fast_path(False)  # the batch scores every row eagerly
            fork.reset(row.context[: row.n], hidden=hidden)

    def propose(self, rows, gammas: list[int], empty: Proposal) -> list[Proposal]:
        """Each row's raw proposal (a chain or a tree, checked by the caller); `empty` for rows not drafting."""
        if isinstance(self.drafter, Medusa) and not self.rowwise:
            return self._propose_medusa(rows, gammas, empty)
        return [row.drafter.propose(row.context[: row.n], g, row.sampling, row.generator) if g else empty
                for row, g in zip(rows, gammas)]

    @torch.inference_mode()
    def _propose_medusa(self, rows, gammas: list[int], empty: Proposal) -> list[Proposal]:
        """One pass of the Medusa heads for every drafting row: features [R, H] -> logits [K, R, V]."""
        drafting = [i for i, (row, g) in enumerate(zip(rows, gammas)) if g and row.drafter.feature is not None]
        out = [empty] * len(rows)
        if not drafting:
            return out
        medusa = self.drafter
        lm_head = medusa.lm_head
        features = torch.stack([rows[i].drafter.feature for i in drafting]).to(lm_head.weight.dtype)  # [R, H]
        logits = lm_head(medusa.heads(features))  # [K, R, V]
        for j, i in enumerate(drafting):
            fork = rows[i].drafter
            fork._forwards += 1
            out[i] = fork.proposal(logits[:, j], gammas[i], rows[i].context.device)
        return out

    def commit(self, row, num_accepted: int, features: torch.Tensor) -> None:
        """After verification: features [k+1, H] of the row's root and accepted path."""
        row.drafter.commit(row.context[: row.n], num_accepted, hidden=features)
