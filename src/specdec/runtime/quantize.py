"""Weight-only int8 and int4: a model's linear layers on quantized, packed weights (`specdec.load(weights=...)`).

Each output row's weights are quantized in groups of `group` consecutive inputs with one float32 scale per group,
symmetric (no zero point):

- int8: scale = max|w| / 127, q = round(w / scale) in [-127, 127];
- int4: scale = -(the group's weight of largest magnitude) / 8, q = round(w / scale) clamped to [-8, 7] (the
  extreme weight lands on -8 exactly, so the 16 levels are all used; llama.cpp's Q4_0 rule).

The model then computes with w = q · scale, made float32 in the kernel's inner loop (kernels/packed_core.h, one
kernel for every instruction-set tier and format): each output is the same fused multiply-adds over its inputs in
order whatever the pass, so a quantized model is row-invariant on every path and speculative decoding of it is
token-identical to its plain decoding. Activations stay in the model's dtype (float32 or bfloat16).

`quantize_model` replaces every `nn.Linear` of the model's decoder (and its LM head) by a `PackedLinear` holding the
packed copy, one layer at a time, and drops the original weight as it goes: no second full copy of the model is
ever held. Under int4 the LM head is quantized to int8 (`LM_HEAD_BITS`): the logits' rounding matters most there,
and llama.cpp keeps its output layer at higher precision for the same reason. Embeddings stay in the model's
dtype: a token reads one row of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.errors import ConfigError

#: `weights=` values and their bits.
FORMATS = {"int8": 8, "int4": 4}
#: Inputs per scale. 64 costs 0.5 bit a weight of float32 scales; docs/quantization.md has the measurements.
DEFAULT_GROUP = 64
#: The LM head's bits when the rest is int4.
LM_HEAD_BITS = 8


def check_format(weights: str | None) -> int | None:
    """The bits of a `weights=` value (None: the model's own dtype), or a ConfigError naming the choices."""
    if weights is None or weights in ("none", "float"):
        return None
    if weights not in FORMATS:
        raise ConfigError(f"unknown weights={weights!r}; choose int8 or int4 (weight-only quantization), or leave it "
                          "out for the model's own dtype")
    return FORMATS[weights]


@dataclass(frozen=True)
class QuantizedWeight:
    """q [N, K] int8 (int4 values in [-8, 7]) and scales [N, ceil(K / group)] float32."""

    q: torch.Tensor
    scales: torch.Tensor
    bits: int
    group: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] the kernel computes with: q · scale, rounded once."""
        k = self.q.shape[1]
        return self.q.float() * self.scales.repeat_interleave(self.group, dim=1)[:, :k]


def quantize_weight(weight: torch.Tensor, bits: int, group: int = DEFAULT_GROUP) -> QuantizedWeight:
    """weight [N, K] (any float dtype) quantized as this module's docstring says."""
    if bits not in (8, 4):
        raise ConfigError(f"bits must be 8 or 4, got {bits}")
    if group < 1 or (bits == 4 and group % 2):
        raise ConfigError(f"the group must be a positive number of inputs (even for int4), got {group}")
    n, k = weight.shape
    groups = -(-k // group)
    w = torch.zeros(n, groups * group, dtype=torch.float32)
    w[:, :k] = weight.detach().float()
    w = w.view(n, groups, group)  # [N, groups, group]
    if bits == 8:
        scales = w.abs().amax(dim=-1) / 127  # [N, groups]
        lo, hi = -127, 127
    else:
        extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)  # [N, groups]
        scales = extreme / -8
        lo, hi = -8, 7
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(w / safe.unsqueeze(-1)).clamp(lo, hi).to(torch.int8).view(n, -1)[:, :k]
    return QuantizedWeight(q.contiguous(), scales.contiguous(), bits, group)


class PackedLinear(nn.Module):
    """A linear layer on packed weights (`specdec::packed_linear`): y = x wᵀ + b in the input's dtype (float32 or
    bfloat16), CPU only. `bits` 8 or 4: quantized weights; None: float32 or bfloat16 weights packed as they are."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
                 bits: int | None, group: int | None):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group = bits, group

    @classmethod
    def quantized(cls, linear: nn.Linear, bits: int, group: int = DEFAULT_GROUP) -> PackedLinear:
        from specdec.runtime.rowwise import load_kernel  # noqa: PLC0415 (builds the kernels on first use)

        load_kernel()
        qw = quantize_weight(linear.weight, bits, group)
        packed = torch.ops.specdec.pack_quantized(qw.q, qw.scales, bits, group)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, bias, linear.in_features, linear.out_features, bits, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return torch.ops.specdec.packed_linear(x, self.packed, bias, self.out_features)

    def extra_repr(self) -> str:
        fmt = f"int{self.bits}, group={self.group}" if self.bits else str(self.packed.dtype)
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmt}"


def quantize_model(model: nn.Module, weights: str, group: int = DEFAULT_GROUP) -> nn.Module:
    """Replace every nn.Linear of `model` (a CPU model) by its `weights` ("int8" | "int4") PackedLinear, in place,
    one layer at a time; the LM head at LM_HEAD_BITS under int4. Returns the model."""
    bits = check_format(weights)
    if bits is None:
        return model
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError(f"weights={weights!r} runs on the CPU kernels only; load the model with device='cpu'")
    head = model.get_output_embeddings()
    tied = head is not None and any(head.weight is p for p in model.get_input_embeddings().parameters())
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in targets:
        layer_bits = LM_HEAD_BITS if module is head and bits == 4 else bits
        replacement = PackedLinear.quantized(module, layer_bits, group)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, replacement)
        if not (module is head and tied):  # a tied head's weight is the embedding's: it stays
            module.weight = None
    return model
