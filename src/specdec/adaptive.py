"""Draft-length policies: pick γ each round from what the decode loop has measured so far.

A policy is any object with ``choose(stats) -> int`` (called before drafting; 0 = draft nothing this round,
i.e. a plain decoding step) and ``update(stats)`` (called after the round is recorded). ``gamma="auto"``
gives an `AdaptiveGamma`.

`AdaptiveGamma` maximises Leviathan et al.'s expected speedup τ(α, γ) / (γc + 1) (`specdec.stats.best_gamma`)
using running estimates of
- α, the per-token acceptance probability: a Beta posterior with exponential forgetting. A round that drafted
  γ' tokens and accepted k is k successes and, if k < γ', one failure (the tokens after the first rejection
  were never tested), which is the right likelihood for the i.i.d.-acceptance model behind τ(α, γ);
  accepted/drafted would underestimate α;
- c, the cost ratio: (drafting time / drafted tokens) / (target time / target forward), as an exponential
  moving average of per-round measurements (time deltas of `DecodeStats.draft_s` / `target_s` between
  `choose` and `update`, so the drafter's prompt prefill in `reset` is not counted).
If no γ >= 1 pays (best_gamma = 0) it returns 0 (plain decoding) and probes with γ = 1 every
`probe_every` rounds to re-measure α. The cost is not updated on a probe that follows skipped rounds (a
model drafter then also catches up on the skipped tokens, a one-off cost), only α is. Per round: a few
float updates and best_gamma's loop over 1..max_gamma.

`HeuristicGamma` is transformers' "heuristic" schedule for comparison: +2 after a fully accepted round,
-1 (down to 1) otherwise.

Both keep what they learned across requests when reused (a new request is detected by a new
`DecodeStats` object); `chosen` records the γ each round asked for (before the loop caps it at the tokens
remaining; `stats.gammas` has what was actually drafted).
"""

from __future__ import annotations

import math

from specdec.errors import ConfigError
from specdec.stats import DecodeStats, best_gamma, expected_speedup


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class _RoundDeltas:
    """Snapshot of the counters at `choose`, to measure one round at `update`."""

    __slots__ = ("stats", "rounds", "accepted", "draft_s", "target_s")

    def __init__(self, stats: DecodeStats):
        self.stats = stats
        self.rounds = stats.rounds
        self.accepted = stats.accepted
        self.draft_s = stats.draft_s
        self.target_s = stats.target_s


class AdaptiveGamma:
    """Choose γ maximising the expected speedup from running estimates of α and c.

    initial: γ for rounds before anything is measured. max_gamma: largest γ considered.
    memory: forgetting factor per round of the α posterior and of the cost averages (0 < memory < 1;
    about 1 / (1 - memory) rounds of memory). prior: Beta(a, b) prior on α. probe_every: when
    speculation does not pay, draft γ = 1 once every this many rounds.
    """

    def __init__(
        self,
        initial: int = 4,
        max_gamma: int = 16,
        memory: float = 0.9,
        prior: tuple[float, float] = (1.0, 1.0),
        probe_every: int = 16,
    ):
        self.initial = _check_int("initial", initial, 1)
        self.max_gamma = _check_int("max_gamma", max_gamma, 1)
        if not (isinstance(memory, (int, float)) and 0.0 < memory < 1.0):
            raise ConfigError(f"memory must be in (0, 1), got {memory!r}")
        self.memory = float(memory)
        a, b = prior
        if not (a > 0 and b > 0):
            raise ConfigError(f"prior must be two positive numbers (a, b), got {prior!r}")
        self.prior = (float(a), float(b))
        self.probe_every = _check_int("probe_every", probe_every, 1)
        self.successes, self.failures = self.prior  # Beta posterior of α
        self.draft_token_s: float | None = None  # EMA: drafting seconds per drafted token
        self.target_forward_s: float | None = None  # EMA: seconds per target forward
        self.skipped = 0  # consecutive rounds with nothing drafted by choice
        self.chosen: list[int] = []
        self._snapshot: _RoundDeltas | None = None
        self._last_drafted = False  # did the previous round of this request draft anything?

    # -- estimates -----------------------------------------------------------------------------------
    @property
    def alpha(self) -> float:
        """Posterior mean of the per-token acceptance probability."""
        return self.successes / (self.successes + self.failures)

    @property
    def cost_ratio(self) -> float | None:
        """c: drafting time per token over a target forward's time (None until both are measured)."""
        if self.draft_token_s is None or not self.target_forward_s:
            return None
        return self.draft_token_s / self.target_forward_s

    def expected_speedup(self, gamma: int) -> float:
        c = self.cost_ratio
        return expected_speedup(self.alpha, gamma, 0.0 if c is None else c)

    # -- policy --------------------------------------------------------------------------------------
    def choose(self, stats: DecodeStats) -> int:
        if self._snapshot is None or self._snapshot.stats is not stats:  # a new request
            self.chosen = []
            self.skipped = 0
            self._last_drafted = False
        self._snapshot = _RoundDeltas(stats)
        c = self.cost_ratio
        if c is None:
            gamma = self.initial
        else:
            gamma = best_gamma(self.alpha, c, self.max_gamma)
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
        target_dt = stats.target_s - snap.target_s
        m = self.memory
        if target_dt > 0:
            self.target_forward_s = target_dt if self.target_forward_s is None else (
                m * self.target_forward_s + (1 - m) * target_dt)
        if drafted == 0:
            self.skipped = self.skipped + 1 if self.chosen and self.chosen[-1] == 0 else 0
            self._last_drafted = False
            return
        # α: k successes, then one failure unless every draft was accepted; older rounds fade.
        a0, b0 = self.prior
        self.successes = a0 + m * (self.successes - a0) + accepted
        self.failures = b0 + m * (self.failures - b0) + (1 if accepted < drafted else 0)
        if self._last_drafted or self.draft_token_s is None:
            per_token = (stats.draft_s - snap.draft_s) / drafted
            if math.isfinite(per_token) and per_token >= 0:
                self.draft_token_s = per_token if self.draft_token_s is None else (
                    m * self.draft_token_s + (1 - m) * per_token)
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
