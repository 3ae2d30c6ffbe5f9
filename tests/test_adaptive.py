"""gamma="auto" (`specdec.AdaptiveGamma`): the acceptance estimates, the cost model and the choice.

Everything here drives the policy with synthetic rounds: acceptance from a seeded random generator (i.i.d. or a
two-state Markov chain) and timings written straight into `DecodeStats` (`clock=None`, so no wall clock is
read), which makes every assertion exact and deterministic. A planted bug in the acceptance bookkeeping
(counting `drafted - accepted` failures per round instead of the one rejection) fails the convergence tests and
the choice test.
"""

from __future__ import annotations

import itertools
import random

import numpy as np

import pytest

from specdec.core.stats import DecodeStats, expected_tokens_per_pass
from specdec.engine.adaptive import AdaptiveGamma, markov_rates, plan
from specdec.errors import ConfigError


class Synthetic:
    """A decode loop without models. `accept(prev)`: is the next tested draft token accepted, given whether the
    previous tested one was (None at the start); `base(γ)`: seconds of a round's target pass over γ+1 tokens;
    `draft`: drafting seconds per drafted token (a number, or a function of the round number)."""

    def __init__(self, accept, base=lambda g: 1.0, draft=0.1):
        self.accept, self.base, self.draft = accept, base, draft
        self.prev: bool | None = None
        self.tokens = 0
        self.seconds = 0.0
        self.rounds = 0
        self.stats = DecodeStats()  # one request (a new DecodeStats is a new request to a policy)

    def run(self, policy, rounds: int, stats: DecodeStats | None = None) -> list[int]:
        stats = stats or self.stats
        chosen = []
        for _ in range(rounds):
            gamma = policy.choose(stats)
            chosen.append(gamma)
            k = 0
            while k < gamma:  # test draft tokens until the first rejection
                ok = self.accept(self.prev)
                self.prev = ok
                if not ok:
                    break
                k += 1
            self.rounds += 1
            draft_s = gamma * (self.draft(self.rounds) if callable(self.draft) else self.draft)
            stats.draft_s += draft_s
            stats.target_s += self.base(gamma)
            self.seconds += draft_s + self.base(gamma)
            self.tokens += k + 1
            stats.record_round(gamma, k, "bonus" if k == gamma else "recovered")
            policy.update(stats)
        return chosen


def iid(alpha: float, seed: int = 0):
    rng = random.Random(seed)
    return lambda prev: rng.random() < alpha


def markov(p_accept: float, p_reject: float, seed: int = 0):
    rng = random.Random(seed)
    return lambda prev: rng.random() < (p_reject if prev is False else p_accept)


def test_alpha_converges_to_the_per_token_acceptance_under_iid_acceptance():
    for alpha in (0.3, 0.6, 0.8, 0.95):
        policy = AdaptiveGamma(clock=None, memory=0.995, max_gamma=8)
        loop = Synthetic(iid(alpha, seed=int(alpha * 100)), base=lambda g: 1.0, draft=0.01)
        estimates = []
        for _ in range(40):
            loop.run(policy, 100)
            estimates.append((policy.alpha, policy.p_after_accept, policy.p_after_reject))
        pooled, after_accept, after_reject = (sum(x) / 30 for x in zip(*estimates[10:]))
        assert pooled == pytest.approx(alpha, abs=0.02), (alpha, pooled)
        # i.i.d.: both transition probabilities are the same α.
        assert after_accept == pytest.approx(alpha, abs=0.04)
        assert after_reject == pytest.approx(alpha, abs=0.04)
        assert 0 not in policy.chosen[-50:]  # cheap drafts, flat verification cost: always drafting


def test_both_transition_probabilities_are_recovered_under_markov_acceptance():
    for p_accept, p_reject in ((0.9, 0.4), (0.95, 0.7), (0.6, 0.9)):
        policy = AdaptiveGamma(clock=None, memory=0.995, max_gamma=8)
        loop = Synthetic(markov(p_accept, p_reject, seed=1), base=lambda g: 1.0, draft=0.01)
        after_accept, after_reject, pooled = [], [], []
        for _ in range(40):
            loop.run(policy, 100)
            after_accept.append(policy.p_after_accept)
            after_reject.append(policy.p_after_reject)
            pooled.append(policy.alpha)
        mean = lambda xs: sum(xs[10:]) / len(xs[10:])  # noqa: E731
        assert mean(after_accept) == pytest.approx(p_accept, abs=0.02)
        assert mean(after_reject) == pytest.approx(p_reject, abs=0.03)
        # The pooled α lies between them, weighted by how often each state is left.
        assert min(p_accept, p_reject) < mean(pooled) < max(p_accept, p_reject)


def brute_force_rate(p_accept: float, p_reject: float, costs, gamma_a: int, gamma_r: int) -> float:
    """Long-run tokens per second of drafting γ_A after an accepted and γ_R after a rejected token, from the
    outcome distribution of a round (k = 0..γ accepted) and the stationary law of the two-state chain."""
    def outcomes(p_first, gamma):  # [(probability, tokens, ends accepted)]
        out, p_run = [], 1.0
        for k in range(gamma + 1):
            p_next = p_first if k == 0 else p_accept
            if k == gamma:
                out.append((p_run, k + 1, True))
            else:
                out.append((p_run * (1 - p_next), k + 1, False))
                p_run *= p_next
        return out

    rounds = {s: outcomes(p, g) for s, p, g in (("A", p_accept, gamma_a), ("R", p_reject, gamma_r))}
    to_r = sum(p for p, _, ok in rounds["A"] if not ok)
    to_a = sum(p for p, _, ok in rounds["R"] if ok)
    pi_a = to_a / (to_a + to_r)
    tokens = {s: sum(p * n for p, n, _ in rounds[s]) for s in rounds}
    seconds = {"A": costs[gamma_a], "R": costs[gamma_r]}
    return (pi_a * tokens["A"] + (1 - pi_a) * tokens["R"]) / (pi_a * seconds["A"] + (1 - pi_a) * seconds["R"])


def test_plan_is_the_brute_force_optimum_of_the_markov_cost_model():
    rng = random.Random(0)
    for _ in range(30):
        p_accept, p_reject = rng.uniform(0.05, 0.98), rng.uniform(0.05, 0.98)
        max_gamma = rng.randint(1, 8)
        base = [1.0] + sorted(rng.uniform(1.0, 2.0) for _ in range(max_gamma))  # v(γ)
        c = rng.uniform(0.0, 0.4)
        costs = [v + g * c for g, v in enumerate(base)]
        pairs = list(itertools.product(range(1, max_gamma + 1), repeat=2))
        rates = {pair: brute_force_rate(p_accept, p_reject, costs, *pair) for pair in pairs}
        best = max(pairs, key=rates.get)
        grid = markov_rates(p_accept, p_reject, costs)
        for (a, r), rate in rates.items():
            assert grid[a - 1, r - 1] == pytest.approx(rate, rel=1e-9)
        got = plan(p_accept, p_reject, costs)
        if rates[best] > 1.0 / costs[0]:
            assert (got.gamma_after_accept, got.gamma_after_reject) == best
            assert got.rate == pytest.approx(rates[best], rel=1e-9)
        else:
            assert (got.gamma_after_accept, got.gamma_after_reject) == (0, 0)


def iid_optimum(alpha: float, c: float, v) -> int:
    """argmax over γ in 0..16 of Leviathan's τ(α, γ) / (v(γ) + γc), with v(0) = 1."""
    values = {g: expected_tokens_per_pass(alpha, g) / (v(g) + g * c) for g in range(17)}
    return max(values, key=values.get)


def test_plan_with_iid_acceptance_is_the_single_gamma_optimum():
    for alpha, c in itertools.product((0.3, 0.6, 0.8, 0.9, 0.97), (0.0, 0.05, 0.2, 0.5)):
        v = lambda g: 1.0 if g == 0 else 1.3 + 0.05 * g  # noqa: E731
        costs = [v(g) + g * c for g in range(17)]
        got = plan(alpha, alpha, costs)
        assert got.gamma_after_accept == got.gamma_after_reject == iid_optimum(alpha, c, v), (alpha, c)


@pytest.mark.parametrize("alpha, c, slope", [(0.8, 0.2, 0.05), (0.8, 0.1, 0.02), (0.6, 0.05, 0.02),
                                             (0.7, 0.2, 0.0), (0.9, 0.02, 0.0)])
def test_chosen_gamma_matches_the_cost_model_optimum_for_known_alpha_c_v(alpha, c, slope):
    """With i.i.d. acceptance α, drafting cost c per token and verification cost v(γ) = 1.3 + slope·γ plain
    rounds (γ >= 1), the policy measures c and v exactly, estimates α, and drafts argmax τ / (v + γc)."""
    v = lambda g: 1.0 if g == 0 else 1.3 + slope * g  # noqa: E731
    target = iid_optimum(alpha, c, v)
    # The optimum is flat in γ; these cases keep it for any α within ±0.012 (the estimate's accuracy here).
    assert all(iid_optimum(alpha + d, c, v) == target for d in (-0.012, 0.012))
    policy = AdaptiveGamma(clock=None, memory=0.999, optimism=0.0)
    loop = Synthetic(iid(alpha, seed=3), base=v, draft=c)
    loop.run(policy, 3000)
    assert policy.cost_ratio == pytest.approx(c)
    for g in range(1, 17):
        assert policy.verify_cost(g) == pytest.approx(v(g), rel=1e-6)
    chosen = loop.run(policy, 1000)
    assert policy.alpha == pytest.approx(alpha, abs=0.012)
    assert max(set(chosen), key=chosen.count) == target, (chosen[-30:], target)


def test_markov_policy_drafts_long_in_runs_and_short_after_rejections():
    # Bursty acceptance: runs of acceptance, then a hard stretch.
    policy = AdaptiveGamma(clock=None, memory=0.995, optimism=0.0)
    loop = Synthetic(markov(0.95, 0.3, seed=4), base=lambda g: 1.0 if g == 0 else 1.3 + 0.03 * g, draft=0.05)
    loop.run(policy, 1500)
    best = policy.plan()
    assert best.gamma_after_accept >= 8 and best.gamma_after_reject <= 3
    burst_rate = _rate_after(policy, loop, 2000)
    # The i.i.d. model, fed the same process, picks one γ and is measurably slower.
    iid_policy = AdaptiveGamma(clock=None, memory=0.995, optimism=0.0, burst_aware=False)
    iid_loop = Synthetic(markov(0.95, 0.3, seed=4), base=lambda g: 1.0 if g == 0 else 1.3 + 0.03 * g, draft=0.05)
    iid_loop.run(iid_policy, 1500)
    assert iid_policy.plan().gamma_after_accept == iid_policy.plan().gamma_after_reject
    assert burst_rate > 1.04 * _rate_after(iid_policy, iid_loop, 2000)


def _rate_after(policy, loop, rounds):
    tokens, seconds = loop.tokens, loop.seconds
    loop.run(policy, rounds)
    return (loop.tokens - tokens) / (loop.seconds - seconds)


def test_falls_back_to_plain_decoding_and_probes():
    policy = AdaptiveGamma(clock=None, probe_every=8, memory=0.9)
    loop = Synthetic(lambda prev: False, base=lambda g: 1.0, draft=0.5)  # never accepted
    chosen = loop.run(policy, 64)
    assert chosen[:4] == [policy.initial, 0, policy.initial, policy.initial]  # warm-up: d, B(0), d, d
    tail = chosen[24:]
    assert set(tail) <= {0, 1} and tail.count(0) >= 30
    assert 4 <= tail.count(1) <= 6  # a γ = 1 probe every 8 rounds
    assert policy.alpha < 0.3 and policy.p_after_reject < 0.3
    # The drafter becomes perfect: the probes see it, and speculation resumes.
    loop.accept = lambda prev: True
    chosen = loop.run(policy, 64)
    assert min(chosen[-16:]) >= 2


def test_no_speculation_when_drafting_costs_more_than_it_saves():
    # α = 0.9, but a draft token costs as much as a target pass: no γ >= 1 beats plain decoding.
    policy = AdaptiveGamma(clock=None)
    chosen = Synthetic(iid(0.9, seed=5), base=lambda g: 1.0, draft=1.0).run(policy, 80)
    assert chosen[-40:].count(0) >= 35
    assert policy.plan().gamma_after_accept == 0


def test_counts_the_extra_cost_of_verifying_drafts():
    # Drafting is nearly free (c = 0.001) and α is low (0.2): Leviathan's model (v = 1) says γ = 1 pays
    # (τ = 1.2); but a target pass over drafts costs 30% more than a plain one, so it does not.
    policy = AdaptiveGamma(clock=None)
    chosen = Synthetic(iid(0.2, seed=6), base=lambda g: 1.3 if g else 1.0, draft=0.001).run(policy, 200)
    assert policy.verify_cost(1) == pytest.approx(1.3)
    assert chosen[-50:].count(0) > 40
    flat = AdaptiveGamma(clock=None)
    chosen = Synthetic(iid(0.2, seed=6), base=lambda g: 1.0, draft=0.001).run(flat, 200)
    assert flat.verify_cost(1) == pytest.approx(1.0) and chosen[-50:].count(0) < 5


def test_costs_come_from_the_stats_of_the_path_it_runs_on():
    """Two paths with the same acceptance and different measured costs get different γ: the policy reads the
    target's pass time (`DecodeStats.target_s`) and the drafting time (`draft_s`) round by round."""
    slow_verify = AdaptiveGamma(clock=None, optimism=0.0)
    Synthetic(iid(0.8, seed=7), base=lambda g: 1.0 if g == 0 else 1.2 + 0.25 * g, draft=0.05).run(slow_verify, 300)
    fast_verify = AdaptiveGamma(clock=None, optimism=0.0)
    Synthetic(iid(0.8, seed=7), base=lambda g: 1.0 + 0.02 * g, draft=0.05).run(fast_verify, 300)
    assert slow_verify.verify_cost(4) == pytest.approx(2.2)
    assert fast_verify.verify_cost(4) == pytest.approx(1.08)
    assert fast_verify.best_gamma() > slow_verify.best_gamma() >= 1


def test_a_clock_adds_the_rest_of_the_round_to_its_cost():
    # The target pass costs 1.0 either way, but verification and bookkeeping add 0.5 per drafted token.
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    policy = AdaptiveGamma(clock=clock)
    stats = DecodeStats()
    for _ in range(30):
        gamma = policy.choose(stats)
        stats.draft_s += 0.1 * gamma
        stats.target_s += 1.0
        clock.now += 0.1 * gamma + 1.0 + 0.5 * gamma
        stats.record_round(gamma, gamma, "bonus")
        policy.update(stats)
        clock.now += 7.0  # the consumer's time between rounds is not part of a round
    assert policy.verify_cost(2) == pytest.approx(2.0)
    assert policy.cost_ratio == pytest.approx(0.1)


def test_cost_table_learns_each_gamma_and_resists_stalls():
    policy = AdaptiveGamma(clock=None, memory=0.97)
    table = policy.round_base
    for _ in range(200):  # a 4-token pass (γ = 3) is cheaper than a 3-token one, as MKL does on some CPUs
        for gamma, seconds in ((0, 1.0), (2, 1.6), (3, 1.45), (5, 1.7)):
            table.add(gamma, seconds)
    estimate = table.estimate()
    assert estimate[0] == pytest.approx(1.0)
    assert estimate[3] < estimate[2]
    for gamma, seconds in ((2, 1.6), (3, 1.45), (5, 1.7)):
        assert estimate[gamma] == pytest.approx(seconds, rel=0.05)
    assert estimate[4] == pytest.approx(1.6, rel=0.05)  # unmeasured: on the fitted line
    before = estimate[3]
    table.add(3, 100.0)  # a stalled round
    assert table.estimate()[3] < before * 1.1


def test_not_put_off_by_a_slow_first_round():
    policy = AdaptiveGamma(clock=None)
    chosen = Synthetic(lambda prev: True, base=lambda g: 1.0, draft=lambda i: 50.0 if i == 1 else 0.01).run(policy, 40)
    assert min(chosen[10:]) >= 10
    # Skipped rounds make a model drafter catch up at the next probe: that cost may not raise c.
    policy = AdaptiveGamma(clock=None, probe_every=4)
    loop = Synthetic(lambda prev: False, base=lambda g: 1.0, draft=0.5)
    loop.run(policy, 20)
    c = policy.cost_ratio
    loop.draft = 5.0
    loop.run(policy, 20)
    assert policy.cost_ratio == pytest.approx(c)


def test_a_new_request_keeps_the_costs_and_carries_acceptance_as_a_light_prior():
    policy = AdaptiveGamma(clock=None, carry=16.0)
    loop = Synthetic(iid(0.9, seed=8), draft=0.05)
    loop.run(policy, 100)
    alpha, costs = policy.alpha, policy.round_costs()
    assert sum(policy.successes) + sum(policy.failures) > 100
    policy.choose(DecodeStats())  # a new request
    assert policy.state is None and len(policy.chosen) == 1
    assert policy.round_costs() == costs
    assert sum(policy.successes) + sum(policy.failures) == pytest.approx(16.0)
    assert policy.alpha == pytest.approx(alpha, abs=0.05)
    # The new request's own acceptance takes over within a few dozen rounds.
    loop.accept, loop.stats = iid(0.4, seed=9), DecodeStats()
    loop.run(policy, 60)
    assert policy.alpha < 0.55


def test_gamma_auto_shares_measurements_per_drafter_and_target_but_not_request_state():
    class Model:  # stands for a target model; only its identity matters
        pass

    class Adapter:
        def __init__(self, model):
            self.model = model

    target, drafter, other_drafter = Model(), object.__new__(type("D", (), {})), object.__new__(type("E", (), {}))
    first = AdaptiveGamma.for_pair(Adapter(target), drafter)
    Synthetic(iid(0.9, seed=10), draft=0.05).run(first, 50)
    second = AdaptiveGamma.for_pair(Adapter(target), drafter)
    assert second is not first and second.round_base is first.round_base and second.successes is first.successes
    assert second.chosen == [] and second.state is None
    assert second.round_costs() == first.round_costs()
    fresh = AdaptiveGamma.for_pair(Adapter(target), other_drafter)
    assert fresh.round_costs() is None
    assert AdaptiveGamma.for_pair(Adapter(Model()), drafter).round_costs() is None


def test_plan_restricted_to_allowed_gammas_is_the_best_allowed_pair():
    costs = [1.0] + [1.2 + 0.05 * g for g in range(1, 9)]
    rates = markov_rates(0.9, 0.4, costs)  # [8, 8]
    allowed = (2, 4, 8)
    best = max(itertools.product(allowed, allowed), key=lambda ar: rates[ar[0] - 1, ar[1] - 1])
    got = plan(0.9, 0.4, costs, allowed)
    assert (got.gamma_after_accept, got.gamma_after_reject) == best
    assert got.rate == pytest.approx(rates[best[0] - 1, best[1] - 1])
    unrestricted = plan(0.9, 0.4, costs)
    assert unrestricted.rate >= got.rate and unrestricted.gamma_after_reject not in allowed  # the set binds here
    with pytest.raises(ConfigError):
        plan(0.9, 0.4, costs, (12,))


@pytest.mark.parametrize("accept", [iid(0.85, seed=11), markov(0.95, 0.3, seed=12), lambda prev: False])
def test_a_gamma_set_is_never_left(accept):
    """On a compiled target every γ is a compiled shape: warm-up, choices and probes stay in the set."""
    policy = AdaptiveGamma(clock=None, gammas=(2, 4, 8), probe_every=4)
    assert policy.max_gamma == 8 and policy.initial == 4
    chosen = Synthetic(accept, base=lambda g: 1.0 if g == 0 else 1.2 + 0.04 * g, draft=0.05).run(policy, 300)
    assert set(chosen) <= {0, 2, 4, 8}
    assert len(set(chosen)) >= 2
    assert AdaptiveGamma(gammas=[3, 6], initial=2).initial == 3


def test_gamma_auto_on_a_compiled_target_uses_the_fast_path_set():
    from specdec.engine.adaptive import FAST_PATH_GAMMAS

    class Model:
        pass

    class Compiled:
        compile = True

        def __init__(self, model):
            self.model = model

    drafter = object.__new__(type("D", (), {}))
    target = Model()
    compiled = AdaptiveGamma.for_pair(Compiled(target), drafter)
    assert compiled.gammas == FAST_PATH_GAMMAS
    eager = AdaptiveGamma.for_pair(type("Eager", (), {"model": target})(), drafter)
    assert eager.gammas is None and eager.round_base is not compiled.round_base


@pytest.mark.parametrize("kwargs", [dict(initial=0), dict(max_gamma=0), dict(memory=1.0), dict(memory=0),
                                    dict(prior=(0, 1)), dict(prior="ab"), dict(probe_every=0), dict(optimism=-1),
                                    dict(clip=0.5), dict(shrink=-1), dict(max_step=-1), dict(tie=0),
                                    dict(clock=3), dict(gammas=()), dict(gammas=(0, 2)), dict(gammas=3)])
def test_bad_options_raise(kwargs):
    with pytest.raises(ConfigError):
        AdaptiveGamma(**kwargs)


def test_plan_rejects_bad_costs():
    with pytest.raises(ConfigError):
        plan(0.5, 0.5, [1.0])
    with pytest.raises(ConfigError):
        plan(0.5, 0.5, [1.0, 0.0])


def test_plan_over_an_allowed_set_is_the_arrays_best_pair_to_the_last_bit():
    """`plan(..., allowed)` evaluates only the allowed pairs on Python floats; it must pick the pair (and rate)
    that `markov_rates`' array masked to them gives np.argmax, ties included."""
    rng = random.Random(3)
    for case in range(3000):
        top = rng.randint(1, 16)
        costs = [1.0] * (top + 1) if case % 7 == 0 else [rng.uniform(0.5, 3.0) for _ in range(top + 1)]
        allowed = rng.sample(range(1, top + 1), rng.randint(1, top))
        p_accept, p_reject = rng.choice([0.0, 1.0, 0.5, rng.random()]), rng.random()
        rates = markov_rates(p_accept, p_reject, costs)  # [G, G]
        keep = np.zeros(top, dtype=bool)
        keep[[g - 1 for g in allowed]] = True
        masked = np.where(keep[:, None] & keep[None, :], rates, -np.inf)
        gamma_a, gamma_r = divmod(int(np.argmax(masked)), top)
        expected = (gamma_a + 1, gamma_r + 1, float(masked[gamma_a, gamma_r]))
        if expected[2] <= (1.0 / costs[0]) * (1.0 + 1e-12):
            expected = (0, 0, 1.0 / costs[0])
        got = plan(p_accept, p_reject, costs, allowed)
        assert (got.gamma_after_accept, got.gamma_after_reject, got.rate) == expected, (case, allowed)
