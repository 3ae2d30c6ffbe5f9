"""`MedusaHeads`: k residual blocks on the target's last hidden state, one per future offset.

    h_k = f_t + SiLU(W_k f_t + b_k)   (repeated `num_layers` times)      logits_k = target.lm_head(h_k)

Head k (1-based) reads the feature at position t and predicts token t+k+1 (the target's own LM head
already predicts t+1). The LM head is the target's, shared and frozen (vLLM's `original_lm_head`
layout), so the shipped heads are a few hundred kilobytes instead of k copies of the vocabulary matrix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from specdec.errors import ConfigError
from specdec.heads.common import FORMAT_VERSION, check_target, load_state, read_head, target_signature, write_head


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), as in Medusa."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """`num_heads` stacks of `num_layers` residual blocks; head k predicts the token k+1 steps ahead."""

    kind = "medusa"

    def __init__(self, signature: dict[str, Any], num_heads: int = 4, num_layers: int = 1):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MedusaHeads {name} must be an integer >= 1, got {value!r}")
        self.signature = dict(signature)
        hidden = int(signature["hidden_size"])
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)]) for _ in range(num_heads)
        )
        self.meta: dict[str, Any] = {}

    @classmethod
    def init(cls, target: PreTrainedModel, num_heads: int = 4, num_layers: int = 1, seed: int = 0) -> MedusaHeads:
        """Untrained heads for `target`, deterministic in `seed`, in the target's dtype and device."""
        param = next(target.parameters())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            heads = cls(target_signature(target), num_heads, num_layers)
            for block in heads.blocks:
                for res in block:
                    nn.init.normal_(res.linear.weight, std=0.5 / res.linear.in_features**0.5)
                    nn.init.zeros_(res.linear.bias)
        return heads.to(device=param.device, dtype=param.dtype).eval()

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def num_layers(self) -> int:
        return len(self.blocks[0])

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., H] -> per-head hidden states [num_heads, ..., H] (feed them to the LM head)."""
        return torch.stack([block(features) for block in self.blocks])

    def config_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "format_version": FORMAT_VERSION, "target": self.signature,
                "num_heads": self.num_heads, "num_layers": self.num_layers, "meta": self.meta}

    def save(self, path: str | Path, dtype: torch.dtype | None = torch.float16) -> Path:
        """config.json + model.safetensors (16-bit by default), written atomically."""
        return write_head(path, self.config_dict(), self.state_dict(), dtype)

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel) -> MedusaHeads:
        """The heads saved in `path`, checked against `target`, in the target's dtype and device."""
        config, tensors = read_head(path, cls.kind)
        check_target(config.get("target", {}), target, str(path))
        try:
            heads = cls.init(target, num_heads=int(config["num_heads"]), num_layers=int(config["num_layers"]))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            from specdec.errors import ModelLoadError

            raise ModelLoadError(f"{path}/config.json lacks valid num_heads / num_layers ({exc}); re-copy the head") from exc
        load_state(heads, tensors, str(path))
        heads.meta = dict(config.get("meta") or {})
        return heads
