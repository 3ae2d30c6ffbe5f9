"""A large model's compiled passes trace and compile its decoder layer once per shape, not once per layer.

A transformer's layers are one module class called N times, and a whole-model graph unrolls them: dynamo traces N
copies of the layer, and inductor lowers, schedules and generates code for each. At the Qwen2.5-1.5B shape (28
layers, float32 on bfloat16 packed weights, one Zen 3 core) plain decoding's first request spent 84.9 s compiling its
two passes. Marked as a nested compile region (`torch.compiler.nested_compile_region`), the layer is traced once and
stamped out for the other layers, and inductor compiles its body once: 36.8 s for the same request, for a decoding
step 3.5% slower (docs/fastpath.md, "One graph per layer").

Dynamo reuses a region only when it takes tensors, constants and modules, so while a pass compiles (`routed`)
each layer is called through `_layer_call`: it passes the region that layer's keys and values of the slot cache and
the pass's slots as tensors, and the region hands the layer a `LayerSlots`, a one-layer view of the cache written at
those slots. Eager calls (and models on any other cache) run the layer's own forward.

What it gives up: the layers' weights stay inputs of the graph (a region that reads one layer's parameters as
constants cannot serve another layer), so nothing is frozen and `runtime/fuse_linears.py` neither fuses nor packs
their linears (`compiled.LAYER_GRAPH_OPTIONS`), and inductor's C++ wrapper does not take nested regions, so a Python
wrapper calls the kernels. Together 3.5% of a step at 1.5B; a small model's passes take a few milliseconds, where
such per-pass costs weigh more and a compile is short anyway, so only models of at least `LAYER_GRAPHS_MIN_BYTES` of
parameters and buffers compile this way.
Every compiled pass of one model object is compiled the same way, so a row gets the same bits in each of them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from specdec.runtime.rowwise import row_invariant
from specdec.runtime.slot_cache import SlotCache, write_slots

#: Models with at least this many bytes of parameters and buffers compile their layer once (the default pair's
#: target, 28 MB in bfloat16, compiles whole; the size ladder's smallest shape, Qwen2.5-0.5B, holds 1 GB in bfloat16).
LAYER_GRAPHS_MIN_BYTES = 256 << 20


class LayerRegions:
    """The decoder layers of a model that its compiled passes trace as one region (its one stack of transformers'
    layer modules, at least two, all of one class; index i is layer i of the cache), none when it compiles whole:
    smaller than LAYER_GRAPHS_MIN_BYTES, or without one such stack (an encoder-decoder's two, a draft head's one
    layer)."""

    def __init__(self, model: torch.nn.Module):
        nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        stacks = [tuple(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) >= 2
                  and all(isinstance(layer, GradientCheckpointingLayer) for layer in m)]
        layers = stacks[0] if len(stacks) == 1 and len({type(m) for m in stacks[0]}) == 1 else ()
        if nbytes < LAYER_GRAPHS_MIN_BYTES:
            layers = ()
        self.layers = layers
        # Made once and kept: dynamo drops a compiled graph when an object its guards saw is freed, these included.
        self.calls = tuple(functools.partial(_layer_call, layer, i) for i, layer in enumerate(layers))

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextlib.contextmanager
    def routed(self):
        """While a pass compiles: each layer (index i in the cache) called through `_layer_call`, an attribute of
        the module for this block alone."""
        for layer, call in zip(self.layers, self.calls):
            layer.forward = call
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward


class LayerSlots:
    """One layer of a `SlotCache` inside the region: its keys and values [*lead, L, D], written at slots [M] (as
    `SlotLayer.update` writes them)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
        self.keys, self.values, self.slots = keys, values, slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return write_slots(self.keys, self.values, self.slots, key_states, value_states)


@torch.compiler.nested_compile_region
def _region(layer, keys, values, slots, cache_name: str, spec: str, *leaves):
    # A region is traced apart from the pass around it, outside the pass's torch-function mode: it enters the mode
    # every compiled pass runs under (`run_model`), so its attention and linears run the row-invariant kernels.
    args, kwargs = _unflatten(spec, leaves)
    with row_invariant(linear=True):
        return type(layer).forward(layer, *args, **kwargs, **{cache_name: LayerSlots(keys, values, slots)})


def _flatten(args: tuple, kwargs: dict) -> tuple[str, list]:
    """A layer call's arguments as a flat list of leaves and a string that rebuilds them (`_unflatten`): one field
    per argument, its keyword (empty for a positional one) and, for a tuple, `*` and its length. Dynamo matches a
    region whose inputs are all leaves (tensors, constants, modules) to the one it traced without flattening them
    itself, which took 77 ms a layer call: 6.5 s of a self-drafted 1.5B target's first request on a Zen 2 core."""
    fields, leaves = [], []
    for name, value in [*(("", arg) for arg in args), *kwargs.items()]:
        split = type(value) is tuple  # a named tuple travels whole, its type kept
        fields.append(f"{name}*{len(value)}" if split else name)
        leaves.extend(value if split else (value,))
    return ",".join(fields), leaves


def _unflatten(spec: str, leaves: tuple) -> tuple[tuple, dict]:
    args, kwargs, at = [], {}, 0
    for field in spec.split(",") if spec else ():
        name, star, width = field.partition("*")
        size = int(width) if star else 1
        value = tuple(leaves[at:at + size]) if star else leaves[at]
        at += size
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def _layer_call(layer: torch.nn.Module, index: int, *args, **kwargs):
    """Layer `index`'s forward: through the region while compiling on a slot cache, else its own."""
    cache_name = next((name for name, value in kwargs.items() if isinstance(value, SlotCache)), None)
    if cache_name is None or not torch.compiler.is_compiling():
        return type(layer).forward(layer, *args, **kwargs)
    cache = kwargs.pop(cache_name)
    own = cache.layers[index]
    spec, leaves = _flatten(args, kwargs)
    return _region(layer, own.keys, own.values, cache.slots, cache_name, spec, *leaves)
