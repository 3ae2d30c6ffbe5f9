"""Token trees: the tree mask, tree verification, the tree drafters' cache bookkeeping, bad proposals and the
negative controls of tree verification (statistical suite: tests/test_exactness.py via tests/methods.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from faulty import SiblingVisibleLM, SoftmaxQDraftTree, tree_duplicates_skipped
from models import PrefixScriptedLM, cached_tokens, perturbed, tiny

import specdec
from specdec.core.sampling import SamplingConfig
from specdec.core.tree import TreeMask, first_branch, validate_proposal
from specdec.core.verify import verify_tree
from specdec.drafters.base import Drafter, Proposal
from specdec.engine.decoding import SpeculativeDecoder
from specdec.exactness import check_exactness, multinomial_test
from specdec.runtime.causal_lm import CachedCausalLM
from specdec.runtime.static_lm import StaticCausalLM

V = 8


# ------------------------------------------------------------------------------------------------ masks


def test_tree_mask_from_parents():
    mask = TreeMask.from_parents(torch.tensor([-1, -1, 0, 0, 2]))
    assert mask.depths.tolist() == [0, 1, 1, 2, 2, 3]
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert mask.ancestors.int().tolist() == expected
    additive = mask.additive(past=2, dtype=torch.float32, device=torch.device("cpu"))
    assert additive.shape == (1, 1, 6, 8)
    assert (additive[0, 0, :, :2] == 0).all()  # every row sees the cache
    assert additive[0, 0, 2, 3] == torch.finfo(torch.float32).min  # node 1 does not see its sibling node 0
    assert first_branch(torch.tensor([-1, -1, 0, 0, 2])).tolist() == [0, 2, 4]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral", "gemma"])
def test_tree_pass_equals_branch_passes_and_commit_keeps_the_path(arch):
    model = tiny(arch, hidden=32, layers=2)
    context = torch.tensor([5, 9, 14, 3, 7])
    tokens = torch.tensor([11, 12, 13, 21, 22, 23])
    parents = torch.tensor([-1, -1, 0, 0, 3, 1])
    lm = CachedCausalLM(model)
    assert lm.supports_tree(7)
    lm.prefill(context[:-1])
    logits = lm.score(torch.cat([context[-1:], tokens]), tree=TreeMask.from_parents(parents)).logits  # [7, V]
    path = [0, 3, 4]  # root -> 11 -> 21 -> 22
    ref = CachedCausalLM(model)
    ref.prefill(context[:-1])
    chain_logits = ref.forward(torch.cat([context[-1:], tokens[path]]))  # [4, V]
    torch.testing.assert_close(logits[[0] + [p + 1 for p in path]], chain_logits)
    # commit keeps the root and the path; the next token then sees exactly that context
    lm.commit(len(context) - 1, torch.tensor([0] + [p + 1 for p in path]))
    assert lm.length == len(context) + len(path)
    nxt = torch.tensor([4])
    torch.testing.assert_close(lm.forward(nxt), ref.forward(nxt))


# -------------------------------------------------------------------------------------------- verify_tree


def test_greedy_tree_verification_follows_the_target_argmax():
    # tree: root -> {0: 3, 1: 5}; 1 -> {2: 6, 3: 1}; 3 -> {4: 2}
    proposal = Proposal(torch.tensor([3, 5, 6, 1, 2]), None, torch.tensor([-1, -1, 1, 1, 3]))
    logits = torch.zeros(6, V)
    for row, token in enumerate([5, 0, 1, 0, 2, 7]):  # target argmax after root, node0, ..., node4
        logits[row, token] = 5.0
    verdict = verify_tree(proposal, logits, SamplingConfig(0.0), None)
    assert (verdict.num_accepted, verdict.path, verdict.next_token, verdict.outcome) == (3, (1, 3, 4), 7, "bonus")
    logits[4, 2], logits[4, 0] = 0.0, 5.0  # after node 3 the target wants 0: node 4 rejected
    verdict = verify_tree(proposal, logits, SamplingConfig(0.0), None)
    assert (verdict.num_accepted, verdict.path, verdict.next_token, verdict.outcome) == (2, (1, 3), 0, "recovered")


def test_point_mass_children_are_accepted_with_the_running_target_probability():
    """Two deterministic children x, y at the root: P(x) = p(x), P(y) = (1 − p(x)) · p(y)/(1 − p(x)) = p(y),
    anything else is the recovered token from p with x and y removed. Checked on 20 000 seeds."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    proposal = Proposal(torch.tensor([1, 3]), None, torch.tensor([-1, -1]))
    logits = p.log().expand(3, 4).clone()
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20_000):
        verdict = verify_tree(proposal, logits, SamplingConfig(1.0), gen)
        first = int(proposal.tokens[verdict.path[0]]) if verdict.path else verdict.next_token
        counts[first] += 1
    observed = counts / counts.sum()
    torch.testing.assert_close(observed, p, atol=0.015, rtol=0)


# ---------------------------------------------------------------------------------- scripted cache checks


def _target_token(prefix: tuple[int, ...]) -> int:
    return (3 * len(prefix) + 1 + sum(prefix)) % V


def _target_table(prefix):
    probs = torch.full((V,), 0.5 / (V - 1), dtype=torch.float64)
    probs[_target_token(prefix)] = 0.5
    return probs


def _draft_table(rank_at: dict[int, int]):
    """The draft ranks the target's token r-th (rank_at[len(prefix)], default 0); r >= 3: outside its top 3."""
    weights = [0.5, 0.2, 0.12, 0.06, 0.05, 0.04, 0.02, 0.01]

    def table(prefix):
        target = _target_token(prefix)
        others = [t for t in range(V) if t != target]
        order = others[:]
        order.insert(min(rank_at.get(len(prefix), 0), V - 1), target)
        probs = torch.zeros(V, dtype=torch.float64)
        for rank, token in enumerate(order):
            probs[token] = weights[rank]
        return probs

    return table


class _Recording:
    """Mixin: after every commit, record (num_accepted, context, target cache tokens, draft cache tokens)."""

    decoder = None

    def commit(self, context, num_accepted):
        super().commit(context, num_accepted)
        self.rounds.append((num_accepted, context.tolist(), _cache_tokens(self.decoder.target),
                            _cache_tokens(self.lm)))


def _cache_tokens(adapter) -> list[int]:
    """The tokens an adapter of a PrefixScriptedLM holds (a slot cache: its first `length` slots)."""
    if isinstance(adapter, StaticCausalLM):
        return adapter.cache.layers[0].keys.view(-1)[: adapter.length].long().tolist()
    return cached_tokens(adapter.cache)


class RecordingTree(_Recording, specdec.DraftTree):
    rounds: list


class RecordingMulti(_Recording, specdec.MultiDraft):
    rounds: list


def _run(drafter, prompt, max_new_tokens, temperature=0.0, seed=0, compile=False):
    drafter.rounds = []
    target = PrefixScriptedLM(_target_table, V)
    decoder = SpeculativeDecoder(target, drafter, max_new_tokens=max_new_tokens, temperature=temperature,
                                 seed=seed, eos_token_id=[], compile=compile)
    drafter.decoder = decoder
    return list(decoder.stream(prompt)), decoder


def _assert_caches_hold_the_accepted_path(rounds):
    for _, context, target_tokens, draft_tokens in rounds:
        assert target_tokens == context[:-1]  # exactly the committed context, no stale tree rows
        assert draft_tokens == context[: len(draft_tokens)] and len(draft_tokens) <= len(context) - 1


@pytest.mark.parametrize("compile", [False, "static"], ids=["dynamic-cache", "slot-cache"])
@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_draft_tree_rejects_at_every_depth_and_branch(depth, rank, compile):
    prompt = [1, 2, 3]
    drafter = RecordingTree(PrefixScriptedLM(_draft_table({len(prompt) + depth: rank}), V),
                            top_k=3, depth=4, max_nodes=40)
    tokens, decoder = _run(drafter, prompt, max_new_tokens=12, compile=compile)
    if compile:  # both caches are slot caches: the tree was drafted as one fixed-shape graph
        assert isinstance(drafter.lm, StaticCausalLM) and isinstance(decoder.target, StaticCausalLM)
    context = prompt[:]
    for _ in range(12):
        context.append(_target_token(tuple(context)))
    assert tokens == context[len(prompt) :]  # greedy: the target's own continuation
    first_accepted = drafter.rounds[0][0]
    if rank == 3:  # the target's token is not among the drafted children at this depth
        assert first_accepted == depth
        assert decoder.stats.recovered >= 1
    else:
        assert first_accepted >= depth + 1  # accepted through sibling `rank`
    _assert_caches_hold_the_accepted_path(drafter.rounds)


@pytest.mark.parametrize("replacement", [True, False])
def test_multi_draft_sampling_keeps_the_cache_invariants(replacement):
    drafter = RecordingMulti(PrefixScriptedLM(_draft_table({}), V), num_drafts=3, replacement=replacement)
    tokens, decoder = _run(drafter, [1, 2, 3], max_new_tokens=60, temperature=1.0, seed=3)
    assert len(tokens) == 60
    accepted = [r[0] for r in drafter.rounds]
    assert 0 in accepted and max(accepted) >= 2  # rejections at the root and deeper acceptances
    _assert_caches_hold_the_accepted_path(drafter.rounds)


# ------------------------------------------------------------------------------------------- bad proposals


class Scripted(Drafter):
    """Returns the same proposal every round."""

    def __init__(self, proposal):
        self.proposal = proposal
        self.vocab_size = 96

    def propose(self, context, gamma, sampling, generator):
        return self.proposal


def _probs(rows):
    probs = torch.zeros(len(rows), 96)
    for i, (token, mass) in enumerate(rows):
        probs[i, token] = mass
        probs[i, (token + 1) % 96] = 1 - mass
    return probs


BAD = {
    "cycle": (Proposal(torch.tensor([3, 4]), None, torch.tensor([1, 0])), "is not in \\[-1, 0\\)"),
    "parent out of range": (Proposal(torch.tensor([3, 4]), None, torch.tensor([-1, 5])), "is not in"),
    "parent below -1": (Proposal(torch.tensor([3, 4]), None, torch.tensor([-1, -2])), "is not in"),
    "too many nodes": (Proposal(torch.arange(600) % 96, None, torch.full((600,), -1)), "only .* fit"),
    "too deep": (Proposal(torch.tensor([3, 4, 5, 6, 7, 8]), None, torch.tensor([-1, 0, 1, 2, 3, 4])),
                 "6 deep but this round allows 4"),
    "rows not summing to 1": (Proposal(torch.tensor([3, 4]), _probs([(3, 0.5), (4, 0.5)]) * 0.9,
                                       torch.tensor([-1, -1])), "not a distribution"),
    "unsampled token": (Proposal(torch.tensor([3, 4]), _probs([(3, 1.0), (5, 1.0)]), torch.tensor([-1, -1])),
                        "probability 0 to its own token"),
    "wrong parents shape": (Proposal(torch.tensor([3, 4]), None, torch.tensor([-1])), "one entry per token"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tree_proposal_raises_before_any_target_pass(case):
    proposal, message = BAD[case]
    target = tiny("llama", hidden=16, layers=1)
    decoder = SpeculativeDecoder(target, Scripted(proposal), gamma=4, max_new_tokens=8, temperature=1.0, seed=0)
    with pytest.raises(specdec.ProposalError, match=message):
        list(decoder.stream([1, 2, 3, 4]))
    assert decoder.target.forwards == 0  # nothing scored
    assert decoder.target.length == 3  # the cache still holds exactly the prefilled prompt[:-1]


def test_validate_accepts_a_well_formed_tree():
    validate_proposal(torch.tensor([3, 4, 5]), _probs([(3, 0.5), (4, 0.5), (5, 1.0)]), torch.tensor([-1, -1, 0]), 96)


def test_tree_drafters_reject_bad_options():
    draft = tiny("llama", hidden=16, layers=1)
    for bad in (dict(top_k=0), dict(depth=1.5), dict(max_nodes=True)):
        with pytest.raises(specdec.ConfigError):
            specdec.DraftTree(draft, **bad)
    with pytest.raises(specdec.ConfigError):
        specdec.MultiDraft(draft, num_drafts=0)


def test_gamma_caps_the_tree_depth_and_defaults_to_it():
    target = tiny("llama", hidden=16, layers=2)
    drafter = specdec.DraftTree(perturbed(target, 0.05), top_k=2, depth=5, max_nodes=10)
    out = specdec.generate(target, [1, 2, 3], drafter=drafter, max_new_tokens=30)
    assert max(len(r) for r in [out.tokens]) == 30
    assert SpeculativeDecoder(target, drafter).gamma_policy.gamma == 5
    assert SpeculativeDecoder(target, specdec.DraftModel(target)).gamma_policy.gamma == specdec.DEFAULT_GAMMA
    capped = specdec.generate(target, [1, 2, 3], drafter=drafter, max_new_tokens=30, gamma=2)
    assert capped.tokens == out.tokens
    assert capped.stats.mean_accepted_tokens <= 3.0


# ---------------------------------------------------------------------------------------- negative controls

PROMPT = [1, 2, 1, 1, 2]


@pytest.fixture(scope="module")
def pair():
    target = tiny("llama", hidden=16, layers=2, vocab=V, seed=3)
    return target, perturbed(target, 0.3, seed=11)


def _check(target, drafter, **kw):
    options = dict(gamma=2, temperature=1.0, max_new_tokens=3, eos_token_id=[], samples=3000, seed=1234, alpha=1e-4)
    options.update(kw)
    return check_exactness(target, PROMPT, drafter, **options)


def _first_token_counts(verify_fn, p, q, k, n, seed):
    """Counts of the first emitted token when k i.i.d. children drawn from q are verified against p."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.tensor(p, dtype=torch.float64).clamp_min(1e-300).log().expand(k + 1, -1).clone()
    q_row = torch.tensor(q, dtype=torch.float64)
    counts = np.zeros(len(p))
    for _ in range(n):
        tokens = torch.multinomial(q_row, k, replacement=True, generator=gen)
        proposal = Proposal(tokens, q_row.expand(k, -1), torch.full((k,), -1))
        verdict = verify_fn(proposal, logits, SamplingConfig(1.0), gen)
        counts[int(tokens[verdict.path[0]]) if verdict.path else verdict.next_token] += 1
    return counts


# p, q where skipping duplicates is far off (TV 0.28 by enumeration with k = 4, see docs/trees.md)
DUP_P, DUP_Q = [0.42, 0.01, 0.57], [0.02, 0.62, 0.36]


@pytest.mark.exactness_positive(checks=1, alpha=1e-4)
def test_iid_children_with_duplicates_are_exact():
    counts = _first_token_counts(verify_tree, DUP_P, DUP_Q, k=4, n=3000, seed=5)
    assert multinomial_test(counts, DUP_P, alpha=1e-4).p_value >= 1e-4


@pytest.mark.statistical
def test_negative_control_duplicate_iid_children_skipped():
    counts = _first_token_counts(tree_duplicates_skipped, DUP_P, DUP_Q, k=4, n=3000, seed=5)
    assert multinomial_test(counts, DUP_P, alpha=1e-4).p_value < 1e-6


@pytest.mark.statistical
def test_negative_control_duplicates_end_to_end_has_the_hook(pair):
    """The same broken verifier through the decode loop (check_exactness's tree_verify_fn); the bias of this
    bug is small on the toy pair (TV ≈ 0.04), so only a loose bound is asserted here."""
    target, draft = pair
    unrelated = tiny("llama", hidden=16, layers=2, vocab=V, seed=7)
    result = _check(target, specdec.MultiDraft(unrelated, num_drafts=8, replacement=True),
                    gamma=1, max_new_tokens=2, tree_verify_fn=tree_duplicates_skipped)
    assert result.settings["tree_verify_fn"] == "tree_duplicates_skipped"
    assert result.p_value < 0.01, result.summary()


@pytest.mark.statistical
def test_negative_control_softmax_q_for_top_k_children(pair):
    target, draft = pair
    result = _check(target, SoftmaxQDraftTree(draft, top_k=3, depth=2, max_nodes=8))
    assert not result.passed and result.p_value < 1e-6, result.summary()


@pytest.mark.statistical
@pytest.mark.exactness_positive(checks=1, alpha=1e-4)  # the correct run
def test_negative_control_mask_lets_a_node_see_its_sibling():
    # a sharper random target (initializer_range 1.0) so that one extra visible token moves its logits a lot;
    # runs on the "cache" engine (the memo refuses rows whose position disagrees with what they see): 1000 draws
    target = tiny("llama", hidden=16, layers=2, vocab=V, seed=3, initializer_range=1.0)
    draft = perturbed(target, 0.3, seed=11)
    result = _check(SiblingVisibleLM(target), specdec.DraftTree(draft, top_k=4, depth=2, max_nodes=8),
                    max_new_tokens=2, samples=1000)
    assert not result.passed and result.p_value < 1e-6, result.summary()
    correct = _check(target, specdec.DraftTree(draft, top_k=4, depth=2, max_nodes=8), max_new_tokens=2)
    assert correct.passed, correct.summary()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral", "gemma"])
def test_hidden_states_feed_the_lm_head(arch):
    """score(..., hidden=True) returns the final hidden state that the LM head turns into the logits."""
    model = tiny(arch, hidden=32, layers=2)
    lm = CachedCausalLM(model)
    prefill_hidden = lm.prefill(torch.tensor([5, 9, 14]), hidden=True)  # [3, H]
    assert prefill_hidden.shape == (3, 32)
    scores = lm.score(torch.tensor([3, 7, 8]), tree=TreeMask.from_parents(torch.tensor([-1, -1])), hidden=True)
    assert scores.hidden.shape == (3, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.get_output_embeddings()(scores.hidden), scores.logits)


def test_sliding_window_past_the_window_falls_back_to_chains_with_one_warning():
    from models import hf_greedy

    target = tiny("mistral", hidden=32, layers=2, sliding_window=16)
    drafter = specdec.DraftTree(perturbed(target, 0.1), top_k=2, depth=3, max_nodes=6)
    prompt = [(i * 37 + 11) % 96 for i in range(30)]  # already past the window
    with pytest.warns(UserWarning, match="first branch") as record:
        out = specdec.generate(target, prompt, drafter=drafter, max_new_tokens=12)
    assert sum("first branch" in str(w.message) for w in record) == 1
    assert out.tokens == hf_greedy(target, prompt, 12)
    assert out.stats.drafted <= 3 * out.stats.rounds  # chains of at most depth 3
