"""DraftTree on the fast path (one fixed-shape tree graph on the draft's slot cache) and max_nodes="auto".

The fixed-shape tree must propose exactly the eager DraftTree's nodes from the same draft logits, every
round of a generation; compiled, it must stay token-identical to greedy decoding with each graph compiled
once. The budget model (specdec.drafters.tree_budget) is checked on synthetic costs and acceptances.
"""

from __future__ import annotations

import pytest
import torch
from models import hf_greedy, perturbed, tiny

import specdec
from specdec.core.sampling import SamplingConfig
from specdec.core.tree import TreeMask
from specdec.drafters.tree_budget import COMPILED_BUDGETS, WARM_PASSES, TreeBudget, accepted_nodes
from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime.compiled import COMPILED
from specdec.runtime.draft_graphs import select_tree, tree_candidates
from specdec.runtime.static_lm import StaticCausalLM

LONG = [(i * 37 + 11) % 96 for i in range(120)]


class RecordingTree(specdec.DraftTree):
    """A DraftTree that records every proposal (tokens, parents)."""

    def propose(self, context, gamma, sampling, generator):
        proposal = super().propose(context, gamma, sampling, generator)
        self.proposals.append((proposal.tokens.tolist(), proposal.parents.tolist()))
        return proposal


@pytest.fixture(scope="module")
def pair():
    target = tiny("llama", hidden=32, layers=2)
    return target, perturbed(target, 0.15)


def _proposals(target, draft, compile, **options):
    tree = dict(top_k=3, depth=4, max_nodes=9)
    tree.update(options.pop("tree", {}))
    drafter = RecordingTree(draft, **tree)
    drafter.proposals = []
    out = specdec.generate(target, LONG[:30], drafter=drafter, max_new_tokens=40, eos_token_id=[],
                           compile=compile, **options)
    return out, drafter.proposals


@pytest.mark.parametrize("options", [dict(), dict(temperature=1.0, top_k=2, seed=5),
                                     dict(tree=dict(top_k=2, depth=5, max_nodes=40))],
                         ids=["greedy", "sampling-top-k", "all-candidates"])
def test_fixed_shape_tree_proposes_the_eager_tree_every_round(pair, options):
    target, draft = pair
    eager, eager_trees = _proposals(target, draft, False, **dict(options))
    static, static_trees = _proposals(target, draft, "static", **dict(options))
    assert static_trees == eager_trees  # same nodes, same order, same parents, round after round
    assert static.tokens == eager.tokens
    assert any(len(set(p)) > 1 and max(p) >= 0 for _, p in eager_trees)  # real trees, not chains
    if "temperature" not in options:
        assert eager.tokens == hf_greedy(target, LONG[:30], 40)


def test_gamma_below_the_depth_masks_the_deeper_levels(pair):
    target, draft = pair
    context = torch.tensor(LONG[:25])
    sampling = SamplingConfig(0.0, None, None)
    for gamma in (1, 2, 4):
        trees = []
        for compile in (False, "static"):
            drafter = specdec.DraftTree(draft, top_k=2, depth=4, max_nodes=12, compile=compile)
            if isinstance(drafter.lm, StaticCausalLM):
                drafter.lm.ensure_capacity(256)
            drafter.reset(context)
            proposal = drafter.propose(context, gamma, sampling, None)
            trees.append((proposal.tokens.tolist(), proposal.parents.tolist()))
        assert trees[0] == trees[1]
        depth = int(TreeMask.from_parents(torch.tensor(trees[0][1])).depths.max())
        assert depth <= gamma and (gamma > 1 or depth == 1)


def test_select_tree_keeps_ties_towards_the_parent():
    # a child with the same score as its parent (probability 1) must never be kept without the parent
    tokens, parents, scores = [5, 6, 7], [-1, 0, 1], [0.0, 0.0, 0.0]
    rank = [0, 1, 2]
    assert select_tree(tokens, parents, scores, rank, 2) == ([5, 6], [-1, 0], [0, 1])
    # −inf candidates are not nodes, whatever the budget
    assert select_tree([1, 2], [-1, -1], [-0.5, float("-inf")], [0, 1], 5) == ([1], [-1], [0])
    assert tree_candidates(2, 6) == 2 + 5 * 4


@pytest.mark.compile
def test_compiled_tree_is_token_identical_and_compiles_each_graph_once(pair):
    target, draft = pair
    for prompt in (LONG[:20], LONG[:37]):
        drafter = specdec.DraftTree(draft, top_k=2, depth=3, max_nodes=4)
        out = specdec.generate(target, prompt, drafter=drafter, max_new_tokens=20, eos_token_id=[], compile=True)
        assert out.tokens == hf_greedy(target, prompt, 20)
        assert out.stats.accepted > 0
    # one tree graph for the draft (reused by every round and request, the short last rounds included), one
    # verification shape (max_nodes + 1 rows) for the target
    assert [k[:3] for k in COMPILED[draft].fns if k[0].startswith("tree")] == [("tree", 2, 3)]
    assert {k[:2] for k in COMPILED[target].fns if k[0] == "pass"} == {("pass", 5)}


# ------------------------------------------------------------------------------------------ max_nodes="auto"


def test_auto_budget_follows_the_measured_costs_and_acceptance():
    budget = TreeBudget(candidates=30)
    budget.budgets = (4, 8, 16)
    budget.fixed = 0.010
    budget.cost = {4: 0.020, 8: 0.022, 16: 0.060}
    budget.seen = {4: 9, 8: 9, 16: 9}
    # every node accepted half the time: 8 nodes pay 4 tokens for 2 ms, 16 nodes 4 more for 38 ms
    budget.hits = [50.0] * 30
    budget.trials = [100.0] * 30
    predicted = budget.predict()
    assert max(predicted, key=lambda b: predicted[b][2]) == 8
    assert predicted[8][0] == pytest.approx(1 + 8 * (50 + 4 * 0.5) / 104)
    budget.rounds = 1
    assert budget.choose() == 8
    # cheap wide passes: the largest budget wins
    budget.cost = {4: 0.020, 8: 0.0201, 16: 0.0202}
    assert budget.choose() == 16


def test_auto_budget_warms_every_compiled_budget_first_then_predicts_eager_ones_by_a_line():
    budget = TreeBudget(candidates=30)

    class CompiledTarget:
        compile, buckets, forward_s = True, (5,), 0.0

    budget.bind(CompiledTarget(), None)
    assert budget.budgets == COMPILED_BUDGETS
    chosen = []
    for _ in range((WARM_PASSES + 1) * len(COMPILED_BUDGETS)):
        b = budget.choose()
        chosen.append(b)
        budget._update_cost(b, 0.01 * b)
    assert sorted(set(chosen)) == list(COMPILED_BUDGETS)  # each compiled shape timed up front
    budget.fixed = 0.01  # then chosen: here a pass costs 10 ms a node, more than half a node (a_r = 0.5) pays
    assert budget.choose() == COMPILED_BUDGETS[0]
    # a compile inside a later pass does not move the median
    budget._update_cost(4, 30.0)
    assert budget.cost[4] == pytest.approx(0.04)
    eager = TreeBudget(candidates=30)
    eager.bind(object(), None)
    eager.cost = {2: 0.020, 24: 0.042}
    assert eager.pass_cost(12) == pytest.approx(0.030)


def test_accepted_nodes_follow_the_emitted_tokens():
    tokens, parents = [4, 9, 7, 4, 2], [-1, -1, 0, 0, 2]
    assert accepted_nodes(tokens, parents, [4, 7, 2]) == {0, 2, 4}
    assert accepted_nodes(tokens, parents, [9]) == {1}
    assert accepted_nodes(tokens, parents, []) == set()


@pytest.mark.parametrize("compile", [False, "static"])
def test_auto_budget_decodes_exactly_and_learns(pair, compile):
    target, draft = pair
    drafter = specdec.DraftTree(draft, top_k=2, depth=4, max_nodes="auto")
    for prompt in (LONG[:20], LONG[:33]):
        out = specdec.generate(target, prompt, drafter=drafter, max_new_tokens=48, eos_token_id=[], compile=compile)
        assert out.tokens == hf_greedy(target, prompt, 48)
    report = drafter.budget.report()
    assert set(report["chosen"]) <= set(report["budgets"])
    assert len(set(report["chosen"])) >= 2  # tried more than one budget
    assert report["fixed_ms"] is not None and report["cost_ms"]
    assert sum(drafter.budget.trials) > 0 and 0 < sum(drafter.budget.hits) <= sum(drafter.budget.trials)


def test_auto_rejects_other_strings(pair):
    _, draft = pair
    with pytest.raises(specdec.ConfigError):
        specdec.DraftTree(draft, max_nodes="many")
    decoder = SpeculativeDecoder(pair[0], specdec.DraftTree(draft, max_nodes="auto"))
    assert decoder.gamma_policy.gamma == 6  # the tree's depth


def test_bench_draft_tree_auto_builds_the_auto_budget(pair):
    from specdec.bench.runner import Bench, BenchSettings, Config, parse_methods

    target, draft = pair
    methods = parse_methods("draft-tree,draft-tree-auto")
    bench = Bench(target, draft, BenchSettings(methods=methods, max_new_tokens=12, forward_costs=False))
    result = bench.run(Config("draft-tree-auto", None), LONG[:20], seed=0)
    assert result.tokens == hf_greedy(target, LONG[:20], 12)
    assert bench.drafter("draft-tree", False, True).max_nodes == "auto"
    assert bench.drafter("draft-tree", False).max_nodes == 8  # the plain method keeps the default budget
