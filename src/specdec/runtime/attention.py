"""Row-invariant attention for the fast path.

A library attention kernel (PyTorch's CPU flash attention, a batched matmul) picks its blocking, and so its
reduction order, from the number of query rows; in bfloat16 a token's logits then depend on whether it was scored
alone, in a γ+1-row verification pass, in a tree or next to other requests, and greedy speculative output can
drift from plain decoding at near-ties. `specdec::row_attention` (kernels/row_attention.cpp) computes every
query row with the same loops in the same order whatever the pass holds, so it cannot.

`row_invariant_attention()` is a `TorchFunctionMode` that routes `F.scaled_dot_product_attention` (what a Hugging
Face model calls with its "sdpa" attention) to that kernel for the model passes run inside it: no model file is
forked and nothing is written on a model's config. It is entered inside the fast path's passes, where
`torch.compile` traces through it and keeps the kernel as one opaque call per layer. Calls it cannot serve
(dropout, `is_causal` without a mask) go to PyTorch unchanged.

The kernel is compiled on first use with `torch.utils.cpp_extension` for this CPU's vector width (AVX-512 or
AVX2, as PyTorch's own kernels are), ~15 s once per machine: the build is cached under
`~/.cache/torch_extensions` (`TORCH_EXTENSIONS_DIR`). It needs the C++ compiler that inductor needs anyway, and
`ninja` (a dependency of specdec).
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

SOURCE = Path(__file__).resolve().parent / "kernels" / "row_attention.cpp"

#: PyTorch's CPU capability (torch.backends.cpu.get_cpu_capability()) -> compiler flags for ATen's vector types.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}


@functools.cache
def load_kernel() -> None:
    """Build (first use on this machine) or load `specdec::row_attention` and register its shape function."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 (heavy; only the fast path needs it)

    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffp-contract=off", *_CAPABILITY_FLAGS.get(capability, [])]
    start = time.perf_counter()
    load(name=f"specdec_row_attention_{capability.lower()}", sources=[str(SOURCE)], extra_cflags=flags,
         is_python_module=False)
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        log.info("built the row-invariant attention kernel (%s) in %.1f s", capability, elapsed)

    @torch.library.register_fake("specdec::row_attention")
    def _(q, k, v, mask, scale):  # [B, H, M, D], as q
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  scale: float | None = None) -> torch.Tensor:
    """softmax(scale · query keyᵀ + attn_mask) value, each query row on its own. query [B, H, M, D]; key, value
    [B, Hkv, L, D] (H a multiple of Hkv); attn_mask additive [B|1, H|1, M, L] or boolean (True = attend)."""
    if not torch.compiler.is_compiling():  # a compiled pass is traced after an eager one loaded it
        load_kernel()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.specdec.row_attention(query, key, value, attn_mask, float(scale))


#: What the kernel computes in (in float32 arithmetic); float64 stays with PyTorch's kernels.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class row_invariant_attention(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch's modes)
    """Inside this context, `F.scaled_dot_product_attention` on CPU tensors runs `row_attention`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            served = _served(*args, **kwargs)
            if served is not None:
                return row_attention(*served)
        return func(*args, **kwargs)


def _served(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """(query, key, value, attn_mask, scale) when row_attention computes this call exactly, else None."""
    if dropout_p or is_causal or query.device.type != "cpu" or query.dim() != 4:
        return None
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return None
    if query.shape[1] % key.shape[1]:
        return None
    return query, key, value, attn_mask, scale
