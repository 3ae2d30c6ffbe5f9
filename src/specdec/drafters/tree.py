"""Drafters that propose token trees from a draft model: `DraftTree` (EAGLE-2-style dynamic top-k tree)
and `MultiDraft` (k sampled chains: SpecInfer with replacement, recursive rejection sampling without).

Both keep the draft model's KV cache at the committed context (context[:n−1]) between rounds. A round
costs `depth` draft passes whatever the tree's width: the first pass catches up on the committed tokens
and yields the root's distribution; DraftTree then appends one level per pass (rows see their ancestors
already in the cache, `CachedCausalLM.score_visible`), MultiDraft re-scores its chains in one tree pass
per step (`CachedCausalLM.score(tree=...)`). The tree rows are cropped away at the end.

What each node's q is (the verifier needs exactly the distribution the node was drawn from):
- DraftTree: every node is a deterministic function of the draft's outputs → a point mass (draft_probs None),
  exact at any temperature.
- MultiDraft at T > 0, replacement=True: the k root children are i.i.d. draws from q, every row = q.
  replacement=False: the root children are drawn without replacement, row i = q with the earlier siblings
  removed and renormalised. Below the root each draft is a chain sampled from the draft (row = q there).
- MultiDraft at T = 0: the top-k root children, each continued by the draft's argmax (point masses).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdec.drafters.base import Drafter, Proposal
from specdec.errors import ConfigError
from specdec.models.causal_lm import CachedCausalLM
from specdec.sampling import SamplingConfig
from specdec.tree import TreeMask


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class _TreeDrafter(Drafter):
    """A draft model with its own KV cache that can score the nodes of a tree it is growing."""

    def __init__(self, model: PreTrainedModel):
        self.lm = CachedCausalLM(model)
        self.vocab_size = self.lm.vocab_size

    @property
    def forwards(self) -> int:
        return self.lm.forwards

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.lm.reset()
        self.lm.prefill(prompt_ids[:-1])  # the last prompt token is the first round's root

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        self.lm.crop(min(self.lm.length, context.shape[0] - 1))

    def _root_logits(self, context: torch.Tensor) -> torch.Tensor:
        """Catch up on the committed tokens; the draft's logits after context [n]: [V]. Cache: context[:n−1]."""
        logits = self.lm.forward(context[self.lm.length :], last_only=True)  # [1, V]
        self.lm.crop(context.shape[0] - 1)
        return logits[0]

    def _node_logits(self, root: torch.Tensor, tokens: list[int], parents: list[int], rows: list[int]) -> torch.Tensor:
        """Draft logits after each node in `rows` of the tree (tokens, parents) under `root` [1]: [len(rows), V].
        One tree pass, cropped away afterwards."""
        start = self.lm.length
        ids = torch.cat([root, torch.tensor(tokens, dtype=torch.long, device=root.device)])  # [M]
        if self.lm.supports_tree(ids.shape[0], warn=False):
            logits = self.lm.score(ids, tree=TreeMask.from_parents(torch.tensor(parents))).logits  # [M, V]
            self.lm.crop(start)
            return logits[[r + 1 for r in rows]]
        out = []  # no 4D-mask support: one chain pass per wanted node
        for r in rows:
            path = [r]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            out.append(self.lm.forward(ids[[0] + [p + 1 for p in reversed(path)]], last_only=True))
            self.lm.crop(start)
        return torch.cat(out)


class DraftTree(_TreeDrafter):
    """EAGLE-2-style dynamic tree from a draft model.

    Each level expands the `top_k` best frontier nodes (by cumulative draft log-probability) into their
    top_k children; after `depth` levels the `max_nodes` best nodes overall are kept (a connected tree,
    since a child never scores above its parent). Children are deterministic (point masses), so
    verification is exact at any temperature. At T > 0 the scores are the draft's warped probabilities.
    `gamma` caps the depth (it defaults to `depth` when generate's gamma is left unset). The defaults
    (top_k=2, depth=6, max_nodes=12) had the best tokens/s of the trees measured on the default pair on a
    2-core CPU (BENCHMARKS.md, "Token trees"); wider trees raise τ but cost more than they gain there.
    """

    def __init__(self, draft_model: PreTrainedModel, top_k: int = 2, depth: int = 6, max_nodes: int = 12):
        super().__init__(draft_model)
        self.top_k = _positive_int("top_k", top_k)
        self.depth = _positive_int("depth", depth)
        self.max_nodes = _positive_int("max_nodes", max_nodes)
        self.default_gamma = self.depth

    @property
    def name(self) -> str:
        return f"DraftTree(top_k={self.top_k}, depth={self.depth}, max_nodes={self.max_nodes})"

    @staticmethod
    def _log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        if sampling.greedy:
            return torch.log_softmax(logits.double(), dim=-1)
        return sampling.warp(logits).double().log()  # −inf outside top-k / top-p

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        depth = min(self.depth, gamma)
        n = context.shape[0]
        # Catch up and keep the root in the cache (slot n − 1); each level then feeds only its frontier.
        root_logits = self.lm.forward(context[self.lm.length :], last_only=True)[0]  # [V]
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        slot: dict[int, int] = {}  # node -> its cache slot once fed

        def add_children(parent_nodes: list[int], log_probs: torch.Tensor) -> list[int]:
            """Add the top_k children of each parent; return the new nodes."""
            values, index = log_probs.topk(min(self.top_k, log_probs.shape[-1]), dim=-1)  # [F, k]
            base = torch.tensor([scores[p] if p >= 0 else 0.0 for p in parent_nodes], dtype=torch.float64)
            cumulative = (base[:, None] + values).tolist()
            new = []
            for f, parent in enumerate(parent_nodes):
                for j, token in enumerate(index[f].tolist()):
                    if cumulative[f][j] > float("-inf"):
                        new.append(len(tokens))
                        tokens.append(token)
                        parents.append(parent)
                        scores.append(cumulative[f][j])
            return new

        frontier = add_children([-1], self._log_probs(root_logits[None], sampling))
        for level in range(1, depth):
            frontier = sorted(sorted(frontier, key=lambda i: (-scores[i], i))[: self.top_k])
            if not frontier:
                break
            logits = self._feed_level(frontier, tokens, parents, slot, n, level)  # [F, V]
            frontier = add_children(frontier, self._log_probs(logits, sampling))
        self.lm.crop(n - 1)

        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: self.max_nodes])
        new_index = {node: i for i, node in enumerate(keep)}
        return Proposal(
            tokens=torch.tensor([tokens[i] for i in keep], dtype=torch.long, device=context.device),  # [N]
            draft_probs=None,  # point masses
            parents=torch.tensor([new_index.get(parents[i], -1) for i in keep], dtype=torch.long),  # [N]
        )

    def _feed_level(self, frontier, tokens, parents, slot, n, level) -> torch.Tensor:
        """Append the frontier nodes (all at depth `level`) to the draft cache, each seeing the committed
        context, the root and its own ancestors; their logits [F, V]."""
        length = self.lm.length
        m = len(frontier)
        visible = torch.zeros(m, length + m, dtype=torch.bool)  # [F, L+F]
        visible[:, :n] = True  # context[:n], the root included
        for row, node in enumerate(frontier):
            visible[row, length + row] = True
            ancestor = parents[node]
            while ancestor >= 0:
                visible[row, slot[ancestor]] = True
                ancestor = parents[ancestor]
            slot[node] = length + row
        ids = torch.tensor([tokens[i] for i in frontier], dtype=torch.long)
        positions = torch.full((m,), n - 1 + level, dtype=torch.long)
        if self.lm.supports_tree(m + 1, warn=False):
            return self.lm.score_visible(ids, positions, visible)
        logits = []  # no 4D-mask support: one chain pass per frontier node, then re-append it plainly
        for row, node in enumerate(frontier):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            start = self.lm.length
            self.lm.crop(n)
            logits.append(self.lm.forward(torch.tensor([tokens[p] for p in reversed(path)]), last_only=True))
            self.lm.crop(min(start, self.lm.length))
        return torch.cat(logits)

