"""`EagleHead`: the EAGLE draft head (EAGLE-1/2, or EAGLE-3's fused variant), built from the target's own architecture.

EAGLE-1/2 (``variant="eagle"``):

    hidden [n, H] = layer( fc( cat(embed(token_{t+1}), feature_t) ) )        logits = target.lm_head(hidden)

`feature_t` is the target's last hidden state at position t (the input of its LM head), `token_{t+1}` the
token that follows it; the head predicts feature_{t+1} and hence token_{t+2}. The layer is one decoder
layer of the target's own family (its HF base model class, built from a copy of the target's config with
one layer), so rotary embeddings, attention masks and KV caches work exactly as in the target. As in
EAGLE-1 (and the layout vLLM and SGLang load) the layer has no input norm and there is no final norm:
the output is compared with a post-norm feature and goes straight to the target's LM head. Token
embeddings and the LM head are the target's, shared and frozen; the head stores neither.

EAGLE-3 (``variant="eagle3"``, Li et al. 2025):

    fused_t [n, 3H] = cat(target layer features at three depths)       (low / mid / high, `feature_layers`)
    h = fc(fused_t)                          (a drafted step feeds back its own output h [n, H] instead)
    hidden [n, H] = midlayer(embed(token_{t+1}), h)                 logits = lm_head(norm(hidden))

The midlayer is the target family's decoder layer with its attention reading the 2H input
cat(input_layernorm(embed), hidden_norm(h)) (q/k/v widened to 2H) and its residual stream carrying h;
it is assembled from the HF layer's own attention, MLP and norms (`FusedInputLayer`), inside the
one-layer HF base model, so rotary embeddings, masks and caches are HF's. The head has its own final
norm; its LM head is the target's (shared) or, with a reduced draft vocabulary, its own rows for the
`draft_vocab_size` most frequent tokens (`draft_to_target` maps draft ids to target ids; logits of
other tokens are -inf). No feature regression: it is trained on tokens only (training/heads.py).
Feature layers are HF ``output_hidden_states`` indices, i.e. the INPUT of that decoder layer (the
convention of vLLM's ``eagle_aux_hidden_state_layer_ids``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec.errors import ConfigError, ModelLoadError, UnsupportedModelError
from specdec.heads.common import (
    FORMAT_VERSION,
    check_target,
    load_state,
    read_head,
    target_signature,
    write_head,
)
from specdec.runtime.base import cache_kwarg
from specdec.runtime.weights import PackedLinear

#: Attribute names, per HF family, of the base model's token embedding, layer list, final norm, and a
#: layer's input norm. The head drops the embedding (it is fed `inputs_embeds`) and both norms.
_EMBEDDINGS = ("embed_tokens", "wte")
_LAYERS = ("layers", "h")
_FINAL_NORMS = ("norm", "ln_f")
_INPUT_NORMS = ("input_layernorm", "ln_1")


def _first_attr(module: nn.Module, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


def body_config(target: PreTrainedModel):
    """A copy of the target's (text) config with one decoder layer; the target's config is untouched."""
    config = copy.deepcopy(target.config.get_text_config())
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    config.use_cache = True
    return config


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / mid / high feature depths for an EAGLE-3 head on a target of `num_layers` decoder layers.

    EAGLE-3's own choice is (2, N//2, N-3) (inputs of those layers). On a shallow target N-3 collides with
    N//2 (N = 6, the default target: 3 and 3), so the high feature then moves to N-1, the input of the last
    layer (the deepest point an engine can capture before a layer); the low one stays at 2 where it fits."""
    low = max(0, min(2, num_layers // 2 - 1))
    mid = num_layers // 2
    high = num_layers - 3 if num_layers - 3 > mid else num_layers - 1
    return low, mid, high


#: A decoder layer's parts, by the names the EAGLE-3 midlayer uses (vLLM's / SGLang's) -> names per HF family.
_MIDLAYER_PARTS = {"input_layernorm": ("input_layernorm",), "self_attn": ("self_attn",),
                   "post_attention_layernorm": ("post_attention_layernorm",), "mlp": ("mlp",)}


def _widen_attention_input(attn: nn.Module, hidden: int) -> bool:
    """Replace the attention's q/k/v input projections by fresh ones reading 2H (False: it has none)."""
    if not all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj")):
        return False
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
    return True


class FusedInputLayer(nn.Module):
    """EAGLE-3's midlayer from one HF decoder layer of a Llama-style family (Llama, Qwen2, Mistral, Gemma).

    The layer's input is cat(embed, h) [B, n, 2H]; attention reads cat(input_layernorm(embed),
    hidden_norm(h)) through input projections widened to 2H, and the residual stream is h. The attention
    module, MLP and norms are the HF layer's own (rotary embeddings, KV cache and attention backend
    included); only the pre-norm residual wiring around them is spelled out here."""

    def __init__(self, layer: nn.Module, hidden: int):
        super().__init__()
        for name, candidates in _MIDLAYER_PARTS.items():
            setattr(self, name, getattr(layer, _first_attr(layer, candidates)))
        self.hidden_norm = copy.deepcopy(self.input_layernorm)  # on the fused feature
        if hasattr(layer, "attention_type"):  # some base models pick each layer's mask by it
            self.attention_type = layer.attention_type

    @staticmethod
    def adapt(layer: nn.Module, hidden: int) -> bool:
        """Widen `layer`'s attention input to 2H if it has the parts a midlayer needs (False: it has not)."""
        if any(_first_attr(layer, names) is None for names in _MIDLAYER_PARTS.values()):
            return False
        return _widen_attention_input(getattr(layer, _first_attr(layer, _MIDLAYER_PARTS["self_attn"])), hidden)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """hidden_states [B, n, 2H] = cat(embed, h); kwargs as the base model passes them to its layers."""
        embeds, h = hidden_states.chunk(2, dim=-1)  # [B, n, H] each
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(h)], dim=-1)  # [B, n, 2H]
        attn, _ = self.self_attn(x, **kwargs)
        h = h + attn  # [B, n, H]
        return h + self.mlp(self.post_attention_layernorm(h))


def build_body(base_class: type, config, fused: bool = False) -> tuple[nn.Module, nn.Module]:
    """One-layer base model of `base_class` without its token embedding and final norm (returned beside it).

    EAGLE-1/2 (`fused=False`): the layer also loses its input norm. EAGLE-3 (`fused=True`): the layer
    becomes a `FusedInputLayer` (2H attention input)."""
    body = base_class(config)
    names = (_first_attr(body, _EMBEDDINGS), _first_attr(body, _LAYERS), _first_attr(body, _FINAL_NORMS))
    if None in names:
        raise UnsupportedModelError(
            f"{base_class.__name__} has no recognisable token embedding / layer list / final norm, so an EAGLE "
            "head cannot be built from it; use a Llama-, Qwen2-, Mistral-, Gemma- or GPT-2-style target, or "
            "specdec.MedusaHeads"
        )
    embedding, layers, final_norm = names
    setattr(body, embedding, None)
    norm = getattr(body, final_norm)
    setattr(body, final_norm, nn.Identity())
    first = getattr(body, layers)[0]
    if fused:
        if not FusedInputLayer.adapt(first, int(config.hidden_size)):
            raise UnsupportedModelError(
                f"{base_class.__name__}'s decoder layer has no Llama-style input / post-attention norms, "
                "self_attn.{q,k,v}_proj and mlp (GPT-2 blocks, for one, fuse q/k/v and add learned positions to "
                "their input), so an EAGLE-3 midlayer cannot be built from it; use variant='eagle' (EAGLE-1/2)")
        getattr(body, layers)[0] = FusedInputLayer(first, int(config.hidden_size))
        return body, norm
    input_norm = _first_attr(first, _INPUT_NORMS)
    if input_norm is not None:
        setattr(first, input_norm, nn.Identity())
    return body, norm


VARIANTS = ("eagle", "eagle3")


class EagleHead(nn.Module):
    """EAGLE-1/2: fc over [token embedding, target feature] -> one decoder layer of the target's family.
    EAGLE-3 (`feature_layers` set): fc over three target depths -> a 2H-input midlayer -> own norm -> LM head."""

    kind = "eagle"

    def __init__(self, base_class: type, config, signature: dict[str, Any], fc_bias: bool = False,
                 feature_layers: tuple[int, ...] | None = None, draft_vocab_size: int | None = None):
        super().__init__()
        hidden = int(config.hidden_size)
        self.signature = dict(signature)
        self.base_class = base_class
        self.body_config = config
        self.feature_layers = None if feature_layers is None else tuple(int(i) for i in feature_layers)
        if self.feature_layers is None:  # EAGLE-1/2
            self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
            self.body, _ = build_body(base_class, config)
            self.norm = None
        else:  # EAGLE-3
            self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=fc_bias)
            self.body, self.norm = build_body(base_class, config, fused=True)
        self.lm_head: nn.Linear | None = None  # EAGLE-3 with a reduced draft vocabulary only
        if draft_vocab_size is not None:
            self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
            self.register_buffer("draft_to_target", torch.arange(draft_vocab_size))  # [Vd] target id of draft id
        self.meta: dict[str, Any] = {}  # training facts written into config.json (data, steps, acceptance)

    @classmethod
    def init(cls, target: PreTrainedModel, seed: int = 0, fc_bias: bool = False, variant: str = "eagle",
             feature_layers: tuple[int, ...] | None = None, draft_vocab_size: int | None = None) -> EagleHead:
        """An untrained head for `target`, deterministic in `seed`, in the target's dtype and device.

        variant="eagle3": features from `feature_layers` (HF hidden-state indices; default
        `default_feature_layers`), the target's LM head shared unless `draft_vocab_size` is given."""
        if variant not in VARIANTS:
            raise ConfigError(f"EagleHead variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        num_layers = int(target.config.get_text_config().num_hidden_layers)
        if variant == "eagle3":
            feature_layers = tuple(feature_layers or default_feature_layers(num_layers))
            bad = [i for i in feature_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= num_layers]
            if bad or len(feature_layers) < 2:
                raise ConfigError(f"EAGLE-3 feature_layers must be two or more hidden-state indices in 0..{num_layers} "
                                  f"(this target's layer count), got {feature_layers!r}; omit them for the default "
                                  f"{default_feature_layers(num_layers)}")
        elif feature_layers is not None or draft_vocab_size is not None:
            raise ConfigError("feature_layers and draft_vocab_size belong to EAGLE-3 heads: pass variant='eagle3'")
        param = next(target.parameters())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(type(target.base_model), body_config(target), target_signature(target), fc_bias,
                       feature_layers, draft_vocab_size)
            if head.norm is not None:  # start the head's norm where the target's final norm is
                final = target.base_model.get_submodule(_first_attr(target.base_model, _FINAL_NORMS))
                head.norm.load_state_dict(final.state_dict())
        return head.to(device=param.device, dtype=param.dtype).eval()

    @property
    def variant(self) -> str:
        return "eagle" if self.feature_layers is None else "eagle3"

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads: H (EAGLE-1/2) or len(feature_layers) * H (EAGLE-3)."""
        return self.hidden_size if self.feature_layers is None else self.fc.in_features

    @property
    def hidden_request(self) -> bool | tuple[int, ...]:
        """What the decoder asks the target for (`hidden=` of a scoring pass): its final features, or the layers'."""
        return True if self.feature_layers is None else self.feature_layers

    @property
    def draft_vocab_size(self) -> int | None:
        return None if self.lm_head is None else self.lm_head.out_features

    def forward(
        self,
        embeds: torch.Tensor,  # [B, n, H] target token embeddings of token_{t+1}
        features: torch.Tensor,  # [B, n, F] target features at t (F = feature_size), or drafted ones [B, n, H]
        position_ids: torch.Tensor,  # [B, n]
        attention_mask: torch.Tensor | None = None,  # None (causal) or additive [B, 1, n, past + n]
        cache=None,
    ) -> torch.Tensor:
        """Predicted next features [B, n, H] (`logits` turns them into draft logits)."""
        if self.feature_layers is None:
            x = self.fc(torch.cat([embeds, features], dim=-1))  # [B, n, H]
        else:  # EAGLE-3: fc only over the target's fused features; a drafted step feeds its own output
            h = self.fc(features) if features.shape[-1] != self.hidden_size else features  # [B, n, H]
            x = torch.cat([embeds, h], dim=-1)  # [B, n, 2H]
        out = self.body(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                        **cache_kwarg(self.body, cache), use_cache=cache is not None)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Draft logits over the target's vocabulary [..., V] of predicted features hidden [..., H];
        `lm_head` is the target's. A reduced draft vocabulary leaves -inf at every other token."""
        if self.norm is None:
            return lm_head(hidden)
        x = self.norm(hidden)
        if self.lm_head is None:
            return lm_head(x)
        draft = self.lm_head(x)  # [..., Vd]
        full = draft.new_full((*draft.shape[:-1], self.signature["vocab_size"]), float("-inf"))  # [..., V]
        return full.index_copy(-1, self.draft_to_target, draft)

    def with_draft_vocab(self, target: PreTrainedModel, token_ids: torch.Tensor) -> EagleHead:
        """A copy of this EAGLE-3 head whose LM head covers only `token_ids` (target ids, e.g. the most frequent
        tokens of the training data), its rows copied from the target's LM head (the one it was trained with; on
        packed weights, float32 or bfloat16 ones: ConfigError for a quantized head, whose float rows are gone)."""
        if self.variant != "eagle3" or self.lm_head is not None:
            raise ConfigError("with_draft_vocab needs an EAGLE-3 head that shares the target's LM head")
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique().sort().values  # [Vd] ascending, as EAGLE-3
        vocab = self.signature["vocab_size"]
        if ids.numel() < 1 or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ConfigError(f"draft vocabulary ids must lie in 0..{vocab - 1}")
        head = copy.deepcopy(self)
        param = self.fc.weight
        head.lm_head = nn.Linear(self.hidden_size, ids.numel(), bias=False).to(param.device, param.dtype)
        with torch.no_grad():
            own = target.get_output_embeddings()
            rows = own.dense_weight() if isinstance(own, PackedLinear) else own.weight  # [V, H]
            head.lm_head.weight.copy_(rows[ids.to(rows.device)])
        head.register_buffer("draft_to_target", ids.to(param.device))
        return head

    # -- checkpoint ---------------------------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "format_version": FORMAT_VERSION,
            "target": self.signature,
            "base_class": self.base_class.__name__,
            "fc_bias": self.fc.bias is not None,
            "variant": self.variant,
            "feature_layers": None if self.feature_layers is None else list(self.feature_layers),
            "draft_vocab_size": self.draft_vocab_size,
            "body_config": self.body_config.to_dict(),
            "meta": self.meta,
        }

    def save(self, path: str | Path, dtype: torch.dtype | None = torch.float16) -> Path:
        """config.json + model.safetensors (16-bit by default), written atomically."""
        return write_head(path, self.config_dict(), self.state_dict(), dtype)

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel) -> EagleHead:
        """The head saved in `path`, checked against `target`, in the target's dtype and device."""
        config, tensors = read_head(path, cls.kind)
        check_target(config.get("target", {}), target, str(path))
        variant = config.get("variant", "eagle")
        if variant not in VARIANTS:
            raise ModelLoadError(f"{path} holds an EAGLE head of unknown variant {variant!r}; it was written by a "
                                 "newer specdec: upgrade specdec, or retrain the head")
        head = cls.init(target, fc_bias=bool(config.get("fc_bias", False)), variant=variant,
                        feature_layers=config.get("feature_layers"), draft_vocab_size=config.get("draft_vocab_size"))
        load_state(head, tensors, str(path))
        head.meta = dict(config.get("meta") or {})
        return head
