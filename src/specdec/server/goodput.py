"""γ under load, from measured goodput (SmartSpec-style): as the batch grows, speculation backs off.

Each round the scheduler picks a cap γ for every row's draft length. The policy measures what it cares about
directly: the **goodput** of a round, tokens committed by all rows / wall seconds, per batch-size bucket
(powers of two) and γ. γ = 0 is plain batched decoding. When the target pass stops being memory-bound (large
B on a small CPU) scoring γ extra tokens per row costs nearly γ times more and γ = 0 wins.

Round times on a shared machine are noisy (a neighbour's burst doubles one round), so the decision is made
robust three ways:

- **windows, not single rounds**: a (bucket, γ) estimate is the median of its last `window` rounds, so one
  slow or fast round does not flip the choice;
- **hysteresis**: the bucket's current γ is kept unless another γ's median is ahead by more than `margin`
  (10%); a measured-equal pair never oscillates;
- **sparse probing**: every `probe_every` rounds of a bucket the least recently measured γ runs once, so
  the estimates follow the machine's load; between probes the current γ runs. Once plain decoding is
  chosen, speculation costs at most one probe round in `probe_every`.

Unmeasured (bucket, γ) pairs are tried first (`warmup` rounds each) in the order γ_max, ..., 0.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


def batch_bucket(batch: int) -> int:
    """Powers of two (round time is close to linear in between; fewer buckets, less exploration)."""
    return 1 << math.ceil(math.log2(max(batch, 1)))


class GoodputGamma:
    def __init__(self, max_gamma: int, *, candidates: list[int] | None = None, window: int = 8, warmup: int = 3,
                 margin: float = 0.10, probe_every: int = 32):
        if candidates is None:
            candidates = sorted({0, 1, 2, max_gamma} | ({max_gamma // 2} if max_gamma >= 4 else set()))
        self.candidates = [g for g in candidates if 0 <= g <= max_gamma] or [0]
        self.window, self.warmup, self.margin, self.probe_every = window, warmup, margin, probe_every
        self.samples: dict[tuple[int, int], deque[float]] = {}  # (bucket, γ) → recent tokens/s
        self.measured_at: dict[tuple[int, int], int] = {}
        self.current: dict[int, int] = {}  # bucket → the γ it runs between probes
        self.rounds_in: dict[int, int] = {}
        self.rounds = 0

    def estimate(self, bucket: int, gamma: int) -> float | None:
        """Median goodput (tokens/s) of the last `window` rounds of this bucket at this γ."""
        samples = self.samples.get((bucket, gamma))
        return statistics.median(samples) if samples else None

    def choose(self, batch: int) -> int:
        if len(self.candidates) == 1:
            return self.candidates[0]
        bucket = batch_bucket(batch)
        for gamma in reversed(self.candidates):  # warm-up: each γ a few rounds
            if len(self.samples.get((bucket, gamma), ())) < self.warmup:
                return gamma
        n = self.rounds_in.get(bucket, 0)
        if n % self.probe_every == self.probe_every - 1:
            return min(self.candidates, key=lambda g: self.measured_at[(bucket, g)])
        return self._decide(bucket)

    def _decide(self, bucket: int) -> int:
        best = max(self.candidates, key=lambda g: self.estimate(bucket, g))
        current = self.current.get(bucket)
        if current is None or self.estimate(bucket, best) > (1 + self.margin) * self.estimate(bucket, current):
            self.current[bucket] = current = best
        return current

    def update(self, batch: int, gamma: int, seconds: float, tokens: int) -> None:
        """A round of `batch` rows under cap `gamma` took `seconds` and committed `tokens` tokens in all."""
        self.rounds += 1
        bucket = batch_bucket(batch)
        self.rounds_in[bucket] = self.rounds_in.get(bucket, 0) + 1
        key = (bucket, gamma)
        # Normalise to the bucket's size: within a bucket a round's cost grows about linearly with rows.
        rate = tokens / max(seconds, 1e-9) * bucket / max(batch, 1)
        self.samples.setdefault(key, deque(maxlen=self.window)).append(rate)
        self.measured_at[key] = self.rounds

    def table(self) -> dict[str, dict[int, float]]:
        """Median measured goodput (tokens/s) per batch bucket and γ: what `specdec serve` logs."""
        out: dict[str, dict[int, float]] = {}
        for (bucket, gamma) in sorted(self.samples):
            out.setdefault(str(bucket), {})[gamma] = round(self.estimate(bucket, gamma), 1)
        return out
