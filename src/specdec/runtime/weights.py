"""Linear layers on packed weights: `specdec.load(weights=...)`, float32, bfloat16, int8, int4, w4a8 or w8a8.

`pack_model(model, weights)` replaces every `nn.Linear` of a model by a `PackedLinear` holding its weights packed
once for specdec's kernel (kernels/packed_core.h: one kernel for every instruction-set tier and format), one layer
at a time, dropping each original weight as it goes: no second full copy of the model is ever held. Activations
stay in the model's dtype; the weights are in `weights`:

- "float32", "bfloat16": the weights as they are (rounded to bfloat16 for "bfloat16"). A float32 model with
  bfloat16 weights reads half the bytes per token and computes in float32: on a CPU without bfloat16 arithmetic
  this is how it gains from bfloat16. A bfloat16 model's "bfloat16" weights use the CPU's bfloat16 dot product
  where it has one (AVX512_BF16's pairs, AMX's tiles: kernels/packed_core.h's BF16_PAIRS);
- "int8", "int4": weight-only quantization. Each output row's weights are quantized in groups of `group`
  consecutive inputs with one float32 scale per group, symmetric (no zero point):
  int8: scale = max|w| / 127, q = round(w / scale) in [-127, 127];
  int4: scale = -(the group's weight of largest magnitude) / 8, q = round(w / scale) clamped to [-8, 7] (the
  extreme weight lands on -8 exactly, so all 16 levels are used; llama.cpp's Q4_0 rule).
  The model computes with w = q · scale in float32: each group's products with q summed, then times its scale
  (kernels/packed_core.h; in a bfloat16 pass on AVX512_BF16 a group is summed by its bfloat16 dot product, a pair
  of inputs at a time). Under int4 the LM head is int8 (`LM_HEAD_BITS`): the logits' rounding matters most
  there, and llama.cpp keeps its output layer at higher precision for the same reason.
- "w4a8": int4's weights (its LM head w8a8's: `LM_HEAD_BITS`), computed as llama.cpp's Q4_0 and OpenVINO's INT4
  compute on a CPU: each row of a layer's input is rounded to int8 per group of `group` inputs (scale max|x| / 127)
  and the products are summed in integers, one float32 multiply-add per group. Several times less arithmetic per
  weight than int4's float32 one, at the cost of rounding the activations too: a format of its own, with its own
  outputs (its quality in docs/quantization.md). `group` must be a multiple of 8.
- "w8a8": int8's weights computed the same way, as llama.cpp's Q8_0 and OpenVINO's INT8 compute on a CPU: the
  inputs rounded to int8 per group, the products summed in integers (its LM head w8a8 too). "int8" widens each
  weight to float32 and multiplies in float, which can cost more than reading it (docs/quantization.md measures
  both); w8a8 reads the same bytes with the integer dot product. `group` must be a multiple of 4.

Each output is the same fused multiply-adds over its inputs in order whatever the pass, so a packed model is
row-invariant on every path (eager, slot cache, compiled, batched) and speculative decoding of it is token-identical
to its plain decoding. Embeddings stay in the model's dtype: a token reads one row of them. A mixture-of-experts
layer's stacked experts (transformers' standard experts module) are packed too, expert by expert (`PackedExperts`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specdec.errors import ConfigError
from specdec.runtime.heap import empty_on_huge_pages, release_free_memory

#: `weights=` values: the quantized formats' bits, the float formats' dtype.
QUANTIZED = {"int8": 8, "int4": 4, "w4a8": 4, "w8a8": 8}
#: The quantized formats that round the activations to int8 too (the kernel's integer dot product).
INT8_INPUTS = frozenset({"w4a8", "w8a8"})
#: What their groups must be a multiple of: the inputs one step of the kernel's dot product takes.
DOT_STEP = {"w4a8": 8, "w8a8": 4}
FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FORMATS = (*FLOATS, *QUANTIZED)
#: Inputs per scale. 64 costs 0.5 bit a weight of float32 scales; docs/quantization.md has the measurements.
DEFAULT_GROUP = 64
#: The LM head's bits when the rest is int4 (or w4a8).
LM_HEAD_BITS = 8


def head_format(weights: str) -> str:
    """The LM head's format in a model whose other linear layers are `weights`: LM_HEAD_BITS under the 4-bit formats
    (int8 under int4; w8a8 under w4a8, whose rows are rounded to int8 already: a one-row int8 pass, float32 in its
    inner loop, read at about half w8a8's rate, and was a third of a w4a8 pass at 1.5B), else `weights`."""
    if QUANTIZED.get(weights) != 4:
        return weights
    return f"w{LM_HEAD_BITS}a8" if weights in INT8_INPUTS else f"int{LM_HEAD_BITS}"


def check_format(weights: str | None) -> str | None:
    """`weights` if it is a known format (None: the model's own modules), else a ConfigError naming the choices."""
    if weights is None or weights in FORMATS:
        return weights
    raise ConfigError(f"unknown weights={weights!r}; choose {', '.join(FORMATS)} (the linear layers' weights, packed "
                      "for specdec's CPU kernels), or leave it out for the model's own layers")


@dataclass(frozen=True)
class QuantizedWeight:
    """q [N, K] int8 (int4 values in [-8, 7]) and scales [N, ceil(K / group)] float32."""

    q: torch.Tensor
    scales: torch.Tensor
    bits: int
    group: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] q · scale, rounded once (the kernel takes each group's scale once, after the
        group's sum over q: close to these, not their bits)."""
        k = self.q.shape[1]
        return self.q.float() * self.scales.repeat_interleave(self.group, dim=1)[:, :k]


def quantize_weight(weight: torch.Tensor, bits: int, group: int = DEFAULT_GROUP) -> QuantizedWeight:
    """weight [N, K] (any float dtype) quantized as this module's docstring says, a block of rows at a time (each
    row's groups are quantized on their own, so the blocks give the bits of one pass: only the float32
    temporaries stay small, QUANTIZE_BLOCK values each, where a whole LM head's would be gigabytes)."""
    if bits not in (8, 4):
        raise ConfigError(f"bits must be 8 or 4, got {bits}")
    if group < 1 or (bits == 4 and group % 2):
        raise ConfigError(f"the group must be a positive number of inputs (even for int4), got {group}")
    n, k = weight.shape
    groups = -(-k // group)
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, groups, dtype=torch.float32)
    rows = max(1, QUANTIZE_BLOCK // (groups * group))
    for r0 in range(0, n, rows):
        q[r0 : r0 + rows], scales[r0 : r0 + rows] = _quantize_rows(weight[r0 : r0 + rows], bits, group, groups)
    return QuantizedWeight(q, scales, bits, group)


#: Values (float32) in one block of rows that `quantize_weight` quantizes (and `PackedLinear.pack` packs) at a time.
#: 1 MB of float32, which stays in a core's L2. Against 16 MB, a streamed load of the Qwen2.5-1.5B shape peaked at
#: 2.34 against 2.42-2.44 GB in int8 and 1.73 against 1.80-1.82 in the 4-bit formats (the LM head's temporaries had
#: been the peak), and took 0.6-0.8x the time (one Zen 4 core; docs/bench/load-memory-block-zen4).
QUANTIZE_BLOCK = 1 << 18

#: read(r0, r1): a weight's rows [r0, r1), read from where the weight is kept (`PackedLinear.pack`).
RowReader = Callable[[int, int], torch.Tensor]
#: read(j, e): expert e's matrix of a stacked experts module's gate_up (j = 0) or down (j = 1) (`PackedExperts.pack`).
ExpertReader = Callable[[int, int], torch.Tensor]


def _pack_rows(weight: torch.Tensor, weights: str, group: int) -> torch.Tensor:
    """Rows weight [n, K] packed in format `weights` (kernels/packed_core.h's layouts). A bfloat16 model's bfloat16
    weights are packed in pairs where the CPU has a bfloat16 dot product (AVX512_BF16, AMX): its passes are all
    bfloat16, and the pairs are what those instructions read. Otherwise the layout a pass in any dtype reads."""
    if weights in FLOATS:
        pairs = weights == "bfloat16" and weight.dtype == torch.bfloat16
        return torch.ops.specdec.pack_weight(weight.to(FLOATS[weights]), pairs)
    if weights in INT8_INPUTS and group % DOT_STEP[weights]:
        raise ConfigError(f"weights={weights!r} needs a group that is a multiple of {DOT_STEP[weights]} inputs, got "
                          f"{group}")
    qw = quantize_weight(weight, QUANTIZED[weights], group)
    return torch.ops.specdec.pack_quantized(qw.q, qw.scales, qw.bits, group, weights in INT8_INPUTS)


def _quantize_rows(weight: torch.Tensor, bits: int, group: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, K] int8 and scales [n, groups] float32 of rows weight [n, K]. One float32 buffer, its own, divided,
    rounded and clamped in place (a fresh tensor per step cost twice the time: 1.5x-2.4x on one Zen 3 core, the
    same bits)."""
    n, k = weight.shape
    w = torch.empty(n, groups * group, dtype=torch.float32)
    w[:, :k] = weight.detach()
    w[:, k:] = 0
    w = w.view(n, groups, group)  # [n, groups, group]
    if bits == 8:
        scales = w.abs().amax(dim=-1) / 127  # [n, groups]
        lo, hi = -127, 127
    else:
        scales = _extreme(w) / -8  # [n, groups]
        lo, hi = -8, 7
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = w.div_(safe.unsqueeze(-1)).round_().clamp_(lo, hi).to(torch.int8).view(n, -1)[:, :k]
    return q, scales


def _extreme(w: torch.Tensor) -> torch.Tensor:
    """Each group's value of the largest magnitude, w [n, groups, group] -> [n, groups]: where a value and its negation
    tie (an all-zero group too, for the sign of its zero), the first of them, as `w.gather(-1, w.abs().argmax(-1))`
    gives it. By a max and a min, which took a fifth of that argmax's time on one Zen 4 core (1 MB blocks); only the
    tied groups take the argmax."""
    hi, lo = w.amax(dim=-1), w.amin(dim=-1)
    extreme = torch.where(hi >= -lo, hi, lo)
    tied = hi == -lo
    if bool(tied.any()):
        t = w[tied]  # [tied groups, group]
        extreme[tied] = t.gather(-1, t.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    return extreme


class PackedLinear(nn.Module):
    """A linear layer on packed weights (`specdec::packed_linear`): y = x wᵀ + b in the input's dtype (float32 or
    bfloat16; other dtypes compute in float32), CPU only. `weights`: the format the packed weights hold."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
                 weights: str, group: int | None = None):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("bias", bias)
        # No float weight is kept: model code that asks for one, as T5's feed-forward does, gets None.
        self.register_parameter("weight", None)
        self.in_features, self.out_features = in_features, out_features
        self.weights, self.group = weights, group

    @classmethod
    def pack(cls, linear: nn.Linear, weights: str, group: int = DEFAULT_GROUP,
             read: RowReader | None = None) -> PackedLinear:
        """`linear`'s weights packed in format `weights` (its original is left as it is), a block of whole panels
        of outputs at a time: each panel is packed on its own, so the blocks give the bits of one pass, and the
        temporaries (float32 copies, quantized values) are one block's, not the layer's. The packed weights get a
        mapping of their own on huge pages where Linux gives them (runtime/heap.py: the one-row pass streams them).
        read(r0, r1): the weight's rows [r0, r1) in `linear.weight`'s dtype, where they are read block by block from
        elsewhere (hub/streamed.py: from the checkpoint; `quantized_copy`: from another packed layer) instead of
        from `linear.weight`, which is not read then."""
        from specdec.runtime.rowwise import load_kernel  # noqa: PLC0415 (builds the kernels on first use)

        load_kernel()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        weight = linear.weight.detach()
        n, k = linear.out_features, linear.in_features
        panel = torch.ops.specdec.panel_width()
        rows = max(1, QUANTIZE_BLOCK // max(k, 1) // panel) * panel  # whole panels
        packed = None
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            block = _pack_rows(weight[r0:r1] if read is None else read(r0, r1), weights, group)  # [panels, ...]
            if packed is None:
                packed = empty_on_huge_pages((-(-n // panel), *block.shape[1:]), block.dtype)
            packed[r0 // panel : r0 // panel + block.shape[0]] = block
        return cls(packed, bias, linear.in_features, linear.out_features, weights,
                   group if weights in QUANTIZED else None)

    @property
    def bits(self) -> int | None:
        return QUANTIZED.get(self.weights)

    def dense_weight(self) -> torch.Tensor:
        """The weights [N, K] as packed (float32 or bfloat16, a copy), read back from the panels' layout
        (kernels/packed_core.h): float formats only, whose packing keeps every value. A quantized format's
        weights are not the model's any more: ConfigError."""
        return self.dense_rows(0, self.out_features)

    def dense_rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) of `dense_weight()` (a copy), read back from the panels that hold them alone."""
        if self.weights not in FLOATS:
            raise ConfigError(f"this layer's weights are {self.weights}: its float weights are not kept; load the "
                              "model with weights='float32' or 'bfloat16' (or without weights=) to read them")
        panel = self.packed.shape[2]
        first = r0 // panel
        p = self.packed[first : -(-r1 // panel)]
        if p.dim() == 4:  # bfloat16 pairs: [panels, pairs of k, PANEL, 2]
            w = p.permute(0, 2, 1, 3).reshape(p.shape[0] * panel, p.shape[1] * 2)
        else:  # [panels, K, PANEL]
            w = p.permute(0, 2, 1).reshape(p.shape[0] * panel, p.shape[1])
        return w[r0 - first * panel : r1 - first * panel, : self.in_features].contiguous()

    def as_linear(self) -> nn.Linear:
        """An nn.Linear of the weights as packed (`dense_weight`'s, in their dtype) and the bias: float formats
        only."""
        weight = self.dense_weight()
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.to(weight.dtype), requires_grad=False)
        return linear

    def quantized_weight(self) -> QuantizedWeight:
        """The quantized weights q [N, K] and scales as packed (copies), read back from the panels' layout
        (kernels/packed_core.h): quantized formats only; a float format's weights are `dense_weight`'s."""
        if self.weights not in QUANTIZED:
            raise ConfigError(f"this layer's weights are {self.weights}, not quantized: read them with dense_weight()")
        p, bits = self.packed, QUANTIZED[self.weights]
        panels, groups, panel = p.shape[0], p.shape[1], torch.ops.specdec.panel_width()
        if self.weights in INT8_INPUTS:  # [panels, groups, 1 + G / step, 4 * PANEL]: the scales' row, then the steps'
            scale_bytes, body = p[:, :, 0], p[:, :, 1:].reshape(panels, groups, -1, panel, 4)
            if bits == 8:  # byte j of output n, step s: q[4s + j]
                q = body.permute(0, 3, 1, 2, 4)  # [panels, PANEL, groups, steps, 4]
            else:  # byte j of output n, step s: q[8s + j] + 8 (low nibble), q[8s + 4 + j] + 8 (high)
                q = torch.stack((body & 15, body >> 4), dim=-2).permute(0, 3, 1, 2, 4, 5).to(torch.int8) - 8
        else:  # [panels, groups, 4 * PANEL + bytes of the group's weights]: scales[PANEL], then the weights
            scale_bytes, body = p[:, :, : 4 * panel], p[:, :, 4 * panel :].reshape(panels, groups, -1, panel)
            if bits == 8:  # q[G][PANEL]
                q = body.permute(0, 3, 1, 2)  # [panels, PANEL, groups, G]
            elif panel == 64:  # AVX-512: per pair i and half panel h, byte 2n + e: q[2i + e] + 8 of output 32h + n (low
                # nibble) and of output 32h + 16 + n (high)
                b = body.reshape(panels, groups, -1, 2, 16, 2)  # [panels, groups, pairs, h, n, e]
                q = torch.stack((b & 15, b >> 4), dim=4)  # [panels, groups, pairs, h, low | high, n, e]
                q = q.permute(0, 3, 4, 5, 1, 2, 6).to(torch.int8) - 8  # [panels, h, low | high, n, groups, pairs, e]
            else:  # [G / 2][PANEL]: q[2i] + 8 in the low nibble, q[2i + 1] + 8 in the high
                q = torch.stack((body & 15, body >> 4), dim=-1).permute(0, 3, 1, 2, 4).to(torch.int8) - 8
        n, k = self.out_features, self.in_features
        scales = scale_bytes.contiguous().view(torch.float32).permute(0, 2, 1).reshape(panels * panel, groups)
        q = q.reshape(panels * panel, -1)
        return QuantizedWeight(q[:n, :k].contiguous(), scales[:n].contiguous(), bits, self.group)

    def outputs(self, ids: torch.Tensor) -> PackedLinear:
        """A layer of this one's outputs `ids` [M] only, in this format, each output packed with the bits it has
        here: its values for an input are this layer's at `ids` (every output is computed on its own). Only the
        panels that hold `ids` are read back, not the whole layer (an LM head's would be gigabytes)."""
        panel = torch.ops.specdec.panel_width()
        used = torch.unique(ids // panel)  # [P] the panels holding ids, sorted
        held = PackedLinear(self.packed.index_select(0, used), None, self.in_features, used.numel() * panel,
                            self.weights, self.group)
        rows = torch.searchsorted(used, ids // panel) * panel + ids % panel  # [M] each id's row in `held`
        if self.weights in FLOATS:
            w = held.dense_weight().index_select(0, rows)
            packed = torch.ops.specdec.pack_weight(w, self.packed.dim() == 4)
        else:
            qw = held.quantized_weight()
            packed = torch.ops.specdec.pack_quantized(qw.q.index_select(0, rows), qw.scales.index_select(0, rows),
                                                      qw.bits, qw.group, self.weights in INT8_INPUTS)
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        return PackedLinear(packed, bias, self.in_features, ids.numel(), self.weights, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_matmul(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.group else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.weights}{group}"


def pack_model(model: nn.Module, weights: str | None, group: int = DEFAULT_GROUP, *, head: bool = True,
               free: bool = True, fill: Callable[[str, nn.Linear], RowReader | None] | None = None,
               fill_experts: Callable[[str], ExpertReader] | None = None) -> nn.Module:
    """Replace every nn.Linear of `model` (a CPU model) by its PackedLinear in format `weights`, in place, one layer
    at a time; the LM head at LM_HEAD_BITS under int4 and w4a8 (`head_format`; head=False: left as it is). free=True
    drops each original weight once packed (a tied head's weight is the embedding's and stays). fill(name, linear):
    called just before a layer (not a tied head) is packed, to give it its weights then, or to return a reader of
    its rows that the packing calls block by block (`PackedLinear.pack`'s `read`; hub/streamed.py reads them from
    the checkpoint). A mixture-of-experts layer's stacked experts become a `PackedExperts` (checked first, once per
    class: a module it cannot pack is a ConfigError before anything is packed); fill_experts(name): a reader of its
    experts' matrices to pack them from instead of its parameters (`PackedExperts.pack`'s `read`). weights=None:
    nothing. Returns the model."""
    if check_format(weights) is None:
        return model
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError(f"weights={weights!r} runs on the CPU kernels only; load the model with device='cpu'")
    experts = stacked_experts(model)
    checked: set[type] = set()
    for name in experts:
        module = model.get_submodule(name)
        if type(module) not in checked:
            check_experts(module, fill_experts(name) if fill_experts is not None else None)
            checked.add(type(module))
    lm_head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = isinstance(lm_head, nn.Linear) and any(lm_head.weight is p for p in embedding.parameters())
    for name, module in [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]:
        if module is lm_head and not head:
            continue
        layer = head_format(weights) if module is lm_head else weights
        read = fill(name, module) if fill is not None and not (module is lm_head and tied) else None
        model.set_submodule(name, PackedLinear.pack(module, layer, group, read))
        if free:
            if not (module is lm_head and tied):  # a tied head's weight is the embedding's: it stays
                module.weight = None
            release_free_memory()  # the freed float weights and the packing's temporaries leave the process
    for name in experts:
        read = fill_experts(name) if fill_experts is not None else None
        model.set_submodule(name, PackedExperts.pack(model.get_submodule(name), weights, group, read=read))
        release_free_memory()  # (the stacked float weights go with the module, unless another model shares them)
    return model


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] times the packed weights `packed` (+ bias) -> [..., out_features] in x's dtype:
    `specdec::packed_linear` for a float32 or bfloat16 x, float32 for any other (float64 in tests, float16)."""
    if packed.dtype == torch.bfloat16 and packed.dim() == 4 and x.dtype != torch.bfloat16:
        raise ConfigError(f"this layer's weights are packed for bfloat16 passes (a bfloat16 model with "
                          f"weights='bfloat16'), but got a {x.dtype} input; load the model with "
                          f"dtype=torch.float32 to run float32 passes on bfloat16 weights")
    if x.dtype not in (torch.float32, torch.bfloat16):  # float64 (tests) or float16: computed in float32
        return packed_matmul(x.float(), packed, bias, out_features).to(x.dtype)
    bias = bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)
    return torch.ops.specdec.packed_linear(x, packed, bias, out_features)


class PackedExperts(nn.Module):
    """A mixture-of-experts layer's experts on packed weights. Transformers' standard experts module (Mixtral,
    Qwen2/3-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE and most others) holds every expert's projections stacked,
    gate_up_proj [E, 2I, H] (the gate's half first) and down_proj [E, H, I], and computes act_fn(gate) * up; here
    each expert's projections are packed as a PackedLinear's are, and stacked: gate_up [E, ...] and down [E, ...].

    A token's output is its experts' outputs times its routing weights, added in increasing expert order (transformers'
    eager loop), and every expert's projection of a row is computed on that row alone (`expert_linear`, the packed
    kernel's contract): a row's output does not depend on the other rows of the pass, so speculative decoding of a
    packed MoE model is token-identical to its plain decoding, eagerly and compiled alike."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module, hidden: int, intermediate: int,
                 weights: str, group: int | None):
        super().__init__()
        self.register_buffer("gate_up", gate_up)  # [E, ...] each expert's [2I, H] packed
        self.register_buffer("down", down)  # [E, ...] each expert's [H, I] packed
        self.act_fn = act_fn
        self.hidden, self.intermediate, self.weights, self.group = hidden, intermediate, weights, group
        self.num_experts = gate_up.shape[0]

    @classmethod
    def pack(cls, experts: nn.Module, weights: str, group: int = DEFAULT_GROUP, ids: range | None = None,
             read: ExpertReader | None = None) -> PackedExperts:
        """`experts`' projections packed in format `weights`, one expert at a time (only the experts `ids`, for a
        check); ConfigError for a module that is not the standard layout (`experts_layout`). read(j, e): expert e's
        matrix of gate_up (j = 0) or down (j = 1), read from elsewhere (hub/streamed.py: the checkpoint) instead of
        from `experts`' parameters, which are not read then."""
        gate_up, down = experts_layout(experts)
        ids = ids if ids is not None else range(gate_up.shape[0])
        if read is None:  # the module's own parameters
            read = lambda j, e: (gate_up, down)[j][e].detach()  # noqa: E731 (a view: no copy)
        stacks = [_stacked(len(ids), lambda i, j=j: read(j, ids[i]), weights, group) for j in (0, 1)]
        return cls(*stacks, dict(experts.named_children())["act_fn"], gate_up.shape[2], down.shape[2], weights,
                   group if weights in QUANTIZED else None)

    def repacked(self, weights: str, group: int = DEFAULT_GROUP) -> PackedExperts:
        """These experts in format `weights`, packed from their float-packed weights (read back one expert at a time;
        a quantized format's are not the model's any more: ConfigError from `PackedLinear.dense_weight`)."""
        stacks = [_stacked(self.num_experts, lambda e, j=j: self.expert(e)[j].dense_weight(), weights, group)
                  for j in (0, 1)]
        return PackedExperts(*stacks, self.act_fn, self.hidden, self.intermediate, weights,
                             group if weights in QUANTIZED else None)

    def expert(self, e: int) -> tuple[PackedLinear, PackedLinear]:
        """Expert e's two projections as PackedLinears (views of the stacks): gate_up [2I, H], down [H, I]."""
        return (PackedLinear(self.gate_up[e], None, self.hidden, 2 * self.intermediate, self.weights, self.group),
                PackedLinear(self.down[e], None, self.intermediate, self.hidden, self.weights, self.group))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], each token's experts top_k_index [T, k] and weights [T, k] -> [T, H]."""
        t, k = top_k_index.shape
        order = top_k_index.sort(dim=-1)  # each token's experts in increasing order, as transformers' loop adds them
        experts = order.values.reshape(-1)  # [T·k]
        rows = hidden_states[:, None, :].expand(t, k, self.hidden).reshape(t * k, self.hidden)  # [T·k, H]
        gate, up = expert_linear(rows, experts, self.gate_up, 2 * self.intermediate).chunk(2, dim=-1)  # [T·k, I]
        out = expert_linear(self.act_fn(gate) * up, experts, self.down, self.hidden).view(t, k, self.hidden)
        weights = top_k_weights.gather(1, order.indices)  # [T, k]
        out = (out * weights[..., None]).to(hidden_states.dtype)  # [T, k, H]
        final = torch.zeros_like(hidden_states)  # [T, H]
        for j in range(k):
            final = final + out[:, j]
        return final

    def extra_repr(self) -> str:
        group = f", group={self.group}" if self.group else ""
        return f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, " \
               f"weights={self.weights}{group}"


def _stacked(count: int, matrix: Callable[[int], torch.Tensor], weights: str, group: int) -> torch.Tensor:
    """[count, ...] the weights matrix(i) [N, K] for i in range(count) packed in format `weights`, one at a time (each
    read just before it is packed)."""
    out = None
    for i in range(count):
        w = matrix(i)
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(w, requires_grad=False)  # a view where w is one: no copy
        one = PackedLinear.pack(linear, weights, group).packed
        if out is None:
            out = empty_on_huge_pages((count, *one.shape), one.dtype)
        out[i] = one
    return out


@torch.library.custom_op("specdec::expert_linear", mutates_args=())
def expert_linear(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Row r of x [R, K] through expert experts[r]'s packed weights packed[experts[r]] -> [R, out_features]; the rows of
    one expert in one call of the packed kernel (each row computed on its own: the kernel's contract). An expert id
    past the last (transformers' id of a slot routed to no expert) gives zeros. One opaque operation to torch.compile,
    which cannot trace the data-dependent grouping."""
    out = x.new_zeros(x.shape[0], out_features)
    for e in torch.unique(experts).tolist():
        if e < packed.shape[0]:
            rows = (experts == e).nonzero().view(-1)  # [n]
            out[rows] = packed_matmul(x[rows], packed[e], None, out_features)
    return out


@expert_linear.register_fake
def _(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def experts_layout(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj [E, 2I, H], down_proj [E, H, I]) of an experts module of the standard layout (`PackedExperts`):
    exactly those two parameters and an `act_fn` child. ConfigError otherwise."""
    params, children = dict(module.named_parameters(recurse=False)), dict(module.named_children())
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if not (set(params) == {"gate_up_proj", "down_proj"} and set(children) == {"act_fn"}
            and gate_up.dim() == down.dim() == 3 and gate_up.shape[0] == down.shape[0]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]):
        raise ConfigError(f"weights= cannot pack {type(module).__name__}: its experts are not transformers' standard "
                          "layout (gate_up_proj [E, 2I, H] and down_proj [E, H, I], no bias); load this model "
                          "without weights=")
    return gate_up, down


def stacked_experts(model: nn.Module) -> list[str]:
    """Names of `model`'s modules that hold stacked weights of several experts (a float parameter of three or more
    dimensions; convolutions' kernels aside)."""
    convolutions = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return [name for name, m in model.named_modules() if not isinstance(m, convolutions)
            and any(p.dim() >= 3 and p.is_floating_point() for p in m.parameters(recurse=False))]


def check_experts(experts: nn.Module, read: ExpertReader | None = None) -> None:
    """ConfigError unless the experts module `experts` computes what `PackedExperts` computes: four tokens through
    two of its experts (packed in float32, which keeps the weights' values) against the module's own forward, once
    with inputs of unit scale and once with the projections' outputs near ±100, where a gating that clamps them
    (gpt-oss, DeepSeek-V4 and others clamp at 7-10) differs from act(gate) * up. read(j, e): those two experts'
    matrices, written into the module's parameters first (a streamed load's are empty)."""
    gate_up, down = experts_layout(experts)
    ids = range(min(2, gate_up.shape[0]))
    if read is not None:
        with torch.no_grad():
            for e in ids:
                gate_up[e].copy_(read(0, e))
                down[e].copy_(read(1, e))
    packed = PackedExperts.pack(experts, "float32", ids=ids)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, gate_up.shape[2], generator=generator)  # [T, H]
    index = torch.tensor([[ids[0]], [ids[-1]], [ids[0]], [ids[-1]]])  # [T, 1]
    routing = torch.rand(4, 1, generator=generator) + 0.5  # [T, 1]
    with torch.no_grad():
        reach = float((x @ gate_up[ids[0]].float().T).abs().max()) or 1.0
        for scale in (1.0, 100.0 / reach):
            own = experts((x * scale).to(gate_up.dtype), index, routing.to(gate_up.dtype)).float()
            ours = packed(x * scale, index, routing)
            if not torch.allclose(ours, own, rtol=0.05, atol=0.05 * float(own.abs().max())):
                raise ConfigError(f"weights= cannot pack {type(experts).__name__}: its forward is not transformers' "
                                  "standard experts loop (act(gate) * up, routing weights after the down projection); "
                                  "load this model without weights=")


def packed_formats(model: nn.Module, *, head: bool = True) -> set[str]:
    """The formats of `model`'s packed linear layers (`load(weights=...)`; empty: its own layers). head=False leaves
    its LM head out."""
    lm_head = model.get_output_embeddings()
    return {m.weights for m in model.modules()
            if isinstance(m, PackedExperts) or (isinstance(m, PackedLinear) and (head or m is not lm_head))}


def quantized_copy(model: nn.Module, weights: str, group: int = DEFAULT_GROUP, *, head: bool = True) -> nn.Module:
    """A second model object whose linear layers are `model`'s packed in format `weights`, sharing every other
    tensor with `model` (embeddings, norms, buffers: no copies); `model` is left as it is. head=False: the copy keeps
    `model`'s LM head as it is (shared). A `model` on packed float weights (load(weights="float32" | "bfloat16")) is
    quantized from those, read back one layer at a time (`PackedLinear.dense_weight`); one on quantized weights
    cannot be: ConfigError."""
    quantized = sorted(packed_formats(model, head=head) - set(FLOATS))
    if quantized:
        raise ConfigError(f"the model's weights are packed as {', '.join(quantized)} already; make the copy from a "
                          "model loaded with weights='float32' or 'bfloat16', or without weights=")
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo=shared)  # its own modules, the same tensors
    sources: dict[str, PackedLinear] = {}  # the twin's float-packed layers, become nn.Linears filled when packed
    twin_head = twin.get_output_embeddings()
    for name, module in list(twin.named_modules()):
        if isinstance(module, PackedLinear) and (head or module is not twin_head):
            sources[name] = module
            linear = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
            linear.weight = nn.Parameter(module.packed.new_empty(0), requires_grad=False)  # `fill` reads its rows back
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias, requires_grad=False)
            twin.set_submodule(name, linear)
        elif isinstance(module, PackedExperts):  # float-packed experts: read back and packed, one expert at a time
            twin.set_submodule(name, module.repacked(weights, group))

    def fill(name: str, linear: nn.Linear) -> RowReader | None:
        # each block of rows read back from the float-packed layer as it is packed, never the whole weight (a tied
        # LM head's read back whole was 0.47 GB at the Qwen2.5-1.5B shape)
        return sources[name].dense_rows if name in sources else None

    # free: each of the twin's layers lets go of its placeholder weight once packed (a weight it shares with `model`
    # stays `model`'s)
    return pack_model(twin, weights, group, head=head, free=True, fill=fill)
