"""Sampling settings and the warp that turns logits into the distribution we sample from.

The same warp (temperature, then top-k, then top-p: the order `transformers.generate` uses) is applied to
the target's and the drafter's logits, so the guarantee is exactness with respect to the *warped* target.
Temperature 0 means greedy: no probabilities, only argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
        """logits [n, V] -> warped probabilities [n, V] (float32, or float64 for float64 logits).

        Same distribution as transformers' Temperature → TopK → TopP warpers followed by a softmax (a
        test checks this), computed over the top-k (or sorted) candidates only: this runs for every
        drafted token and every verification pass, and masking and sorting the whole vocabulary there
        costs several times more on a CPU. (With exact ties at the k-th logit, HF keeps all tied tokens;
        this keeps k.)
        """
        if self.greedy:
            raise ConfigError("greedy decoding (temperature=0) has no sampling distribution; use argmax")
        scores = (logits if logits.dtype == torch.float64 else logits.float()) / self.temperature  # [n, V]
        vocab = scores.shape[-1]
        top_p = self.top_p if self.top_p is not None and self.top_p < 1.0 else None
        if self.top_k is not None and self.top_k < vocab:
            values, index = scores.topk(self.top_k, dim=-1)  # [n, k], descending
        elif top_p is not None:
            values, index = scores.sort(dim=-1, descending=True)  # [n, V]
        else:
            return torch.softmax(scores, dim=-1)
        kept = torch.softmax(values, dim=-1)  # [n, k]
        if top_p is not None:
            # Keep a candidate while the mass ranked strictly above it is below top_p (the first always).
            above = kept.cumsum(dim=-1) - kept  # [n, k]
            kept = kept * (above < top_p)
            kept = kept / kept.sum(dim=-1, keepdim=True)
        return torch.zeros_like(scores).scatter_(-1, index, kept)  # [n, V]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [n, V] (non-negative, rows need not sum to 1) -> token ids [n], one draw per row.

    Inverse-CDF sampling with one float64 uniform per row: a token of probability 0 is never drawn (the
    search is for the first cumulative mass strictly above u * total). On a CPU this is several times
    cheaper than torch.multinomial for a large vocabulary, and it is on the path of every round.
    """
    cdf = probs.double().cumsum(dim=-1)  # [n, V]
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator)  # [n, 1]
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [n, 1]
    return index.squeeze(-1).clamp_max(probs.shape[-1] - 1)
