"""Attention masks as the models take them: a boolean visibility pattern turned into an additive float mask."""

from __future__ import annotations

import torch


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """visible [..., M, L] bool (True = attend) -> the additive mask of the same shape, dtype and device: 0 where
    visible, the dtype's most negative value elsewhere (additive, so the eager and sdpa attention paths agree)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)
