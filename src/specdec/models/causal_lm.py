"""`CachedCausalLM`: feed tokens, get logits, roll the cache back.

The adapter owns a `transformers.DynamicCache`. Tokens are appended at explicit position ids (the cache
length), so no model file is forked and no config is touched: the model sees an ordinary incremental call.
Rolling back after a rejection crops the cache (`DynamicCache.crop` takes the negative count to drop);
nothing is ever recomputed from the prompt.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.errors import NumericalError, UnsupportedModelError
from specdec.models.base import Scores


def vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's logits."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's position scheme supports, or None if unbounded/unknown."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_rollback_support(model: PreTrainedModel) -> None:
    """Raise unless `model` is a causal LM whose KV cache is a croppable DynamicCache."""
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a Hugging Face causal LM with an LM head; "
            "load it with AutoModelForCausalLM (or specdec.load)"
        )
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps a recurrent state that cannot be rolled back to an earlier "
            "token, so draft tokens cannot be verified and undone; use an attention model as target "
            "and draft (Llama, Qwen2, Mistral, GPT-2, ...)"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; specdec drives decoder-only causal LMs"
        )


class CachedCausalLM:
    """A causal LM and its KV cache. `length` tokens are in the cache."""

    def __init__(self, model: PreTrainedModel):
        check_rollback_support(model)
        self.model = model
        self.vocab_size = vocab_size(model)
        self.device = next(model.parameters()).device
        self.cache = DynamicCache()
        self.length = 0
        self.forwards = 0  # decoding forward passes since reset (prefill not counted)
        self.forward_s = 0.0  # wall time spent in them
        self.prefill_s = 0.0

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.length = 0
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append input_ids [n] to the cache; return logits [n, V] (or [1, V] with last_only)."""
        return self.score(input_ids, last_only=last_only).logits

    def score(self, input_ids: torch.Tensor, *, hidden: bool = False, last_only: bool = False) -> Scores:
        """Append input_ids [M]; logits [M, V] and, with `hidden`, the final hidden states [M, H]."""
        start = time.perf_counter()
        scores = self._run(input_ids, last_only, hidden)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return scores

    def prefill(self, input_ids: torch.Tensor, hidden: bool = False) -> torch.Tensor | None:
        """Cache input_ids [n] (n may be 0); not a decoding forward. Returns hidden [n, H] when asked."""
        if not input_ids.shape[-1]:
            if not hidden:
                return None
            size = self.model.config.get_text_config().hidden_size
            return torch.empty(0, size, dtype=next(self.model.parameters()).dtype, device=self.device)
        start = time.perf_counter()
        scores = self._run(input_ids, last_only=not hidden, hidden=hidden)
        self.prefill_s += time.perf_counter() - start
        return scores.hidden

    @torch.inference_mode()
    def _run(self, input_ids: torch.Tensor, last_only: bool, hidden: bool = False) -> Scores:
        n = input_ids.shape[-1]
        positions = torch.arange(self.length, self.length + n, device=self.device)  # [n]
        out = self.model(
            input_ids=input_ids.view(1, n).to(self.device),
            position_ids=positions[None],
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=hidden,
        )
        self.cache = out.past_key_values
        self.length += n
        logits = out.logits[0]  # [n or 1, V]
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        if not bool(torch.isfinite(logits).all()):
            raise NumericalError(
                f"{type(self.model).__name__} produced NaN or infinite logits at positions "
                f"{self.length - n}..{self.length - 1}; this usually means float16 overflow or broken "
                "weights: load the model in float32 or bfloat16"
            )
        # The last hidden state is the LM head's input (post final norm) in HF causal LMs.
        return Scores(logits, out.hidden_states[-1][0] if hidden else None)

    def crop(self, length: int) -> None:
        """Roll the cache back to its first `length` tokens."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length
