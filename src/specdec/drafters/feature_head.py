"""`FeatureHeadDrafter`: what every drafter over a head that reads the target's features keeps per request.

`Eagle` and `BlockDraft` draft with a small head conditioned on the target's features. Both keep the same state:
the head's KV cache (a `DynamicCache` eagerly, a preallocated `SlotCache` on the fast path), `rows` (the cache
rows computed from target features) and `pending` (the target's features the head has not consumed yet). This
class owns that state, its sizing and its per-request life (`reset`, `fork`); the drafters own their rounds.
"""

from __future__ import annotations

import copy
from abc import abstractmethod

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.drafters.base import Drafter
from specdec.errors import ConfigError
from specdec.runtime.compiled import CACHE_ROUND, fast_path_problem, static_cache_problem
from specdec.runtime.slot_cache import SlotCache


def positive(owner: str, name: str, value: object) -> int:
    """`value`, an integer >= 1, or ConfigError naming `owner`'s argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner} {name} must be an integer >= 1, got {value!r}")
    return value


class FeatureHeadDrafter(Drafter):
    """A drafter over `head`, a module that reads the target's features and the target's embeddings and LM head.

    Subclasses call `_bind` in their constructor, say how many slots beyond the target's a round needs
    (`extra_slots`), and extend `reset` with their own per-request fields."""

    def _bind(self, target, head, head_type: type, owner: str) -> PreTrainedModel:
        """Check `head` (a `head_type` built for this target) and take the target's embeddings and LM head."""
        model: PreTrainedModel = target if isinstance(target, PreTrainedModel) else target.model  # or an adapter
        if not isinstance(head, head_type):
            name = head_type.__name__
            raise ConfigError(f"{owner} needs a specdec.{name}, got {type(head).__name__}; build one with "
                              f"specdec.{name}.init(target) or load one with specdec.{name}.load(path, target)")
        from specdec.heads.common import check_target

        check_target(head.signature, model, f"the given {head_type.__name__}")
        self.head = head.eval()
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.out_features)
        self._forwards = 0
        self._model = model
        self.mode: bool | str = False  # the decoder's compile setting (use_fast_path)
        self.slot_cache: SlotCache | None = None  # the head's cache on the fast path
        self._capacity: int | None = None
        return model

    @abstractmethod
    def extra_slots(self) -> int:
        """Head cache slots one round may take beyond the target's (its padded catch-up and drafted rows)."""

    @property
    def forwards(self) -> int:
        return self._forwards

    def use_fast_path(self, mode: bool | str) -> None:
        """The decoder's `compile` setting: True drafts with the compiled fixed-shape round, "static" runs that
        round eagerly, False keeps a dynamic cache. A target the slot cache cannot model (sliding windows), or a
        machine without a compiler, degrades the same way the target does."""
        if mode is not False:
            problem = fast_path_problem(self._model, mode is True)
            if problem is not None:
                mode = "static" if mode is True and static_cache_problem(self._model) is None else False
        self.mode = mode

    def ensure_capacity(self, tokens: int) -> None:
        """Size the head's slot cache for a request whose target needs `tokens` slots (decoder hook)."""
        self._capacity = -(-(tokens + self.extra_slots()) // CACHE_ROUND) * CACHE_ROUND

    def fork(self):
        """Another request's drafter over the same head: its own head cache and pending features."""
        twin = copy.copy(self)
        twin.slot_cache = None  # reset builds its own (a shared slot cache would mix two requests' rows)
        twin.reset(torch.zeros(1, dtype=torch.long))
        return twin

    def reset(self, prompt_ids: torch.Tensor, *, hidden: torch.Tensor | None = None) -> None:
        """hidden [n-1, F]: the target's features of prompt_ids[:-1] (F = head.feature_size)."""
        self.cache = DynamicCache()
        if self.mode is not False:
            size = self._capacity or -(-(prompt_ids.shape[0] + 512) // CACHE_ROUND) * CACHE_ROUND
            if self.slot_cache is None or self.slot_cache.max_len < size:
                self.slot_cache = SlotCache(size)
        self.rows = 0  # head cache rows computed from target features (positions 0..rows-1)
        param = self.embed.weight  # (the features' dtype and device: the target's head may be packed)
        self.pending = (torch.empty(0, self.head.feature_size, dtype=param.dtype, device=param.device)
                        if hidden is None else hidden.to(param.dtype))  # [m, F]
        self._forwards = 0
