"""Decoding statistics and the theory they are compared with (Leviathan et al. 2023, section 3)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Counters of one generation. `accepted_at[i]` / `drafted_at[i]`: acceptance of draft position i."""

    new_tokens: int = 0
    target_forwards: int = 0  # decoding passes of the target (prefill not counted)
    draft_forwards: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0  # rounds that ended in a correction of a rejected draft token
    bonus: int = 0  # rounds that ended in a bonus token after full acceptance
    target_only: int = 0  # rounds that drafted nothing (γ' = 0): one token from the target alone
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    gammas: list[int] = field(default_factory=list)  # γ' drafted in each round
    wall_s: float = 0.0
    prefill_s: float = 0.0
    target_s: float = 0.0  # in target decoding forwards
    draft_s: float = 0.0  # in drafting (model forwards, lookups, sampling of drafts)
    # Compiling fast-path shapes on first use (compile=True), inside wall_s: in all, and the part of it before the
    # first round (inside prefill_s). tokens_per_s leaves both out.
    compile_s: float = 0.0
    prefill_compile_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """α: accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def estimated_alpha(self) -> float:
        """α under the i.i.d. model of Leviathan et al.: accepted / (accepted + rejected) draft tokens.

        `acceptance_rate` also counts drafts after the first rejection, which are never tested; this is the
        per-token acceptance probability that the theory's τ and speedup formulas take.
        """
        tested = self.accepted + self.recovered
        return self.accepted / tested if tested else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """τ: new tokens per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed: new tokens over the rounds' time, without the prefill and without compiling."""
        decode_s = self.wall_s - self.prefill_s - (self.compile_s - self.prefill_compile_s)
        return self.new_tokens / decode_s if decode_s > 0 else 0.0

    @property
    def overhead_s(self) -> float:
        """Time in the loop that is neither a model forward nor drafting: verification, bookkeeping."""
        return max(0.0, self.wall_s - self.prefill_s - self.target_s - self.draft_s)

    @property
    def overhead_per_round_pct(self) -> float:
        """Per-round overhead as a percentage of one target forward pass."""
        if not self.rounds or not self.target_forwards or self.target_s <= 0:
            return 0.0
        return 100.0 * (self.overhead_s / self.rounds) / (self.target_s / self.target_forwards)

    @property
    def cost_ratio(self) -> float:
        """c: drafting time per drafted token over one target forward's time."""
        if not self.drafted or not self.target_forwards or self.target_s <= 0:
            return 0.0
        return (self.draft_s / self.drafted) / (self.target_s / self.target_forwards)

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def record_round(self, gamma: int, num_accepted: int, outcome: str) -> None:
        self.rounds += 1
        self.drafted += gamma
        self.accepted += num_accepted
        self.gammas.append(gamma)
        # Every round ends in exactly one of these, so recovered + bonus + target_only == rounds.
        if not gamma:
            self.target_only += 1
        elif outcome == "recovered":
            self.recovered += 1
        else:
            self.bonus += 1
        while len(self.drafted_at) < gamma:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(gamma):
            self.drafted_at[i] += 1
            if i < num_accepted:
                self.accepted_at[i] += 1

    def as_dict(self) -> dict:
        data = {k: v for k, v in self.__dict__.items()}
        for name in ("acceptance_rate", "estimated_alpha", "mean_accepted_tokens", "tokens_per_s", "overhead_s",
                     "overhead_per_round_pct", "cost_ratio"):
            data[name] = getattr(self, name)
        data["acceptance_by_position"] = self.acceptance_by_position()
        return data

    def summary(self) -> str:
        return (
            f"α={self.acceptance_rate:.3f} τ={self.mean_accepted_tokens:.2f} "
            f"{self.tokens_per_s:.1f} tok/s, {self.new_tokens} tokens in {self.target_forwards} target forwards"
        )


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """τ = (1 - α^(γ+1)) / (1 - α): expected tokens per target pass with i.i.d. acceptance α."""
    if gamma < 0:
        raise ValueError("gamma must be >= 0")
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Expected walltime improvement τ / (γc + 1) over plain decoding."""
    return expected_tokens_per_pass(alpha, gamma) / (gamma * cost_ratio + 1.0)


def best_gamma(alpha: float, cost_ratio: float, max_gamma: int = 16) -> int:
    """The γ in 0..max_gamma that maximises the expected speedup (0: speculation does not pay)."""
    best, best_value = 0, 1.0
    for gamma in range(1, max_gamma + 1):
        value = expected_speedup(alpha, gamma, cost_ratio)
        if value > best_value + 1e-12:
            best, best_value = gamma, value
    return best

