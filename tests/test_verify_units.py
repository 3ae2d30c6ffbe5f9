"""Hand-computed checks of the accept / recover / bonus arithmetic and of the theory formulas."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.core.sampling import SamplingConfig
from specdec.core.stats import best_gamma, expected_speedup, expected_tokens_per_pass
from specdec.core.verify import (
    acceptance_ratio,
    draw_uniforms,
    greedy_rule,
    rejection_rule,
    residual_distribution,
    verify_greedy,
    verify_sampled,
)
from specdec.engine.verification import verify_round

P = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
Q = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)


def test_acceptance_ratio_is_p_over_q_or_p_for_point_masses():
    tokens = torch.tensor([1, 0])
    probs = torch.stack([P, P])
    ratio = acceptance_ratio(tokens, torch.stack([Q, Q]), torch.cat([probs, P[None]]))
    assert ratio.tolist() == pytest.approx([0.3 / 0.5, 0.5 / 0.25])  # > 1 means always accepted
    assert acceptance_ratio(tokens, None, probs).tolist() == pytest.approx([0.3, 0.5])


def test_residual_is_positive_part_normalised():
    # max(0, P - Q) = [0.25, 0, 0]  ->  [1, 0, 0]
    assert residual_distribution(P, Q, 1).tolist() == pytest.approx([1.0, 0.0, 0.0])
    q = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)  # max(0, P - q) = [0.4, 0, 0]
    assert residual_distribution(P, q, 1).tolist() == pytest.approx([1.0, 0.0, 0.0])
    q = torch.tensor([0.4, 0.2, 0.4], dtype=torch.float64)  # [0.1, 0.1, 0] -> [0.5, 0.5, 0]
    assert residual_distribution(P, q, 2).tolist() == pytest.approx([0.5, 0.5, 0.0])


def test_point_mass_residual_is_target_without_the_drafted_token():
    assert residual_distribution(P, None, 0).tolist() == pytest.approx([0.0, 0.6, 0.4])


def test_zero_residual_falls_back_to_the_target():
    assert residual_distribution(P, P.clone(), 0).tolist() == pytest.approx(P.tolist())


def test_one_round_output_distribution_equals_target_analytically():
    # P(out = y) = q(y) min(1, p(y)/q(y)) + P(reject) * residual(y) must equal p(y).
    accept = Q * torch.minimum(torch.ones(3, dtype=torch.float64), P / Q)
    reject_mass = 1 - accept.sum()
    out = accept + reject_mass * residual_distribution(P, Q, 0)
    assert out.tolist() == pytest.approx(P.tolist())


def _expected_u(seed: int, gamma: int) -> torch.Tensor:
    return torch.rand(gamma, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def test_sampled_verification_accepts_exactly_while_u_below_ratio():
    seed, gamma = 3, 4
    u = _expected_u(seed, gamma)
    # Choose target probabilities of the drafted tokens so that positions 0,1 accept and 2 rejects.
    ratios = [min(1.0, float(u[0]) + 0.01), float(u[1]) + 0.01, float(u[2]) - 0.01, 1.0]
    V = 4
    target = torch.zeros(gamma + 1, V, dtype=torch.float64)
    for i, r in enumerate(ratios):
        target[i, 0] = r  # drafted token 0 with point-mass q: ratio = p(0)
        target[i, 1] = 1 - r  # all other mass on token 1: the residual is one-hot on 1
    target[gamma, 3] = 1.0
    verdict = verify_sampled(torch.zeros(gamma, dtype=torch.long), None, target, torch.Generator().manual_seed(seed))
    assert verdict.num_accepted == 2
    assert verdict.outcome == "recovered" and verdict.next_token == 1


def test_full_acceptance_draws_the_bonus_from_the_last_row():
    V, gamma = 5, 3
    target = torch.zeros(gamma + 1, V, dtype=torch.float64)
    target[:gamma, 2] = 1.0  # ratio 1 > any u in [0, 1): always accepted
    target[gamma, 4] = 1.0
    draft = torch.zeros(gamma, V, dtype=torch.float64)
    draft[:, 2] = 1.0
    verdict = verify_sampled(torch.full((gamma,), 2), draft, target, torch.Generator().manual_seed(0))
    assert (verdict.num_accepted, verdict.next_token, verdict.outcome) == (3, 4, "bonus")


def test_zero_target_probability_is_always_rejected():
    target = torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)
    for seed in range(20):
        v = verify_sampled(torch.tensor([0]), None, target, torch.Generator().manual_seed(seed))
        assert (v.num_accepted, v.next_token) == (0, 1)


def test_greedy_verification_accepts_the_matching_prefix():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 2.0, 0.0]])
    # target argmax per position: 1, 0, 2, 1
    v = verify_greedy(torch.tensor([1, 0, 2]), logits)
    assert (v.num_accepted, v.next_token, v.outcome) == (3, 1, "bonus")
    v = verify_greedy(torch.tensor([1, 2, 2]), logits)
    assert (v.num_accepted, v.next_token, v.outcome) == (1, 0, "recovered")
    v = verify_greedy(torch.tensor([0, 0, 2]), logits)
    assert (v.num_accepted, v.next_token) == (0, 1)
    v = verify_greedy(torch.empty(0, dtype=torch.long), logits[:1])
    assert (v.num_accepted, v.next_token) == (0, 1)


def _greedy_by_hand(draft, logits):
    """The greedy rule written as a loop: (accepted, next token) with the first-index argmax on ties."""
    rows = logits.tolist()
    best = [row.index(max(row)) for row in rows]
    k = 0
    while k < len(draft) and draft[k] == best[k]:
        k += 1
    return k, best[k]


def test_greedy_verification_matches_the_rule_written_as_a_loop():
    """Random drafts against random logits with many exact ties (integer logits in 0..2), so every accepted
    length 0..γ and the tie-break (lowest token id, as torch.argmax and plain greedy decoding) are hit."""
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(400):
        gamma = int(torch.randint(0, 5, (), generator=gen))
        logits = torch.randint(0, 3, (gamma + 1, 4), generator=gen).double()  # [γ+1, V]
        best = logits.argmax(dim=-1)
        draft = torch.where(torch.rand(gamma, generator=gen) < 0.7, best[:gamma],
                            torch.randint(0, 4, (gamma,), generator=gen))  # [γ], mostly the argmax
        v = verify_greedy(draft, logits)
        k, nxt = _greedy_by_hand(draft.tolist(), logits)
        assert (v.num_accepted, v.next_token) == (k, nxt), (draft, logits)
        assert v.outcome == ("bonus" if k == gamma else "recovered")
        assert verify_round(draft, None, logits, SamplingConfig(0.0), None) == v  # T = 0 routes here
        seen.add((gamma, k))
    assert {(4, k) for k in range(5)} <= seen


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_greedy_rule_on_tensors_matches_the_rule_written_as_a_loop(compiled):
    """greedy_rule (what the fast path's verifying pass runs, compiled) against the loop, on logits with many
    exact ties in a realistic vocabulary: compiled, inductor's argmax must break ties as torch.argmax does."""
    gen = torch.Generator().manual_seed(1)
    rule = torch.compile(greedy_rule, fullgraph=True, dynamic=False) if compiled else greedy_rule
    seen = set()
    for _ in range(60 if compiled else 400):
        gamma = 4
        logits = torch.randint(0, 3, (gamma + 1, 1000), generator=gen).to(torch.bfloat16).float()  # [γ+1, V]
        best = logits.argmax(dim=-1)
        draft = torch.where(torch.rand(gamma, generator=gen) < 0.7, best[:gamma],
                            torch.randint(0, 1000, (gamma,), generator=gen))  # [γ], mostly the argmax
        k, nxt = rule(draft, logits)
        assert (int(k), int(nxt)) == _greedy_by_hand(draft.tolist(), logits), (draft, logits)
        seen.add(int(k))
    assert seen == set(range(gamma + 1))


def _sampled_by_hand(draft, q, p, u):
    """The rejection rule written as a loop over floats: accept while u_i < p_i(x_i) / q_i(x_i), then draw
    (inverse CDF with the last uniform) from norm(max(0, p_k − q_k)) at the first rejection, or from p_γ."""
    gamma = len(draft)
    k = 0
    while k < gamma:
        qx = 1.0 if q is None else q[k][draft[k]]
        if not u[k] < p[k][draft[k]] / max(qx, torch.finfo(torch.float64).tiny):
            break
        k += 1
    if k == gamma:
        row = p[gamma]
    else:
        qk = [1.0 if (q is None and y == draft[k]) else 0.0 for y in range(len(p[k]))] if q is None else q[k]
        row = [max(0.0, a - b) for a, b in zip(p[k], qk)]
        if not sum(row) > 0:
            row = p[k]
    cdf = torch.tensor(row, dtype=torch.float64).cumsum(0)
    return k, min(int(torch.searchsorted(cdf, u[gamma] * cdf[-1:], right=True)), len(row) - 1)


def test_rejection_rule_matches_the_rule_written_as_a_loop():
    """The branch-free rule (the one the fast path's compiled pass runs) against a loop over floats, with
    draft probabilities and point masses, a point mass also as its one-hot row (what the fast path passes),
    γ = 0..4, and targets that put zero mass on many tokens (top-k / top-p style) so rejections, residual
    fallbacks and every accepted length occur."""
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for trial in range(300):
        gamma, vocab = trial % 5, 6
        p = torch.rand(gamma + 1, vocab, generator=gen, dtype=torch.float64)
        p = p * (torch.rand(gamma + 1, vocab, generator=gen) < 0.6)  # zero mass on ~40% of the tokens
        p[:, 0] += 1e-3  # never an all-zero row
        p = p / p.sum(-1, keepdim=True)  # [γ+1, V]
        q = p[:gamma] * torch.rand(gamma, vocab, generator=gen, dtype=torch.float64) ** 2 + 1e-3
        q = q / q.sum(-1, keepdim=True)  # [γ, V], close to p: partial acceptance
        draft = torch.multinomial(q, 1, generator=gen)[:, 0] if gamma else torch.empty(0, dtype=torch.long)
        u = draw_uniforms(gamma, gen)  # [γ+1]
        one_hot = torch.nn.functional.one_hot(draft, vocab).double()  # [γ, V]
        for probs, by_hand_q in ((q, q.tolist()), (None, None), (one_hot, None)):
            k, token = rejection_rule(draft, probs, p, u)
            assert (int(k), int(token)) == _sampled_by_hand(draft.tolist(), by_hand_q, p.tolist(), u.tolist())
            seen.add((gamma, int(k)))
    assert {(4, k) for k in range(5)} <= seen


def test_verify_sampled_draws_its_uniforms_as_one_call_of_the_same_stream():
    """γ accept tests then one draw consume the request's generator exactly as γ + 1 single draws would, so
    pre-drawing them (the fast path) keeps a seeded request's tokens."""
    for gamma in (0, 1, 4, 8):
        one_by_one = torch.Generator().manual_seed(9)
        singles = [torch.rand(1, dtype=torch.float64, generator=one_by_one) for _ in range(gamma + 1)]
        assert torch.equal(draw_uniforms(gamma, torch.Generator().manual_seed(9)), torch.cat(singles))
    p = torch.softmax(torch.randn(4, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64), -1)
    draft = torch.tensor([3, 1, 4])
    for seed in range(20):
        k, token = rejection_rule(draft, None, p, draw_uniforms(3, torch.Generator().manual_seed(seed)))
        v = verify_sampled(draft, None, p, torch.Generator().manual_seed(seed))
        assert (v.num_accepted, v.next_token) == (int(k), int(token))


def test_acceptance_is_strict_u_below_ratio(monkeypatch):
    """u ~ U[0, 1) can be exactly 0.0; a draft token the target gives probability 0 must still be rejected
    (u < ratio, never u <= ratio), and any positive ratio is then accepted. Forced with u = 0."""

    def zeros(*size, generator=None, dtype=None, device=None, **kwargs):
        return torch.zeros(*size, dtype=dtype, device=device)

    monkeypatch.setattr(torch, "rand", zeros)
    target = torch.tensor([[0.0, 1.0, 0.0], [1e-300, 0.5, 0.5], [0.2, 0.3, 0.5]], dtype=torch.float64)
    # Point-mass draft: ratio = p(x). Position 0 drafts token 0 of probability 0: rejected even at u = 0.
    v = verify_sampled(torch.tensor([0, 0]), None, target, None)
    assert (v.num_accepted, v.next_token, v.outcome) == (0, 1, "recovered")
    # A tiny positive ratio is accepted at u = 0 (position 1), then the bonus row is sampled.
    v = verify_sampled(torch.tensor([1, 0]), None, target, None)
    assert (v.num_accepted, v.outcome) == (2, "bonus")
    # With draft probabilities: p = 0, q > 0 gives ratio 0, rejected.
    draft = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    v = verify_sampled(torch.tensor([0]), draft, target[[0, 2]], None)
    assert (v.num_accepted, v.next_token) == (0, 1)


def test_theory_formulas():
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)
    assert best_gamma(0.0, 0.1) == 0  # nothing is ever accepted: do not speculate
    assert best_gamma(0.95, 0.01) >= 8
    g = best_gamma(0.7, 0.1)
    assert all(expected_speedup(0.7, g, 0.1) >= expected_speedup(0.7, h, 0.1) for h in range(1, 17))
    assert math.isclose(expected_speedup(0.7, 0, 0.5), 1.0)
