"""γ under load, from measured goodput (SmartSpec-style): as the batch grows, speculation backs off.

Each round the scheduler picks a cap γ for every row's draft length. The policy estimates the **goodput** of
a round, tokens committed by all rows / wall seconds, per batch-size bucket (powers of two) and γ, and runs
the best. γ = 0 is plain batched decoding. When the target pass stops being memory-bound (large B on a small
CPU) scoring γ extra tokens per row costs nearly γ times more and γ = 0 wins.

Two sources, blended:

- **measured**: expected tokens over the median seconds of the last `window` rounds of this (bucket, γ).
  Goodput is expected tokens over expected time, never a median of per-round rates: a round's tokens are as
  random as its drafts' acceptance (1 to γ + 1 a row; at α = 0.5 half of one row's rounds commit 1), so they
  come from α pooled over every speculative round (rows · τ(α, γ)), or their mean before any; a round's time is
  steady but for outliers (a neighbour's burst, a compile), so it is a median;
- **predicted** (`CostModel`, the prior): rows · τ(α, γ) / (t_pass(N, R) + t_rest(B) + γ · t_step(B)), with
  the target pass time t_pass(N, R) = a + c·N + d·R fitted over the padded tokens N that each round's pass scored
  (at B rows a speculative round scores (γ+1)·B) and its padded rows R: the linears cost per token, and each row
  also reads its own cache (at 32 rows of the default pair in float32, a row's attention and host work cost ~0.1
  ms, and one pass of 32 x 1 inputs takes longer than one of 8 x 5). Until two row counts have each been seen at
  two widths (three passes each) it is a line in N alone. t_rest(B) is the rest of a plain round and t_step(B) what each
  drafted position adds besides the pass (draft forward, per-row verification and rollback), both lines
  over rows, and α the per-token acceptance (accepted / (accepted + rejections), the estimate of a
  geometric acceptance truncated at γ). Its inputs are pooled over every round of every bucket, so a bucket
  seen for the first time needs no exploration, and one slow round moves it little.

A (bucket, γ) estimate is (n · measured + prior_weight · predicted) / (n + prior_weight) over its n samples.
Round times on a shared machine are noisy (a neighbour's burst doubles one round), so the choice also has:

- **hysteresis**: the bucket's current γ is kept unless another γ's estimate is ahead by more than `margin`
  (10%); a measured-equal pair never oscillates;
- **sparse probing**: every `probe_every` rounds of a bucket the least recently measured γ runs once, so
  the measurements follow the machine's load. Once plain decoding is chosen, speculation costs at most one
  probe round in `probe_every` (two: the first speculative round after plain ones is not measured, it runs
  again; a draft model spends it catching up on the tokens the plain rounds committed, a cost of having
  decoded plainly, and counted against speculation it would keep plain decoding chosen for good).

Before the cost model has seen two pass sizes (the first rounds of a server) unmeasured (bucket, γ) pairs are
tried first (`warmup` rounds each), in the order γ_max, ..., 0.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

import numpy as np


def batch_bucket(batch: int) -> int:
    """Powers of two (round time is close to linear in between; fewer buckets, less exploration)."""
    return 1 << math.ceil(math.log2(max(batch, 1)))


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a row commits per round at per-token acceptance α with γ drafts: (1 − α^{γ+1}) / (1 − α)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Intercept and slope (both >= 0) of a least-squares line through the per-x medians of (x, y) points;
    None until there are two distinct x values. Medians per x first: one noisy round moves its group's
    median a little, not the line."""
    groups: dict[float, list[float]] = {}
    for x, y in points:
        groups.setdefault(x, []).append(y)
    if len(groups) < 2:
        return None
    xs = sorted(groups)
    ys = [statistics.median(groups[x]) for x in xs]
    weights = [len(groups[x]) for x in xs]
    total = sum(weights)
    mx = sum(w * x for w, x in zip(weights, xs)) / total
    my = sum(w * y for w, y in zip(weights, ys)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, xs))
    slope = max(0.0, sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, xs, ys)) / sxx)
    return max(0.0, my - slope * mx), slope


def _plane(points: list[tuple[float, float, float]], min_group: int = 3) -> tuple[float, float, float] | None:
    """Intercept a and slopes c, d of the least-squares plane y = a + c·x + d·z through the per-(x, z) medians of
    (x, z, y) points, each median weighted by its group's size. None until two z values have each been seen with
    two x values in `min_group` points or more each (so that c is measured at each z, and d between them: a slope
    taken from one z alone, or from one noisy point, is noise), or when a coefficient comes out negative."""
    groups: dict[tuple[float, float], list[float]] = {}
    for x, z, y in points:
        groups.setdefault((x, z), []).append(y)
    xs_at: dict[float, set[float]] = {}
    for (x, z), ys in groups.items():
        if len(ys) >= min_group:
            xs_at.setdefault(z, set()).add(x)
    # Past this the design has rank 3: (1, x1, z1), (1, x2, z1), (1, x3, z2) are independent when x1 != x2, z1 != z2.
    if sum(len(xs) >= 2 for xs in xs_at.values()) < 2:
        return None
    keys = list(groups)
    design = np.array([(1.0, x, z) for x, z in keys])  # [G, 3]
    weights = np.sqrt([len(groups[key]) for key in keys])  # [G]
    medians = np.array([statistics.median(groups[key]) for key in keys])  # [G]
    coef = np.linalg.lstsq(design * weights[:, None], medians * weights, rcond=None)[0]  # [3]
    if (coef < 0).any():
        return None
    a, c, d = (float(v) for v in coef)
    return a, c, d


class CostModel:
    """A round's cost and yield from measurements pooled over the last `history` rounds (see module doc)."""

    def __init__(self, history: int = 256):
        self.passes: deque[tuple[float, float, float]] = deque(maxlen=history)  # (tokens scored, rows, seconds)
        self.plain_rest: deque[tuple[float, float]] = deque(maxlen=history)  # γ = 0: (rows, round − pass)
        self.spec_rest: deque[tuple[float, int, float]] = deque(maxlen=history)  # γ > 0: (rows, γ, round − pass)
        self._outcomes: deque[tuple[int, int]] = deque(maxlen=history)  # (accepted, rejections) per round
        self._outcome_sums = [0, 0]  # accepted and rejections over `_outcomes` (kept by `observe_outcome`)
        # The fitted lines: a round's choice asks for them once per candidate γ, and each fit reads every round kept
        # (~0.2 ms for all of them at 256 rounds, of a one-stream round of ~6 ms). They are refitted after every round
        # until the window is full, then every 8 rounds (1/32 of the window: one round moves them little), and at
        # once when a round brings a pass shape or a batch size the last fit had not seen.
        self._fits: dict[str, object] = {}
        self._fit_keys: set[tuple] = set()  # the pass shapes and batch sizes the fits were made with
        self._since_fit = 0  # rounds observed since then

    def _fitted(self, name: str, fit: Callable[[], object]):
        if name not in self._fits:
            self._fits[name] = fit()
        return self._fits[name]

    def observe_outcome(self, accepted: int, rejections: int) -> None:
        """A speculative round's accepted drafts and rejections (rows whose drafts were not all accepted)."""
        if len(self._outcomes) == self._outcomes.maxlen:  # the oldest leaves the window
            old_accepted, old_rejections = self._outcomes[0]
            self._outcome_sums[0] -= old_accepted
            self._outcome_sums[1] -= old_rejections
        self._outcomes.append((accepted, rejections))
        self._outcome_sums[0] += accepted
        self._outcome_sums[1] += rejections

    def _observed(self, *keys: tuple) -> None:
        """A round was kept: drop the fits when it is time to refit them (see __init__)."""
        self._since_fit += 1
        full = len(self.passes) == self.passes.maxlen
        if not full or self._since_fit * 32 >= len(self.passes) or not self._fit_keys.issuperset(keys):
            self._fits.clear()
            self._fit_keys.update(keys)
            self._since_fit = 0

    def _keep_pass(self, pass_tokens: int, pass_rows: int, pass_seconds: float) -> tuple:
        """Keep a target pass; its shape's key for `_observed`."""
        self.passes.append((float(pass_tokens), float(pass_rows), pass_seconds))
        return ("pass", float(pass_tokens), float(pass_rows))

    def observe_pass(self, pass_tokens: int, pass_rows: int, pass_seconds: float) -> None:
        """A target pass of `pass_rows` rows that scored `pass_tokens` tokens (padding included of both) in
        `pass_seconds`."""
        self._observed(self._keep_pass(pass_tokens, pass_rows, pass_seconds))

    def observe(self, rows: int, gamma: int, seconds: float, pass_tokens: int, pass_seconds: float,
                pass_rows: int | None = None) -> None:
        """A round of `rows` rows at γ took `seconds`, its target pass (`pass_rows` rows, default `rows`, and
        `pass_tokens` tokens, padding included) `pass_seconds` of them."""
        shape = self._keep_pass(pass_tokens, rows if pass_rows is None else pass_rows, pass_seconds)
        rest = max(0.0, seconds - pass_seconds)
        if gamma > 0:
            self.spec_rest.append((float(rows), gamma, rest))
        else:
            self.plain_rest.append((float(rows), rest))
        self._observed(shape, ("rest", float(rows), gamma > 0))

    @property
    def alpha(self) -> float | None:
        if not self._outcomes:
            return None
        accepted, rejections = self._outcome_sums  # sums kept as outcomes come and go: asked several times a round
        return (accepted + 1) / (accepted + rejections + 2)  # a uniform prior: 1/2 before any outcome

    def pass_seconds(self, tokens: float, rows: float | None = None) -> float | None:
        """A target pass's predicted seconds: a + c·tokens + d·rows where the passes seen fit that plane (and
        `rows` is given), else a + c·tokens on the line through them; None before two pass sizes."""
        plane = self._fitted("pass plane", lambda: _plane(list(self.passes)))
        if plane is not None and rows is not None:
            return plane[0] + plane[1] * tokens + plane[2] * rows
        line = self._fitted("pass", lambda: _line([(n, seconds) for n, _, seconds in self.passes]))
        return None if line is None else line[0] + line[1] * tokens

    def plain_rest_seconds(self, rows: float) -> float:
        """The rest of a plain round (everything but the target pass) at `rows` rows."""
        return self._plain_rest()(rows)

    def _plain_rest(self) -> Callable[[float], float]:
        """`plain_rest_seconds` as a function of rows, its line fitted once per refit (see __init__)."""
        return self._fitted("plain rest", self._fit_plain_rest)

    def _fit_plain_rest(self) -> Callable[[float], float]:
        line = _line(list(self.plain_rest))
        if line is None:
            median = statistics.median(r for _, r in self.plain_rest) if self.plain_rest else 0.0
            return lambda rows: median
        return lambda rows: line[0] + line[1] * rows

    def step_seconds(self, rows: int) -> float | None:
        """What each drafted position adds to a round besides the target pass at `rows` rows: the draft
        forward, and the per-row verification, commit and rollback work that grows with γ."""
        if not self.spec_rest:
            return None
        return self._fitted("step", self._fit_step)(rows)

    def _fit_step(self) -> Callable[[float], float]:
        # One fit of the plain rounds for every point: a fit per point cost O(history²) a round, 20-25 ms of
        # each one-row round once plain rounds of two batch sizes were kept (after a 32-stream wave).
        plain_rest = self._plain_rest()
        at = {r: plain_rest(r) for r in {r for r, _, _ in self.spec_rest}}  # a few batch sizes, each evaluated once
        points = [(r, max(0.0, rest - at[r]) / g) for r, g, rest in self.spec_rest]
        line = _line(points)
        if line is None:  # one batch size so far: its median
            median = statistics.median(s for _, s in points)
            return lambda rows: median
        return lambda rows: line[0] + line[1] * rows

    def goodput(self, rows: int, gamma: int, pass_tokens: float, pass_rows: float | None = None) -> float | None:
        """Predicted tokens/s of a round of `rows` rows at γ whose target pass scores `pass_tokens` over `pass_rows`
        rows (padding included of both; default `rows`)."""
        target = self.pass_seconds(pass_tokens, rows if pass_rows is None else pass_rows)
        if target is None:
            return None
        tokens, extra = rows * 1.0, 0.0
        if gamma > 0:
            step, alpha = self.step_seconds(rows), self.alpha
            if step is None or alpha is None:
                return None
            tokens, extra = rows * expected_tokens(alpha, gamma), gamma * step
        return tokens / max(target + self.plain_rest_seconds(rows) + extra, 1e-9)


class GoodputGamma:
    def __init__(self, max_gamma: int, *, candidates: list[int] | None = None, window: int = 16, warmup: int = 3,
                 margin: float = 0.10, probe_every: int = 32, prior_weight: float = 4.0,
                 pass_tokens: Callable[[int, int], int] | None = None):
        """pass_tokens(rows, width): the tokens the target pass scores for `rows` rows of `width` inputs
        (padding included: the fast path pads rows and widths to buckets); default rows · width."""
        if candidates is None:
            candidates = sorted({0, 1, 2, max_gamma} | ({max_gamma // 2} if max_gamma >= 4 else set()))
        self.candidates = [g for g in candidates if 0 <= g <= max_gamma] or [0]
        self.window, self.warmup, self.margin, self.probe_every = window, warmup, margin, probe_every
        self.prior_weight = prior_weight
        self.pass_tokens = pass_tokens or (lambda rows, width: rows * width)
        self.cost = CostModel()
        self.samples: dict[tuple[int, int], deque[tuple[float, float]]] = {}  # (bucket, γ) → recent (tokens, s)
        self.measured_at: dict[tuple[int, int], int] = {}
        self.current: dict[int, int] = {}  # bucket → the γ it runs between probes
        self.rounds_in: dict[int, int] = {}
        self.rounds = 0
        self.previous: int | None = None  # the last round's γ
        self.again: int | None = None  # a γ to run once more: its last round caught a draft up on plain rounds

    def measured(self, bucket: int, gamma: int) -> float | None:
        """Goodput (tokens/s, normalised to the bucket's size) of the last `window` rounds: expected tokens (the
        pooled α's, or the rounds' mean before any) over their median seconds."""
        samples = self.samples.get((bucket, gamma))
        if not samples:
            return None
        alpha = self.cost.alpha
        tokens = (bucket * expected_tokens(alpha, gamma) if gamma > 0 and alpha is not None
                  else statistics.fmean(t for t, _ in samples))
        return tokens / max(statistics.median(s for _, s in samples), 1e-9)

    def pass_rows(self, batch: int) -> int:
        """The rows a target pass over `batch` rows runs, padding included (`pass_tokens` at one input a row)."""
        return self.pass_tokens(batch, 1)

    def predicted(self, batch: int, gamma: int) -> float | None:
        """The cost model's goodput for `batch` rows at γ, normalised to the bucket's size as `measured`."""
        rate = self.cost.goodput(batch, gamma, self.pass_tokens(batch, gamma + 1), self.pass_rows(batch))
        return None if rate is None else rate * batch_bucket(batch) / max(batch, 1)

    def estimate(self, bucket: int, gamma: int, batch: int | None = None) -> float | None:
        """Measured and predicted goodput blended by their weights (n samples vs `prior_weight`)."""
        measured = self.measured(bucket, gamma)
        prior = self.predicted(batch or bucket, gamma)
        if prior is None:
            return measured
        n = len(self.samples.get((bucket, gamma), ()))
        if measured is None:
            return prior
        return (n * measured + self.prior_weight * prior) / (n + self.prior_weight)

    def choose(self, batch: int) -> int:
        if len(self.candidates) == 1:
            return self.candidates[0]
        if self.again is not None:
            gamma, self.again = self.again, None
            return gamma
        bucket = batch_bucket(batch)
        if self.cost.pass_seconds(1) is None or self.cost.alpha is None:
            for gamma in reversed(self.candidates):  # no cost model yet: each γ a few rounds
                if len(self.samples.get((bucket, gamma), ())) < self.warmup:
                    return gamma
        n = self.rounds_in.get(bucket, 0)
        if n % self.probe_every == self.probe_every - 1:
            return min(self.candidates, key=lambda g: self.measured_at.get((bucket, g), -1))
        return self._decide(bucket, batch)

    def _decide(self, bucket: int, batch: int) -> int:
        scores = {g: self.estimate(bucket, g, batch) for g in self.candidates}
        scores = {g: s for g, s in scores.items() if s is not None}
        if not scores:
            return max(self.candidates)
        best = max(scores, key=scores.get)
        current = self.current.get(bucket)
        if current not in scores or scores[best] > (1 + self.margin) * scores[current]:
            self.current[bucket] = current = best
        return current

    def update(self, batch: int, gamma: int, seconds: float, tokens: int, *, pass_tokens: int | None = None,
               pass_seconds: float | None = None, accepted: int = 0, rejections: int = 0) -> None:
        """A round of `batch` rows under cap `gamma` took `seconds` and committed `tokens` tokens in all.
        With its target pass's size (pass_tokens, padding included) and time, and its rows' accepted drafts
        and rejections (rows whose drafts were not all accepted), it also feeds the cost model."""
        self.rounds += 1
        bucket = batch_bucket(batch)
        self.rounds_in[bucket] = self.rounds_in.get(bucket, 0) + 1
        if gamma > 0 and accepted + rejections:
            self.cost.observe_outcome(accepted, rejections)
        resumed, self.previous = gamma > 0 and self.previous == 0, gamma
        if resumed:  # a draft model first caught up on the plain rounds' tokens: not this γ's cost; run it again
            self.again = gamma
            if pass_tokens is not None and pass_seconds is not None:  # the target's pass is as any other
                self.cost.observe_pass(pass_tokens, self.pass_rows(batch), pass_seconds)
            return
        key = (bucket, gamma)
        # Normalise to the bucket's size: within a bucket a round's cost grows about linearly with rows.
        self.samples.setdefault(key, deque(maxlen=self.window)).append((tokens * bucket / max(batch, 1), seconds))
        self.measured_at[key] = self.rounds
        if pass_tokens is not None and pass_seconds is not None:
            self.cost.observe(batch, gamma, seconds, pass_tokens, pass_seconds, self.pass_rows(batch))

    def table(self) -> dict[str, dict[int, float]]:
        """Measured goodput (tokens/s) per batch bucket and γ: what `specdec serve` logs."""
        out: dict[str, dict[int, float]] = {}
        for (bucket, gamma) in sorted(self.samples):
            out.setdefault(str(bucket), {})[gamma] = round(self.measured(bucket, gamma), 1)
        return out
