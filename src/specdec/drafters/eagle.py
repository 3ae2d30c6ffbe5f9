"""`Eagle`: draft with an EAGLE head that reads the target's own features.

Bookkeeping. Row t of the head's KV cache was computed from (embed(x_{t+1}), f_t), where f_t is the
target's feature at position t. Between rounds the cache holds only rows computed from *target*
features (`rows` of them); features the target produced in the last round but the head has not
consumed yet wait in `pending`. A round:

1. propose: feed the pending rows (one head pass), then draft from the last output, feeding the head's
   own predicted features back in (chain: argmax; tree: EAGLE-2's dynamic top-k expansion);
2. commit: drop every row computed from drafted features (crop to `rows`) and queue the target's
   features of the root and the accepted path (the decoder passes exactly those, so features of
   rejected nodes never reach the head).

Every draft token is a deterministic function of the committed context (argmax / top-k), i.e. a point
mass, so verification is exact at any temperature.

Fast path. When the decoder runs with compile=True or "static" (`use_fast_path`), the head keeps a
preallocated slot cache instead and a round is `heads.static_draft.draft_round`: catch-up, every level and
the rerank at fixed shapes, compiled as ONE graph per (top_k, levels, max_nodes, cache size) with
compile=True. It proposes the same tokens and tree as the eager code above. A round with fewer levels than
the request's first (the short last rounds) runs the same code uncompiled rather than compiling a new shape.
"""

from __future__ import annotations

import torch

from specdec.core.masks import additive_mask
from specdec.core.sampling import SamplingConfig
from specdec.drafters.base import DrafterCapabilities, Proposal
from specdec.drafters.batched_heads import BatchedEagle
from specdec.drafters.feature_head import FeatureHeadDrafter, positive
from specdec.errors import ConfigError, NumericalError, PromptError
from specdec.heads import EagleHead
from specdec.heads.static_draft import draft_round, grow_level, round_slots
from specdec.runtime.compiled import compile_head_round


class Eagle(FeatureHeadDrafter):
    """EAGLE drafter. `top_k=1` drafts a chain of γ tokens; `top_k > 1` an EAGLE-2 dynamic tree of at most
    `max_nodes` nodes and `depth` levels (needs a decoder with tree verification). The head may be EAGLE-1/2
    or EAGLE-3 (`head.variant`): the same rounds, only the features asked of the target (`needs_hidden`: its
    final features, or EAGLE-3's layer tuple) and the head's readout (`head.logits`) differ."""

    def __init__(self, target, head: EagleHead, top_k: int = 1, depth: int = 8, max_nodes: int = 32):
        self._bind(target, head, EagleHead, "Eagle")
        self.top_k = positive("Eagle", "top_k", top_k)
        self.depth = positive("Eagle", "depth", depth)
        self.max_nodes = positive("Eagle", "max_nodes", max_nodes)
        self.reset(torch.zeros(1, dtype=torch.long))

    def extra_slots(self) -> int:
        return 2 * (self.depth + 1) * self.top_k + 2 * self.depth + 2  # one round's padded catch-up + drafted rows

    @property
    def capabilities(self) -> DrafterCapabilities:
        """Reads the target's features (the final ones, or EAGLE-3's layer tuple); its depth is the default γ
        (the chain's length / the tree's depth); at most max_nodes nodes; batched with one head pass per level
        for every row (`BatchedEagle`)."""
        return DrafterCapabilities(tree=self.top_k > 1, needs_hidden=self.head.hidden_request, batched=BatchedEagle,
                                   default_gamma=self.depth, max_nodes=self.max_nodes)

    def reset(self, prompt_ids: torch.Tensor, *, hidden: torch.Tensor | None = None) -> None:
        super().reset(prompt_ids, hidden=hidden)
        self._levels: int | None = None  # the request's first round's levels: the compiled shape

    def commit(self, context: torch.Tensor, num_accepted: int, *, hidden: torch.Tensor | None = None) -> None:
        """hidden [k+1, F]: the target's features of the root and the accepted path."""
        extra = self.cache.get_seq_length() - self.rows  # rows computed from drafted features are stale
        if extra > 0 and self.mode is False:  # (the slot cache needs no crop: its masks hide stale rows)
            self.cache.crop(-extra)
        if hidden is not None:
            self.pending = torch.cat([self.pending, hidden.to(self.pending.dtype)])

    def _step(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """One head pass: tokens [m], features [m, F] (target's) or [m, H] (drafted), positions [m] -> [m, H]."""
        self._forwards += 1
        embeds = self.embed(tokens.to(self.embed.weight.device))[None]  # [1, m, H]
        out = self.head(embeds, features[None].to(embeds.dtype), positions[None], attention_mask=mask, cache=self.cache)
        return out[0]

    def _catch_up(self, context: torch.Tensor) -> torch.Tensor | None:
        """Feed the pending target features; return the head's prediction of f_{n-1} [H] (None: no features)."""
        n = context.shape[0]
        m = self.pending.shape[0]
        if m == 0:
            return None
        if self.rows + m != n - 1:
            raise ConfigError(
                f"Eagle holds target features of {self.rows + m} positions but the context has {n} tokens "
                f"(expected {n - 1}); drive it through specdec's decoder, which passes the features each round"
            )
        positions = torch.arange(self.rows, n - 1, device=self.pending.device)  # [m]
        out = self._step(context[self.rows + 1 : n], self.pending, positions)  # [m, H]
        self.rows = n - 1
        self.pending = self.pending[:0]
        return out[-1]

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        if self.mode is not False:
            return self._propose_static(context, gamma)
        feature = self._catch_up(context)  # [H]
        if feature is None:
            return Proposal(context.new_empty(0))
        if self.top_k == 1:
            return self._chain(feature, gamma, context)
        return self._tree(feature, gamma, context)

    def _propose_static(self, context: torch.Tensor, gamma: int) -> Proposal:
        """The round on the slot cache: pending features padded to the request's first round's size."""
        n = context.shape[0]
        m = self.pending.shape[0]
        if m == 0:
            return Proposal(context.new_empty(0))
        if self.rows + m != n - 1:
            raise ConfigError(
                f"Eagle holds target features of {self.rows + m} positions but the context has {n} tokens "
                f"(expected {n - 1}); drive it through specdec's decoder, which passes the features each round"
            )
        levels = gamma if self.top_k == 1 else min(self.depth, gamma)
        if self._levels is None:
            self._levels = levels
        pad = max(self._levels, levels) + 1
        cache = self.slot_cache
        device = self.pending.device
        if m > pad:  # the prompt's features (or a longer accepted run): all but the last in one eager causal pass
            feed = m - 1
            self._check_room(self.rows + feed)
            slots = torch.arange(self.rows, self.rows + feed, device=device)  # [feed]
            ids = context[self.rows + 1 : self.rows + 1 + feed].to(device)
            visible = torch.arange(cache.max_len, device=device)[None, :] <= slots[:, None]  # [feed, L]
            cache.slots = slots
            embeds = self.embed(ids)[None]  # [1, feed, H]
            mask = additive_mask(visible, embeds.dtype)[None, None]  # [1, 1, feed, L]
            self.head(embeds, self.pending[:feed][None].to(embeds.dtype), slots[None], attention_mask=mask,
                      cache=cache)
            self._forwards += 1
            self.rows += feed
            self.pending = self.pending[feed:]
            m = 1
        self._check_room(self.rows + round_slots(pad, levels, self.top_k))
        ids = torch.zeros(pad, dtype=torch.long, device=device)
        ids[:m] = context[self.rows + 1 : n].to(device)
        features = self.pending.new_zeros(pad, self.pending.shape[1])  # [pad, H]
        features[:m] = self.pending
        args = (self.head, self.embed, self.lm_head, cache, ids, features, torch.tensor(m, device=device),
                torch.tensor(self.rows, device=device))
        if self.mode is True and levels == self._levels and cache.ready:
            # compiled once per (pad, levels, top_k, max_nodes, cache slots), like the target's passes: its
            # projections and the LM head on packed weights
            key = ("eagle", pad, levels, self.top_k, self.max_nodes, cache.max_len)
            compiled = compile_head_round(self.head, key, draft_round, pad=pad, levels=levels, top_k=self.top_k,
                                          max_nodes=self.max_nodes)
            tokens, parents, finite = compiled(*args)
        else:
            tokens, parents, finite = draft_round(*args, pad=pad, levels=levels, top_k=self.top_k,
                                                  max_nodes=self.max_nodes)
        if not bool(finite):
            raise NumericalError(
                "the EAGLE head produced NaN or infinite features; this usually means float16 overflow or broken "
                "head weights: load the target (and head) in float32 or bfloat16, or retrain the head")
        self._forwards += levels
        self.rows += m
        self.pending = self.pending[:0]
        return Proposal(tokens.to(context.device), None, None if parents is None else parents.to(context.device))

    def _check_room(self, slots: int) -> None:
        if slots > self.slot_cache.max_len:
            raise PromptError(
                f"the EAGLE head's slot cache of {self.slot_cache.max_len} slots is full ({slots} needed); drive "
                "Eagle through specdec's decoder (which sizes it per request) or lower max_new_tokens")

    def _chain(self, feature: torch.Tensor, gamma: int, context: torch.Tensor) -> Proposal:
        n = context.shape[0]
        tokens = []
        for i in range(gamma):
            token = self.head.logits(feature, self.lm_head).argmax(-1, keepdim=True)  # [1]
            tokens.append(token)
            if i + 1 < gamma:
                position = torch.tensor([n - 1 + i], device=feature.device)
                feature = self._step(token, feature[None], position)[0]  # [H]
        return Proposal(torch.cat(tokens).to(context.device))

    def _tree(self, feature: torch.Tensor, gamma: int, context: torch.Tensor) -> Proposal:
        """EAGLE-2: expand the `top_k` best frontier nodes per level by cumulative draft log-prob, keep the
        best `max_nodes` nodes (a parent always outscores its child, so the kept set is a subtree)."""
        n = context.shape[0]
        k = self.top_k
        device = feature.device
        logp = torch.log_softmax(self.head.logits(feature, self.lm_head).float(), -1)  # [V]
        top = logp.topk(k)
        tokens = [top.indices]  # per level: [k] (level 0) or [k*k]
        scores = [top.values]
        parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
        offset = 0  # index of the current level's first node among all nodes
        frontier = torch.arange(k, device=device)  # indices (within the level) of the nodes to expand
        frontier_features = feature[None].expand(k, -1)  # [k, H] features each frontier node is drafted from
        frontier_ids = torch.arange(k, device=device)  # global ids of frontier nodes
        ancestors = torch.eye(k, dtype=torch.bool, device=device)  # [k, k] over draft rows fed so far
        fed = 0  # draft rows fed into the head cache this round
        for level in range(1, min(self.depth, gamma)):
            level_tokens = tokens[-1][frontier]  # [k]
            # Attention of the k new rows: every target row, and its own chain of drafted rows.
            rows_mask = torch.zeros(k, fed + k, dtype=torch.bool, device=device)
            if fed:
                rows_mask[:, :fed] = ancestors_of_frontier
            rows_mask[:, fed:] = torch.eye(k, dtype=torch.bool, device=device)
            full = torch.cat([torch.ones(k, self.rows, dtype=torch.bool, device=device), rows_mask], dim=1)
            mask = additive_mask(full, frontier_features.dtype)  # [k, rows + fed + k]
            positions = torch.full((k,), n - 1 + level - 1, device=device)
            out = self._step(level_tokens, frontier_features, positions, mask[None, None])  # [k, H]
            fed_rows = rows_mask
            fed += k
            logp = torch.log_softmax(self.head.logits(out, self.lm_head).float(), -1)  # [k, V]
            frontier, frontier_ids, offset = grow_level(logp, tokens, scores, parents, frontier, frontier_ids,
                                                        offset)
            frontier_features = out[frontier // k]
            ancestors_of_frontier = fed_rows[frontier // k]  # [k, fed]
        all_tokens = torch.cat(tokens)
        all_scores = torch.cat(scores)
        all_parents = torch.cat(parents)
        keep = all_scores.topk(min(self.max_nodes, all_scores.shape[0])).indices.sort().values  # topological order
        remap = torch.full((all_tokens.shape[0],), -1, dtype=torch.long, device=device)
        remap[keep] = torch.arange(keep.shape[0], device=device)
        kept_parents = all_parents[keep]
        kept_parents = torch.where(kept_parents >= 0, remap[kept_parents.clamp(min=0)], kept_parents)
        return Proposal(all_tokens[keep].to(context.device), None, kept_parents.to(context.device))
