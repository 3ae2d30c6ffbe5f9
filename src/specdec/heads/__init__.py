"""Draft heads that read the target's own features: EAGLE (`EagleHead`), Medusa (`MedusaHeads`) and the DFlash
block drafter (`DFlashHead`)."""

from __future__ import annotations

from specdec.heads.dflash import DFlashHead
from specdec.heads.eagle import EagleHead
from specdec.heads.medusa import MedusaHeads

__all__ = ["DFlashHead", "EagleHead", "MedusaHeads"]
