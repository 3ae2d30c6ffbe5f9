"""γ under load, from measured goodput (SmartSpec-style): as the batch grows, speculation backs off.

Each round the scheduler picks a cap γ for every row's draft length. For a batch of B rows the expected
goodput of cap γ is

    B · E[tokens per row | γ] / t(B, γ),     E[tokens | γ] = (1 − α^(γ+1)) / (1 − α)

where α is the running per-token acceptance probability (accepted / tested drafts, Leviathan et al.'s i.i.d.
model) and t(B, γ) the measured wall time of a round (exponential moving average per batch-size bucket and γ).
γ = 0 is plain batched decoding (one token per row per round). Unmeasured (bucket, γ) pairs are tried once,
and every `probe_every` rounds the stalest one is measured again, so the choice follows the machine's load.
When the target pass stops being memory-bound (large B on a small CPU), t grows with B·(γ+1) and γ = 0 wins.
"""

from __future__ import annotations

import math


def batch_bucket(batch: int) -> int:
    """Powers of two (round time is close to linear in between; fewer buckets, less exploration)."""
    return 1 << math.ceil(math.log2(max(batch, 1)))


def expected_tokens(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class GoodputGamma:
    def __init__(self, max_gamma: int, *, probe_every: int = 64, smoothing: float = 0.2, prior_alpha: float = 0.7):
        self.candidates = list(range(0, max_gamma + 1))
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.accepted = 0.0  # decayed counts of accepted and rejected draft tokens
        self.rejected = 0.0
        self.prior_alpha = prior_alpha
        self.times: dict[tuple[int, int], float] = {}
        self.measured_at: dict[tuple[int, int], int] = {}
        self.rounds = 0

    @property
    def alpha(self) -> float:
        tested = self.accepted + self.rejected
        return self.accepted / tested if tested >= 8 else self.prior_alpha

    def goodput(self, batch: int, gamma: int) -> float | None:
        t = self.times.get((batch_bucket(batch), gamma))
        return None if t is None else batch_bucket(batch) * expected_tokens(self.alpha, gamma) / t

    def choose(self, batch: int) -> int:
        if len(self.candidates) == 1:
            return 0
        bucket = batch_bucket(batch)
        unmeasured = [g for g in self.candidates if (bucket, g) not in self.times]
        if unmeasured:
            return unmeasured[0]
        if self.rounds % self.probe_every == self.probe_every - 1:
            return min(self.candidates, key=lambda g: self.measured_at[(bucket, g)])
        return max(self.candidates, key=lambda g: self.goodput(batch, g))

    def update(self, batch: int, gamma: int, seconds: float, accepted: int, rejected: int) -> None:
        """A round of `batch` rows under cap `gamma` took `seconds`; rows accepted / rejected that many drafts."""
        self.rounds += 1
        key = (batch_bucket(batch), gamma)
        seconds_per_row = seconds * batch_bucket(batch) / max(batch, 1)  # normalise within a bucket
        old = self.times.get(key)
        self.times[key] = seconds_per_row if old is None else old + self.smoothing * (seconds_per_row - old)
        self.measured_at[key] = self.rounds
        decay = 0.98
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + rejected

    def table(self) -> dict[str, dict[int, float]]:
        """Measured goodput (tokens/s) per batch bucket and γ: what `specdec serve` logs and bench reports."""
        out: dict[str, dict[int, float]] = {}
        for (bucket, gamma), t in sorted(self.times.items()):
            out.setdefault(str(bucket), {})[gamma] = round(bucket * expected_tokens(self.alpha, gamma) / t, 1)
        return out
