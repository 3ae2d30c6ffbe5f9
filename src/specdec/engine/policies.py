"""The γ policy of a request: one rule for a lone request and a batch's rows.

A policy is a `GammaPolicy`: ``choose(stats) -> int`` (before drafting; 0 = a plain round) and
``update(stats)`` (after the round is recorded). ``gamma=N`` is a `FixedGamma`; ``gamma="auto"`` the
`AdaptiveGamma` shared by every request of the same (drafter, target model, target adapter) in the process
(`AdaptiveGamma.for_pair`: its measured costs belong to the models, the path and the machine; each request
gets its own fork); None is the drafter's declared default γ (a tree's depth), else `DEFAULT_GAMMA`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from specdec.core.stats import DecodeStats
from specdec.drafters.base import Drafter

#: γ when neither the request nor the drafter names one.
DEFAULT_GAMMA = 4


@runtime_checkable
class GammaPolicy(Protocol):
    """What the round calls on a γ policy (`FixedGamma`, `AdaptiveGamma`, or a user's object passed as `gamma=`).
    An adaptive policy may also name `gammas`, the γ values it picks from, so that their shapes compile up
    front."""

    def choose(self, stats: DecodeStats) -> int:
        """γ for the next round, before drafting (0: a plain round)."""

    def update(self, stats: DecodeStats) -> None:
        """After the round is recorded in `stats`."""


class FixedGamma:
    """Draft the same γ every round. (Adaptive policies implement the same two methods.)"""

    def __init__(self, gamma: int):
        self.gamma = gamma

    def choose(self, stats: DecodeStats) -> int:
        return self.gamma

    def update(self, stats: DecodeStats) -> None:
        pass


def gamma_policy(gamma: int | str | object | None, target: object, drafter: Drafter | None):
    """The policy for a request's (validated, `DecodeOptions`) `gamma`, drafting with `drafter` for the target
    adapter `target` (a lone request's or a batch's)."""
    if gamma is None:
        declared = drafter.capabilities.default_gamma if drafter is not None else None
        gamma = declared or DEFAULT_GAMMA
    if isinstance(gamma, GammaPolicy):
        return gamma
    if gamma == "auto":
        from specdec.engine.adaptive import AdaptiveGamma  # noqa: PLC0415 (optional policy, loaded on demand)

        return AdaptiveGamma.for_pair(target, drafter) if drafter is not None else AdaptiveGamma()
    return FixedGamma(gamma)
