"""`LayerSkip`: self-speculation with the target's first k decoder layers, its final norm and its LM head.

No second model is loaded and nothing of the target is modified. The drafter runs the target's *own*
forward code on a **shallow view** of it:

    view        = a new object of the target's class, sharing its __dict__ entries (config, flags) and its
                  submodules, except that its base-model submodule is replaced by
    base view   = a new object of the base model's class (LlamaModel, GPT2Model, ...) whose layer list is a
                  new nn.ModuleList holding the first k of the target's layer modules (the same objects).

Both views get their own copies of the module bookkeeping dicts (`_modules`, `_parameters`, `_buffers`,
hooks), so the target's module tree is never touched: `target.model.layers` stays the full list, and the
shared `config` is only read (`num_hidden_layers` still says the full depth; the base models loop over
`self.layers[: config.num_hidden_layers]`, which on a k-long list is the k layers). Weights are shared, not
copied. Because nothing is swapped in and out, the target may run concurrently with the drafter (e.g.
another request on another thread) and always sees all its layers. Architecture details in the base
model's forward (rotary embeddings, causal / sliding-window masks, Gemma's embedding scale, the LM head's
logit soft-capping, ...) are whatever the model's own code does, so they are right by construction.

The drafter owns its own DynamicCache (via `CachedCausalLM`), holding k layers of keys/values, and drafts
exactly like `DraftModel`: argmax at T = 0 (point mass), sampling from its warped distribution at T > 0.

Supported: models whose base model keeps its decoder layers in an nn.ModuleList named `layers`
(Llama, Qwen2, Mistral, Gemma, Phi-3, ...) or `h` (GPT-2, GPT-J, ...) and iterates over that list in its
forward; this is checked with a one-token dry run at construction (UnsupportedModelError otherwise).
Models wrapped by accelerate hooks (device_map) keep the hooks of their layers; the base model's own
top-level hook is bypassed in the view.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from specdec.drafters.draft_model import DraftModel
from specdec.errors import ConfigError, UnsupportedModelError
from specdec.runtime.base import cache_kwarg
from specdec.runtime.causal_lm import CachedCausalLM, check_rollback_support

#: Attribute names under which base models keep their decoder layers.
LAYER_LIST_NAMES = ("layers", "h")


def _shallow_view(module: nn.Module, replace: dict[str, nn.Module]) -> nn.Module:
    """A new instance of module's class sharing its attributes and submodules, with `replace` substituted
    among its direct submodules. `module` itself is not modified."""
    view = object.__new__(type(module))
    for key, value in module.__dict__.items():
        # Own copies of the bookkeeping containers (_modules, _parameters, _buffers, hook dicts, ...), so
        # that nothing done to the view can reach the original; tensors and modules inside are shared.
        if isinstance(value, (dict, set, list)):
            value = copy.copy(value)
        view.__dict__[key] = value
    # accelerate installs an instance-level `forward` bound to the original module, and Module.compile()
    # caches a compiled call of the original: the view must run its class's forward on itself.
    view.__dict__.pop("forward", None)
    if "_compiled_call_impl" in view.__dict__:
        view.__dict__["_compiled_call_impl"] = None
    for name, sub in replace.items():
        if name not in view._modules:
            raise UnsupportedModelError(f"{type(module).__name__} has no submodule {name!r}")
        view._modules[name] = sub
    return view


def _locate_layers(model: PreTrainedModel) -> tuple[str, nn.Module, str, nn.ModuleList]:
    """(base attribute name, base model, layer-list attribute name, layer list) of a causal LM."""
    prefix = getattr(model, "base_model_prefix", "")
    base = model._modules.get(prefix) if prefix else None
    if base is not None:
        for name in LAYER_LIST_NAMES:
            layers = base._modules.get(name)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return prefix, base, name, layers
    raise UnsupportedModelError(
        f"LayerSkip cannot find the decoder layers of {type(model).__name__}: it supports causal LMs whose "
        f"base model (model.<base_model_prefix>) keeps them in an nn.ModuleList named "
        f"{' or '.join(repr(n) for n in LAYER_LIST_NAMES)} (Llama, Qwen2, Mistral, Gemma, GPT-2, ...); "
        "use specdec.DraftModel or specdec.PromptLookup for this model"
    )


def shallow_layer_view(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A view of causal LM `model` that runs only its first `num_layers` decoder layers (weights shared)."""
    prefix, base, name, layers = _locate_layers(model)
    base_view = _shallow_view(base, {name: nn.ModuleList(list(layers)[:num_layers])})
    return _shallow_view(model, {prefix: base_view})


class LayerSkip(DraftModel):
    """Draft with the target's first `num_layers` decoder layers + final norm + LM head (its own KV cache).

    num_layers: in [1, L) for a target of L layers; default L // 2.
    """

    def __init__(self, target: PreTrainedModel | CachedCausalLM, num_layers: int | None = None):
        model = target.model if isinstance(target, CachedCausalLM) else target
        check_rollback_support(model)
        _, _, _, layers = _locate_layers(model)
        total = len(layers)
        if total < 2:
            raise ConfigError(f"LayerSkip needs a target with at least 2 decoder layers; it has {total}")
        if num_layers is None:
            num_layers = max(1, total // 2)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < total:
            raise ConfigError(
                f"num_layers (decoder layers the drafter keeps) must be an integer in [1, {total - 1}] for this "
                f"{total}-layer target, got {num_layers!r}"
            )
        self.target_model = model
        self.num_layers = num_layers
        self.total_layers = total
        view = shallow_layer_view(model, num_layers)
        _dry_run(view, num_layers)
        super().__init__(view)

    @property
    def name(self) -> str:
        return f"LayerSkip({self.num_layers}/{self.total_layers})"


def _dry_run(view: PreTrainedModel, num_layers: int) -> None:
    """One token through the view: it must run and fill exactly num_layers cache layers."""
    device = next(view.parameters()).device
    cache = DynamicCache()
    try:
        with torch.inference_mode():
            view(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), **cache_kwarg(view, cache),
                 use_cache=True, logits_to_keep=1)
    except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise UnsupportedModelError(
            f"LayerSkip could not run the first {num_layers} layers of {type(view).__name__} "
            f"({type(exc).__name__}: {exc}); use specdec.DraftModel or specdec.PromptLookup for this model"
        ) from exc
    filled = len(getattr(cache, "layers", ())) or None
    if filled is not None and filled != num_layers:
        raise UnsupportedModelError(
            f"{type(view).__name__}'s forward does not iterate over its layer list (it filled {filled} cache "
            f"layers instead of {num_layers}); LayerSkip cannot truncate it"
        )
