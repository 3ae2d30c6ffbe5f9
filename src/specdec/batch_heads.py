"""`BatchedHeads`: drafters that read the target's features (`Eagle`, `Medusa`) over the rows of a batch.

Every row owns a fork of the drafter (`Drafter.fork`: the head's weights shared, its own head KV cache and
pending features), created when the row joins and dropped when it leaves. The batched target's passes return
per-row features, and each row's fork is fed exactly what a lone request's drafter is fed:

    join:   the prompt's features [n-1, H] from the batched prefill          -> fork.reset(prompt, hidden=)
    round:  fork.propose                                                      -> the row's chain or tree
    commit: the features of the root and the accepted path [k+1, H] only     -> fork.commit(context, k, hidden=)

so features of rejected drafts (chain tails, tree nodes off the path) never reach a head, and every row
proposes what the same request decoded alone proposes. Medusa's heads run once for all rows (one stacked
[R, H] feature through the residual blocks and the LM head), and so does an EAGLE chain's head (one pass
per level over a temporary batch of the rows' head caches); EAGLE-2 trees draft per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from transformers import DynamicCache

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.eagle import Eagle
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
        if type(self.drafter) is Eagle and self.drafter.top_k == 1 and not self.rowwise:
            return self._propose_eagle_chain(rows, gammas, empty)
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

    @torch.inference_mode()
    def _propose_eagle_chain(self, rows, gammas: list[int], empty: Proposal) -> list[Proposal]:
        """EAGLE chains for every drafting row in one head pass per level (`Eagle._catch_up` + `Eagle._chain`,
        batched). The rows' head caches are stacked into a temporary left-padded batch cache [R, h, L, d] with a
        2-D mask over its valid slots; the catch-up pass (each row's pending target features, right-padded)
        runs on it and each row's new keys/values are appended to the row's own cache; the γ − 1 levels fed
        drafted features run on the temporary cache only, which is then dropped, so no row computed from a
        drafted feature ever reaches a row's cache (as `Eagle.commit`'s crop guarantees for a lone request)."""
        drafting = [i for i, (row, g) in enumerate(zip(rows, gammas)) if g and row.drafter.pending.shape[0]]
        out = [empty] * len(rows)
        if not drafting:
            return out
        eagle = self.drafter
        forks = [rows[i].drafter for i in drafting]
        for i, fork in zip(drafting, forks):
            n, m = rows[i].n, fork.pending.shape[0]
            if fork.rows + m != n - 1:
                fork._catch_up(rows[i].context[: rows[i].n])  # raises Eagle's own ConfigError
        device = eagle.lm_head.weight.device
        lengths = torch.tensor([f.rows for f in forks], device=device)  # [R] head-cache rows per row
        pending = torch.tensor([f.pending.shape[0] for f in forks], device=device)  # [R]
        past, width = int(lengths.max()), int(pending.max())
        cache = DynamicCache()
        if past:
            template = next(f.cache.layers[0] for f in forks if f.rows)
            keys = template.keys.new_zeros(len(forks), template.keys.shape[1], past, template.keys.shape[3])
            values = torch.zeros_like(keys)
            for r, f in enumerate(forks):
                if f.rows:
                    keys[r, :, past - f.rows :] = f.cache.layers[0].keys[0]
                    values[r, :, past - f.rows :] = f.cache.layers[0].values[0]
            cache = DynamicCache([(keys, values)])
        slots = torch.arange(past, device=device)  # [L]
        valid = slots[None] >= (past - lengths)[:, None]  # [R, L] left padding is a hole
        # Catch-up: row r feeds context[rows+1 : n] with its pending features at positions rows..n-2.
        steps = torch.arange(width, device=device)  # [M]
        tokens = torch.zeros(len(forks), width, dtype=torch.long, device=device)  # [R, M]
        features = forks[0].pending.new_zeros(len(forks), width, eagle.head.hidden_size)  # [R, M, H]
        for r, (i, f) in enumerate(zip(drafting, forks)):
            m = f.pending.shape[0]
            tokens[r, :m] = rows[i].context[f.rows + 1 : rows[i].n].to(device)
            features[r, :m] = f.pending
        positions = torch.minimum(lengths[:, None] + steps[None], (lengths + pending - 1)[:, None])  # [R, M]
        new = steps[None] < pending[:, None]  # [R, M] real catch-up inputs
        mask = torch.cat([valid, torch.ones_like(new)], dim=1).long()  # [R, L + M] padding sees only itself
        hidden = self._head(eagle, tokens, features, positions, mask, cache)  # [R, M, H]
        layer = cache.layers[0]
        for r, f in enumerate(forks):
            m = int(pending[r])
            f.cache.update(layer.keys[r : r + 1, :, past : past + m], layer.values[r : r + 1, :, past : past + m], 0)
            f.rows += m
            f.pending = f.pending[:0]
            f._forwards += 1
        valid = torch.cat([valid, new], dim=1)  # [R, L + M]
        feature = hidden[torch.arange(len(forks), device=device), pending - 1]  # [R, H] prediction of f_{n-1}
        # Levels: argmax of the LM head, then the drafted token and feature one position on (temporary rows).
        gamma = [gammas[i] for i in drafting]
        base = torch.tensor([rows[i].n - 1 for i in drafting], device=device)  # [R] position of the first level
        drafts: list[torch.Tensor] = []
        for level in range(max(gamma)):
            token = eagle.lm_head(feature).argmax(-1)  # [R]
            drafts.append(token)
            if level + 1 == max(gamma):
                break
            mask = torch.cat([valid, valid.new_ones(len(forks), 1)], dim=1).long()  # [R, slots + 1]
            feature = self._head(eagle, token[:, None], feature[:, None], (base + level)[:, None], mask, cache)[:, 0]
            valid = torch.cat([valid, valid.new_ones(len(forks), 1)], dim=1)
            for r, f in enumerate(forks):
                f._forwards += level + 1 < gamma[r]
        chain = torch.stack(drafts, dim=1)  # [R, γmax]
        for r, i in enumerate(drafting):
            out[i] = Proposal(chain[r, : gamma[r]].to(rows[i].context.device))
        return out

    @staticmethod
    def _head(eagle, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              cache: DynamicCache) -> torch.Tensor:
        """One EAGLE head pass over rows: tokens [R, W], features [R, W, H], positions [R, W], a 2-D mask over
        the cache's slots and the new ones [R, S + W] -> predicted features [R, W, H]."""
        embeds = eagle.embed(tokens)  # [R, W, H]
        return eagle.head(embeds, features.to(embeds.dtype), positions, attention_mask=mask, cache=cache)

    def commit(self, row, num_accepted: int, features: torch.Tensor) -> None:
        """After verification: features [k+1, H] of the row's root and accepted path."""
        row.drafter.commit(row.context[: row.n], num_accepted, hidden=features)
