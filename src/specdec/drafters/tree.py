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

import copy
import math

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig
from specdec.core.tree import TreeMask
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal
from specdec.drafters.per_row import PerRow
from specdec.drafters.tree_budget import TreeBudget
from specdec.errors import ConfigError
from specdec.runtime.causal_lm import CachedCausalLM
from specdec.runtime.draft_graphs import select_tree, tree_candidates, tree_log_probs
from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, is_encoder_decoder
from specdec.runtime.static_lm import StaticCausalLM, fast_adapter


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class TreeDrafter(Drafter):
    """A draft model with its own KV cache that can score the nodes of a tree it is growing."""

    def __init__(self, model: PreTrainedModel):
        # An encoder-decoder draft (for an encoder-decoder target) runs its own encoder once per request.
        self.lm = CachedSeq2SeqLM(model) if is_encoder_decoder(model) else CachedCausalLM(model)
        self.vocab_size = self.lm.vocab_size

    @property
    def is_encoder_decoder(self) -> bool:
        return isinstance(self.lm, CachedSeq2SeqLM)

    @property
    def capabilities(self) -> DrafterCapabilities:
        """A tree drafter; batched as one fork per row (each row grows its own tree on its own draft cache)."""
        return DrafterCapabilities(tree=True, batched=PerRow, encoder_decoder=self.is_encoder_decoder,
                                   accepts_encoder_inputs=self.is_encoder_decoder)

    @property
    def forwards(self) -> int:
        return self.lm.forwards

    def ensure_capacity(self, tokens: int) -> None:
        """On the fast path: the draft's slot cache sized for the request plus its own round's room."""
        if isinstance(self.lm, StaticCausalLM):
            self.lm.ensure_capacity(tokens + self.capabilities.draft_room)

    def reset(self, prompt_ids: torch.Tensor, *, encoder_inputs=None, encoder_input_ids=None) -> None:
        self.lm.reset(**({} if encoder_inputs is None else {"encoder_inputs": encoder_inputs}))
        self.lm.prefill(prompt_ids[:-1])  # the last prompt token is the first round's root

    def fork(self) -> TreeDrafter:
        """Another request's drafter over the same draft model, with its own (eager) draft cache."""
        twin = copy.copy(self)
        twin.lm = CachedCausalLM(self.lm.model)
        if "_adapters" in vars(self):
            twin._adapters = {False: twin.lm}
        return twin

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


class DraftTree(TreeDrafter):
    """EAGLE-2-style dynamic tree from a draft model.

    Each level expands the `top_k` best frontier nodes (by cumulative draft log-probability) into their
    top_k children; after `depth` levels the `max_nodes` best nodes overall are kept (a connected tree,
    since a child never scores above its parent; ties go to the earlier node, so a parent always ranks
    first). Children are deterministic (point masses), so verification is exact at any temperature. At
    T > 0 the scores are the draft's warped probabilities. `gamma` caps the depth (it defaults to `depth`
    when generate's gamma is left unset).

    On the fast path (`generate(..., compile=True)` or "static") the draft model runs on a slot cache and
    the whole tree is grown as ONE fixed-shape graph (`StaticCausalLM.draft_tree`): the same nodes as the
    eager drafter from the same draft logits. `max_nodes="auto"` picks the node budget online from the
    measured cost of the target's pass and the measured acceptance of each ranked node
    (specdec.drafters.tree_budget, docs/trees.md). The defaults (top_k=2, depth=6, max_nodes=8) were chosen by
    measurement on the default pair on a 2-core CPU: 8 nodes beat 12 and 16 on the fast path in two runs
    and matched 12 on the eager path (BENCHMARKS.md, "Token trees on the fast path"); the same defaults
    serve both paths.

    compile: None (default) follows the decoder, like `DraftModel`; True / "static" / False pin it.
    """

    def __init__(self, draft_model: PreTrainedModel, top_k: int = 2, depth: int = 6, max_nodes: int | str = 8,
                 compile: bool | str | None = None):
        super().__init__(draft_model)
        self.top_k = positive_int("top_k", top_k)
        self.depth = positive_int("depth", depth)
        self.budget: TreeBudget | None = None
        if max_nodes == "auto":
            self.budget = TreeBudget(tree_candidates(self.top_k, self.depth))
        elif isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ConfigError(f"max_nodes must be an integer >= 1 or \"auto\" (a budget chosen online from the "
                              f"measured pass costs and acceptance), got {max_nodes!r}")
        self.max_nodes = max_nodes
        self.compile = compile
        self._adapters: dict[object, object] = {False: self.lm}
        if compile is not None:
            self.use_fast_path(compile, pinned=True)

    @property
    def name(self) -> str:
        return f"DraftTree(top_k={self.top_k}, depth={self.depth}, max_nodes={self.max_nodes!r})"

    @property
    def capabilities(self) -> DrafterCapabilities:
        """Its depth as the default γ; at most max_nodes nodes (its draft cache needs the frontier rows and the
        re-fed tokens past the committed context)."""
        return DrafterCapabilities(
            tree=True, batched=PerRow, default_gamma=self.depth,
            max_nodes=self.max_nodes if isinstance(self.max_nodes, int) else None,
            draft_room=(self.depth - 1) * self.top_k + self.depth + 2,
            encoder_decoder=self.is_encoder_decoder, accepts_encoder_inputs=self.is_encoder_decoder)

    @property
    def node_budgets(self) -> tuple[int, ...]:
        """Every node count this drafter may propose (the target's verification shapes: each + 1)."""
        return self.budget.budgets if self.budget is not None else (int(self.max_nodes),)

    def use_fast_path(self, mode: bool | str, pinned: bool = False) -> None:
        """Called by the decoder with its `compile` setting; a drafter built with compile=... keeps its own."""
        if (self.compile is not None and not pinned) or isinstance(self.lm, CachedSeq2SeqLM):
            return  # a seq2seq draft decodes eagerly (the target warns once about compile)
        if mode not in self._adapters:
            self._adapters[mode] = fast_adapter(self.lm.model, mode)
        self.lm = self._adapters[mode]

    def plan(self, target) -> tuple[int, ...]:
        """Before each request, with the target's adapter (max_nodes="auto" measures its passes): the node
        budgets this request may use."""
        if self.budget is not None:
            self.budget.bind(target, self.lm)
        return self.node_budgets

    _log_probs = staticmethod(tree_log_probs)  # −inf outside top-k / top-p at T > 0

    def propose(self, context, gamma, sampling, generator) -> Proposal:
        depth = min(self.depth, gamma)
        top_k = min(self.top_k, self.vocab_size)
        if isinstance(self.lm, StaticCausalLM):  # the fast path: one fixed-shape graph
            tokens, parents, scores, rank = self.lm.draft_tree(context, top_k, self.depth, depth, sampling)
        else:
            tokens, parents, scores, rank = self._grow(context, depth, sampling)
        if self.budget is None:
            tokens, parents, _ = select_tree(tokens, parents, scores, rank, int(self.max_nodes))
        else:
            max_nodes = self.budget.choose()
            probs = [math.exp(scores[i]) for i in rank]  # the draft's own estimate, best first
            tokens, parents, keep = select_tree(tokens, parents, scores, rank, max_nodes)
            position = {c: r for r, c in enumerate(rank[:max_nodes])}
            self.budget.proposed(probs, tokens, parents, [position[c] for c in keep], max_nodes)
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long, device=context.device),  # [N]
            draft_probs=None,  # point masses
            parents=torch.tensor(parents, dtype=torch.long),  # [N]
        )

    def commit(self, context: torch.Tensor, num_accepted: int) -> None:
        super().commit(context, num_accepted)
        if self.budget is not None:
            self.budget.accepted(context, num_accepted)

    def _grow(self, context, depth, sampling):
        """The eager tree: one draft pass per level on the dynamic cache. Candidates as in
        `draft_graphs.expand_tree` (tokens, parents, scores, rank), children of −inf score left out."""
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
            cumulative = (base[:, None] + values.to("cpu", torch.float64)).tolist()
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
        rank = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
        return tokens, parents, scores, rank

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

