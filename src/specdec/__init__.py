"""specdec: exact speculative decoding for Hugging Face causal language models.

    out = specdec.generate(target, prompt_ids, drafter=specdec.DraftModel(draft), gamma=4)
    out.tokens, out.stats.acceptance_rate, out.stats.mean_accepted_tokens
"""

from specdec.adaptive import AdaptiveGamma
from specdec.decoding import DEFAULT_GAMMA, GenerationOutput, SpeculativeDecoder, generate, stream
from specdec.drafters import (
    Bigram, Drafter, DraftModel, DraftTree, Eagle, LayerSkip, Medusa, MultiDraft, PromptLookup, Proposal,
)
from specdec.errors import (
    ConfigError,
    IncompatibleModelsError,
    ModelLoadError,
    NumericalError,
    PromptError,
    ProposalError,
    SpecdecError,
    UnsupportedModelError,
)
from specdec.heads import EagleHead, MedusaHeads
from specdec.loading import load
from specdec.models.static_lm import FastPathWarning, StaticCausalLM
from specdec.sampling import SamplingConfig
from specdec.stats import DecodeStats, expected_speedup, expected_tokens_per_pass
from specdec.tree import TreeMask
from specdec.text import TextOutput, generate_text, stream_text

__version__ = "0.1.0"


def load_default_heads(*args, **kwargs):
    """{"eagle": EagleHead, "medusa": MedusaHeads}: the heads shipped for the default target."""
    from specdec.default_pair import load_default_heads as _load_default_heads

    return _load_default_heads(*args, **kwargs)


def train_head(*args, **kwargs):
    """Train an EAGLE head or Medusa heads on a frozen target (see specdec.training.heads.train_head)."""
    from specdec.training.heads import train_head as _train_head

    return _train_head(*args, **kwargs)


def load_default(*args, **kwargs):
    """(target, draft, tokenizer): the default pair shipped with specdec, trained on Python's stdlib."""
    from specdec.default_pair import load_default as _load_default

    return _load_default(*args, **kwargs)


__all__ = [
    "AdaptiveGamma", "Bigram", "DraftTree", "Eagle", "EagleHead", "LayerSkip", "Medusa", "MedusaHeads", "MultiDraft",
    "PromptLookup", "ProposalError", "TreeMask", "FastPathWarning", "StaticCausalLM",
    "DEFAULT_GAMMA", "ConfigError", "DecodeStats", "DraftModel", "Drafter", "GenerationOutput",
    "IncompatibleModelsError", "ModelLoadError", "NumericalError", "PromptError", "Proposal",
    "SamplingConfig", "SpecdecError", "SpeculativeDecoder", "TextOutput", "UnsupportedModelError",
    "expected_speedup", "expected_tokens_per_pass", "generate", "generate_text", "load", "load_default", "load_default_heads",
    "stream", "stream_text", "train_head",
]
