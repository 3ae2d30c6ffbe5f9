"""Model adapters: a Hugging Face causal LM plus the KV cache it owns, with rollback (eager DynamicCache,
or the fast path's slot cache with compiled passes)."""

from specdec.models.causal_lm import CachedCausalLM, context_length, vocab_size
from specdec.models.static_lm import FastPathWarning, Scores, SlotCache, StaticCausalLM

__all__ = ["CachedCausalLM", "FastPathWarning", "Scores", "SlotCache", "StaticCausalLM", "context_length",
           "vocab_size"]
