"""`EagleHead`: the EAGLE-1/2 draft head, built from the target's own architecture.

    hidden [n, H] = layer( fc( cat(embed(token_{t+1}), feature_t) ) )        logits = target.lm_head(hidden)

`feature_t` is the target's last hidden state at position t (the input of its LM head), `token_{t+1}` the
token that follows it; the head predicts feature_{t+1} and hence token_{t+2}. The layer is one decoder
layer of the target's own family (its HF base model class, built from a copy of the target's config with
one layer), so rotary embeddings, attention masks and KV caches work exactly as in the target. As in
EAGLE-1 (and the layout vLLM and SGLang load) the layer has no input norm and there is no final norm:
the output is compared with a post-norm feature and goes straight to the target's LM head. Token
embeddings and the LM head are the target's, shared and frozen; the head stores neither.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec.errors import UnsupportedModelError
from specdec.heads.common import (
    FORMAT_VERSION,
    check_target,
    load_state,
    read_head,
    target_signature,
    write_head,
)

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


def build_body(base_class: type, config) -> nn.Module:
    """One-layer base model of `base_class` without its token embedding, first input norm and final norm."""
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
    setattr(body, final_norm, nn.Identity())
    first = getattr(body, layers)[0]
    input_norm = _first_attr(first, _INPUT_NORMS)
    if input_norm is not None:
        setattr(first, input_norm, nn.Identity())
    return body


class EagleHead(nn.Module):
    """fc over [token embedding, target feature] -> one decoder layer of the target's family."""

    kind = "eagle"

    def __init__(self, base_class: type, config, signature: dict[str, Any], fc_bias: bool = False):
        super().__init__()
        hidden = int(config.hidden_size)
        self.signature = dict(signature)
        self.base_class = base_class
        self.body_config = config
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.body = build_body(base_class, config)
        self.meta: dict[str, Any] = {}  # training facts written into config.json (data, steps, acceptance)

    @classmethod
    def init(cls, target: PreTrainedModel, seed: int = 0, fc_bias: bool = False) -> EagleHead:
        """An untrained head for `target`, deterministic in `seed`, in the target's dtype and device."""
        param = next(target.parameters())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(type(target.base_model), body_config(target), target_signature(target), fc_bias)
        return head.to(device=param.device, dtype=param.dtype).eval()

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    def forward(
        self,
        embeds: torch.Tensor,  # [B, n, H] target token embeddings of token_{t+1}
        features: torch.Tensor,  # [B, n, H] target (or drafted) features at t
        position_ids: torch.Tensor,  # [B, n]
        attention_mask: torch.Tensor | None = None,  # None (causal) or additive [B, 1, n, past + n]
        cache=None,
    ) -> torch.Tensor:
        """Predicted next features [B, n, H] (feed them to the target's LM head for logits)."""
        x = self.fc(torch.cat([embeds, features], dim=-1))  # [B, n, H]
        out = self.body(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                        past_key_values=cache, use_cache=cache is not None)
        return out.last_hidden_state

    # -- checkpoint ---------------------------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "format_version": FORMAT_VERSION,
            "target": self.signature,
            "base_class": self.base_class.__name__,
            "fc_bias": self.fc.bias is not None,
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
        head = cls.init(target, fc_bias=bool(config.get("fc_bias", False)))
        load_state(head, tensors, str(path))
        head.meta = dict(config.get("meta") or {})
        return head
