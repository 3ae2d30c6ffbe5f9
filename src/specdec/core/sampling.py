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

        Temperature, then top-k, then top-p (transformers' order). Only the top-k candidates are sorted
        (the whole vocabulary only for top-p without top-k): this runs for every drafted token and every
        verification pass, and sorting the whole vocabulary there costs several times more on a CPU. No
        data-dependent branch, so it also runs inside torch.compile (the slot-cache draft graph).

        Ties: tokens with equal logits are kept or dropped together, so the result depends on the logit
        values only, never on token ids. Top-k keeps every token tied with the k-th largest (as transformers'
        TopKLogitsWarper); top-p keeps a token while the mass of the tokens with a strictly larger logit is
        below top_p (transformers keeps part of a tied group straddling that boundary, chosen by sort
        order). Tests compare this with `specdec.exactness.warp.reference_warp` and with transformers.
        """
        if self.greedy:
            raise ConfigError("greedy decoding (temperature=0) has no sampling distribution; use argmax")
        scores = (logits if logits.dtype == torch.float64 else logits.float()) / self.temperature  # [n, V]
        vocab = scores.shape[-1]
        top_k = self.top_k if self.top_k is not None and self.top_k < vocab else None
        top_p = self.top_p if self.top_p is not None and self.top_p < 1.0 else None
        if top_k is None and top_p is None:
            return torch.softmax(scores, dim=-1)
        # Candidates in descending order: the top k (tokens tied with the k-th beyond them are kept by the
        # mask below), or the whole sorted vocabulary. No data-dependent branch: this also runs compiled.
        if top_k is not None:
            values, index = scores.topk(top_k, dim=-1)  # [n, k], descending
            scores = scores.masked_fill(scores < values[:, -1:], -math.inf)  # every token tied with the k-th kept
        else:
            values, index = scores.sort(dim=-1, descending=True)  # [n, V]
        probs = torch.softmax(scores, dim=-1)  # [n, V]
        if top_p is not None:
            # Keep a candidate while the mass ranked above it is below top_p (the first always), and with
            # it every token tied with the last one kept.
            kept = probs.gather(-1, index)  # [n, k], the candidates' probabilities
            above = torch.nn.functional.pad(kept.cumsum(dim=-1)[:, :-1], (1, 0))  # [n, k], non-decreasing
            last = (above < top_p).sum(dim=-1, keepdim=True) - 1  # [n, 1]: index of the last one kept
            probs = probs * (scores >= values.gather(-1, last))
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs  # [n, V]


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [n, V] (non-negative, rows need not sum to 1), uniforms [n] float64 in [0, 1) -> token ids [n].

    The first token whose cumulative mass is strictly above u * total, so a token of probability 0 is never
    drawn. No data-dependent branch: it also runs inside a compiled graph (the draft steps, the fused
    verification pass).
    """
    cdf = probs.double().cumsum(dim=-1)  # [n, V]
    index = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)  # [n, 1]
    return index.squeeze(-1).clamp_max(probs.shape[-1] - 1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [n, V] (non-negative, rows need not sum to 1) -> token ids [n], one draw per row.

    Inverse-CDF sampling with one float64 uniform per row (`inverse_cdf`). On a CPU this is several times
    cheaper than torch.multinomial for a large vocabulary, and it is on the path of every round.
    """
    uniforms = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device, generator=generator)  # [n]
    return inverse_cdf(probs, uniforms)
