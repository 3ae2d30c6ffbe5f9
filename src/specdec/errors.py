"""Exceptions: every bad input raises one of these, with the problem and the fix in the message."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class of every error specdec raises on purpose."""


class ConfigError(SpecdecError, ValueError):
    """A decoding argument is out of range (gamma, temperature, top_k, top_p, max_new_tokens...)."""


class PromptError(SpecdecError, ValueError):
    """The prompt is empty, has ids outside the vocabulary, or does not fit the model's context."""


class IncompatibleModelsError(SpecdecError, ValueError):
    """Draft and target cannot be paired (different vocabularies)."""


class UnsupportedModelError(SpecdecError, TypeError):
    """A model specdec cannot drive (no rollback-able KV cache, not a causal LM)."""


class ModelLoadError(SpecdecError, OSError):
    """A model path or hub id that cannot be loaded."""


class NumericalError(SpecdecError, FloatingPointError):
    """A model produced NaN or infinite logits."""


class ProposalError(SpecdecError, ValueError):
    """A drafter returned a malformed proposal (tree shape, token ids, draft probabilities)."""
