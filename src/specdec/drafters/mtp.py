"""`Mtp`: draft with the target's own multi-token-prediction (MTP) layer.

The layer (heads/mtp.py) reads the target's final hidden state h_t and the embedding of the token after it,
x_{t+1}, and predicts x_{t+2}; transformers drops it when it loads the target, so `Mtp` loads it from the
target's checkpoint. Drafting is EAGLE's with the MTP layer as the head:

    catch-up:  rows t = rows..n-2:  g_t = mtp(embed(x_{t+1}), h_t)       (one pass; the target's features)
    draft 1:   logits(g_{n-2})                                           -> d_1 (x_n)
    draft i+1: g = mtp(embed(d_i), g_previous), logits(g)                -> d_{i+1}

a chain reusing the one MTP layer, each step fed its own previous output in place of the target's feature
(as vLLM and SGLang chain a single MTP layer; only the first MTP layer of a checkpoint with several is used).
Row t of the layer's KV cache sits at position t+1 (that of the token it embeds, as transformers' MtpModel).

Bookkeeping (as `Eagle`): between rounds the layer's cache holds only rows computed from the target's own
features (`rows` of them); the target's features of the last round's root and accepted drafts wait in
`pending` and are fed by the next round's catch-up pass; `commit` drops every row computed from a drafted
token. So no feature of a rejected draft ever reaches the layer.

Sampling. At temperature 0 the chain is the layer's argmax at every step (a point mass). At T > 0 each draft
token is drawn from the warped MTP distribution q_i = warp(logits_i) of its step (the same temperature, top-k
and top-p as the target), and q_i is what the proposal reports: exact at every temperature. `top_k > 1`
proposes an EAGLE-2 dynamic tree of the layer's top-k tokens instead (a point mass per node, exact at any
temperature): every level expands the `top_k` best frontier nodes by cumulative draft log-probability and the
best `max_nodes` nodes are kept.

Batched decoding: `BatchedMtp` gives every row its own fork (its layer cache and pending features) and runs
the catch-up and each chain step as one layer pass over every drafting row (trees: each row's fork alone).
The fast path (`compile=True` / "static") runs the target on its slot cache; the MTP layer drafts eagerly.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.core.masks import additive_mask
from specdec.core.sampling import SamplingConfig, sample
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftRow, Proposal
from specdec.drafters.batched_heads import BatchedHeads
from specdec.errors import ConfigError
from specdec.heads.mtp import load_mtp
from specdec.heads.static_draft import grow_level
from specdec.runtime.base import check_finite


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"Mtp {name} must be an integer >= 1, got {value!r}")
    return value


class Mtp(Drafter):
    """Draft with the target's own MTP layer (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash, Mellum; docs/heads.md).

    target: the target model (loaded with from_pretrained, so its MTP layer can be read from the same
    checkpoint) or its adapter. checkpoint: the directory or hub id holding the MTP weights (default: the one
    the target was loaded from). depth: the default γ (the chain's length, a tree's depth). top_k=1 drafts a
    chain (sampled at T > 0); top_k > 1 an EAGLE-2 tree of at most max_nodes nodes (needs tree verification).
    Raises UnsupportedModelError for a family without a loadable MTP layer and ModelLoadError for a checkpoint
    without MTP weights."""

    def __init__(self, target, checkpoint: str | Path | None = None, *, depth: int = 3, top_k: int = 1,
                 max_nodes: int = 16):
        model: PreTrainedModel = target if isinstance(target, PreTrainedModel) else target.model  # or an adapter
        self.depth = _positive("depth", depth)
        self.top_k = _positive("top_k", top_k)
        self.max_nodes = _positive("max_nodes", max_nodes)
        mtp = load_mtp(model, checkpoint)  # transformers' MtpModel: the layer beside the target's embedding/head
        # Its parts, not the MtpModel itself: a drafter holds no second causal-LM-like model (the exactness
        # engine patches every PreTrainedModel a drafter holds as a causal LM).
        self.layer = mtp.layers[0]  # transformers' MtpLayer: enorm, hnorm, eh_proj, the family's block, post_norm
        self.embed = mtp.embed_tokens
        self.rotary = mtp.rotary_emb  # the target's
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.out_features)
        self.family = type(model).__name__
        config = mtp.config.to_dict()
        layer_type = (config.get("layer_types") or [None])[0]
        self._rope = {"layer_type": layer_type} if mtp.has_per_layer_rope else {}
        #: The layer's attention window (a sliding-window MTP layer, as Mellum's), None: it sees every row.
        self.window: int | None = config.get("sliding_window") if layer_type == "sliding_attention" else None
        self._forwards = 0
        self.reset(torch.zeros(1, dtype=torch.long))

    @property
    def capabilities(self) -> DrafterCapabilities:
        """Reads the target's final features; its depth is the default γ; a tree when top_k > 1; batched with one
        layer pass per step for every row (`BatchedMtp`)."""
        return DrafterCapabilities(tree=self.top_k > 1, needs_hidden=True, batched=BatchedMtp,
                                   default_gamma=self.depth, max_nodes=self.max_nodes if self.top_k > 1 else None)

    @property
    def forwards(self) -> int:
        return self._forwards

    def fork(self) -> Mtp:
        """Another request's drafter over the same MTP layer: its own layer cache and pending features."""
        twin = copy.copy(self)
        twin.reset(torch.zeros(1, dtype=torch.long))
        return twin

    def reset(self, prompt_ids: torch.Tensor, *, hidden: torch.Tensor | None = None) -> None:
        """hidden [n-1, H]: the target's final features of prompt_ids[:-1] (None for a one-token prompt)."""
        self.cache = DynamicCache()
        self.rows = 0  # layer cache rows computed from target features (row t at position t+1)
        param = self.embed.weight  # (the features' dtype and device: the target's head may be packed)
        width = int(self.lm_head.in_features)
        self.pending = torch.empty(0, width, dtype=param.dtype, device=param.device) if hidden is None else hidden
        self._forwards = 0

    def commit(self, context: torch.Tensor, num_accepted: int, *, hidden: torch.Tensor | None = None) -> None:
        """hidden [k+1, H]: the target's features of the root and the accepted drafts."""
        extra = self.cache.get_seq_length() - self.rows  # rows computed from drafted tokens are stale
        if extra > 0:
            self.cache.crop(-extra)
        if hidden is not None:
            self.pending = torch.cat([self.pending, hidden.to(self.pending.dtype)])

    # -- one layer pass ---------------------------------------------------------------------------------------

    def visible(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """allowed [..., W, S] (bool) restricted to the layer's attention window, if it has one."""
        if self.window is None:
            return allowed
        return allowed & (query_pos[..., :, None] - key_pos[..., None, :] < self.window)

    def run_layer(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                  cache: DynamicCache) -> torch.Tensor:
        """One MTP pass over rows: tokens [R, W] (x_{t+1}), hidden [R, W, H] (h_t: the target's features or the
        layer's own earlier outputs), positions [R, W], visible [R, W, S + W] over the cache's S rows and the new
        ones -> the layer's outputs [R, W, H] (post-normed: `logits` turns them into draft logits)."""
        embeds = self.embed(tokens)  # [R, W, H]
        rope = self.rotary(embeds, positions, **self._rope)
        mask = additive_mask(visible, embeds.dtype)[:, None]  # [R, 1, W, S + W]
        return self.layer(embeds, hidden.to(embeds.dtype), position_embeddings=rope, attention_mask=mask,
                          position_ids=positions, cache=cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V] of layer outputs [..., H] (the target's LM head)."""
        return self.lm_head(out)

    def catch_up(self, context: torch.Tensor) -> torch.Tensor | None:
        """Feed the pending target features (one pass); the layer's output at the last committed row [H]."""
        n = context.shape[0]
        m = self.pending.shape[0]
        if m == 0:
            return None
        if self.rows + m != n - 1:
            raise ConfigError(
                f"Mtp holds target features of {self.rows + m} positions but the context has {n} tokens (expected "
                f"{n - 1}); drive it through specdec's decoder, which passes the features each round")
        device = self.pending.device
        positions = torch.arange(self.rows + 1, n, device=device)  # [m]
        keys = torch.arange(1, n, device=device)  # [rows + m] the positions of the cache's rows and the new ones
        allowed = keys[None, :] <= positions[:, None]  # [m, rows + m] causal
        out = self.run_layer(context[self.rows + 1 : n].to(device)[None], self.pending[None], positions[None],
                             self.visible(allowed, positions, keys)[None], self.cache)[0]  # [m, H]
        self._forwards += 1
        self.rows = n - 1
        self.pending = self.pending[:0]
        return out[-1]

    # -- proposals ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        out = self.catch_up(context)  # [H]
        if out is None:
            return Proposal(context.new_empty(0))
        if self.top_k == 1:
            return self._chain(out, gamma, context, sampling, generator)
        return self._tree(out, gamma, context)

    def _chain(self, out: torch.Tensor, gamma: int, context: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Proposal:
        n = context.shape[0]
        device = out.device
        tokens, probs = [], []
        for i in range(gamma):
            logits = self.logits(out)[None]  # [1, V]
            check_finite(logits, self, f"in {self.family}'s MTP layer (draft {i + 1})")
            token, q = draw(logits, sampling, generator)  # [1], [1, V] | None
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < gamma:  # row n-1+i, at position n+i: the drafted token and the layer's own output
                keys = torch.arange(1, n + i + 1, device=device)  # [rows + i + 1]
                position = keys[-1:]
                allowed = torch.ones(1, keys.shape[0], dtype=torch.bool, device=device)
                out = self.run_layer(token[None].to(device), out[None, None], position[None],
                                     self.visible(allowed, position, keys)[None], self.cache)[0, 0]  # [H]
                self._forwards += 1
        return Proposal(torch.cat(tokens).to(context.device),
                        torch.cat(probs).to(context.device) if probs else None)  # [γ], [γ, V] | None

    def _tree(self, out: torch.Tensor, gamma: int, context: torch.Tensor) -> Proposal:
        """EAGLE-2 over the MTP layer (as `Eagle._tree`): expand the `top_k` best frontier nodes per level by
        cumulative draft log-prob, keep the best `max_nodes` nodes (a parent outscores its child: a subtree)."""
        n = context.shape[0]
        k = self.top_k
        device = out.device
        logp = torch.log_softmax(self.logits(out).float(), -1)  # [V]
        top = logp.topk(k)
        tokens, scores = [top.indices], [top.values]  # per level: [k] (level 0) or [k*k]
        parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
        offset = 0
        frontier = torch.arange(k, device=device)  # within-level indices of the nodes to expand
        frontier_ids = torch.arange(k, device=device)  # their global node ids
        frontier_out = out[None].expand(k, -1)  # [k, H] the layer output each frontier node is drafted from
        ancestors = torch.zeros(k, 0, dtype=torch.bool, device=device)  # [k, fed] drafted rows each one descends from
        key_pos = torch.arange(1, self.rows + 1, device=device)  # positions of the cache's rows
        eye = torch.eye(k, dtype=torch.bool, device=device)
        for level in range(1, min(self.depth, gamma)):
            position = torch.full((k,), n + level - 1, device=device)  # [k]
            key_pos = torch.cat([key_pos, position])
            rows_mask = torch.cat([ancestors, eye], dim=1)  # [k, fed + k]
            allowed = torch.cat([torch.ones(k, self.rows, dtype=torch.bool, device=device), rows_mask], dim=1)
            new = self.run_layer(tokens[-1][frontier][None], frontier_out[None], position[None],
                                 self.visible(allowed, position, key_pos)[None], self.cache)[0]  # [k, H]
            self._forwards += 1
            logp = torch.log_softmax(self.logits(new).float(), -1)  # [k, V]
            check_finite(logp, self, f"in {self.family}'s MTP layer (tree level {level})")
            frontier, frontier_ids, offset = grow_level(logp, tokens, scores, parents, frontier, frontier_ids, offset)
            frontier_out = new[frontier // k]
            ancestors = rows_mask[frontier // k]  # [k, fed + k]
        kept_tokens, kept_parents = best_nodes(tokens, scores, parents, self.max_nodes)
        return Proposal(kept_tokens.to(context.device), None, kept_parents.to(context.device))


def draw(logits: torch.Tensor, sampling: SamplingConfig,
         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of logits [R, V]: the argmax at T = 0 (q = None, a point mass), else a draw from
    q = warp(logits) [R, V], the distribution the proposal reports."""
    if sampling.greedy:
        return logits.argmax(dim=-1), None
    q = sampling.warp(logits)
    return sample(q, generator), q


def best_nodes(tokens: list[torch.Tensor], scores: list[torch.Tensor], parents: list[torch.Tensor],
               max_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's rerank: the `max_nodes` best-scored nodes in topological order, parents re-indexed. [N], [N]."""
    all_tokens, all_scores, all_parents = torch.cat(tokens), torch.cat(scores), torch.cat(parents)
    keep = all_scores.topk(min(max_nodes, all_scores.shape[0])).indices.sort().values  # [N]
    remap = torch.full((all_tokens.shape[0],), -1, dtype=torch.long, device=all_tokens.device)
    remap[keep] = torch.arange(keep.shape[0], device=all_tokens.device)
    kept = all_parents[keep]
    return all_tokens[keep], torch.where(kept >= 0, remap[kept.clamp(min=0)], kept)


class BatchedMtp(BatchedHeads):
    """`Mtp` over a batch's rows: a fork per row (its layer cache and pending features, fed as a lone request's);
    a chain round is one catch-up pass and one pass per further step for every drafting row, on a temporary
    left-padded stack of the rows' layer caches (each row's own cache only ever gains its catch-up rows). Each
    row draws with its own generator in the lone request's order, so it proposes what it would alone. Trees:
    each row's fork drafts alone."""

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], gammas: Sequence[int]) -> list[Proposal]:
        drafting = [i for i, (row, g) in enumerate(zip(rows, gammas)) if g and row.drafter.pending.shape[0]]
        out = [Proposal(row.context[:0]) for row in rows]
        if len(drafting) < 2 or self.drafter.top_k > 1:
            for i in drafting:
                out[i] = rows[i].drafter.propose(rows[i].context[: rows[i].n], gammas[i], rows[i].sampling,
                                                 rows[i].generator)
            return out
        forks = [rows[i].drafter for i in drafting]
        for i, fork in zip(drafting, forks):
            if fork.rows + fork.pending.shape[0] != rows[i].n - 1:
                fork.catch_up(rows[i].context[: rows[i].n])  # raises Mtp's own ConfigError
        mtp = self.drafter
        device = mtp.embed.weight.device
        count = len(forks)
        lengths = torch.tensor([f.rows for f in forks], device=device)  # [R] cache rows per row
        pending = torch.tensor([f.pending.shape[0] for f in forks], device=device)  # [R]
        past, width = int(lengths.max()), int(pending.max())
        cache = self._stack(forks, past)
        slots = torch.arange(past, device=device)  # [L]
        # A row's slot j (left-padded) holds its row j - (past - rows_r), at position j - (past - rows_r) + 1.
        key_pos = slots[None] - (past - lengths)[:, None] + 1  # [R, L]; padding gets positions <= 0
        valid = key_pos >= 1  # [R, L]
        steps = torch.arange(width, device=device)  # [M]
        positions = torch.minimum(lengths[:, None] + 1 + steps[None], (lengths + pending)[:, None])  # [R, M]
        new = steps[None] < pending[:, None]  # [R, M] real inputs (padding repeats the last position)
        tokens = torch.zeros(count, width, dtype=torch.long, device=device)  # [R, M]
        features = forks[0].pending.new_zeros(count, width, forks[0].pending.shape[-1])  # [R, M, H]
        for r, (i, f) in enumerate(zip(drafting, forks)):
            m = f.pending.shape[0]
            tokens[r, :m] = rows[i].context[f.rows + 1 : rows[i].n].to(device)
            features[r, :m] = f.pending
        causal = steps[None, :] <= steps[:, None]  # [M, M]
        allowed = torch.cat([valid[:, None, :].expand(count, width, past),
                             causal[None] & new[:, None, :]], dim=2)  # [R, M, L + M]
        keys = torch.cat([key_pos, positions], dim=1)  # [R, L + M]
        hidden = mtp.run_layer(tokens, features, positions, mtp.visible(allowed, positions, keys), cache)  # [R, M, H]
        layer = cache.layers[0]
        for r, f in enumerate(forks):
            m = int(pending[r])
            f.cache.update(layer.keys[r : r + 1, :, past : past + m], layer.values[r : r + 1, :, past : past + m], 0)
            f.rows += m
            f.pending = f.pending[:0]
            f._forwards += 1
        last = hidden[torch.arange(count, device=device), pending - 1]  # [R, H]
        valid = torch.cat([valid, new], dim=1)  # [R, L + M]
        key_pos = keys
        gamma = [gammas[i] for i in drafting]
        drafted: list[list[torch.Tensor]] = [[] for _ in forks]
        probs: list[list[torch.Tensor]] = [[] for _ in forks]
        base = torch.tensor([rows[i].n for i in drafting], device=device)  # [R] position of the first drafted row
        for level in range(max(gamma)):
            logits = mtp.logits(last)  # [R, V]
            check_finite(logits, mtp, f"in {mtp.family}'s MTP layer (draft {level + 1})")
            token = torch.empty(count, dtype=torch.long, device=device)
            for r, i in enumerate(drafting):
                if level < gamma[r]:  # each row draws with its own generator, as alone
                    t, q = draw(logits[r : r + 1], rows[i].sampling, rows[i].generator)
                    token[r] = t[0]
                    drafted[r].append(t)
                    if q is not None:
                        probs[r].append(q)
                else:
                    token[r] = 0
            if level + 1 == max(gamma):
                break
            position = (base + level)[:, None]  # [R, 1]
            key_pos = torch.cat([key_pos, position], dim=1)
            valid = torch.cat([valid, valid.new_ones(count, 1)], dim=1)  # [R, S + 1]
            last = mtp.run_layer(token[:, None], last[:, None], position,
                                 mtp.visible(valid[:, None, :], position, key_pos), cache)[:, 0]  # [R, H]
            for r, f in enumerate(forks):
                f._forwards += level + 1 < gamma[r]
        for r, i in enumerate(drafting):
            context_device = rows[i].context.device
            out[i] = Proposal(torch.cat(drafted[r]).to(context_device),
                              torch.cat(probs[r]).to(context_device) if probs[r] else None)
        return out

    @staticmethod
    def _stack(forks: Sequence[Mtp], past: int) -> DynamicCache:
        """The rows' layer caches left-padded to `past` rows: a temporary cache [R, heads, L, d] (a hole in
        padding) whose drafted rows the caller drops with it."""
        if not past:
            return DynamicCache()
        template = next(f.cache.layers[0] for f in forks if f.rows)
        keys = template.keys.new_zeros(len(forks), template.keys.shape[1], past, template.keys.shape[3])
        values = template.values.new_zeros(len(forks), template.values.shape[1], past, template.values.shape[3])
        for r, f in enumerate(forks):
            if f.rows:
                keys[r, :, past - f.rows :] = f.cache.layers[0].keys[0]
                values[r, :, past - f.rows :] = f.cache.layers[0].values[0]
        return DynamicCache([(keys, values)])
