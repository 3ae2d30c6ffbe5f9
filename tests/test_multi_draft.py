"""MultiDraft's schemes (rrs / specinfer / spectr) and per-level widths, SpecTr's k-sequential selection
(exact enumeration, a statistical check and its negative control), and bad configurations. The statistical
suites run the schemes end to end through tests/methods.py."""

from __future__ import annotations

import itertools

import pytest
import torch
from faulty import tree_kseq_rho_one
from models import PrefixScriptedLM, tiny
from test_trees import DUP_P, DUP_Q, RecordingMulti, _assert_caches_hold_the_accepted_path, _draft_table, _run

import specdec
from specdec.core.sampling import SamplingConfig
from specdec.core.tree import children
from specdec.core.verify import kseq_residual, kseq_rho, verify_tree
from specdec.drafters import make_drafter
from specdec.drafters.base import Proposal
from specdec.errors import ConfigError, ProposalError
from specdec.exactness import multinomial_test

V = 8

# --------------------------------------------------------------------------------- SpecTr k-sequential


def _kseq_output(p, q, k):
    """Exact law of the token SpecTr's k-sequential selection emits, enumerating every k-tuple of drafts."""
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    rho, beta = kseq_rho(p, q, k)
    out = torch.zeros_like(p)
    for drafts in itertools.product(range(p.shape[0]), repeat=k):
        mass = float(q[list(drafts)].prod())
        for x in drafts:  # first acceptance wins
            accept = min(1.0, float(p[x] / (rho * q[x]))) if q[x] > 0 else 0.0
            out[x] += mass * accept
            mass *= 1 - accept
        out += mass * kseq_residual(p, q, rho, beta, k)
    return out


@pytest.mark.parametrize("p, q, k", [
    (DUP_P, DUP_Q, 4),
    ([0.5, 0.3, 0.2], [0.2, 0.3, 0.5], 3),
    ([0.7, 0.2, 0.1, 0.0], [0.1, 0.2, 0.3, 0.4], 2),
    ([0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25], 3),
    ([0.0, 1.0, 0.0], [0.5, 0.0, 0.5], 3),  # disjoint supports: nothing can be accepted
])
def test_kseq_emits_the_target_law_by_enumeration(p, q, k):
    torch.testing.assert_close(_kseq_output(p, q, k), torch.tensor(p, dtype=torch.float64), atol=1e-12, rtol=0)


def test_kseq_rho_is_the_smallest_valid_rho():
    p = torch.tensor(DUP_P, dtype=torch.float64)
    q = torch.tensor(DUP_Q, dtype=torch.float64)
    assert kseq_rho(p, q, 1)[0] == 1.0  # one draft: ordinary speculative sampling
    for k in (2, 3, 4, 8):
        rho, beta = kseq_rho(p, q, k)
        assert 1.0 <= rho <= k
        assert rho * beta >= 1 - (1 - beta) ** k - 1e-12
        smaller = rho - 1e-6
        b = float(torch.minimum(q, p / smaller).sum())
        assert smaller * b < 1 - (1 - b) ** k  # not valid just below
        assert (kseq_residual(p, q, rho, beta, k) >= 0).all()


def _first_token_counts(verify_fn, p, q, k, n, seed):
    """Counts of the first emitted token when k i.i.d. children drawn from q are verified by SpecTr against p."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.tensor(p, dtype=torch.float64).clamp_min(1e-300).log().expand(k + 1, -1).clone()
    q_row = torch.tensor(q, dtype=torch.float64)
    counts = [0] * len(p)
    for _ in range(n):
        tokens = torch.multinomial(q_row, k, replacement=True, generator=gen)
        proposal = Proposal(tokens, q_row.expand(k, -1), torch.full((k,), -1), selection="spectr")
        verdict = verify_fn(proposal, logits, SamplingConfig(1.0), gen)
        counts[int(tokens[verdict.path[0]]) if verdict.path else verdict.next_token] += 1
    return counts


@pytest.mark.exactness_positive(checks=1, alpha=1e-4)
def test_spectr_verification_is_exact_statistically():
    counts = _first_token_counts(verify_tree, DUP_P, DUP_Q, k=4, n=3000, seed=5)
    assert multinomial_test(counts, DUP_P, alpha=1e-4).p_value >= 1e-4


@pytest.mark.statistical
def test_negative_control_spectr_with_rho_one():
    """ρ fixed at 1 (accept each i.i.d. draft with p/q, no ρ): TV 0.24 by enumeration here."""
    counts = _first_token_counts(tree_kseq_rho_one, DUP_P, DUP_Q, k=4, n=3000, seed=5)
    assert multinomial_test(counts, DUP_P, alpha=1e-4).p_value < 1e-6


def test_spectr_node_with_one_child_is_ordinary_speculative_sampling():
    """A chain tagged spectr verifies exactly like the sequential rule (same draws, same verdicts)."""
    p = torch.tensor([0.3, 0.5, 0.2], dtype=torch.float64)
    q = torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64)
    logits = p.log().expand(3, -1).clone()
    for seed in range(20):
        tokens = torch.tensor([seed % 3, (seed // 3) % 3])
        verdicts = []
        for selection in ("sequential", "spectr"):
            proposal = Proposal(tokens, q.expand(2, -1), torch.tensor([-1, 0]), selection=selection)
            verdicts.append(verify_tree(proposal, logits, SamplingConfig(1.0), torch.Generator().manual_seed(seed)))
        assert verdicts[0] == verdicts[1]


def test_proposal_selection_is_checked():
    with pytest.raises(ProposalError, match="selection"):
        Proposal(torch.tensor([1]), selection="k-seq")
    with pytest.raises(ProposalError, match="draft_probs"):
        Proposal(torch.tensor([1, 2]), parents=torch.tensor([-1, -1]), selection="spectr")


# ------------------------------------------------------------------------------------- MultiDraft shapes


@pytest.fixture(scope="module")
def draft():
    return tiny("llama", hidden=16, layers=2, vocab=V, seed=3)


def test_schemes_and_the_replacement_flag(draft):
    assert specdec.MultiDraft(draft).scheme == "rrs"
    assert specdec.MultiDraft(draft, replacement=True).scheme == "specinfer"
    assert specdec.MultiDraft(draft, replacement=False).scheme == "rrs"
    assert specdec.MultiDraft(draft, scheme="spectr").replacement
    assert specdec.MultiDraft(draft, scheme="spectr", replacement=True).scheme == "spectr"
    assert specdec.drafters.MultiDraft is specdec.MultiDraft
    with pytest.raises(ConfigError, match="contradicts"):
        specdec.MultiDraft(draft, scheme="rrs", replacement=True)
    with pytest.raises(ConfigError, match="choose one of"):
        specdec.MultiDraft(draft, scheme="sequoia")
    with pytest.raises(ConfigError, match="widths"):
        specdec.MultiDraft(draft, widths=())
    with pytest.raises(ConfigError, match=">= 1"):
        specdec.MultiDraft(draft, widths=(2, 0))
    built = make_drafter("multi-draft", draft=draft, scheme="spectr", widths=(2, 2))
    assert (built.scheme, built.widths, built.num_drafts) == ("spectr", (2, 2), 4)


@pytest.mark.parametrize("scheme", ["rrs", "specinfer", "spectr"])
def test_widths_shape_the_tree(draft, scheme):
    drafter = specdec.MultiDraft(draft, scheme=scheme, widths=(3, 2))
    context = torch.tensor([1, 2, 3, 4])
    drafter.reset(context)
    proposal = drafter.propose(context, 3, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    kids = children(proposal.parents)
    assert len(kids[0]) == 3 and all(len(kids[c + 1]) == 2 for c in kids[0])  # 3 root children, 2 under each
    assert len(proposal) == 3 + 6 + 6  # the third level: one child per node
    assert proposal.selection == ("spectr" if scheme == "spectr" else "sequential")
    if scheme == "rrs":  # without replacement: siblings are distinct, and each row excludes the earlier ones
        for siblings in kids:
            tokens = proposal.tokens[siblings].tolist()
            assert len(set(tokens)) == len(tokens)
            for i, child in enumerate(siblings):
                assert float(proposal.draft_probs[child, tokens[:i]].sum()) == 0.0
    greedy = drafter.propose(context, 2, SamplingConfig(0.0), None)
    assert greedy.draft_probs is None and greedy.selection == "sequential" and len(greedy) == 3 + 6


@pytest.mark.parametrize("scheme, widths", [("spectr", (3,)), ("rrs", (2, 2)), ("specinfer", (2, 2))])
def test_multi_draft_schemes_keep_the_cache_invariants(scheme, widths):
    drafter = RecordingMulti(PrefixScriptedLM(_draft_table({}), V), scheme=scheme, widths=widths)
    tokens, decoder = _run(drafter, [1, 2, 3], max_new_tokens=40, temperature=1.0, seed=3)
    assert len(tokens) == 40
    accepted = [r[0] for r in drafter.rounds]
    assert decoder.stats.recovered >= 1 and max(accepted) >= 2  # rejections and deeper acceptances
    _assert_caches_hold_the_accepted_path(drafter.rounds)


# ------------------------------------------------------------------------------ prompt-lookup branches


def test_prompt_lookup_branches_form_a_trie():
    drafter = specdec.PromptLookup(max_ngram=2, min_ngram=1, branches=3)
    # "5 6" is followed by "1 2", by "1 3" and by "4"; the latest n-gram is "5 6"
    context = torch.tensor([5, 6, 1, 2, 9, 5, 6, 1, 3, 9, 5, 6, 4, 9, 5, 6])
    drafter.reset(context)
    proposal = drafter.propose(context, 2, SamplingConfig(0.0), None)
    assert proposal.draft_probs is None  # point masses
    branches = [[int(proposal.tokens[i]) for i in _path(proposal.parents.tolist(), leaf)]
                for leaf in range(len(proposal)) if leaf not in proposal.parents.tolist()]
    assert branches == [[4, 9], [1, 3], [1, 2]]  # most recent first; "1" is one node shared by two branches
    assert len(proposal) == 5
    chain = specdec.PromptLookup(max_ngram=2, min_ngram=1)
    chain.reset(context)
    assert chain.propose(context, 2, SamplingConfig(0.0), None).tokens.tolist() == branches[0]


def _path(parents, node):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_prompt_lookup_branches_decode_like_greedy_and_one_match_is_a_chain():
    target = tiny("llama", hidden=16, layers=2, vocab=V, seed=5)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]
    plain = specdec.generate(target, prompt, max_new_tokens=20, eos_token_id=[])
    tree = specdec.generate(target, prompt, drafter=specdec.PromptLookup(branches=3), max_new_tokens=20,
                            eos_token_id=[])
    assert tree.tokens == plain.tokens
    lone = specdec.PromptLookup(branches=3)
    lone.reset(torch.tensor([7, 1, 2, 7]))
    assert lone.propose(torch.tensor([7, 1, 2, 7]), 3, SamplingConfig(0.0), None).parents is None
    with pytest.raises(ConfigError, match="branches"):
        specdec.PromptLookup(branches=0)
