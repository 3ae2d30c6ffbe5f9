"""Row-invariant kernels: attention and linear layers whose every output row is computed on its own.

A library kernel (PyTorch's CPU flash attention, a batched matmul, a BLAS GEMM) picks its blocking, and so its
reduction order, from the number of rows it is given; in low precision a token's logits then depend on whether it
was scored alone, in a γ+1-row verification pass, in a tree or next to other requests, and greedy speculative
output drifts from plain decoding at near-ties. The two kernels here (kernels/*.cpp) compute every row with the
same loops in the same order whatever the pass holds, so they cannot:

- `specdec::row_attention` for `F.scaled_dot_product_attention` (with an explicit mask);
- `specdec::row_linear` for `F.linear`: small-row-count GEMMs that read each weight once for a block of rows, with
  the CPU's bf16 dot-product instruction where it has one.

Two more serve the compiled fast path's graphs: `specdec::packed_linear` (pre-packed weights, wired by
runtime/fuse_linears.py) and `specdec::argmax_finite` (each row's argmax and whether every logit is finite, in one
read of a pass's logits; `argmax_finite` below).

`row_invariant(linear=...)` is a `TorchFunctionMode` that routes those calls, made by a Hugging Face model inside it,
to the kernels: no model file is forked and nothing is written on a model's config. The fast path enters it in its
passes, where `torch.compile` traces through it and keeps each kernel as one opaque call. Calls a kernel cannot
serve (dropout, `is_causal` without a mask, float64, another device) go to PyTorch unchanged.

The kernels are compiled on first use with `torch.utils.cpp_extension` for this CPU (its vector width, and the bf16
dot product where present), ~20 s once per machine: the build is cached under `~/.cache/torch_extensions`
(`TORCH_EXTENSIONS_DIR`). It needs the C++ compiler inductor needs anyway, and `ninja` (a dependency of specdec).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

log = logging.getLogger("specdec.fastpath")

SOURCES = [Path(__file__).resolve().parent / "kernels" / name
           for name in ("row_attention.cpp", "row_linear.cpp", "packed_linear.cpp", "row_argmax.cpp")]

#: PyTorch's CPU capability (torch.backends.cpu.get_cpu_capability()) -> compiler flags for ATen's vector types.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}

#: What the kernels compute in (float32 arithmetic); float64 stays with PyTorch's kernels.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bf16_dot_product() -> bool:
    """Whether this CPU has AVX512_BF16's dot-product instruction."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


@functools.cache
def load_kernel() -> None:
    """Build (first use on this machine) or load the kernels and register their shape functions."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 (heavy; only the fast path needs it)

    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffp-contract=off", *_CAPABILITY_FLAGS.get(capability, [])]
    name = f"specdec_rowwise_{capability.lower()}"
    if capability == "AVX512" and _bf16_dot_product():
        flags.append("-mavx512bf16")
        name += "_bf16"
    start = time.perf_counter()
    load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags, is_python_module=False)
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        log.info("built the row-invariant kernels (%s) in %.1f s", name, elapsed)

    @torch.library.register_fake("specdec::row_attention")
    def _(q, k, v, mask, scale):  # [B, H, M, D], as q
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    @torch.library.register_fake("specdec::row_linear")
    def _(x, weight, bias):  # [..., N]
        return torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)

    @torch.library.register_fake("specdec::packed_linear")
    def _(x, packed, bias, n):  # [..., N]
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)

    @torch.library.register_fake("specdec::argmax_finite")
    def _(logits):  # [...] int64, [] bool
        return (torch.empty(logits.shape[:-1], dtype=torch.long, device=logits.device),
                torch.empty((), dtype=torch.bool, device=logits.device))


def packed_linear_serves(weight: torch.Tensor) -> bool:
    """Whether `specdec::packed_linear` (kernels/packed_linear.cpp) can run with this weight here: a 2-D CPU weight,
    float32 on a CPU with AVX-512 or bfloat16 on one with AVX512_BF16."""
    if weight.device.type != "cpu" or weight.dim() != 2 or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _bf16_dot_product())


def _ensure_loaded() -> None:
    if not torch.compiler.is_compiling():  # a compiled pass is traced after an eager one loaded them
        load_kernel()


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  scale: float | None = None) -> torch.Tensor:
    """softmax(scale · query keyᵀ + attn_mask) value, each query row on its own. query [B, H, M, D]; key, value
    [B, Hkv, L, D] (H a multiple of Hkv); attn_mask additive [B|1, H|1, M, L] or boolean (True = attend)."""
    _ensure_loaded()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.specdec.row_attention(query, key, value, attn_mask, float(scale))


def argmax_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits.argmax(-1), torch.isfinite(logits).all()) for logits [..., V]: on CPU float32, bfloat16 and float16
    in one read (`specdec::argmax_finite`, kernels/row_argmax.cpp), elsewhere by PyTorch's two reductions. The
    indices are unspecified where `finite` is false."""
    if logits.device.type == "cpu" and logits.dtype in DTYPES:
        _ensure_loaded()
        return torch.ops.specdec.argmax_finite(logits)
    return logits.argmax(dim=-1), torch.isfinite(logits).all()


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x weightᵀ + bias, each output element in one fixed reduction order. x [..., K], weight [N, K] -> [..., N]."""
    _ensure_loaded()
    return torch.ops.specdec.row_linear(x, weight, bias)


class row_invariant(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch's modes)
    """Inside this context, `F.scaled_dot_product_attention` (and with linear=True, `F.linear`) on CPU tensors of
    float32, bfloat16 or float16 run the row-invariant kernels."""

    def __init__(self, linear: bool = False):
        super().__init__()
        self.linear = linear

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            served = _attention_args(*args, **kwargs)
            if served is not None:
                return row_attention(*served)
        elif func is F.linear and self.linear and _linear_served(*args, **kwargs):
            return row_linear(*args, **kwargs)
        return func(*args, **kwargs)


def _attention_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """(query, key, value, attn_mask, scale) when row_attention computes this call exactly, else None."""
    if dropout_p or is_causal or query.device.type != "cpu" or query.dim() != 4:
        return None
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return None
    if query.shape[1] % key.shape[1]:
        return None
    return query, key, value, attn_mask, scale


def _linear_served(input, weight, bias=None) -> bool:
    return (input.device.type == "cpu" and input.dtype in DTYPES and weight.dtype == input.dtype
            and weight.dim() == 2 and (bias is None or bias.dtype == input.dtype))
