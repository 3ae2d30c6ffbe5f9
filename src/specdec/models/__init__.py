"""Model adapters: a Hugging Face causal LM plus the KV cache it owns, with rollback (eager DynamicCache,
or the fast path's slot cache with compiled passes)."""

from specdec.models.base import ModelAdapter, Scores
from specdec.models.causal_lm import CachedCausalLM, context_length, vocab_size
from specdec.models.static_lm import FastPathWarning, SlotCache, StaticCausalLM

__all__ = ["CachedCausalLM", "FastPathWarning", "ModelAdapter", "Scores", "SlotCache", "StaticCausalLM",
           "context_length", "vocab_size"]
