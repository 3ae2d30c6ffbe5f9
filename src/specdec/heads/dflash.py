"""`DFlashHead`: a block drafter on the target's features (DFlash, Chen et al. 2026, arXiv 2602.06036).

One forward fills a whole block of masked positions:

    ctx_t [m, H]   = hidden_norm( fc( cat(target layer features of token t at `feature_layers`) ) )
    block [γ+1, H] = [embed(root), mask, mask, ..., mask]       (the root: the last committed token, at n−1)
    out            = layers(block, ctx)       logits_j = lm_head( norm(out_j) ),  j = 1..γ: token n−1+j

Each of the head's decoder layers reads the context the DFlash way ("KV injection"): its attention's keys and
values are computed from the context features ctx_t (the same ctx in every layer) and from the block's own rows;
the block attends to every context row and, bidirectionally, to the whole block. Only the block rows go through
the MLPs. Row j of the output is the head's distribution of token n−1+j given the committed context: the
marginal of that position, all γ of them from one pass (no drafted token is fed back).

The layers are the target family's own decoder layers (its HF base model class built from a copy of the
target's config with `num_layers` layers: attention, MLP, norms, rotary embedding), called part by part:
`BlockLayer` feeds the attention the context rows (already normed) ahead of the block's normed rows, so the
HF attention module computes, rotates and caches the context's keys and values itself, and the block's
queries see them. The attention's outputs for the context rows are not used. Token embeddings and the LM head
are the target's (shared, frozen, not stored); the head owns `fc`, `hidden_norm`, the layers, the final
`norm` and `mask_embedding` [block_size − 1, H], the input of the masked position j rows after the root (the
target's vocabulary has no mask token, and the head needs none: a mask is never a token id, never drafted and
never verified). DFlash feeds one mask embedding at every offset and lets rotary positions tell them apart
through attention; here each offset has its own, so a head of one or two layers need not tell the masks apart
through rotary positions alone (not measured against the shared embedding).

Feature layers are HF ``output_hidden_states`` indices (0 = the embeddings, N = the final normed state); the
default spreads three over the target's depth (`default_block_layers`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec.errors import ConfigError, UnsupportedModelError
from specdec.heads.common import (
    FORMAT_VERSION,
    check_target,
    load_state,
    read_head,
    target_signature,
    write_head,
)
from specdec.runtime.base import cache_kwarg


def default_block_layers(num_layers: int) -> tuple[int, ...]:
    """Three target depths spread evenly, the deepest the final state: (2, 4, 6) on a 6-layer target (DFlash
    spreads its context layers from shallow to deep the same way)."""
    return tuple(sorted({max(1, round(num_layers * k / 3)) for k in (1, 2, 3)}))


def block_config(target: PreTrainedModel, num_layers: int):
    """A copy of the target's (text) config with `num_layers` decoder layers; the target's config is untouched."""
    config = copy.deepcopy(target.config.get_text_config())
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = (config.layer_types * num_layers)[:num_layers]
    config.use_cache = True
    return config


class BlockLayer(nn.Module):
    """One DFlash decoder layer assembled from an HF Llama-style decoder layer (Llama, Qwen2, Mistral, Gemma): its
    attention, MLP and norms, with the context rows injected into the attention's input."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        try:
            self.input_layernorm = layer.input_layernorm
            self.self_attn = layer.self_attn
            self.post_attention_layernorm = layer.post_attention_layernorm
            self.mlp = layer.mlp
        except AttributeError as exc:
            raise UnsupportedModelError(
                f"{type(layer).__name__} has no Llama-style input / post-attention norms, self_attn and mlp, so a "
                "DFlash layer cannot be built from it; use a Llama-, Qwen2-, Mistral- or Gemma-style target "
                "(or specdec.EagleHead)") from exc

    def forward(self, ctx: torch.Tensor, x: torch.Tensor, position_embeddings, mask: torch.Tensor | None,
                cache) -> torch.Tensor:
        """ctx [B, m, H] (normed context features), x [B, b, H] (the block); position_embeddings for the m + b
        rows; mask additive [B, 1, m + b, past + m + b] -> the block's new rows [B, b, H]."""
        m = ctx.shape[1]
        h = torch.cat([ctx, self.input_layernorm(x)], dim=1)  # [B, m + b, H]
        attn = self.self_attn(h, position_embeddings=position_embeddings, attention_mask=mask,
                              **cache_kwarg(self.self_attn, cache))[0]
        x = x + attn[:, m:]  # [B, b, H]
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(nn.Module):
    """fc over the target's fused features -> `num_layers` DFlash layers over a block [root, mask, ...] -> own
    norm -> the target's LM head. `block_size`: the longest block it was trained for (γ + 1 rows)."""

    kind = "dflash"

    def __init__(self, base_class: type, config, signature: dict[str, Any], feature_layers: tuple[int, ...],
                 block_size: int):
        super().__init__()
        hidden = int(config.hidden_size)
        self.signature = dict(signature)
        self.base_class = base_class
        self.body_config = config
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.block_size = int(block_size)
        self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        body = base_class(config)
        try:
            layers, norm, rotary = body.layers, body.norm, body.rotary_emb
        except AttributeError as exc:
            raise UnsupportedModelError(
                f"{base_class.__name__} has no layers / norm / rotary_emb, so a DFlash head cannot be built from "
                "it; use a Llama-, Qwen2-, Mistral- or Gemma-style target (or specdec.EagleHead)") from exc
        self.layers = nn.ModuleList(BlockLayer(layer) for layer in layers)
        self.hidden_norm = copy.deepcopy(self.layers[0].input_layernorm)  # on the fused context feature
        self.norm = norm
        self.rotary_emb = rotary
        self.mask_embedding = nn.Parameter(torch.zeros(self.block_size - 1, hidden))  # [bs - 1, H] per offset
        self.meta: dict[str, Any] = {}  # training facts written into config.json

    @classmethod
    def init(cls, target: PreTrainedModel, seed: int = 0, feature_layers: tuple[int, ...] | None = None,
             num_layers: int = 1, block_size: int = 16) -> DFlashHead:
        """An untrained head for `target`, deterministic in `seed`, in the target's dtype and device."""
        depth = int(target.config.get_text_config().num_hidden_layers)
        feature_layers = tuple(feature_layers or default_block_layers(depth))
        bad = [i for i in feature_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= depth]
        if bad or not feature_layers:
            raise ConfigError(f"DFlash feature_layers must be hidden-state indices in 0..{depth} (this target's layer "
                              f"count), got {feature_layers!r}; omit them for the default {default_block_layers(depth)}")
        for name, value, low in (("num_layers", num_layers, 1), ("block_size", block_size, 2)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"DFlashHead {name} must be an integer >= {low}, got {value!r}")
        param = next(target.parameters())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = cls(type(target.base_model), block_config(target, num_layers), target_signature(target),
                       feature_layers, block_size)
            nn.init.normal_(head.mask_embedding, std=float(target.get_input_embeddings().weight.detach().std()))
            head.norm.load_state_dict(target.base_model.norm.state_dict())  # start where the target's norm is
        return head.to(device=param.device, dtype=param.dtype).eval()

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads: len(feature_layers) * H."""
        return self.fc.in_features

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_request(self) -> tuple[int, ...]:
        """What the decoder asks the target for (`hidden=` of a scoring pass): the layers' states side by side."""
        return self.feature_layers

    def block_embeds(self, root_embeds: torch.Tensor, masks: int) -> torch.Tensor:
        """root_embeds [B, H] -> the block's input [B, 1 + masks, H]: the root, then the first `masks` mask rows
        (masks <= block_size − 1)."""
        mask = self.mask_embedding[:masks].to(root_embeds.dtype).expand(root_embeds.shape[0], -1, -1)
        return torch.cat([root_embeds[:, None], mask], dim=1)

    def forward(
        self,
        features: torch.Tensor,  # [B, m, F] the target's features of the new context rows (m may be 0)
        block: torch.Tensor,  # [B, b, H] the block's input rows (`block_embeds`)
        position_ids: torch.Tensor,  # [B, m + b] context rows' positions, then the block's
        attention_mask: torch.Tensor,  # additive [B, 1, m + b, past + m + b]
        cache=None,
    ) -> torch.Tensor:
        """The block's output features [B, b, H] (`logits` turns them into draft logits). The context rows' keys
        and values, and the block's, are written to `cache` (the caller drops the block's afterwards)."""
        ctx = self.hidden_norm(self.fc(features.to(block.dtype)))  # [B, m, H]
        position_embeddings = self.rotary_emb(block, position_ids)
        x = block
        for layer in self.layers:
            x = layer(ctx, x, position_embeddings, attention_mask, cache)
        return x

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Draft logits [..., V] of block outputs hidden [..., H]; `lm_head` is the target's."""
        return lm_head(self.norm(hidden))

    # -- checkpoint ---------------------------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "format_version": FORMAT_VERSION,
            "target": self.signature,
            "base_class": self.base_class.__name__,
            "feature_layers": list(self.feature_layers),
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "body_config": self.body_config.to_dict(),
            "meta": self.meta,
        }

    def save(self, path: str | Path, dtype: torch.dtype | None = torch.float16) -> Path:
        """config.json + model.safetensors (16-bit by default), written atomically."""
        return write_head(path, self.config_dict(), self.state_dict(), dtype)

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel) -> DFlashHead:
        """The head saved in `path`, checked against `target`, in the target's dtype and device."""
        config, tensors = read_head(path, cls.kind)
        check_target(config.get("target", {}), target, str(path))
        head = cls.init(target, feature_layers=tuple(config.get("feature_layers") or ()) or None,
                        num_layers=int(config.get("num_layers", 1)), block_size=int(config.get("block_size", 16)))
        load_state(head, tensors, str(path))
        head.meta = dict(config.get("meta") or {})
        return head
