"""Sampling settings and the warp that turns logits into the distribution we sample from.

The same warp (temperature, then top-k, then top-p: the order `transformers.generate` uses) is applied to
the target's and the drafter's logits, so the guarantee is exactness with respect to the *warped* target.
Temperature 0 means greedy: no probabilities, only argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise ConfigError(f"top_k must be an integer >= 1, or None to disable it; got {self.top_k!r}")
        if self.top_p is not None:
            p = self.top_p
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
                raise ConfigError(f"top_p must be in (0, 1], or None to disable it; got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n, V] -> warped probabilities [n, V] (float32, or float64 for float64 logits)."""
        if self.greedy:
            raise ConfigError("greedy decoding (temperature=0) has no sampling distribution; use argmax")
        scores = logits if logits.dtype == torch.float64 else logits.float()
        for warper in self._warpers:
            scores = warper(None, scores)
        return torch.softmax(scores, dim=-1)

    @property
    def _warpers(self) -> list:
        # Built lazily and cached on the frozen instance.
        cached = self.__dict__.get("_warpers_cache")
        if cached is None:
            cached = [TemperatureLogitsWarper(float(self.temperature))]
            if self.top_k is not None:
                cached.append(TopKLogitsWarper(self.top_k))
            if self.top_p is not None and self.top_p < 1.0:
                cached.append(TopPLogitsWarper(float(self.top_p)))
            object.__setattr__(self, "_warpers_cache", cached)
        return cached


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [n, V] -> token ids [n], one draw per row."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
