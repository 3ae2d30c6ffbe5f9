"""`BatchedEagle`, `BatchedMedusa`: drafters that read the target's features over the rows of a batch.

Both are `BatchedHeads`, a `PerRow` form: every row owns a fork of the drafter (`Drafter.fork`: the head's
weights shared, its own head KV cache and pending features), created when the row joins and dropped when it
leaves. The batched target's passes return
per-row features, and each row's fork is fed exactly what a lone request's drafter is fed:

    join:   the prompt's features [n-1, H] from the batched prefill          -> fork.reset(prompt, hidden=)
    round:  the fork's head drafts (one batched head pass per level for all rows) -> the row's chain or tree
    commit: the features of the root and the accepted path [k+1, H] only     -> fork.commit(context, k, hidden=)

so features of rejected drafts (chain tails, tree nodes off the path) never reach a head, and every row
proposes what the same request decoded alone proposes. Medusa's heads run once for all rows (one stacked
[R, H] feature through the residual blocks and the LM head), and so does an EAGLE head, chain or EAGLE-2
tree (one pass per level over a temporary batch of the rows' head caches; each row's tree is grown and
reranked by the same rules as `Eagle._tree`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specdec.core.masks import additive_mask
from specdec.drafters.base import BatchSetting, Drafter, DraftRow, Proposal
from specdec.drafters.per_row import PerRow
from specdec.heads.static_draft import grow_level


class BatchedHeads(PerRow):
    """A fork of a head drafter per row, fed the target's features of its root and accepted path; the forks draft
    eagerly (the batch scores every row eagerly)."""

    def __init__(self, drafter: Drafter, setting: BatchSetting | None = None):
        super().__init__(drafter, fork=True)

    def add_rows(self, rows: Sequence[DraftRow], features: Sequence[torch.Tensor | None] | None) -> None:
        """New rows (prefilled): each gets its own fork, reset with its prompt's features (None: a one-token
        prompt has none yet)."""
        for i, row in enumerate(rows):
            row.drafter = self.drafter.fork()
            row.drafter.use_fast_path(False)
            self._start(row, features[i])


class BatchedMedusa(BatchedHeads):
    """`Medusa` over a batch's rows: the heads run once for every drafting row."""

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], gammas: Sequence[int]) -> list[Proposal]:
        """One pass of the Medusa heads for every drafting row: features [R, H] -> logits [K, R, V]."""
        drafting = [i for i, (row, g) in enumerate(zip(rows, gammas)) if g and row.drafter.feature is not None]
        out = [Proposal(row.context[:0]) for row in rows]
        if not drafting:
            return out
        medusa = self.drafter
        lm_head = medusa.lm_head
        features = torch.stack([rows[i].drafter.feature for i in drafting]).to(medusa.embed.weight.dtype)  # [R, H]
        logits = lm_head(medusa.heads(features))  # [K, R, V]
        for j, i in enumerate(drafting):
            fork = rows[i].drafter
            fork._forwards += 1
            out[i] = fork.proposal(logits[:, j], gammas[i], rows[i].context.device)
        return out


class BatchedEagle(BatchedHeads):
    """`Eagle` over a batch's rows: one head pass per level for every drafting row."""

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], gammas: Sequence[int]) -> list[Proposal]:
        """EAGLE for every drafting row in one head pass per level: `Eagle._catch_up` then `Eagle._chain` or
        `Eagle._tree`, batched over rows (`_catch_up`), each row's tree grown by the same `grow_level`."""
        drafting = [i for i, (row, g) in enumerate(zip(rows, gammas)) if g and row.drafter.pending.shape[0]]
        out = [Proposal(row.context[:0]) for row in rows]
        if len(drafting) == 1:  # one row: its own head cache directly (no temporary batch cache to build)
            i = drafting[0]
            out[i] = rows[i].drafter.propose(rows[i].context[: rows[i].n], gammas[i], rows[i].sampling,
                                             rows[i].generator)
        if len(drafting) < 2:
            return out
        cache, valid, feature = self._catch_up(rows, drafting)
        gamma = [gammas[i] for i in drafting]
        base = torch.tensor([rows[i].n - 1 for i in drafting], device=feature.device)  # [R] first level's position
        if self.drafter.top_k == 1:
            drafted = self._chain(cache, valid, feature, gamma, base, [rows[i].drafter for i in drafting])
        else:
            drafted = self._tree(cache, valid, feature, gamma, base, [rows[i].drafter for i in drafting])
        for i, (tokens, parents) in zip(drafting, drafted):
            device = rows[i].context.device
            out[i] = Proposal(tokens.to(device), None, None if parents is None else parents.to(device))
        return out

    def _catch_up(self, rows, drafting: list[int]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """Feed every drafting row's pending target features in one head pass.

        The rows' head caches are stacked into a temporary left-padded cache [R, h, L, d] (`valid` [R, L] marks
        each row's slots; the padding is a hole); row r feeds context[rows_r+1 : n_r] with its pending
        features at positions rows_r..n_r−2 (right-padded). Each row's new keys/values are appended to its own
        cache; the levels drafted afterwards run on the temporary cache only, which the caller drops, so a
        row's head cache only ever holds rows computed from target features (what `Eagle.commit`'s crop
        guarantees for a lone request). Returns (temporary cache, valid [R, L + M], the head's prediction of
        f_{n−1} per row [R, H])."""
        eagle = self.drafter
        forks = [rows[i].drafter for i in drafting]
        for i, fork in zip(drafting, forks):
            if fork.rows + fork.pending.shape[0] != rows[i].n - 1:
                fork._catch_up(rows[i].context[: rows[i].n])  # raises Eagle's own ConfigError
        device = eagle.embed.weight.device
        lengths = torch.tensor([f.rows for f in forks], device=device)  # [R] head-cache rows per row
        pending = torch.tensor([f.pending.shape[0] for f in forks], device=device)  # [R]
        past, width = int(lengths.max()), int(pending.max())
        cache = DynamicCache()
        if past:
            template = next(f.cache.layers[0].keys for f in forks if f.rows)  # [1, h, rows, d]
            keys = template.new_zeros(len(forks), template.shape[1], past, template.shape[3])  # [R, h, L, d]
            values = torch.zeros_like(keys)
            for r, f in enumerate(forks):
                if f.rows:
                    keys[r, :, past - f.rows :] = f.cache.layers[0].keys[0]
                    values[r, :, past - f.rows :] = f.cache.layers[0].values[0]
            cache = DynamicCache([(keys, values)])
        valid = torch.arange(past, device=device)[None] >= (past - lengths)[:, None]  # [R, L]
        steps = torch.arange(width, device=device)  # [M]
        tokens = torch.zeros(len(forks), width, dtype=torch.long, device=device)  # [R, M]
        features = forks[0].pending.new_zeros(len(forks), width, forks[0].pending.shape[-1])  # [R, M, F]
        for r, (i, f) in enumerate(zip(drafting, forks)):
            m = f.pending.shape[0]
            tokens[r, :m] = rows[i].context[f.rows + 1 : rows[i].n].to(device)
            features[r, :m] = f.pending
        # Padding repeats the row's last position and is seen only by later padding of its own row.
        positions = torch.minimum(lengths[:, None] + steps[None], (lengths + pending - 1)[:, None])  # [R, M]
        new = steps[None] < pending[:, None]  # [R, M] real inputs
        mask = torch.cat([valid, torch.ones_like(new)], dim=1).long()  # [R, L + M]
        hidden = self._head(tokens, features, positions, mask, cache)  # [R, M, H]
        layer = cache.layers[0]
        for r, f in enumerate(forks):
            m = int(pending[r])
            f.cache.update(layer.keys[r : r + 1, :, past : past + m], layer.values[r : r + 1, :, past : past + m], 0)
            f.rows += m
            f.pending = f.pending[:0]
            f._forwards += 1
        feature = hidden[torch.arange(len(forks), device=device), pending - 1]  # [R, H]
        return cache, torch.cat([valid, new], dim=1), feature

    def _chain(self, cache, valid, feature, gamma: list[int], base, forks) -> list[tuple[torch.Tensor, None]]:
        """`Eagle._chain` for R rows: argmax of the LM head, then the drafted token and feature one position on."""
        rows = len(forks)
        drafts: list[torch.Tensor] = []
        for level in range(max(gamma)):
            token = self.drafter.head.logits(feature, self.drafter.lm_head).argmax(-1)  # [R]
            drafts.append(token)
            if level + 1 == max(gamma):
                break
            valid = torch.cat([valid, valid.new_ones(rows, 1)], dim=1)  # [R, S + 1]
            feature = self._head(token[:, None], feature[:, None], (base + level)[:, None], valid.long(), cache)[:, 0]
            for r, f in enumerate(forks):
                f._forwards += level + 1 < gamma[r]
        chain = torch.stack(drafts, dim=1)  # [R, γmax]
        return [(chain[r, : gamma[r]], None) for r in range(rows)]

    def _tree(self, cache, valid, feature, gamma: list[int], base, forks) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`Eagle._tree` (EAGLE-2) for R rows: each level feeds every row's k frontier nodes in one head pass
        with a 4-D mask [R, 1, k, S + fed + k] (a row's committed slots, then its frontier nodes' own chains of
        drafted rows); each row's next frontier is picked by `grow_level` on its own log-probabilities."""
        eagle = self.drafter
        k, rows, device = eagle.top_k, len(forks), feature.device
        levels = [min(eagle.depth, g) for g in gamma]
        logp = torch.log_softmax(eagle.head.logits(feature, eagle.lm_head).float(), -1)  # [R, V]
        top = logp.topk(k, dim=-1)  # [R, k]
        tokens = [[top.indices[r]] for r in range(rows)]  # per row, per level: [k] (level 0) or [k*k]
        scores = [[top.values[r]] for r in range(rows)]
        parents = [[torch.full((k,), -1, dtype=torch.long, device=device)] for _ in range(rows)]
        offset = [0] * rows
        frontier = [torch.arange(k, device=device) for _ in range(rows)]
        frontier_ids = [torch.arange(k, device=device) for _ in range(rows)]
        frontier_features = feature[:, None].expand(rows, k, feature.shape[-1])  # [R, k, H]
        ancestors = None  # [R, k, fed]: which drafted rows each frontier node descends from
        fed = 0
        eye = torch.eye(k, dtype=torch.bool, device=device)
        for level in range(1, max(levels)):
            level_tokens = torch.stack([tokens[r][-1][frontier[r]] for r in range(rows)])  # [R, k]
            rows_mask = eye.expand(rows, k, k) if ancestors is None else torch.cat(
                [ancestors, eye.expand(rows, k, k)], dim=2)  # [R, k, fed + k]
            allowed = torch.cat([valid[:, None, :].expand(rows, k, valid.shape[1]), rows_mask], dim=2)
            mask = additive_mask(allowed, frontier_features.dtype)  # [R, k, S + fed + k]
            positions = (base + level - 1)[:, None].expand(rows, k)  # [R, k]
            out = self._head(level_tokens, frontier_features, positions, mask[:, None], cache)  # [R, k, H]
            fed += k
            logp = torch.log_softmax(eagle.head.logits(out, eagle.lm_head).float(), -1)  # [R, k, V]
            for r in range(rows):
                if level < levels[r]:  # rows drafting fewer levels keep their tree (this level is ignored)
                    frontier[r], frontier_ids[r], offset[r] = grow_level(
                        logp[r], tokens[r], scores[r], parents[r], frontier[r], frontier_ids[r], offset[r])
                    forks[r]._forwards += 1
            pick = torch.stack([f // k for f in frontier])  # [R, k] which of the k fed nodes each child is under
            frontier_features = torch.gather(out, 1, pick[:, :, None].expand(rows, k, out.shape[-1]))  # [R, k, H]
            ancestors = torch.gather(rows_mask, 1, pick[:, :, None].expand(rows, k, fed))  # [R, k, fed]
        return [_best_nodes(tokens[r], scores[r], parents[r], eagle.max_nodes) for r in range(rows)]

    def _head(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              cache: DynamicCache) -> torch.Tensor:
        """One EAGLE head pass over rows: tokens [R, W], features [R, W, F] (the target's, F = the head's
        feature_size) or [R, W, H] (drafted ones), positions [R, W], a mask over the
        cache's slots and the new ones (2-D [R, S + W] or additive 4-D [R, 1, W, S + W]) -> features [R, W, H]."""
        eagle = self.drafter
        embeds = eagle.embed(tokens)  # [R, W, H]
        return eagle.head(embeds, features.to(embeds.dtype), positions, attention_mask=mask, cache=cache)



def _best_nodes(tokens: list[torch.Tensor], scores: list[torch.Tensor], parents: list[torch.Tensor],
                max_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's rerank, as `Eagle._tree`: the `max_nodes` best-scored nodes in topological order (a parent
    always outscores its child, so they form a subtree), parents re-indexed among them. [N], [N]."""
    all_tokens, all_scores, all_parents = torch.cat(tokens), torch.cat(scores), torch.cat(parents)
    keep = all_scores.topk(min(max_nodes, all_scores.shape[0])).indices.sort().values  # [N]
    remap = torch.full((all_tokens.shape[0],), -1, dtype=torch.long, device=all_tokens.device)
    remap[keep] = torch.arange(keep.shape[0], device=all_tokens.device)
    kept = all_parents[keep]
    return all_tokens[keep], torch.where(kept >= 0, remap[kept.clamp(min=0)], kept)
