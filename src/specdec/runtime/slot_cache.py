"""The fast path's KV cache: `SlotCache`, a preallocated `transformers.Cache` written at explicit slots, and
`run_model`, one model pass over it.

The cache (passed as the forward's cache keyword; no model file forked, nothing written on the config) holds
`max_len` slots per layer, allocated once. A call writes its rows at explicit slots (`cache.slots`), and every
query row gets an explicit additive mask over all `max_len` slots, so a rollback is only a move of a length
pointer: stale slots are hidden by the mask and overwritten by the next write. Keeping a non-prefix path of a
tree (`SlotCache.move`) is one index copy. Used by `StaticCausalLM`, `StaticBatchedCausalLM` (rows of a
batch) and the EAGLE head's fixed-shape round. `POOL` keeps the caches of requests that ended for the next
request of the same model and size.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.core.masks import additive_mask
from specdec.runtime.rowwise import argmax_finite, load_kernel, row_invariant
from specdec.runtime.base import as_float_logits, cache_kwarg, select_hidden


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values: [1, heads, max_len, head_dim], written at the owner's `slots`."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(LayerLayout(tuple(key_states.shape[:2]), key_states.shape[-1], value_states.shape[-1],
                                  key_states.dtype, key_states.device))

    def allocate(self, layout: LayerLayout) -> None:
        """Zeroed keys [*lead, max_len, key_dim] and values [*lead, max_len, value_dim]."""
        shape = (*layout.lead, self.owner.max_len)
        self.dtype, self.device = layout.dtype, layout.device
        self.keys = static_address(torch.zeros((*shape, layout.key_dim), dtype=layout.dtype, device=layout.device))
        self.values = static_address(torch.zeros((*shape, layout.value_dim), dtype=layout.dtype,
                                                 device=layout.device))
        self.is_initialized = True

    def first_rows(self, owner: SlotCache, rows: int) -> SlotLayer:
        """A layer of `owner` over the first `rows` rows of this one's buffers (the same memory, no copy)."""
        layer = SlotLayer(owner)
        layer.keys, layer.values = static_address(self.keys[:rows]), static_address(self.values[:rows])
        layer.dtype, layer.device, layer.is_initialized = self.dtype, self.device, True
        return layer

    @property
    def layout(self) -> LayerLayout:
        return LayerLayout(tuple(self.keys.shape[:2]), self.keys.shape[-1], self.values.shape[-1], self.dtype,
                           self.device)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return write_slots(self.keys, self.values, self.owner.slots, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_len, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.max_len


def static_address(buffer: torch.Tensor) -> torch.Tensor:
    """`buffer`, marked for compiled passes as living at one address across their calls when it is a CUDA tensor:
    a pass that writes it can then run as a CUDA graph (runtime/compiled.py, CUDA_GRAPHS), writing it where it is
    instead of skipping the graph. On a CPU the mark would make it a constant that freezing folds, so none there."""
    if buffer.device.type == "cuda":
        torch._dynamo.mark_static_address(buffer)
    return buffer


def write_slots(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, key_states: torch.Tensor,
                value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write key_states / value_states [*lead, M, D] into keys / values [*lead, L, D] at slots [M]; return both."""
    keys.index_copy_(2, slots, key_states)
    values.index_copy_(2, slots, value_states)
    return keys, values


@dataclass(frozen=True)
class LayerLayout:
    """What a layer's keys and values look like, less the slots: [*lead, max_len, key_dim] and
    [*lead, max_len, value_dim] of `dtype` on `device` (lead = (batch, kv heads))."""

    lead: tuple[int, ...]
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device


class SlotCache(Cache):
    """A preallocated KV cache written at explicit slots. `length` (slots in use once the current write is
    done) is bookkeeping for models that ask; the masks alone decide what a query sees."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.slots = torch.zeros(1, dtype=torch.long)
        super().__init__(layers=[])

    @property
    def ready(self) -> bool:
        """Every layer allocated (by a first, eager write): from then on a pass can run compiled."""
        return bool(self.layers) and all(layer.is_initialized for layer in self.layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # layers appear on the first (eager) pass
            self.layers.append(SlotLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    def allocate(self, layouts: Sequence[LayerLayout]) -> None:
        """Allocate every layer now, as a first write would: the cache is `ready` before any pass, so a compiled
        adapter runs every pass of a request compiled, the first one too."""
        with torch.inference_mode():
            for layout in layouts:
                layer = SlotLayer(self)
                layer.allocate(layout)
                self.layers.append(layer)

    @torch.inference_mode()
    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy slots src [k] to slots dst [k] in every layer (the accepted path of a tree)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[:, :, dst] = layer.keys[:, :, src]
                layer.values[:, :, dst] = layer.values[:, :, src]


class CachePool:
    """Allocated caches of requests that ended, kept per model object for the next request of the same size
    (`take`; an adapter gives its cache back when it is dropped). A new cache's memory is fresh pages, which its
    first writes fault in: for the default target in bfloat16, 12 layer tensors of 384 KiB cost ~1.7 ms a request,
    3% of one. A reused cache is zeroed, so a request sees exactly what a new cache would give it."""

    def __init__(self, keep: int = 2):
        self.keep = keep  # caches kept per model
        self._lock = threading.Lock()
        self._free: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [SlotCache]

    def take(self, model, size: int) -> SlotCache:
        """An allocated, zeroed cache of `size` slots for `model`'s layers."""
        with self._lock:
            free = self._free.get(model, [])
            cache = next((c for c in free if c.max_len == size), None)
            if cache is not None:
                free.remove(cache)
        if cache is None:
            cache = SlotCache(size)
            cache.allocate(kv_layout(model))
        else:
            with torch.inference_mode():
                cache.reset()
            cache.length = 0
        return cache

    def held(self, model) -> list[SlotCache]:
        """The caches kept for `model` now."""
        with self._lock:
            return list(self._free.get(model, []))

    def give_back(self, model_ref: weakref.ref, cache: SlotCache) -> None:
        """Keep `cache` for the model `model_ref` names (while it lives), up to `keep` caches."""
        model = model_ref()
        if model is None:
            return
        with self._lock:
            free = self._free.setdefault(model, [])
            if len(free) < self.keep:
                free.append(cache)


POOL = CachePool()


#: model -> its layers' layouts, found once per model object (`kv_layout`).
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kv_layout(model) -> tuple[LayerLayout, ...]:
    """The layouts of `model`'s cache layers for one sequence: read once per model object from one eager
    one-token pass into a one-slot cache (whatever the architecture names its heads and dims). The pass asks for
    hidden states, so that transformers installs its hidden-state hooks eagerly: a compiled first pass that asks
    cannot (a lock)."""
    if model not in _LAYOUTS:
        probe = SlotCache(1)
        device = next(model.parameters()).device
        with torch.inference_mode():
            zero = torch.zeros((1, 1), dtype=torch.long, device=device)
            run_model(model, zero, zero, zero[0], None, probe, True, keep=1)
        _LAYOUTS[model] = tuple(layer.layout for layer in probe.layers)
    return _LAYOUTS[model]


def run_model(model, input_ids, position_ids, slots, mask, cache, hidden: bool, keep: int = 0):
    """One pass: input_ids [1, M] at position_ids [1, M], written to cache slots [M]; mask [1, 1, M, L]
    additive, or None for a chain (row i sees slots <= slots[i]). Returns logits [M, V] (the last `keep` rows
    only when keep > 0: a prefill needs none of the others), hidden | None, whether every logit is finite, and
    each row's argmax [M] (unspecified where a logit is not finite), both from one read of the logits."""
    cache.slots = slots
    if not torch.compiler.is_compiling():  # eager only: for models that ask the cache its length; the kernel
        cache.length = int(slots[-1]) + 1
        load_kernel()
    if mask is None:
        visible = torch.arange(cache.max_len, device=slots.device)[None, :] <= slots[:, None]  # [M, L]
        mask = additive_mask(visible, model.dtype)[None, None]  # [1, 1, M, L]
    with row_invariant(linear=True):  # each row's logits as a one-row pass would give them
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                    **cache_kwarg(model, cache), use_cache=True, output_hidden_states=bool(hidden),
                    logits_to_keep=keep)
    best, finite = argmax_finite(out.logits[0])  # [M], []: in the model's dtype (widening changes neither)
    logits = as_float_logits(out.logits[0])  # [M, V]
    states = select_hidden(out.hidden_states, hidden) if hidden else None  # [M, H] (or [M, len * H])
    return logits, states, finite, best
