"""Drafters: every way of proposing tokens, behind one small interface (`Drafter`)."""

from __future__ import annotations

from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.draft_model import DraftModel
from specdec.errors import ConfigError

#: Names accepted by `make_drafter` and the CLI's --drafter.
DRAFTER_KINDS = ("draft",)


def make_drafter(kind: str, target=None, draft=None, **options) -> Drafter:
    """Build a drafter by name: "draft" (a separate draft model)."""
    if kind == "draft":
        if draft is None:
            raise ConfigError("--drafter draft needs a draft model: pass --draft PATH (or draft=model)")
        return DraftModel(draft)
    raise ConfigError(f"unknown drafter {kind!r}; choose one of: {', '.join(DRAFTER_KINDS)}")


__all__ = ["DRAFTER_KINDS", "Drafter", "DraftModel", "Proposal", "make_drafter"]
