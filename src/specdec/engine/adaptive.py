"""Draft-length policies: pick γ each round from what the decode loop has measured so far.

A policy is any object with ``choose(stats) -> int`` (called before drafting; 0 = draft nothing this round,
i.e. a plain decoding step) and ``update(stats)`` (called after the round is recorded in `DecodeStats`).
``gamma="auto"`` gives an `AdaptiveGamma`. Policies read only `DecodeStats` (and, optionally, a clock), so
they work unchanged with any target adapter and drafter.

`AdaptiveGamma` maximises expected new tokens per second. Its two ingredients (docs/adaptive_gamma.md has
the derivation and the measurements):

**Acceptance is a two-state Markov chain.** Greedy acceptance on code is not i.i.d.: per prompt it comes in
runs (a repeated structure is accepted whole) or in regular patterns (a rejection almost always followed by
an acceptance). The policy keeps two Beta posteriors, p_A = P(a draft token is accepted | the previous
tested draft token was accepted) and p_R = P(accepted | the previous one was rejected); their counts decay
by `memory` per round, and each has a prior of `tie` tokens at the pooled α (itself with a Beta `prior`).
A round that drafted γ' tokens from state s and accepted k tested: the first token from s (a success if
k >= 1), then k - 1 successes and, if k < γ', one failure, all from A (the tokens after the first rejection
were never tested, so they are not failures). The round leaves the chain in A (all accepted) or R. The
pooled posterior mean is `alpha`, the per-token α of the i.i.d. model (where p_A = p_R = α).

**Costs are measured per γ on the path the loop runs on.** For every γ' the policy keeps B(γ'), the time of
a round without its drafting (the target's pass over γ'+1 tokens, verification, bookkeeping): the delta of
`DecodeStats.target_s` over the round (the adapter's own forward timing, whatever the adapter: eager,
static-cache or compiled) plus, when a clock is given, the rest of the round's wall time outside
`DecodeStats.draft_s`. d is the drafting time per drafted token (delta of `draft_s` / γ'). In the units of a
plain round: c = d / B(0) and v(γ) = B(γ) / B(0) (Leviathan et al. assume v = 1; an eager float32 CPU pass
over 5 tokens costs ~1.5 one-token passes). One sample per round is noisy on a shared CPU, so B(γ) for
γ >= 1 is each γ's forgetting mean shrunk towards a line fitted through all measured γ >= 1 (`_CostTable`):
a γ drafted often keeps its own cost (a 4-token pass can be cheaper than a 3-token one), an unmeasured γ
gets the line's, and γ may grow at most `max_step` beyond the longest measured draft per round.

**Choice.** A round drafting γ from state s costs C(γ) = B(γ) + γd and yields
τ_s(γ) = 1 + p_s (1 - p_A^γ) / (1 - p_A) tokens; it ends in A with probability p_s p_A^(γ-1). A policy is a
pair (γ_A, γ_R); its long-run rate is that of the two-state renewal process,
  rate = (π_A τ_A(γ_A) + π_R τ_R(γ_R)) / (π_A C(γ_A) + π_R C(γ_R)),  π_A ∝ P(R → A), π_R ∝ P(A → R),
and the policy picks the pair with the highest rate (all pairs in 1..max_gamma, vectorised), drafting γ_A or
γ_R according to the last round's outcome. Because the rate counts where a round leaves the chain, a
rejection does not by itself stop speculation: drafting after a rejection is worth it when it leads back
into a run. If no pair beats plain decoding (1 / B(0)) it returns 0 and probes with γ = 1 every
`probe_every` rounds to re-measure α. With p_A = p_R = α the optimum is γ_A = γ_R = the argmax of
τ(α, γ) / (v(γ) + γc), Leviathan's expected speedup with a measured v.

Warm-up: the first `warmup` drafting rounds draft `initial` (d keeps the minimum of those samples: first
calls are often slow), and the second round is a plain one, to measure B(0). A sample may raise a cost by
at most `clip` times. The probabilities used for the choice are the posterior means (plus `optimism`
standard deviations if asked: optimism while uncertain explores more, but in replays of recorded
acceptance it cost more than it found); each transition probability has a prior of `tie` tokens at the
pooled α, so a state seen rarely behaves like the i.i.d. model. A drafting round after skipped rounds
may only lower d (a model drafter then also catches up on the skipped tokens, a one-off cost). Per round:
a few float updates, the cost table's estimate and the best pair of the allowed γ, on Python floats (choose +
update ~70 µs a round in the fast path's decode loop, bf16 default pair, one thread; ~190 µs as numpy arrays).

**Across requests.** A new request is detected by a new `DecodeStats` object: the Markov state starts
unknown (read as A), the costs carry over as measured, and the acceptance counts keep their means but at
most `carry` tokens of weight (the last requests are a light prior for the next, which may be easier or
harder). ``gamma="auto"`` gets its policy from `AdaptiveGamma.for_pair`: one per (drafter object, target
model, target adapter class) in the process, weakly keyed, so a drafter reused across calls does not pay
the warm-up and the cost learning again; each decoder gets a `fork` with its own per-request state.

`HeuristicGamma` is transformers' "heuristic" schedule for comparison: +2 after a fully accepted round,
-1 (down to 1) otherwise. Both keep what they learned across requests when reused; `chosen` records the γ
each round asked for (before the loop caps it at the tokens remaining; `stats.gammas` has what was
actually drafted).
"""

from __future__ import annotations

import copy
import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specdec.core.stats import DecodeStats
from specdec.errors import ConfigError

#: Markov states: the last tested draft token was accepted / rejected.
ACCEPTED, REJECTED = 0, 1
#: gamma="auto" policies by drafter, then target model, then adapter class (see `AdaptiveGamma.for_pair`).
_PAIRS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Probabilities are kept inside [EPS, 1 - EPS] in the rate formula (no 0/0 for absorbing chains).
_EPS = 1e-6
#: The γ a gamma="auto" policy may draft on a compiled target (the fast path): each γ is one compiled draft
#: graph and one verification shape (γ+1 rows), all compiled before the first request decodes, so that no
#: round ever compiles (docs/adaptive_gamma.md, "On the fast path"). 7, not 8: the fast path's linear kernel
#: runs a pass of up to 8 rows as one block of rows, and a 9-row pass as two (bf16, default target, one
#: thread: 8 rows 1.04 ms, 9 rows 1.22 ms).
FAST_PATH_GAMMAS = (2, 4, 7)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_number(name: str, value: object, low: float, high: float | None, hint: str) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < low or (high is not None and value >= high):
        raise ConfigError(f"{name} must be {hint}, got {value!r}")
    return float(value)


# -- the cost model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """The best Markov policy for given acceptance probabilities and round costs."""

    gamma_after_accept: int  # γ_A (0: plain decoding pays more)
    gamma_after_reject: int  # γ_R
    rate: float  # expected new tokens per second (per cost unit) of (γ_A, γ_R)
    plain_rate: float  # 1 / C(0)


def _clamped(p: float) -> float:
    """A probability kept inside [EPS, 1 - EPS] for the rate formula."""
    return min(max(float(p), _EPS), 1.0 - _EPS)


def markov_rates(p_accept: float, p_reject: float, costs: Sequence[float]) -> np.ndarray:
    """Long-run tokens per cost unit of every policy (γ_A, γ_R) in 1..G: an array [G, G].

    p_accept = P(accept | previous tested token accepted), p_reject = P(accept | previous rejected);
    costs[γ] (γ = 0..G) is the cost of a round that drafts γ tokens, drafting included.
    """
    cost = np.asarray(costs, dtype=np.float64)[1:]  # [G]
    pa, pr = _clamped(p_accept), _clamped(p_reject)
    gammas = np.arange(1, cost.shape[0] + 1)  # [G]
    run = pa ** (gammas - 1)  # [G] P(tokens 2..γ accepted | token 1 accepted)
    tested_after_first = (1.0 - pa * run) / (1.0 - pa)  # [G] Σ_{i<γ} p_A^i
    tau_a = 1.0 + pa * tested_after_first  # [G] tokens of a round from A
    tau_r = 1.0 + pr * tested_after_first  # [G] tokens of a round from R
    leave_a = 1.0 - pa * run  # [G] P(a round from A ends in a rejection)
    enter_a = pr * run  # [G] P(a round from R is accepted whole)
    # Stationary weights π_A ∝ enter_a[γ_R], π_R ∝ leave_a[γ_A]; rows γ_A, columns γ_R.
    tokens = enter_a[None, :] * tau_a[:, None] + leave_a[:, None] * tau_r[None, :]  # [G, G]
    seconds = enter_a[None, :] * cost[:, None] + leave_a[:, None] * cost[None, :]  # [G, G]
    return tokens / seconds


def plan(p_accept: float, p_reject: float, costs: Sequence[float], allowed: Sequence[int] | None = None) -> Plan:
    """The (γ_A, γ_R) maximising `markov_rates`, or (0, 0) when plain decoding (rate 1 / costs[0]) is
    at least as fast. With p_accept = p_reject = α both equal argmax_γ τ(α, γ) / costs[γ].
    allowed: the only γ either of the pair may take (None: every γ in 1..len(costs) - 1)."""
    if len(costs) < 2 or not all(c > 0 for c in costs):
        raise ConfigError(f"costs must be positive, one per γ = 0..max_gamma (at least two), got {costs!r}")
    if allowed is None:
        rates = markov_rates(p_accept, p_reject, costs)  # [G, G]
        best = int(np.argmax(rates))
        gamma_a, gamma_r = divmod(best, rates.shape[1])
        rate = float(rates[gamma_a, gamma_r])
    else:
        gammas = sorted({g for g in allowed if 1 <= g < len(costs)})
        if not gammas:
            raise ConfigError(f"none of the allowed γ {tuple(allowed)!r} is within 1..{len(costs) - 1}")
        gamma_a, gamma_r, rate = _best_pair(p_accept, p_reject, costs, gammas)
    plain_rate = 1.0 / float(costs[0])
    if rate <= plain_rate * (1.0 + 1e-12):
        return Plan(0, 0, plain_rate, plain_rate)
    return Plan(gamma_a + 1, gamma_r + 1, rate, plain_rate)


def _best_pair(p_accept: float, p_reject: float, costs: Sequence[float], gammas: list[int]) -> tuple[int, int, float]:
    """`markov_rates`' best entry among the pairs of `gammas` (ascending): (γ_A − 1, γ_R − 1, rate), ties to the
    first pair in row-major order as np.argmax. The same arithmetic on Python floats: a few pairs cost far
    less than the [G, G] array's numpy calls, which the fast path's rounds pay every round."""
    pa, pr = _clamped(p_accept), _clamped(p_reject)
    terms = {}
    runs = np.power(pa, np.asarray(gammas) - 1).tolist()  # as markov_rates computes them, to the last bit
    for g, run in zip(gammas, runs):
        tested_after_first = (1.0 - pa * run) / (1.0 - pa)
        # tau_a, tau_r, leave_a, enter_a, cost (as in markov_rates)
        terms[g] = (1.0 + pa * tested_after_first, 1.0 + pr * tested_after_first, 1.0 - pa * run, pr * run,
                    float(costs[g]))
    best = (-1, -1, -math.inf)
    for ga in gammas:
        tau_a, _, leave_a, _, cost_a = terms[ga]
        for gr in gammas:
            _, tau_r, _, enter_a, cost_r = terms[gr]
            rate = (enter_a * tau_a + leave_a * tau_r) / (enter_a * cost_a + leave_a * cost_r)
            if rate > best[2]:
                best = (ga - 1, gr - 1, rate)
    return best


# -- measurements --------------------------------------------------------------------------------------
class _RoundDeltas:
    """Snapshot of the counters at `choose`, to measure one round at `update`."""

    __slots__ = ("stats", "rounds", "accepted", "draft_s", "target_s", "clock")

    def __init__(self, stats: DecodeStats, clock: float | None):
        self.stats = stats
        self.rounds = stats.rounds
        self.accepted = stats.accepted
        self.draft_s = stats.draft_s
        self.target_s = stats.target_s
        self.clock = clock


class _Estimate:
    """A timing: the minimum of the first `warmup` samples (first calls are often slow), then an EMA in which
    a sample counts for at most `clip` times the current value (a stalled round cannot swamp it)."""

    __slots__ = ("value", "count", "warmup", "memory", "clip")

    def __init__(self, warmup: int, memory: float, clip: float):
        self.value: float | None = None
        self.count = 0
        self.warmup = warmup
        self.memory = memory
        self.clip = clip

    def add(self, sample: float, downward_only: bool = False) -> None:
        if not (math.isfinite(sample) and sample >= 0):
            return
        if self.value is None:
            self.value = sample
        elif self.count < self.warmup:
            self.value = min(self.value, sample)
        elif not (downward_only and sample >= self.value):
            sample = min(sample, self.clip * self.value)
            self.value = self.memory * self.value + (1 - self.memory) * sample
        self.count += 1


class _CostTable:
    """B(γ), γ = 0..G: the seconds of a round that drafted γ tokens, drafting excluded.

    Each γ keeps a forgetting mean of its samples (weights decay by `memory` per sample of any γ). One
    sample per round at 20-30% noise on a shared CPU is too little to trust a γ on its own, so for γ >= 1 the
    estimate is that mean shrunk towards a line fitted through every measured γ >= 1 (weighted least squares,
    slope >= 0), with the line's weight `shrink` samples: a γ measured often keeps its own cost (a pass over
    4 tokens may be cheaper than over 3), a γ never measured gets the line's. With one measured γ >= 1 the
    line runs from B(0) to it. B(0), the unit of every cost, is its own mean. A sample is first clipped to
    `clip` times the current estimate of its γ (a stalled round cannot swamp it).
    """

    def __init__(self, max_gamma: int, memory: float, shrink: float, clip: float):
        # Python floats, not numpy arrays: a handful of values, updated and read every round of the decode loop,
        # where each numpy call costs more than the arithmetic (~50 µs a round on the fast path).
        self.memory, self.shrink, self.clip = memory, shrink, clip
        self.weight = [0.0] * (max_gamma + 1)  # [G+1] decayed sample counts
        self.total = [0.0] * (max_gamma + 1)  # [G+1] decayed sums of seconds
        self.samples = [0] * (max_gamma + 1)  # [G+1] samples ever taken
        self._cached: list[float] | None = None

    def add(self, gamma: int, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0) or gamma >= len(self.weight):
            return
        current = self.estimate()
        if current is not None:
            seconds = min(seconds, self.clip * current[gamma])
        self.weight = [x * self.memory for x in self.weight]
        self.total = [x * self.memory for x in self.total]
        self.weight[gamma] += 1.0
        self.total[gamma] += seconds
        self.samples[gamma] += 1
        self._cached = None

    def measured(self, gamma: int) -> bool:
        return bool(self.samples[gamma])

    def longest_measured(self) -> int:
        """The largest γ with a sample (0 when none)."""
        return max((g for g, n in enumerate(self.samples) if n), default=0)

    def estimate(self) -> list[float] | None:
        """[G+1] seconds per γ (None until a round was measured)."""
        if self._cached is None:
            self._cached = self._estimate()
        return self._cached

    def _estimate(self) -> list[float] | None:
        w = self.weight
        if not any(w):
            return None
        means = [t / x if x else 0.0 for t, x in zip(self.total, w)]  # [G+1] (0 where unmeasured)
        drafting = [g for g in range(1, len(w)) if w[g]]  # measured γ >= 1
        if not drafting:
            return [means[0]] * len(w)
        wg, y = [w[g] for g in drafting], [means[g] for g in drafting]
        if len(drafting) >= 2:  # weighted least squares
            sw = sum(wg)
            g_mean = sum(a * g for a, g in zip(wg, drafting)) / sw
            y_mean = sum(a * v for a, v in zip(wg, y)) / sw
            dg = [g - g_mean for g in drafting]
            slope = sum(a * d * (v - y_mean) for a, d, v in zip(wg, dg, y)) / sum(a * d * d for a, d in zip(wg, dg))
        elif w[0] > 0:  # one drafting γ: the line from B(0) to it
            g_mean, y_mean = float(drafting[0]), y[0]
            slope = (y_mean - means[0]) / g_mean
        else:
            g_mean, y_mean, slope = float(drafting[0]), y[0], 0.0
        floor, rise = 0.5 * min(y), max(0.0, slope)
        out = []
        for g, (x, m) in enumerate(zip(w, means)):
            line = max(y_mean + rise * (g - g_mean), floor)
            out.append((x * m + self.shrink * line) / (x + self.shrink) if x + self.shrink > 0 else math.nan)
        if w[0] > 0:
            out[0] = means[0]
        return out


# -- the policy ----------------------------------------------------------------------------------------
class AdaptiveGamma:
    """Choose γ each round to maximise expected tokens per second under a two-state Markov model of
    acceptance and the round costs measured per γ (see the module docstring).

    initial: γ of the warm-up rounds, which measure the drafter. max_gamma: largest γ considered.
    memory: forgetting factor per round of the acceptance counts and of the cost averages (0 < memory < 1;
    about 1 / (1 - memory) rounds of memory). prior: Beta(a, b) prior of the pooled α. probe_every: when
    speculation does not pay, draft γ = 1 once every this many rounds. warmup: drafting rounds at
    `initial` before choosing (d keeps their minimum). clock: a monotonic clock in seconds that adds the
    round's time outside the target pass and drafting (verification, bookkeeping) to its cost; None: costs
    are the target's and the drafter's own timings in `DecodeStats` only (no wall clock read).
    optimism: the choice uses posterior means plus this many standard deviations. burst_aware: False pools
    the two transition probabilities into one α (the i.i.d. model). clip: a sample raises a timing by at
    most this factor. shrink: weight, in samples, of the fitted line in each γ's cost. max_step: γ may
    exceed the longest measured draft by at most this (0: no limit). tie: weight, in tokens, of the pooled
    α in each transition probability's prior. carry: weight, in tokens, of the acceptance counts a new
    request inherits. gammas: the only γ the policy drafts (warm-up, probes and choices; None: every γ in
    1..max_gamma); on a compiled target each γ is a compiled shape, so the set is kept small and compiled
    up front (`FAST_PATH_GAMMAS`); max_gamma becomes its largest and `max_step` counts steps in the set.
    """

    def __init__(
        self,
        initial: int = 4,
        max_gamma: int = 16,
        memory: float = 0.97,
        prior: tuple[float, float] = (3.0, 1.0),
        probe_every: int = 16,
        warmup: int = 3,
        clock: Callable[[], float] | None = time.perf_counter,
        optimism: float = 0.0,
        burst_aware: bool = True,
        clip: float = 2.0,
        shrink: float = 4.0,
        max_step: int = 2,
        tie: float = 4.0,
        carry: float = 16.0,
        gammas: Sequence[int] | None = None,
    ):
        self.initial = _check_int("initial", initial, 1)
        self.max_gamma = _check_int("max_gamma", max_gamma, 1)
        self.gammas: tuple[int, ...] | None = None
        if gammas is not None:
            try:
                chosen = sorted({_check_int("each of gammas", g, 1) for g in gammas})
            except TypeError:
                raise ConfigError(f"gammas must be a sequence of integers >= 1, got {gammas!r}") from None
            if not chosen:
                raise ConfigError("gammas must name at least one γ >= 1 (or be None for every γ)")
            self.gammas = tuple(chosen)
            self.max_gamma = chosen[-1]
            below = [g for g in chosen if g <= self.initial]
            self.initial = below[-1] if below else chosen[0]  # warm up at an allowed γ
        self.memory = _check_number("memory", memory, 0.0, 1.0, "in (0, 1)")
        if self.memory == 0.0:
            raise ConfigError(f"memory must be in (0, 1), got {memory!r}")
        try:
            a, b = (float(x) for x in prior)
        except (TypeError, ValueError):
            raise ConfigError(f"prior must be two positive numbers (a, b), got {prior!r}") from None
        if not (a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)):
            raise ConfigError(f"prior must be two positive numbers (a, b), got {prior!r}")
        self.prior = (a, b)
        self.probe_every = _check_int("probe_every", probe_every, 1)
        self.warmup = _check_int("warmup", warmup, 1)
        if clock is not None and not callable(clock):
            raise ConfigError(f"clock must be a function returning seconds, or None, got {clock!r}")
        self.clock = clock
        self.optimism = _check_number("optimism", optimism, 0.0, None, "a number >= 0")
        self.burst_aware = bool(burst_aware)
        self.clip = _check_number("clip", clip, 1.0, None, "a number >= 1")
        self.shrink = _check_number("shrink", shrink, 0.0, None, "a number >= 0")
        self.max_step = _check_int("max_step", max_step, 0)
        self.carry = _check_number("carry", carry, 0.0, None, "a number >= 0")
        self.tie = _check_number("tie", tie, 0.0, None, "a number >= 0")
        if self.tie == 0.0:
            raise ConfigError(f"tie must be > 0, got {tie!r}")
        # Tested draft tokens (decayed) after an accepted / a rejected one: accepted, rejected.
        self.successes = [0.0, 0.0]
        self.failures = [0.0, 0.0]
        self.draft_token = _Estimate(self.warmup, self.memory, self.clip)  # d: seconds per drafted token
        # B(γ): seconds of a round that drafted γ tokens, drafting excluded.
        self.round_base = _CostTable(self.max_gamma, self.memory, self.shrink, self.clip)
        self.state: int | None = None  # ACCEPTED / REJECTED: outcome of the last tested draft token
        self.skipped = 0  # consecutive rounds with nothing drafted by choice
        self.chosen: list[int] = []  # γ asked for in each round of the current request
        self._snapshot: _RoundDeltas | None = None
        self._last_drafted = False  # did the previous round of this request draft anything?

    @classmethod
    def for_pair(cls, target: object, drafter: object) -> AdaptiveGamma:
        """The policy behind ``gamma="auto"``: one per (drafter object, target model, target adapter class and
        whether it compiles) in this process, so that a drafter reused across requests keeps the costs it
        measured (they belong to the models, the path and the machine) and carries acceptance over as a light
        prior (`carry`). Keyed weakly: nothing is stored on the models. A new drafter object starts afresh."""
        model = getattr(target, "model", target)
        try:
            by_model = _PAIRS.setdefault(drafter, weakref.WeakKeyDictionary())
            policies = by_model.setdefault(model, {})
        except TypeError:  # an object that cannot be weakly referenced: no sharing
            return cls()
        key = f"{type(target).__module__}.{type(target).__qualname__}"
        compiled = getattr(target, "compile", None) is True  # a static-cache adapter with compiled forwards
        if compiled:
            key += ":compiled"
        if key not in policies:  # compiled: only γ whose shapes are compiled up front (FAST_PATH_GAMMAS)
            policies[key] = cls(gammas=FAST_PATH_GAMMAS) if compiled else cls()
        return policies[key].fork()

    def fork(self) -> AdaptiveGamma:
        """A policy for another request that shares this one's measurements (costs, acceptance counts) and
        has its own per-request state, so concurrent requests do not mix their rounds."""
        twin = copy.copy(self)
        twin.chosen, twin.state, twin.skipped, twin._snapshot, twin._last_drafted = [], None, 0, None, False
        return twin

    # -- estimates -----------------------------------------------------------------------------------
    @staticmethod
    def _beta(a: float, b: float) -> tuple[float, float]:
        """Mean and standard deviation of Beta(a, b)."""
        return a / (a + b), math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))

    def _pooled(self) -> tuple[float, float]:
        """Beta parameters of α with both states pooled: the prior plus every tested token."""
        return self.prior[0] + sum(self.successes), self.prior[1] + sum(self.failures)

    def _row(self, row: int) -> tuple[float, float]:
        """Beta parameters of one transition probability: its own tokens plus a prior of `tie` tokens at the
        pooled α (a state seen rarely, or never, behaves like the i.i.d. model until it is seen)."""
        a, b = self._pooled()
        mean = a / (a + b)
        return self.tie * mean + self.successes[row], self.tie * (1 - mean) + self.failures[row]

    @property
    def alpha(self) -> float:
        """Posterior mean of the per-token acceptance probability, both states pooled (the i.i.d. α)."""
        return self._beta(*self._pooled())[0]

    @property
    def p_after_accept(self) -> float:
        """Posterior mean of P(a draft token is accepted | the previous tested one was accepted)."""
        return self._beta(*self._row(ACCEPTED))[0]

    @property
    def p_after_reject(self) -> float:
        """Posterior mean of P(a draft token is accepted | the previous tested one was rejected)."""
        return self._beta(*self._row(REJECTED))[0]

    def _planning_probabilities(self) -> tuple[float, float]:
        """(p_A, p_R) for the choice: posterior means plus `optimism` standard deviations."""
        rows = (self._row(ACCEPTED), self._row(REJECTED)) if self.burst_aware else (self._pooled(),) * 2
        out = []
        for a, b in rows:
            mean, std = self._beta(a, b)
            out.append(min(1.0, mean + self.optimism * std))
        return out[0], out[1]

    def base_costs(self) -> list[float] | None:
        """B(γ) for γ = 0..max_gamma: seconds of a round drafting γ tokens, drafting excluded (see
        `_CostTable`; None until a round was measured)."""
        base = self.round_base.estimate()
        return None if base is None else list(base)

    def round_costs(self) -> list[float] | None:
        """C(γ) = B(γ) + γd for γ = 0..max_gamma, in seconds (None until B(0) and d are measured)."""
        base = self.round_base.estimate()
        d = self.draft_token.value
        if base is None or not self.round_base.measured(0) or d is None:
            return None
        return [b + d * g for g, b in enumerate(base)]

    @property
    def cost_ratio(self) -> float | None:
        """c: drafting time per drafted token over a plain round's time B(0) (None until measured)."""
        base = self.base_costs()
        if self.draft_token.value is None or not base or base[0] <= 0:
            return None
        return self.draft_token.value / base[0]

    def verify_cost(self, gamma: int) -> float:
        """v(γ) = B(γ) / B(0): a round's non-drafting cost at γ in plain rounds (1.0 until measured)."""
        base = self.base_costs()
        if base is None or not self.round_base.measured(0) or base[0] <= 0:
            return 1.0
        return base[min(gamma, self.max_gamma)] / base[0]

    def plan(self) -> Plan | None:
        """The best (γ_A, γ_R) for the current estimates (None until the costs are measured)."""
        costs = self.round_costs()
        if costs is None or costs[0] <= 0:
            return None
        costs = [max(c, 1e-12) for c in costs]
        if self.max_step:  # explore longer drafts gradually: at most max_step beyond the longest measured
            top = self.round_base.longest_measured()
            if self.gammas is None:
                limit = max(top + self.max_step, 1)
            else:  # max_step steps up the allowed set
                above = [g for g in self.gammas if g > top]
                limit = max(above[: self.max_step] or [g for g in self.gammas if g <= top][-1:] or [1])
            costs = costs[: limit + 1]
        return plan(*self._planning_probabilities(), costs, self.gammas)

    def expected_speedup(self, gamma: int) -> float:
        """Expected tokens/s of drafting γ in every round over plain decoding (1.0 for γ = 0 or while
        unmeasured): τ(α, γ) / (v(γ) + γc) when p_A = p_R = α."""
        costs = self.round_costs()
        if gamma == 0 or costs is None or costs[0] <= 0:
            return 1.0
        p_a, p_r = self._planning_probabilities()
        rates = markov_rates(p_a, p_r, costs[: gamma + 1])
        return float(rates[gamma - 1, gamma - 1]) * costs[0]

    def best_gamma(self) -> int:
        """The γ for the current Markov state (0: speculation does not pay)."""
        best = self.plan()
        if best is None:
            return self.initial
        return best.gamma_after_reject if self.state == REJECTED else best.gamma_after_accept

    # -- policy --------------------------------------------------------------------------------------
    def choose(self, stats: DecodeStats) -> int:
        if self._snapshot is None or self._snapshot.stats is not stats:  # a new request
            self.chosen = []
            self.skipped = 0
            self.state = None
            self._last_drafted = False
            self._carry_over()
        self._snapshot = _RoundDeltas(stats, self.clock() if self.clock is not None else None)
        if self.draft_token.count < self.warmup or not self.round_base.measured(0):
            # Warm-up: measure the drafter at γ = initial (its first calls are often slow), and, after the
            # first drafting round, one plain round: the unit of every cost.
            gamma = 0 if self.draft_token.count >= 1 and not self.round_base.measured(0) else self.initial
        else:
            gamma = self.best_gamma()
            if gamma == 0 and self.skipped + 1 >= self.probe_every:
                gamma = self.gammas[0] if self.gammas else 1  # probe: re-measure α now and then
        self.chosen.append(gamma)
        return gamma

    def update(self, stats: DecodeStats) -> None:
        snap = self._snapshot
        if snap is None or snap.stats is not stats or stats.rounds != snap.rounds + 1:
            return  # not a round we chose for
        drafted = stats.gammas[-1]  # γ' actually drafted (the drafter may propose fewer)
        accepted = stats.accepted - snap.accepted
        draft_dt = stats.draft_s - snap.draft_s
        base_dt = stats.target_s - snap.target_s  # the target's pass over γ'+1 tokens
        if self.clock is not None:  # plus verification and bookkeeping: the round's wall time, drafting excluded
            base_dt = max(base_dt, self.clock() - snap.clock - draft_dt)
        self.round_base.add(drafted, base_dt)
        if drafted == 0:
            self.skipped = self.skipped + 1 if self.chosen and self.chosen[-1] == 0 else 0
            self._last_drafted = False
            return
        self._observe(drafted, accepted)
        # After skipped rounds a model drafter also caught up on the skipped tokens (a one-off cost that can
        # only inflate the measurement), so such a round may only lower the estimate.
        self.draft_token.add(draft_dt / drafted,
                             downward_only=not self._last_drafted and self.draft_token.count > 0)
        self.skipped = 0
        self._last_drafted = True

    def _carry_over(self) -> None:
        """At a new request, keep the acceptance counts' means but at most `carry` tokens of their weight: the
        last requests become a prior for this one, which may be easier or harder. Costs carry over as they are."""
        total = sum(self.successes) + sum(self.failures)
        if total > self.carry:
            scale = self.carry / total
            self.successes[:] = [x * scale for x in self.successes]  # in place: forks share these lists
            self.failures[:] = [x * scale for x in self.failures]

    def _observe(self, drafted: int, accepted: int) -> None:
        """Add one round's tested tokens to the counts (older rounds fade: the prior takes over)."""
        for row in (ACCEPTED, REJECTED):
            self.successes[row] *= self.memory
            self.failures[row] *= self.memory
        # The first draft token was tested from the chain's state (unknown at a request's start: not counted).
        if self.state is not None:
            if accepted >= 1:
                self.successes[self.state] += 1
            else:
                self.failures[self.state] += 1
        # Tokens 2..k+1 were tested right after an accepted token; nothing after the first rejection was.
        if accepted >= 1:
            self.successes[ACCEPTED] += accepted - 1
            if accepted < drafted:
                self.failures[ACCEPTED] += 1
        self.state = ACCEPTED if accepted == drafted else REJECTED


class HeuristicGamma:
    """transformers' "heuristic" schedule: start at `initial`; +2 when all drafts were accepted, -1 otherwise
    (never below `min_gamma`, nor above `max_gamma` if given)."""

    def __init__(self, initial: int = 5, increase: int = 2, decrease: int = 1, min_gamma: int = 1,
                 max_gamma: int | None = None):
        self.gamma = _check_int("initial", initial, 1)
        self.increase = _check_int("increase", increase, 0)
        self.decrease = _check_int("decrease", decrease, 0)
        self.min_gamma = _check_int("min_gamma", min_gamma, 1)
        self.max_gamma = None if max_gamma is None else _check_int("max_gamma", max_gamma, self.min_gamma)
        self.chosen: list[int] = []
        self._stats: DecodeStats | None = None
        self._rounds = self._accepted = 0

    def choose(self, stats: DecodeStats) -> int:
        if stats is not self._stats:
            self._stats, self.chosen = stats, []
        self._rounds, self._accepted = stats.rounds, stats.accepted
        self.chosen.append(self.gamma)
        return self.gamma

    def update(self, stats: DecodeStats) -> None:
        if stats is not self._stats or stats.rounds != self._rounds + 1:
            return
        drafted = stats.gammas[-1]
        if drafted == 0:  # e.g. prompt lookup found no match: nothing learned
            return
        if stats.accepted - self._accepted == drafted:
            self.gamma += self.increase
        else:
            self.gamma = max(self.min_gamma, self.gamma - self.decrease)
        if self.max_gamma is not None:
            self.gamma = min(self.gamma, self.max_gamma)
