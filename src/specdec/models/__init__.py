"""Model adapters: a Hugging Face causal LM plus the KV cache it owns, with rollback."""

from specdec.models.base import ModelAdapter, Scores
from specdec.models.causal_lm import CachedCausalLM, context_length, vocab_size

__all__ = ["CachedCausalLM", "ModelAdapter", "Scores", "context_length", "vocab_size"]
