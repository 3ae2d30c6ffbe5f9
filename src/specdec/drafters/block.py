"""`BlockDraft`: a DFlash block drafter (arXiv 2602.06036): γ masked positions filled in one head pass.

Bookkeeping (as `Eagle`'s). The head's KV cache holds context rows: row t was computed from the target's
features of token t (`DFlashHead`: every layer's keys and values of the fused feature). Between rounds it holds
only such rows (`rows` of them); features the target produced in the last round wait in `pending`. A round:

1. propose: ONE head pass over the pending context rows and the block [root, mask × γ] at positions n−1 .. n−1+γ
   (the root is the last committed token); the block's rows are dropped from the cache right after it, the
   context rows stay. Row j of the block gives the head's distribution of token n−1+j: per-position marginals,
   none of them conditioned on another drafted token;
2. commit: queue the target's features of the root and the accepted drafts (the decoder passes exactly those).

Proposal. A chain: at T = 0 each position's argmax (a point mass); at T > 0 each position's token drawn from
`sampling.warp` of its own marginal, and that warped marginal is its q: the token was drawn from exactly that
distribution, and no token's distribution depends on another draw, so verification is exact. A tree (`top_k` >
1): the EAGLE-2 expansion over the marginals (each level's children are the top-k of that position, ranked by
cumulative log-probability, the best `max_nodes` kept): deterministic picks, point masses at any temperature.

γ is at most the head's block size − 1 (a longer request proposes that many). Fast path (compile=True /
"static"): the head keeps a `SlotCache` and a round is `block_round`, the pending rows padded to a fixed count,
the block and (for a tree) the expansion at fixed shapes: one `torch.compile` graph per (pad, γ, top_k,
max_nodes, cache size) with compile=True, at the request's first γ; a round of another γ (the short last rounds)
runs the same function uncompiled rather than compiling a new shape. It proposes the eager code's tokens.
"""

from __future__ import annotations

import torch

from specdec.core.masks import additive_mask
from specdec.core.sampling import SamplingConfig, sample
from specdec.drafters.base import DrafterCapabilities, Proposal
from specdec.drafters.batched_heads import BatchedHeads
from specdec.drafters.feature_head import FeatureHeadDrafter, positive
from specdec.errors import ConfigError, NumericalError, PromptError
from specdec.heads.dflash import DFlashHead
from specdec.heads.static_draft import grow_level
from specdec.runtime.compiled import compile_head_round
from specdec.runtime.rowwise import all_finite
from specdec.runtime.slot_cache import SlotCache

#: The chain length a request drafts when it names no γ (measured on the default pair: BENCHMARKS.md).
DEFAULT_BLOCK_GAMMA = 7


def marginal_tree(logp: torch.Tensor, top_k: int, max_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The EAGLE-2 tree over per-position marginals logp [γ, V] (log-probabilities): level d's children are the
    top_k tokens of position d under each of the top_k best nodes of level d−1 (cumulative score), and the best
    `max_nodes` nodes are kept (a child scores below its parent, so they form a subtree), in topological order.
    Returns tokens [N], parents [N] (−1 = the root). No host synchronisation (it runs inside the compiled round)."""
    k = top_k
    device = logp.device
    top = logp[0].topk(k)
    tokens, scores = [top.indices], [top.values]  # per level: [k] (level 0) or [k*k]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device)
    frontier_ids = torch.arange(k, device=device)
    offset = 0
    for level in range(1, logp.shape[0]):
        frontier, frontier_ids, offset = grow_level(logp[level].expand(k, -1), tokens, scores, parents, frontier,
                                                    frontier_ids, offset)
    all_tokens, all_scores, all_parents = torch.cat(tokens), torch.cat(scores), torch.cat(parents)
    keep = all_scores.topk(min(max_nodes, all_scores.shape[0])).indices.sort().values  # [N] topological order
    remap = torch.full((all_tokens.shape[0],), -1, dtype=torch.long, device=device)
    remap[keep] = torch.arange(keep.shape[0], device=device)
    kept = all_parents[keep]
    return all_tokens[keep], torch.where(kept >= 0, remap[kept.clamp(min=0)], kept)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Visibility [M, L] as 0/1 floats -> additive mask [1, 1, M, L] (0 / the dtype's min). Floats, not bools:
    inductor (torch 2.13, CPU) emits C++ that does not compile for bool masks written by slices."""
    return ((visible.to(dtype) - 1) * -torch.finfo(dtype).min)[None, None]


def block_round(head: DFlashHead, embed, lm_head, cache: SlotCache, features: torch.Tensor, count: torch.Tensor,
                rows: torch.Tensor, root: torch.Tensor, *, pad: int, gamma: int, top_k: int, max_nodes: int):
    """One drafting round at fixed shapes on the head's slot cache.

    features [pad, F]: the target's features of context rows rows .. rows+count−1 (padded at the end); count,
    rows: 0-d long tensors; root [1]: the last committed token, at position rows+count. Slots: context row t at
    slot t; the padded rows at rows .. rows+pad−1 (those past count are never seen and are overwritten later);
    the block at rows+pad .. rows+pad+γ. Returns (logits [γ, V] float, tokens [γ] argmax or [N] tree nodes,
    parents [N] | None, all-finite flag)."""
    device = features.device
    slot_ids = torch.arange(cache.max_len, device=device)  # [L]
    ctx_slots = rows + torch.arange(pad, device=device)  # [pad]
    block_slots = rows + pad + torch.arange(gamma + 1, device=device)  # [γ+1]
    committed = rows + count  # context rows visible to the block: slots [0, committed)
    ctx_visible = (slot_ids[None, :] <= ctx_slots[:, None]).float()  # [pad, L] causal (never read)
    block_visible = ((slot_ids < committed) | ((slot_ids >= rows + pad) & (slot_ids <= rows + pad + gamma))).float()
    visible = torch.cat([ctx_visible, block_visible[None, :].expand(gamma + 1, -1)])  # [pad+γ+1, L]
    positions = torch.cat([ctx_slots, committed + torch.arange(gamma + 1, device=device)])  # [pad+γ+1]
    cache.slots = torch.cat([ctx_slots, block_slots])
    block = head.block_embeds(embed(root), gamma)  # [1, γ+1, H]
    out = head(features[None], block, positions[None], _additive(visible, block.dtype), cache)  # [1, γ+1, H]
    logits = head.logits(out[0, 1:], lm_head).float()  # [γ, V]
    finite = torch.isfinite(logits).all()
    if top_k == 1:
        return logits, logits.argmax(-1), None, finite
    tokens, parents = marginal_tree(torch.log_softmax(logits, -1), top_k, max_nodes)
    return logits, tokens, parents, finite


class BlockDraft(FeatureHeadDrafter):
    """DFlash-style block drafter over a `DFlashHead`: a chain of per-position marginals (sampled at T > 0), or with
    `top_k > 1` a tree from their top-k (at most `max_nodes` nodes; needs a decoder with tree verification)."""

    def __init__(self, target, head: DFlashHead, top_k: int = 1, max_nodes: int = 32,
                 gamma: int = DEFAULT_BLOCK_GAMMA):
        self._bind(target, head, DFlashHead, "BlockDraft")
        self.top_k = positive("BlockDraft", "top_k", top_k)
        self.max_nodes = positive("BlockDraft", "max_nodes", max_nodes)
        self.gamma = min(positive("BlockDraft", "gamma", gamma), head.block_size - 1)
        self.reset(torch.zeros(1, dtype=torch.long))

    @property
    def capabilities(self) -> DrafterCapabilities:
        """Reads the target's fused features (`head.feature_layers`); γ = the chain's length / the tree's depth,
        at most the head's block size − 1; batched with one fork per row (`BatchedBlockDraft`)."""
        return DrafterCapabilities(tree=self.top_k > 1, needs_hidden=self.head.hidden_request,
                                   batched=BatchedBlockDraft, default_gamma=self.gamma,
                                   max_nodes=self.max_nodes if self.top_k > 1 else None)

    def extra_slots(self) -> int:
        return 2 * self.head.block_size + 2  # one round's padded context rows and its block

    def reset(self, prompt_ids: torch.Tensor, *, hidden: torch.Tensor | None = None) -> None:
        super().reset(prompt_ids, hidden=hidden)
        self._gamma: int | None = None  # the request's first round's γ: the compiled shape

    def commit(self, context: torch.Tensor, num_accepted: int, *, hidden: torch.Tensor | None = None) -> None:
        """hidden [k+1, F]: the target's features of the root and the accepted drafts (the block's rows left
        the head's cache in `propose`)."""
        if hidden is not None:
            self.pending = torch.cat([self.pending, hidden.to(self.pending.dtype)])

    def _check_rows(self, n: int) -> None:
        if self.rows + self.pending.shape[0] != n - 1:
            raise ConfigError(
                f"BlockDraft holds target features of {self.rows + self.pending.shape[0]} positions but the context "
                f"has {n} tokens (expected {n - 1}); drive it through specdec's decoder, which passes the features "
                "each round")

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        n = context.shape[0]
        self._check_rows(n)
        gamma = min(gamma, self.head.block_size - 1)
        if gamma < 1:
            return Proposal(context.new_empty(0))
        if self.mode is not False:
            logits, tokens, parents = self._static_round(context, gamma)
        else:
            logits = self._eager_round(context, gamma)
            tokens, parents = logits.argmax(-1), None
            if self.top_k > 1:
                tokens, parents = marginal_tree(torch.log_softmax(logits, -1), self.top_k, self.max_nodes)
        device = context.device
        if parents is not None:
            return Proposal(tokens.to(device), None, parents.to(device))
        if sampling.greedy:
            return Proposal(tokens[:gamma].to(device))
        probs = sampling.warp(logits)  # [γ, V] each position's own warped marginal
        return Proposal(sample(probs, generator).to(device), probs.to(device))

    def _eager_round(self, context: torch.Tensor, gamma: int) -> torch.Tensor:
        """The pending context rows and the block in one head pass on the dynamic cache -> logits [γ, V]."""
        n = context.shape[0]
        m = self.pending.shape[0]
        device = self.pending.device
        past = self.rows
        visible = torch.ones(m + gamma + 1, past + m + gamma + 1, dtype=torch.bool, device=device)
        visible[:m, past:] = torch.ones(m, m + gamma + 1, dtype=torch.bool, device=device).tril()  # never read
        visible[m:, past : past + m] = True
        positions = torch.arange(past, n + gamma, device=device)  # [m + γ + 1]: context rows, then the block
        block = self.head.block_embeds(self.embed(context[n - 1 :].to(device)), gamma)  # [1, γ+1, H]
        out = self.head(self.pending[None], block, positions[None], additive_mask(visible, block.dtype)[None, None],
                        self.cache)  # [1, γ+1, H]
        self._forwards += 1
        self.cache.crop(-(gamma + 1))  # the block's rows; the context rows stay
        self.rows = n - 1
        self.pending = self.pending[:0]
        logits = self.head.logits(out[0, 1:], self.lm_head).float()  # [γ, V]
        if not all_finite(logits):
            raise self._numerical_error()
        return logits

    def _static_round(self, context: torch.Tensor, gamma: int):
        """The round on the slot cache: pending rows padded to the request's first round's γ + 1 (at most that
        many arrive), the block of this round's γ; compiled at the first round's γ, the same code eagerly at
        another (the short last rounds)."""
        n = context.shape[0]
        m = self.pending.shape[0]
        if self._gamma is None:
            self._gamma = gamma
        pad = max(self._gamma, gamma) + 1
        cache = self.slot_cache
        device = self.pending.device
        if m > pad:  # the prompt's features (or a longer accepted run): all but the last in one eager pass
            feed = m - 1
            self._check_room(self.rows + feed)
            slots = torch.arange(self.rows, self.rows + feed, device=device)  # [feed]
            visible = torch.arange(cache.max_len, device=device)[None, :] <= slots[:, None]  # [feed, L]
            cache.slots = slots
            empty = self.embed.weight.new_zeros(1, 0, self.head.hidden_size)  # no block rows
            self.head(self.pending[None, :feed], empty, slots[None],
                      additive_mask(visible, empty.dtype)[None, None], cache)
            self._forwards += 1
            self.rows += feed
            self.pending = self.pending[feed:]
            m = 1
        self._check_room(self.rows + pad + gamma + 1)
        features = self.pending.new_zeros(pad, self.pending.shape[1])  # [pad, F]
        features[:m] = self.pending
        root = context[n - 1 :].to(device)  # [1]
        args = (self.head, self.embed, self.lm_head, cache, features, torch.tensor(m, device=device),
                torch.tensor(self.rows, device=device), root)
        if self.mode is True and gamma == self._gamma and cache.ready:
            # compiled once per (pad, γ, top_k, max_nodes, cache slots), like the target's passes: its projections
            # and the LM head on packed weights
            compiled = compile_head_round(self.head, ("block", pad, gamma, self.top_k, self.max_nodes, cache.max_len),
                                          block_round, pad=pad, gamma=gamma, top_k=self.top_k, max_nodes=self.max_nodes)
            logits, tokens, parents, finite = compiled(*args)
        else:
            logits, tokens, parents, finite = block_round(*args, pad=pad, gamma=gamma, top_k=self.top_k,
                                                          max_nodes=self.max_nodes)
        if not bool(finite):
            raise self._numerical_error()
        self._forwards += 1
        self.rows += m
        self.pending = self.pending[:0]
        return logits, tokens, parents

    def _check_room(self, slots: int) -> None:
        if slots > self.slot_cache.max_len:
            raise PromptError(
                f"the DFlash head's slot cache of {self.slot_cache.max_len} slots is full ({slots} needed); drive "
                "BlockDraft through specdec's decoder (which sizes it per request) or lower max_new_tokens")

    @staticmethod
    def _numerical_error() -> NumericalError:
        return NumericalError(
            "the DFlash head produced NaN or infinite logits; this usually means float16 overflow or broken head "
            "weights: load the target (and head) in float32 or bfloat16, or retrain the head")


class BatchedBlockDraft(BatchedHeads):
    """`BlockDraft` over a batch's rows: each row's fork (the head's weights shared, its own cache and pending
    features) drafts its block in one head pass, fed exactly the features a lone request's drafter is fed."""
