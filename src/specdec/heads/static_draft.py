"""One EAGLE drafting round at fixed shapes on a slot cache: the graph `specdec.Eagle` compiles on the fast path.

`draft_round` does what `Eagle._catch_up` + `Eagle._chain` / `Eagle._tree` do eagerly, with every tensor
shape fixed by (pad, levels, top_k, max_nodes, cache size), so the whole round (catch-up on the target's
features, every tree level, the rerank) is one `torch.compile` graph with no host synchronisation:

* the head's KV cache is a `SlotCache` (runtime/slot_cache.py): rows are written at explicit slots and every
  query row gets an additive mask over all slots, so stale rows need no crop, only a mask;
* the pending target features (k+1 of them after a round that accepted k drafts) are padded to `pad` rows
  at the END; their count `count` and the committed row count `rows` are 0-d tensors, so a different
  count is the same graph. Padded rows sit at slots the real rows never see and are overwritten later;
* slot layout of one round, after the `rows` rows computed from target features:
  ``[rows, rows+pad)`` catch-up rows (the first `count` real), then ``levels-1`` blocks of `top_k` tree
  rows (chain: one row per level). A tree row sees the real rows and its own chain of drafted rows.

The expansion is EAGLE-2's: the `top_k` best frontier nodes by cumulative draft log-prob are expanded per
level into top_k² candidates, and the best `max_nodes` of all nodes are kept (a parent outscores its child,
so they form a subtree). Every node is an argmax/top-k pick: a point mass, so the round does not depend on
the sampling settings and the proposal is exact at any temperature.
"""

from __future__ import annotations

import torch


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Visibility [M, L] (1 = visible, 0 = hidden) -> additive mask [1, 1, M, L] (0 / the dtype's min).

    Visibility is kept as 0/1 floats, never bool tensors, in this module: inductor (torch 2.13) emits C++
    that does not compile for bool masks written into a bool tensor by slices (a VecMask type clash)."""
    return ((visible.to(dtype) - 1) * -torch.finfo(dtype).min)[None, None]


def _head_pass(head, embed, cache, tokens, features, positions, slots, visible):
    """tokens [M], features [M, H] at positions [M], written to slots [M]; visible [M, L] -> features [M, H]."""
    cache.slots = slots
    embeds = embed(tokens)[None]  # [1, M, H]
    out = head(embeds, features[None].to(embeds.dtype), positions[None],
               attention_mask=_additive(visible, embeds.dtype), cache=cache)
    return out[0]


def grow_level(logp, tokens, scores, parents, frontier, frontier_ids, offset: int):
    """One EAGLE-2 level: append the top-k children of each of the k frontier nodes (log-probabilities
    logp [k, V] after each) to the per-level lists tokens / scores / parents, and pick the k best of them as
    the next frontier. Returns (frontier [k] within the new level, their global ids [k], the new level's
    offset among all nodes)."""
    k = frontier.shape[0]
    child = logp.topk(k, dim=-1)  # [k, k]
    # A child scores strictly below its parent, so the best-scored nodes always form a subtree.
    cumulative = scores[-1][frontier][:, None] + child.values - 1e-6  # [k, k]
    tokens.append(child.indices.reshape(-1))
    scores.append(cumulative.reshape(-1))
    parents.append(frontier_ids.repeat_interleave(k))
    offset += tokens[-2].shape[0]
    best = cumulative.reshape(-1).topk(k).indices  # [k] within this level
    return best, offset + best, offset


def draft_round(head, embed, lm_head, cache, tokens, features, count, rows, *, pad: int, levels: int,
                top_k: int, max_nodes: int):
    """One drafting round.

    tokens [pad]: token_{t+1} of each pending feature row (padded with anything); features [pad, H]: the
    target's features of rows rows..rows+count-1 (padded; H wide, or EAGLE-3's fused width); count, rows: 0-d
    long tensors. The head turns its outputs into draft logits (`head.logits`, with the target's `lm_head`).
    Returns (draft tokens [N], parents [N] with -1 = root (None for a chain), all-finite flag).
    """
    device = features.device
    num_slots = cache.max_len
    slot_ids = torch.arange(num_slots, device=device)  # [L]
    committed = rows + count  # slots [0, committed) hold rows computed from target features
    # 1. catch up on the pending target features (causal over the committed rows).
    catch_slots = rows + torch.arange(pad, device=device)  # [pad]
    out = _head_pass(head, embed, cache, tokens, features, catch_slots, catch_slots,
                     (slot_ids[None, :] <= catch_slots[:, None]).float())  # [pad, H]
    feature = out.index_select(0, (count - 1).view(1))  # [1, H] the prediction of the last committed feature
    finite = torch.isfinite(feature).all()
    base = rows + pad  # first slot of this round's drafted rows
    seen = (slot_ids < committed).float()  # [L] what every drafted row sees besides its own chain

    if top_k == 1:  # 2. chain: argmax, feeding the head its own predicted feature
        drafted = []
        for i in range(levels):
            token = head.logits(feature, lm_head).argmax(-1)  # [1]
            drafted.append(token)
            if i + 1 < levels:
                slot = (base + i).view(1)  # [1]
                visible = seen + ((slot_ids >= base) & (slot_ids <= slot)).float()  # [L] (disjoint parts)
                feature = _head_pass(head, embed, cache, token, feature, (committed + i).view(1), slot,
                                     visible[None])  # [1, H]
                finite = finite & torch.isfinite(feature).all()
        return torch.cat(drafted), None, finite

    # 2. EAGLE-2 tree: level 0 is the root's top_k children.
    k = top_k
    width = (levels - 1) * k  # drafted rows fed to the head this round
    logp = torch.log_softmax(head.logits(feature[0], lm_head).float(), -1)  # [V]
    top = logp.topk(k)
    all_tokens, all_scores = [top.indices], [top.values]  # per level: [k] (level 0) or [k*k]
    all_parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    offset = 0  # index of the current level's first node among all nodes
    frontier = torch.arange(k, device=device)  # within-level indices of the nodes to expand
    frontier_ids = torch.arange(k, device=device)  # their global node ids
    frontier_features = feature.expand(k, -1)  # [k, H] the feature each frontier node is drafted from
    chains = torch.zeros(k, width, device=device)  # [k, width] 0/1: drafted rows each frontier row sees
    eye = torch.eye(k, device=device)  # [k, k]
    for level in range(1, levels):
        fed = (level - 1) * k
        rows_mask = chains.clone()
        rows_mask[:, fed : fed + k] = eye  # each new row also sees itself
        visible = seen[None, :].expand(k, -1).clone()  # [k, L]
        visible.index_copy_(1, base + torch.arange(width, device=device), rows_mask)
        slots = base + fed + torch.arange(k, device=device)  # [k]
        positions = (committed + level - 1).expand(k)  # [k]
        out = _head_pass(head, embed, cache, all_tokens[-1][frontier], frontier_features, positions, slots,
                         visible)  # [k, H]
        finite = finite & torch.isfinite(out).all()
        logp = torch.log_softmax(head.logits(out, lm_head).float(), -1)  # [k, V]
        frontier, frontier_ids, offset = grow_level(logp, all_tokens, all_scores, all_parents, frontier,
                                                    frontier_ids, offset)
        frontier_features = out[frontier // k]  # [k, H]
        chains = rows_mask[frontier // k]  # [k, width]
    tokens_out = torch.cat(all_tokens)  # [T]
    scores = torch.cat(all_scores)  # [T]
    parents = torch.cat(all_parents)  # [T]
    keep = scores.topk(min(max_nodes, scores.shape[0])).indices.sort().values  # [N] topological order
    remap = torch.full((tokens_out.shape[0],), -1, dtype=torch.long, device=device)
    remap[keep] = torch.arange(keep.shape[0], device=device)
    kept_parents = parents[keep]  # [N]
    kept_parents = torch.where(kept_parents >= 0, remap[kept_parents.clamp(min=0)], kept_parents)
    return tokens_out[keep], kept_parents, finite


def round_slots(pad: int, levels: int, top_k: int) -> int:
    """Slots one round writes after the committed rows: the padded catch-up plus the drafted rows."""
    return pad + (levels - 1) * top_k
