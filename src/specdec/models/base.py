"""What every model adapter returns to the decode loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scores:
    """One scoring pass: logits [M, V] and, when asked, the final hidden states [M, H] (rows as logits)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
