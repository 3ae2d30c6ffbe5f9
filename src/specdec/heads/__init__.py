"""Draft heads that read the target's own features: EAGLE (`EagleHead`) and Medusa (`MedusaHeads`)."""

from __future__ import annotations

from specdec.heads.eagle import EagleHead
from specdec.heads.medusa import MedusaHeads

__all__ = ["EagleHead", "MedusaHeads"]
