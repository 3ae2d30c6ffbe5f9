"""Goodness-of-fit statistics against a *known* reference distribution, and their power.

Two tests, both with an asymptotically chi-square null whose parameters are known in advance:

- `multinomial_test` (enumeration mode): n i.i.d. draws over categories (whole continuations) with exact
  probabilities. Categories with an expected count below `MIN_EXPECTED` are pooled (in a fixed order that
  depends only on the reference, never on the data) so every cell has expected count >= 5; Pearson's
  X² = Σ (O − E)²/E is referred to χ²(cells − 1). (Pearson, not G = 2·Σ O·ln(O/E): with hundreds of cells of
  expected count 5–10, G is anti-conservative — measured 25% of null p-values below 0.1 — while X² keeps
  its nominal rate down to 1e-4: 1.15e-4 ± 0.2e-4 in 200 000 null simulations with 674 cells.)
- `pooled_conditional_test` (conditional mode): many observations, each drawn from its *own* known
  distribution (the target's next-token distribution after an observed prefix). Observations are split into
  groups; within a group, O (counts per cell), E = Σᵢ Pᵢ and Σ = Σᵢ (diag Pᵢ − PᵢPᵢᵀ) are the exact mean and
  covariance of O under the null, and (O − E)ᵀ Σ⁺ (O − E) is asymptotically χ²(rank Σ) (martingale CLT);
  the groups' statistics add up, and so do their degrees of freedom. For a group of identical distributions
  this is Pearson's X².

An observation in a category of probability 0 is impossible under the null: the p-value is then 0.

Total variation. `tv` is the plug-in ½·Σ|O − E|/N on a *coarse* version of the test's cells (rare cells
pooled further, to expected counts >= N_g / `TV_CELLS`, so at most about `TV_CELLS` cells per group), plus
the impossible mass. Coarse, because the plug-in's noise is about 0.4/√(expected count per cell) whatever N
is: on cells of expected count 5 an exact sampler shows TV̂ ≈ 0.18. On the coarse cells it is ≈ 0.4·√(TV_CELLS/N)
(0.018 for N = 20 000). Pooling can only merge differences, so this estimates a lower bound of the TV over
continuations (enumeration) or of the group's next-token TV (conditional). The interval is TV̂ ± d₉₅, d₉₅ the
95th percentile of the plug-in's noise ½‖p̂ − p‖₁ (valid by the triangle inequality |TV − TV̂| ≤ ½‖p̂ − p‖₁),
simulated from the null covariance of the coarse cells (Gaussian approximation; cells hold >= N/TV_CELLS
observations). `tv_null_mean` is the TV̂ an exact sampler shows on average at this sample size.

Power. For any deviation whose TV on the test's cells is δ, Cauchy–Schwarz gives the noncentrality
λ = N·Σ d²/p ≥ N·(Σ|d|)² = 4Nδ² (d: cell-probability differences, Σ|d| = 2δ); the same bound holds per
group in conditional mode (there δ is the TV of the group's pooled next-token distribution). Power is
increasing in λ, so every deviation of TV ≥ δ* is detected with probability ≥ `power` at level α, where
δ* solves P(χ²_df(4Nδ*²) > χ²_df,1−α) = power (`detectable_tv`). The worst case is a deviation spread in
proportion to p over two halves of the mass; concentrated deviations (two small cells) are detected at a
far smaller TV.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

#: Smallest expected count of a cell after pooling (the usual validity rule for chi-square tests).
MIN_EXPECTED = 5.0
#: About how many cells per group the TV estimate uses (see the module docstring).
TV_CELLS = 32
#: Default power for `detectable_tv`.
DEFAULT_POWER = 0.8


@dataclass(frozen=True)
class TestOutcome:
    """What a goodness-of-fit test found. N counts observations (draws, or tokens in conditional mode)."""

    statistic: float
    df: int
    p_value: float
    n: int
    cells: int
    impossible: int  # observations in categories of probability 0
    tv: float
    tv_ci: tuple[float, float]
    tv_null_mean: float
    detectable_tv: float
    alpha: float
    power: float

    def to_dict(self) -> dict:
        return {
            "statistic": self.statistic, "df": self.df, "p_value": self.p_value, "n": self.n,
            "cells": self.cells, "impossible": self.impossible, "tv": self.tv, "tv_ci": list(self.tv_ci),
            "tv_null_mean": self.tv_null_mean, "detectable_tv": self.detectable_tv, "alpha": self.alpha,
            "power": self.power,
        }


def pool_cells(expected: np.ndarray, min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """Map categories to cells so that every cell's expected count is >= min_expected.

    Categories are taken by decreasing expected count (ties: lower index first); one with
    expected >= min_expected is a cell of its own, the rest are grouped consecutively until each group
    reaches min_expected; a final group that falls short is merged into the last cell formed. Categories
    with expected count 0 get label -1. Depends on `expected` only (never on observed counts), so the test's
    null distribution is untouched. Returns labels [len(expected)] in 0..cells-1.
    """
    expected = np.asarray(expected, dtype=np.float64)
    labels = np.full(expected.shape[0], -1, dtype=np.int64)
    order = np.argsort(-expected, kind="stable")
    order = order[expected[order] > 0]
    cell, acc, pending = -1, 0.0, []
    for idx in order:
        e = expected[idx]
        if not pending and e >= min_expected:
            cell += 1
            labels[idx] = cell
            continue
        pending.append(idx)
        acc += e
        if acc >= min_expected:
            cell += 1
            labels[pending] = cell
            pending, acc = [], 0.0
    if pending:
        labels[pending] = max(cell, 0)
    return labels


def cell_sums(values: np.ndarray, labels: np.ndarray, cells: int) -> np.ndarray:
    """Sum `values` [..., categories] into cells: [..., cells] (label -1 dropped)."""
    keep = labels >= 0
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 1:
        return np.bincount(labels[keep], weights=values[keep], minlength=cells)
    out = np.zeros(values.shape[:-1] + (cells,))
    np.add.at(out.T, labels[keep], np.moveaxis(values[..., keep], -1, 0))
    return out


def g_statistic(observed: np.ndarray, expected: np.ndarray) -> float:
    """2·Σ O·ln(O/E) over cells with O > 0 (E > 0 assumed)."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    mask = observed > 0
    return float(2.0 * np.sum(observed[mask] * np.log(observed[mask] / expected[mask])))


def _critical(df: int, alpha: float) -> float:
    return float(stats.chi2.isf(alpha, df))


def power_at(tv: float, n: int, df: int, alpha: float) -> float:
    """Lower bound on the power against any deviation of TV `tv` on the cells (noncentral χ², λ = 4n·tv²)."""
    if n <= 0:
        return 0.0
    if df <= 0:  # one cell: only impossible outcomes can reveal a deviation
        return 1.0 - (1.0 - min(max(tv, 0.0), 1.0)) ** n
    return float(stats.ncx2.sf(_critical(df, alpha), df, 4.0 * n * tv * tv))


def detectable_tv(n: int, df: int, alpha: float, power: float = DEFAULT_POWER) -> float:
    """Smallest TV δ* such that every deviation of TV >= δ* on the test's cells is detected with
    probability >= `power` at level `alpha` (asymptotic; see the module docstring). Decreasing in n."""
    if n <= 0:
        return 1.0
    if df <= 0:
        return 1.0 - (1.0 - power) ** (1.0 / n)
    crit = _critical(df, alpha)
    target = lambda lam: stats.ncx2.sf(crit, df, lam) - power  # noqa: E731
    hi = max(1.0, crit)
    while target(hi) < 0:
        hi *= 2.0
    lam = optimize.brentq(target, 0.0, hi, xtol=1e-10, rtol=1e-10)
    return float(min(1.0, math.sqrt(lam / (4.0 * n))))


@dataclass
class Group:
    """Observations of one group in cell space: counts, their null mean and covariance.

    cov=None means i.i.d. draws from one distribution p = mean / n (enumeration mode, or one prefix in
    conditional mode): the covariance is n·(diag p − p pᵀ) and the statistic is Pearson's X²."""

    observed: np.ndarray  # [K]
    mean: np.ndarray  # [K]
    cov: np.ndarray | None = None  # [K, K]

    @property
    def n(self) -> int:
        return int(round(float(self.observed.sum())))

    @property
    def cells(self) -> int:
        return int(self.observed.shape[0])

    def covariance(self) -> np.ndarray:
        if self.cov is not None:
            return self.cov
        total = self.mean.sum()
        p = self.mean / total if total > 0 else self.mean
        return total * (np.diag(p) - np.outer(p, p))

    def statistic(self) -> tuple[float, int]:
        """(X², df): Pearson's Σ(O − E)²/E with df = K − 1, or (O − E)ᵀ Σ⁺ (O − E) with df = rank Σ."""
        if self.cov is None:
            mask = self.mean > 0
            diff = self.observed[mask] - self.mean[mask]
            return float(np.sum(diff * diff / self.mean[mask])), max(int(mask.sum()) - 1, 0)
        q, rank, _ = _quadratic_form(self.observed - self.mean, self.cov)
        return q, rank

    def coarsen(self, labels: np.ndarray) -> "Group":
        """Merge cells: new cell labels[i] gets old cell i (labels cover 0..K'-1, no -1)."""
        cells = int(labels.max()) + 1
        observed = np.bincount(labels, weights=self.observed, minlength=cells)
        mean = np.bincount(labels, weights=self.mean, minlength=cells)
        if self.cov is None:
            return Group(observed, mean)
        rows = np.zeros((cells, self.cov.shape[1]))
        np.add.at(rows, labels, self.cov)
        cov = np.zeros((cells, cells))
        np.add.at(cov.T, labels, rows.T)
        return Group(observed, mean, cov)


def _quadratic_form(diff: np.ndarray, cov: np.ndarray) -> tuple[float, int, np.ndarray]:
    """(diffᵀ Σ⁺ diff, rank Σ, a factor F with F Fᵀ = Σ) with eigenvalues below a relative tolerance dropped."""
    values, vectors = np.linalg.eigh((cov + cov.T) / 2)
    tol = max(values.max(initial=0.0), 0.0) * max(cov.shape[0], 1) * 1e-10
    keep = values > tol
    values, vectors = values[keep], vectors[:, keep]
    proj = vectors.T @ diff
    return float(np.sum(proj * proj / values)), int(keep.sum()), vectors * np.sqrt(values)


def tv_estimate(
    groups: Sequence[Group], impossible: int, rng: np.random.Generator, simulations: int = 2000
) -> tuple[float, tuple[float, float], float]:
    """(TV̂, 95% interval, mean TV̂ of an exact sampler) on the coarse cells of `groups` (module docstring)."""
    n = sum(g.n for g in groups) + impossible
    if n == 0:
        return 0.0, (0.0, 0.0), 0.0
    abs_dev = float(impossible)
    noise = np.zeros(simulations)
    for group in groups:
        if group.n == 0:
            continue
        coarse = group.coarsen(pool_cells(group.mean, max(MIN_EXPECTED, group.n / TV_CELLS)))
        abs_dev += float(np.abs(coarse.observed - coarse.mean).sum())
        _, rank, factor = _quadratic_form(np.zeros_like(coarse.mean), coarse.covariance())
        if rank:
            noise += np.abs(rng.standard_normal((simulations, rank)) @ factor.T).sum(axis=1)
    tv = 0.5 * abs_dev / n
    noise = 0.5 * noise / n
    q95 = float(np.quantile(noise, 0.95))
    return tv, (max(0.0, tv - q95), min(1.0, tv + q95)), float(noise.mean())


def _outcome(statistic, df, groups, impossible, alpha, power, rng) -> TestOutcome:
    n = sum(g.n for g in groups) + impossible
    p_value = 0.0 if impossible else (1.0 if df <= 0 else float(stats.chi2.sf(statistic, df)))
    tv, ci, null_mean = tv_estimate(groups, impossible, rng)
    return TestOutcome(
        statistic=math.inf if impossible else float(statistic), df=int(df), p_value=p_value, n=int(n),
        cells=sum(g.cells for g in groups), impossible=int(impossible), tv=tv, tv_ci=ci,
        tv_null_mean=null_mean, detectable_tv=detectable_tv(n, df, alpha, power), alpha=alpha, power=power,
    )


def multinomial_test(
    counts: Sequence[int] | np.ndarray,
    probs: Sequence[float] | np.ndarray,
    *,
    alpha: float,
    power: float = DEFAULT_POWER,
    min_expected: float = MIN_EXPECTED,
    rng: np.random.Generator | None = None,
) -> TestOutcome:
    """Pearson chi-square test of i.i.d. category counts against exact probabilities (summing to 1), on
    cells pooled to expected counts >= min_expected; df = cells − 1.

    Counts in categories of probability 0 are impossible outcomes (p-value 0): pass e.g. one trailing
    category of probability 0 for "anything not in the reference".
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if counts.shape != probs.shape:
        raise ValueError("counts and probs must have the same length")
    rng = rng if rng is not None else np.random.default_rng(0)
    impossible = int(counts[probs <= 0].sum())
    n = int(counts.sum()) - impossible
    labels = pool_cells(n * probs, min_expected)
    cells = int(labels.max()) + 1 if (labels >= 0).any() else 0
    groups: list[Group] = []
    statistic = 0.0
    if cells and n:
        cell_p = cell_sums(probs, labels, cells)
        cell_p = cell_p / cell_p.sum()
        observed = cell_sums(counts, labels, cells)
        expected = n * cell_p
        group = Group(observed, expected)
        statistic, _ = group.statistic()
        groups.append(group)
    return _outcome(statistic, max(cells - 1, 0), groups, impossible, alpha, power, rng)


def pooled_conditional_test(
    groups: Sequence[Group],
    *,
    impossible: int = 0,
    alpha: float,
    power: float = DEFAULT_POWER,
    rng: np.random.Generator | None = None,
) -> TestOutcome:
    """Σ over groups of their statistic (`Group.statistic`); df = Σ df_g; N = all observations."""
    rng = rng if rng is not None else np.random.default_rng(0)
    statistic, df = 0.0, 0
    for group in groups:
        q, rank = group.statistic()
        statistic += q
        df += rank
    return _outcome(statistic, df, list(groups), impossible, alpha, power, rng)
