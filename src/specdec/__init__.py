"""specdec: exact speculative decoding for Hugging Face causal language models.

    out = specdec.generate(target, prompt_ids, drafter=specdec.DraftModel(draft), gamma=4)
    out.tokens, out.stats.acceptance_rate, out.stats.mean_accepted_tokens
"""

from specdec.adaptive import AdaptiveGamma
from specdec.batch import BatchDecoder, generate_batch
from specdec.decoding import DEFAULT_GAMMA, GenerationOutput, SpeculativeDecoder, generate, stream
from specdec.drafters import Bigram, Drafter, DraftModel, LayerSkip, PromptLookup, Proposal
from specdec.errors import (
    ConfigError,
    IncompatibleModelsError,
    ModelLoadError,
    NumericalError,
    PromptError,
    SpecdecError,
    UnsupportedModelError,
)
from specdec.loading import load
from specdec.sampling import SamplingConfig
from specdec.stats import DecodeStats, expected_speedup, expected_tokens_per_pass
from specdec.text import TextOutput, generate_text, stream_text

__version__ = "0.1.0"


def load_default(*args, **kwargs):
    """(target, draft, tokenizer): the default pair shipped with specdec, trained on Python's stdlib."""
    from specdec.default_pair import load_default as _load_default

    return _load_default(*args, **kwargs)


__all__ = [
    "AdaptiveGamma", "BatchDecoder", "Bigram", "LayerSkip", "PromptLookup",
    "DEFAULT_GAMMA", "ConfigError", "DecodeStats", "DraftModel", "Drafter", "GenerationOutput",
    "IncompatibleModelsError", "ModelLoadError", "NumericalError", "PromptError", "Proposal",
    "SamplingConfig", "SpecdecError", "SpeculativeDecoder", "TextOutput", "UnsupportedModelError",
    "expected_speedup", "expected_tokens_per_pass", "generate", "generate_batch", "generate_text", "load", "load_default",
    "stream", "stream_text",
]
