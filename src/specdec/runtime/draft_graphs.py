"""The draft side of the fast path as fixed-shape graphs over a `SlotCache` (`StaticCausalLM.draft_steps`
and `.draft_tree` compile them): γ autoregressive draft steps, argmax or sampling, as ONE graph (per-call
overhead, not arithmetic, dominates a small draft model), and an EAGLE-2-style dynamic tree of fixed shape.
Sampling uses uniforms drawn beforehand from the request's generator and the same warp as
`SamplingConfig.warp` inside the graph, so the returned draft probabilities are exactly the distributions the
tokens were drawn from.
"""

from __future__ import annotations

import torch

from specdec.core.masks import additive_mask
from specdec.core.sampling import SamplingConfig
from specdec.runtime.slot_cache import run_model


def draft_chain(model, tokens, slot0, cache, uniforms, gamma: int, sampling: SamplingConfig, vocab=None):
    """γ draft steps in one graph. tokens [W] = the last W committed tokens at slots slot0.. (W = 2 in a cache of
    the draft's own: re-writing the first is harmless, same token at the same position; W = 1 in a cache whose
    committed slots another model wrote, which must stay as they are); uniforms [γ] float64 (sampling only);
    vocab [N] | None: the token id of each logits column when the model's LM head is reduced to N rows.
    Returns proposed tokens [γ], draft_probs [γ, V] when sampling (over the N columns with a vocab), and whether
    every logit was finite."""
    ids = tokens[None]  # [1, W]
    slots = slot0 + torch.arange(tokens.shape[0], device=tokens.device)  # [W]
    logits, _, finite, best = run_model(model, ids, slots[None], slots, None, cache, False)
    logits, best = logits[-1:], best[-1:]  # [1, V], [1]
    out_tokens, out_probs = [], []
    slot = slots[-1:]  # [1]
    for i in range(gamma):
        if sampling.greedy:
            token = best  # [1]: the argmax
        else:
            probs = sampling.warp(logits)  # [1, V]
            cdf = probs.double().cumsum(dim=-1)  # [1, V]
            token = torch.searchsorted(cdf, uniforms[i].view(1, 1) * cdf[:, -1:], right=True)[:, 0]
            token = token.clamp_max(probs.shape[-1] - 1)  # [1]
            out_probs.append(probs)
        if vocab is not None:
            token = vocab[token]  # [1] column -> token id
        out_tokens.append(token)
        if i + 1 < gamma:
            slot = slot + 1
            logits, _, step_finite, best = run_model(model, token[None], slot[None], slot, None, cache, False)
            finite = finite & step_finite
    tokens_out = torch.cat(out_tokens)  # [γ]
    return tokens_out, (torch.cat(out_probs) if out_probs else None), finite


def tree_log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Scores of a tree's children: the draft's log-probabilities [F, V] float64 (warped at T > 0, −inf
    outside top-k / top-p). The same rule as the eager `DraftTree`."""
    if sampling.greedy:
        return torch.log_softmax(logits.double(), dim=-1)
    return sampling.warp(logits).double().log()


def tree_root(model, ids, slot0, n, cache, top_k: int, sampling: SamplingConfig):
    """The root's top_k children. ids [W] are committed tokens at slots slot0..slot0+W−1, the root
    (context[n−1]) among them at slot n−1 (rows past it, if any, are padding whose slots the tree
    overwrites; re-writing cached tokens is harmless: same token, same position).
    Returns tokens [k], scores [k] float64, and whether every logit was finite."""
    slots = slot0 + torch.arange(ids.shape[0], device=ids.device)  # [W]
    logits, _, finite, _ = run_model(model, ids[None], slots[None], slots, None, cache, False)  # [W, V]
    root = logits.index_select(0, (n - 1 - slot0).view(1))  # [1, V]
    values, index = tree_log_probs(root, sampling).topk(top_k, dim=-1)  # [1, k]
    return index[0], values[0], finite


def tree_level(model, frontier_tokens, frontier_scores, seen, n, level, cache, top_k: int, depth: int,
                sampling: SamplingConfig):
    """One level: feed the frontier [k] (nodes `level` below the root) at slots n + (level−1)·k + j, each
    row seeing the context, the root and its ancestors (seen [k, R] over the R = (depth−1)·k frontier
    slots), and take each one's top_k children. Returns the level's candidates (tokens [k²], scores [k²],
    in (frontier row, rank) order), the next frontier (its top_k candidates by score, ties to the earlier
    candidate, in candidate order: chosen [k], and seen [k, R] for it), and whether the logits were finite."""
    k, device = top_k, frontier_tokens.device
    region = (depth - 1) * k
    rows = torch.arange(k, device=device)  # [k]
    row_slots = n + (level - 1) * k + rows  # [k]
    positions = (n - 1 + level).expand(k)  # [k]
    columns = torch.arange(cache.max_len, device=device) - n  # [L] slot − n
    in_region = (columns >= 0) & (columns < region)  # [L]
    visible = (columns < 0)[None, :] | (seen[:, columns.clamp(0, region - 1)] & in_region[None, :])  # [k, L]
    mask = additive_mask(visible, model.dtype)[None, None]  # [1, 1, k, L]
    logits, _, finite, _ = run_model(model, frontier_tokens[None], positions[None], row_slots, mask, cache,
                                   False)  # [k, V]
    values, index = tree_log_probs(logits, sampling).topk(k, dim=-1)  # [k, k]
    level_scores = (frontier_scores[:, None] + values).reshape(-1)  # [k²]
    level_tokens = index.reshape(-1)  # [k²]
    best = torch.sort(level_scores, descending=True, stable=True).indices[:k]  # [k]
    chosen = torch.sort(best).values  # [k]
    own = torch.arange(region, device=device)[None, :] == (level * k + rows)[:, None]  # [k, R]
    return level_tokens, level_scores, chosen, seen[chosen // k] | own, finite


def expand_tree(model, ids, slot0, n, max_depth, cache, top_k: int, depth: int, sampling: SamplingConfig,
                 root_fn=tree_root, level_fn=tree_level):
    """An EAGLE-2-style dynamic tree of fixed shape: level 0 is the root's top_k children; each later level
    feeds its frontier (the top_k nodes of the level before) and adds their top_k children, so there are
    C = top_k + (depth−1)·top_k² candidates. Candidates deeper than max_depth get score −inf (one shape
    serves a round whose γ caps the depth). Run whole as one graph, or with root_fn / level_fn compiled.

    Returns candidates ranked by score (a stable sort: ties to the earlier candidate, so a parent, which
    never scores below its child, ranks before it): tokens [C], parents [C] (candidate index, −1 = root),
    scores [C] float64 (−inf = not a node), rank [C] (candidate indices, best first), and whether every
    logit was finite.
    """
    k = top_k
    device = ids.device
    frontier_tokens, frontier_scores, finite = root_fn(model, ids, slot0, n, cache, k, sampling)  # [k], [k]
    tokens, scores = [frontier_tokens], [frontier_scores]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    frontier_index = torch.arange(k, device=device)  # [k] candidate indices: level 0 is the whole frontier
    seen = torch.eye(k, (depth - 1) * k, dtype=torch.bool, device=device)  # [k, R] each row's own slot
    offset = k
    for level in range(1, depth):
        level_tokens, level_scores, chosen, seen, step_finite = level_fn(
            model, frontier_tokens, frontier_scores, seen, n, torch.tensor(level, device=device), cache, k,
            depth, sampling)
        finite = finite & step_finite
        tokens.append(level_tokens)
        parents.append(frontier_index.repeat_interleave(k))
        scores.append(level_scores.masked_fill(max_depth <= level, float("-inf")))
        frontier_tokens, frontier_scores = level_tokens[chosen], level_scores[chosen]
        frontier_index = offset + chosen
        offset += k * k
    all_scores = torch.cat(scores)  # [C]
    rank = torch.sort(all_scores, descending=True, stable=True).indices  # [C]
    return torch.cat(tokens), torch.cat(parents), all_scores, rank, finite


#: How a fixed-shape tree is compiled: "whole" = the entire tree as one graph; "level" = one graph for the
#: root pass and one for a level (shared by every level), the levels looped in Python. Measured on the
#: default pair, interleaved (BENCHMARKS.md, "Token trees on the fast path"): whole 11.8 ms vs level
#: 13.7 ms a tree (top_k=2, depth=6), but whole compiles in ~52 s vs ~18 s for level.
TREE_GRAPH = "whole"


def tree_candidates(top_k: int, depth: int) -> int:
    """Candidates C a fixed-shape tree of `depth` levels expanding `top_k` frontier nodes produces."""
    return top_k + (depth - 1) * top_k * top_k


def select_tree(tokens: list[int], parents: list[int], scores: list[float], rank: list[int],
                max_nodes: int) -> tuple[list[int], list[int], list[int]]:
    """The best `max_nodes` candidates (by `rank`, −inf scores dropped) as a tree in node order: tokens [N],
    parents [N] (−1 = root), and the candidate index of each node. Connected because a parent ranks before
    its children."""
    keep = sorted(i for i in rank[:max_nodes] if scores[i] > float("-inf"))
    new_index = {node: j for j, node in enumerate(keep)}
    return [tokens[i] for i in keep], [new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep], keep
