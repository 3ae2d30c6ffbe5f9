"""Draft-length policies: pick γ each round from what the decode loop has measured so far.

A policy is any object with ``choose(stats) -> int`` (called before drafting; 0 = draft nothing this round,
i.e. a plain decoding step) and ``update(stats)`` (called after the round is recorded). ``gamma="auto"``
gives an `AdaptiveGamma`.

`AdaptiveGamma` maximises the expected speedup of Leviathan et al., τ(α, γ) / (γc + 1)
(`specdec.stats.best_gamma`), generalised by one measured term: τ(α, γ) / (r + γc), where
- α is the per-token acceptance probability: a Beta posterior with exponential forgetting. A round that drafted
  γ' tokens and accepted k is k successes and, if k < γ', one failure (the tokens after the first rejection
  were never tested), which is the right likelihood for the i.i.d.-acceptance model behind τ(α, γ);
  accepted/drafted would underestimate α; γ is chosen with the posterior mean plus one standard deviation
  (optimism while uncertain, so early rejections do not lock decoding into plain steps);
- c = d / B0: drafting time per drafted token over the time of a plain decoding round;
- r = B1 / B0 >= 1: the non-drafting time of a round with drafts (target forward over γ'+1 tokens,
  verification, bookkeeping) over that of a plain round. Leviathan's model has r = 1 (a target pass costs
  the same for 1 or γ+1 tokens); on CPU, or with a small target, the pass over several tokens and the
  verification cost measurably more (20% for a tiny model on CPU), which makes cheap but useless drafters
  (prompt lookup with no hits, a poor bigram) look free when they are not. r = 1 until a plain round has
  been measured, and then the formula is exactly Leviathan's.
Times are measured per round between `choose` and `update` on the wall clock minus the delta of
`DecodeStats.draft_s`, so the drafter's prompt prefill in `reset` and the consumer's time between rounds are
not counted. The first `warmup` drafting rounds use γ = `initial` (plus one plain round to measure B0) and
keep the minimum of each timing (first calls are often slow); after that, exponential moving averages. If
no γ >= 1 pays it returns 0 (plain decoding) and probes with γ = 1 every `probe_every` rounds to re-measure
α. A drafting round that follows skipped rounds may only lower d (a model drafter then also catches up on
the skipped tokens, a one-off cost). Per round: a few float updates and a loop over 1..max_gamma.

`HeuristicGamma` is transformers' "heuristic" schedule for comparison: +2 after a fully accepted round,
-1 (down to 1) otherwise.

Both keep what they learned across requests when reused (a new request is detected by a new
`DecodeStats` object); `chosen` records the γ each round asked for (before the loop caps it at the tokens
remaining; `stats.gammas` has what was actually drafted).
"""

from __future__ import annotations

import math
import time

from specdec.errors import ConfigError
from specdec.stats import DecodeStats, best_gamma, expected_tokens_per_pass


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class _RoundDeltas:
    """Snapshot of the counters at `choose`, to measure one round at `update`."""

    __slots__ = ("stats", "rounds", "accepted", "draft_s", "clock")

    def __init__(self, stats: DecodeStats, clock: float):
        self.stats = stats
        self.rounds = stats.rounds
        self.accepted = stats.accepted
        self.draft_s = stats.draft_s
        self.clock = clock


class _Estimate:
    """A timing: the minimum of the first `warmup` samples (first calls are often slow), then an EMA."""

    __slots__ = ("value", "count", "warmup", "memory")

    def __init__(self, warmup: int, memory: float):
        self.value: float | None = None
        self.count = 0
        self.warmup = warmup
        self.memory = memory

    def add(self, sample: float, downward_only: bool = False) -> None:
        if not (math.isfinite(sample) and sample >= 0):
            return
        if self.value is None:
            self.value = sample
        elif self.count < self.warmup:
            self.value = min(self.value, sample)
        elif not (downward_only and sample >= self.value):
            self.value = self.memory * self.value + (1 - self.memory) * sample
        self.count += 1


class AdaptiveGamma:
    """Choose γ maximising the expected speedup from running estimates of α and of the costs.

    initial: γ for the first `warmup` drafting rounds, while the costs are measured. max_gamma: largest γ
    considered. memory: forgetting factor per round of the α posterior and of the cost averages
    (0 < memory < 1; about 1 / (1 - memory) rounds of memory). prior: Beta(a, b) prior on α.
    probe_every: when speculation does not pay, draft γ = 1 once every this many rounds. clock: the wall
    clock used to time rounds.
    """

    def __init__(
        self,
        initial: int = 4,
        max_gamma: int = 16,
        memory: float = 0.97,
        prior: tuple[float, float] = (0.5, 0.5),
        probe_every: int = 16,
        warmup: int = 3,
        clock=time.perf_counter,
    ):
        self.initial = _check_int("initial", initial, 1)
        self.max_gamma = _check_int("max_gamma", max_gamma, 1)
        if isinstance(memory, bool) or not (isinstance(memory, (int, float)) and 0.0 < memory < 1.0):
            raise ConfigError(f"memory must be in (0, 1), got {memory!r}")
        self.memory = float(memory)
        try:
            a, b = (float(x) for x in prior)
        except (TypeError, ValueError):
            raise ConfigError(f"prior must be two positive numbers (a, b), got {prior!r}") from None
        if not (a > 0 and b > 0):
            raise ConfigError(f"prior must be two positive numbers (a, b), got {prior!r}")
        self.prior = (a, b)
        self.probe_every = _check_int("probe_every", probe_every, 1)
        self.warmup = _check_int("warmup", warmup, 1)
        self.clock = clock  # seconds, monotonic (replaceable in tests)
        self.successes, self.failures = self.prior  # Beta posterior of α
        self.draft_token = _Estimate(self.warmup, self.memory)  # d: drafting seconds per drafted token
        self.plain_round = _Estimate(self.warmup, self.memory)  # B0: a round without drafts, drafting excluded
        self.spec_round = _Estimate(self.warmup, self.memory)  # B1: a round with drafts, drafting excluded
        self.skipped = 0  # consecutive rounds with nothing drafted by choice
        self.chosen: list[int] = []  # γ asked for in each round of the current request
        self._snapshot: _RoundDeltas | None = None
        self._last_drafted = False  # did the previous round of this request draft anything?

    # -- estimates -----------------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        """Posterior mean of the per-token acceptance probability."""
        return self.successes / (self.successes + self.failures)

    @property
    def optimistic_alpha(self) -> float:
        """Posterior mean plus one standard deviation: γ is chosen optimistically while α is uncertain, so a
        run of early rejections does not lock decoding into plain steps; a drafter that is really poor
        concentrates its posterior near 0 and is still dropped."""
        a, b = self.successes, self.failures
        std = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
        return min(1.0, self.alpha + std)

    @property
    def _unit(self) -> float | None:
        """The time of a plain decoding round (B0), or of a drafting round (B1) until B0 is measured."""
        return self.plain_round.value or self.spec_round.value

    @property
    def cost_ratio(self) -> float | None:
        """c: drafting time per drafted token over a plain round's time (None until measured)."""
        unit = self._unit
        if self.draft_token.value is None or not unit:
            return None
        return self.draft_token.value / unit

    @property
    def overhead_ratio(self) -> float:
        """r = B1 / B0 >= 1: a drafting round's non-drafting time over a plain round's (1 if unmeasured)."""
        if not self.plain_round.value or self.spec_round.value is None:
            return 1.0
        return max(1.0, self.spec_round.value / self.plain_round.value)

    def expected_speedup(self, gamma: int) -> float:
        """τ(α, γ) / (r + γc) for γ >= 1, 1 for γ = 0: Leviathan's τ / (γc + 1) when r = 1."""
        if gamma == 0:
            return 1.0
        c = self.cost_ratio or 0.0
        return expected_tokens_per_pass(self.alpha, gamma) / (self.overhead_ratio + gamma * c)

    def best_gamma(self) -> int:
        """The γ in 0..max_gamma with the highest expected speedup (0: speculation does not pay)."""
        c, r, alpha = self.cost_ratio or 0.0, self.overhead_ratio, self.optimistic_alpha
        if r == 1.0:
            return best_gamma(alpha, c, self.max_gamma)
        best, best_value = 0, 1.0
        for gamma in range(1, self.max_gamma + 1):
            value = expected_tokens_per_pass(alpha, gamma) / (r + gamma * c)
            if value > best_value + 1e-12:
                best, best_value = gamma, value
        return best

    # -- policy --------------------------------------------------------------------------------------
    def choose(self, stats: DecodeStats) -> int:
        if self._snapshot is None or self._snapshot.stats is not stats:  # a new request
            self.chosen = []
            self.skipped = 0
            self._last_drafted = False
        self._snapshot = _RoundDeltas(stats, self.clock())
        if self.draft_token.count < self.warmup or self.cost_ratio is None:
            # Warm-up: measure the drafter at γ = initial, and one plain round for B0.
            gamma = 0 if self.draft_token.count >= 1 and self.plain_round.count == 0 else self.initial
        else:
            gamma = self.best_gamma()
            if gamma == 0 and self.skipped + 1 >= self.probe_every:
                gamma = 1  # probe: re-measure α now and then
        self.chosen.append(gamma)
        return gamma

    def update(self, stats: DecodeStats) -> None:
        snap = self._snapshot
        if snap is None or snap.stats is not stats or stats.rounds != snap.rounds + 1:
            return  # not a round we chose for
        drafted = stats.gammas[-1]  # γ' actually drafted (the drafter may propose fewer)
        accepted = stats.accepted - snap.accepted
        draft_dt = stats.draft_s - snap.draft_s
        base_dt = self.clock() - snap.clock - draft_dt  # target forward + verification + bookkeeping
        if drafted == 0:
            self.plain_round.add(base_dt)
            self.skipped = self.skipped + 1 if self.chosen and self.chosen[-1] == 0 else 0
            self._last_drafted = False
            return
        self.spec_round.add(base_dt)
        # α: k successes, then one failure unless every draft was accepted; older rounds fade to the prior.
        m, (a0, b0) = self.memory, self.prior
        self.successes = a0 + m * (self.successes - a0) + accepted
        self.failures = b0 + m * (self.failures - b0) + (1 if accepted < drafted else 0)
        # After skipped rounds a model drafter also caught up on the skipped tokens (a one-off cost that can
        # only inflate the measurement), so such a round may only lower the estimate.
        self.draft_token.add(draft_dt / drafted,
                             downward_only=not self._last_drafted and self.draft_token.count > 0)
        self.skipped = 0
        self._last_drafted = True


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
