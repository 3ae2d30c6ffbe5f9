"""`MultiDraft`: several sampled drafts from one draft model, verified together as a token tree.

The tree is grown one level per draft pass: level 0 holds `widths[0]` children of the root (the last
committed token), and every node of level l gets `widths[l]` children (1 past the end of `widths`), down to
γ levels. `widths=(k,)` is k draft chains that share only the root; `widths=(3, 2)` is six drafts whose
pairs share their first token, i.e. identical sampled prefixes kept as one node. The draft's KV cache
stays at the committed context between rounds (`TreeDrafter`); each level re-scores the tree in one
4D-masked pass (`CachedCausalLM.score(tree=...)`), cropped away afterwards.

How a node's children are drawn, per `scheme`, and the q each one carries (`draft_probs` row: exactly the
distribution it was drawn from, which is what keeps `verify_tree` exact):
- "rrs" (recursive rejection sampling, the default): the children are drawn **without replacement** from
  the draft's warped q; child i's row is q with the earlier siblings' tokens removed and renormalised.
  Siblings are distinct, so there is never a duplicate prefix to merge: the tree with widths > 1 below the
  root is a k-ary tree of distinct sampled prefixes.
- "specinfer" (SpecInfer's multi-step speculative sampling): i.i.d. draws **with replacement**, every row q.
  Duplicates stay separate nodes: each is its own i.i.d. draw and the verifier must try it, with its own
  residual update (skipping it is biased; a negative control checks this).
- "spectr" (SpecTr's k-sequential selection): the same i.i.d. draws as "specinfer", but the proposal is
  tagged `selection="spectr"` and the verifier accepts among the siblings by SpecTr's ρ rule
  (`specdec.core.verify.verify_kseq`) instead of sequential residuals.
At T = 0 every scheme proposes the top-w children of each node (point masses, `draft_probs=None`).
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig, sample
from specdec.drafters.base import DrafterCapabilities, Proposal
from specdec.drafters.per_row import PerRow
from specdec.drafters.tree import positive_int, TreeDrafter
from specdec.errors import ConfigError

#: Drafting schemes: how a node's sibling children are drawn (and verified).
SCHEMES = ("rrs", "specinfer", "spectr")


def _scheme(scheme: str | None, replacement: bool | None) -> str:
    """The scheme from `scheme=` and/or the older `replacement=` flag (True = "specinfer", False = "rrs")."""
    if replacement is not None and not isinstance(replacement, bool):
        raise ConfigError(f"replacement must be True or False, got {replacement!r}")
    if scheme is None:
        return "specinfer" if replacement else "rrs"
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown multi-draft scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")
    if replacement is not None and replacement != (scheme != "rrs"):
        raise ConfigError(f"scheme={scheme!r} contradicts replacement={replacement!r} ('rrs' draws without "
                          "replacement, 'specinfer' and 'spectr' with); pass only scheme=")
    return scheme


class MultiDraft(TreeDrafter):
    """Sampled drafts from `draft_model` verified as one tree.

    num_drafts: children of the root (k draft chains when `widths` is not given).
    scheme: "rrs" (without replacement, default), "specinfer" (i.i.d.) or "spectr" (i.i.d., SpecTr's
    k-sequential selection). `replacement=True|False` is the older spelling of "specinfer" / "rrs".
    widths: children per node at each level, e.g. (4, 2): four root children, two under each of them, one
    below; overrides num_drafts (num_drafts becomes the number of leaves, the product of the widths).
    The tree is γ levels deep (generate's gamma; default 4), so it has at most num_drafts·γ nodes.
    Defaults (num_drafts=2, "rrs", γ = 4): the best τ per drafted token and per second of the trees measured
    on the default pair at T = 1 (BENCHMARKS.md, "Token trees"); a third root child added no τ there.
    """

    def __init__(
        self,
        draft_model: PreTrainedModel,
        num_drafts: int = 2,
        replacement: bool | None = None,
        *,
        scheme: str | None = None,
        widths: tuple[int, ...] | list[int] | None = None,
    ):
        super().__init__(draft_model)
        self.scheme = _scheme(scheme, replacement)
        if widths is None:
            widths = (positive_int("num_drafts", num_drafts),)
        if isinstance(widths, int) or not len(widths):
            raise ConfigError(f"widths must be a non-empty sequence of integers >= 1 (children per node by level, "
                              f"e.g. widths=(2, 2)), got {widths!r}")
        self.widths = tuple(positive_int("widths[i]", w) for w in widths)
        self.num_drafts = math.prod(self.widths)  # leaves of a full tree: an upper bound on nodes per level

    @property
    def capabilities(self) -> DrafterCapabilities:
        """A tree of at most num_drafts nodes per level (γ levels); batched as one fork per row."""
        return DrafterCapabilities(tree=True, batched=PerRow, nodes_per_level=self.num_drafts,
                                   encoder_decoder=self.is_encoder_decoder,
                                   accepts_encoder_inputs=self.is_encoder_decoder)

    @property
    def replacement(self) -> bool:
        return self.scheme != "rrs"

    @property
    def name(self) -> str:
        shape = f"num_drafts={self.widths[0]}" if len(self.widths) == 1 else f"widths={self.widths}"
        return f"MultiDraft({shape}, scheme={self.scheme!r})"

    def _width(self, level: int) -> int:
        return self.widths[level] if level < len(self.widths) else 1

    def _children(self, q: torch.Tensor, width: int, generator) -> tuple[list[int], list[torch.Tensor]]:
        """Up to `width` children drawn from q [V] by the scheme, and the row each was drawn from. Never more
        children than q has tokens: a function of q alone, fixed before any draw, so exactness is untouched
        (after a top-k / top-p warp a confident draft often keeps one token, whose copies would be dead
        nodes: once x ~ δ_x is rejected, r(x) = 0)."""
        width = min(width, int((q > 0).sum()))
        if self.scheme != "rrs":
            return sample(q.expand(width, -1), generator).tolist(), [q] * width
        tokens, rows = [], []
        for _ in range(width):
            token = int(sample(q[None], generator))
            tokens.append(token)
            rows.append(q)
            q = q.clone()
            q[token] = 0.0
            q = q / q.sum()  # the next sibling is drawn from q without the tokens already drawn
        return tokens, rows

    def propose(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig, generator) -> Proposal:
        root = context[-1:]  # [1]
        tokens: list[int] = []
        parents: list[int] = []
        rows: list[torch.Tensor] = []  # draft_probs rows (T > 0)
        frontier = [-1]  # the nodes whose children the next level draws; −1 = the root
        logits = self._root_logits(context)[None]  # [F, V]
        for level in range(gamma):
            if level:
                logits = self._node_logits(root, tokens, parents, frontier)  # [F, V]
            width = self._width(level)
            if sampling.greedy:  # the top-w children of each node: point masses
                drawn = logits.topk(min(width, logits.shape[-1]), dim=-1).indices.tolist()  # [F, w]
                drawn_rows = [[]] * len(frontier)
            elif width == 1:  # one sampled child per node, drawn for the whole level at once
                q = sampling.warp(logits)  # [F, V]
                drawn = [[t] for t in sample(q, generator).tolist()]
                drawn_rows = [[row] for row in q.unbind(0)]
            else:
                q = sampling.warp(logits)  # [F, V]
                drawn, drawn_rows = zip(*(self._children(q[f], width, generator) for f in range(len(frontier))))
            new = []
            for parent, kids, kid_rows in zip(frontier, drawn, drawn_rows):
                for token in kids:
                    new.append(len(tokens))
                    tokens.append(token)
                    parents.append(parent)
                rows.extend(kid_rows)
            frontier = new
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long, device=context.device),  # [N]
            draft_probs=torch.stack(rows).to(context.device) if rows else None,  # [N, V] | None (point masses)
            parents=torch.tensor(parents, dtype=torch.long),  # [N]
            selection="spectr" if self.scheme == "spectr" and rows else "sequential",
        )
