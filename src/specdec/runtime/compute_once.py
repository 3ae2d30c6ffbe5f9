"""The tables a compiled pass reads in every layer computed once: the rotary cos and sin, and the attention mask.

A Llama-shaped model computes its rotary embedding's cos and sin once per forward (a [1, M, head_dim] table each)
and hands them to every layer. Inductor inlines a cheap pointwise result into each of its consumers instead of
storing it, and on a CPU it only stores a reused result whose code holds exp, log, sigmoid or tanh: cos and sin are
not among them. So every layer recomputed both tables for its query and its key rotation, head by head (72 times
each per pass on the default target: 6 layers x q and k x 6 heads), and those vectorised sines and cosines made
the costliest fused kernel of a verification pass: ~7 µs a layer for 8 rows in bfloat16 on the project's CPU.
Likewise the additive mask the slot cache builds for a pass (runtime/slot_cache.py, [M, max_len]) reaches each
layer's attention call through views, and inductor computed a copy of it for every call.

`ComputeOnce` (inductor's `post_grad_custom_post_pass`) puts a storage point after every cos and sin of the graph
and after the computed mask of every attention call (`inductor_prims.force_stride_order` at the node's own strides:
inductor computes the node into a buffer there and its consumers read that buffer). Nothing else changes: the same
values are computed by the same vectorised code, once, and each consumer reads them where it computed them before
(tests/test_compute_once.py compares the logits bit for bit). On the default target in bfloat16, one thread: an
8-row verification pass ~1.09 -> 1.00 ms, a one-row pass ~0.72 -> 0.68 ms (docs/fastpath.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch._inductor import inductor_prims
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from specdec.runtime.rowwise import load_kernel

aten = torch.ops.aten
#: The ops whose results are stored once per pass.
TRANSCENDENTAL = (aten.cos.default, aten.sin.default)
#: Ops that only view their first argument: a mask reaches the attention calls through them.
VIEWS = (aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default, aten.slice.Tensor,
         aten.squeeze.dim)


class ComputeOnce(CustomGraphPass):
    """The graph pass of the module's docstring; `uuid` keys inductor's cache on this file."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        load_kernel()  # (loaded already when a pass compiles; it names the attention op)
        computed = [node for node in graph.nodes if node.op == "call_function" and node.target in TRANSCENDENTAL]
        attention = torch.ops.specdec.row_attention.default
        for call in graph.nodes:  # the mask of each attention call, where the graph computes it
            if call.op == "call_function" and call.target is attention and isinstance(call.args[3], torch.fx.Node):
                mask = call.args[3]
                while mask.op == "call_function" and mask.target in VIEWS:
                    mask = mask.args[0]
                if mask.op == "call_function" and mask not in computed:
                    computed.append(mask)
        for node in computed:
            value = node.meta.get("val")
            if value is None or not node.users:
                continue
            with graph.inserting_after(node):
                stored = graph.call_function(inductor_prims.force_stride_order, (node, tuple(value.stride())))
            stored.meta["val"] = value
            node.replace_all_uses_with(stored, delete_user_cb=lambda user: user is not stored)

    def uuid(self) -> bytes:
        return hashlib.sha256(get_hash_for_files((str(Path(__file__).resolve()),))).digest()
