"""specdec: exact speculative decoding for Hugging Face causal language models.

    out = specdec.generate(target, prompt_ids, drafter=specdec.DraftModel(draft), gamma=4)
    out.tokens, out.stats.acceptance_rate, out.stats.mean_accepted_tokens

Public names are imported on first use (PEP 562), so `import specdec` and `specdec --help` do not load
torch or transformers until something needs them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS = {
    "AdaptiveGamma": "specdec.engine.adaptive",
    "HeuristicGamma": "specdec.engine.adaptive",
    "DEFAULT_GAMMA": "specdec.engine.policies",
    "DecodeOptions": "specdec.engine.options",
    "GenerationOutput": "specdec.engine.request",
    "SpeculativeDecoder": "specdec.engine.decoding",
    "generate": "specdec.engine.decoding",
    "stream": "specdec.engine.decoding",
    "BatchDecoder": "specdec.engine.batch",
    "generate_batch": "specdec.engine.batch",
    "Bigram": "specdec.drafters",
    "DraftTree": "specdec.drafters",
    "MultiDraft": "specdec.drafters",
    "Eagle": "specdec.drafters",
    "Medusa": "specdec.drafters",
    "Mtp": "specdec.drafters",
    "BlockDraft": "specdec.drafters",
    "ParallelDraft": "specdec.drafters",
    "DFlashHead": "specdec.heads",
    "EagleHead": "specdec.heads",
    "MedusaHeads": "specdec.heads",
    "FastPathWarning": "specdec.runtime.compiled",
    "StaticCausalLM": "specdec.runtime.static_lm",
    "TreeMask": "specdec.core.tree",
    "ProposalError": "specdec.errors",
    "Drafter": "specdec.drafters",
    "DraftModel": "specdec.drafters",
    "LayerSkip": "specdec.drafters",
    "SelfDraft": "specdec.drafters",
    "PromptLookup": "specdec.drafters",
    "Proposal": "specdec.drafters",
    "SuffixDecoding": "specdec.drafters",
    "SuffixCache": "specdec.drafters",
    "ConfigError": "specdec.errors",
    "IncompatibleModelsError": "specdec.errors",
    "ModelLoadError": "specdec.errors",
    "NumericalError": "specdec.errors",
    "PromptError": "specdec.errors",
    "SpecdecError": "specdec.errors",
    "UnsupportedModelError": "specdec.errors",
    "load": "specdec.hub.loading",
    "frequent_tokens": "specdec.hub.frequency",
    "SamplingConfig": "specdec.core.sampling",
    "DecodeStats": "specdec.core.stats",
    "expected_speedup": "specdec.core.stats",
    "expected_tokens_per_pass": "specdec.core.stats",
    "SelfDraftChoice": "specdec.engine.self_draft_choice",
    "choose_self_draft": "specdec.engine.self_draft_choice",
    "TextOutput": "specdec.engine.text",
    "generate_text": "specdec.engine.text",
    "stream_text": "specdec.engine.text",
    "set_threads": "specdec.runtime.threads",
    "load_default_seq2seq": "specdec.hub.default_pair",
    "check_exactness": "specdec.exactness",
    "check_greedy": "specdec.exactness",
}


def load_default_heads(*args, **kwargs):
    """{"eagle": EagleHead, "medusa": MedusaHeads}: the heads shipped for the default target."""
    from specdec.hub.default_pair import load_default_heads as _load_default_heads

    return _load_default_heads(*args, **kwargs)


def train_head(*args, **kwargs):
    """Train an EAGLE head or Medusa heads on a frozen target (see specdec.training.heads.train_head)."""
    from specdec.training.heads import train_head as _train_head

    return _train_head(*args, **kwargs)


def load_default(*args, **kwargs):
    """(target, draft, tokenizer): the default pair shipped with specdec, trained on Python's stdlib."""
    from specdec.hub.default_pair import load_default as _load_default

    return _load_default(*args, **kwargs)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted([*_EXPORTS, "load_default", "load_default_heads", "train_head"])
