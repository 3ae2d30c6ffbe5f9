"""The rotary tables of a compiled pass computed once, not once per layer and head.

A Llama-shaped model computes its rotary embedding's cos and sin once per forward (a [1, M, head_dim] table each)
and hands them to every layer. Inductor inlines a cheap pointwise result into each of its consumers instead of
storing it, and on a CPU it only stores a reused result whose code holds exp, log, sigmoid or tanh: cos and sin are
not among them. So every layer recomputed both tables for its query and its key rotation, head by head (72 times
each per pass on the default target: 6 layers x q and k x 6 heads), and those vectorised sines and cosines made
the costliest fused kernel of a verification pass: ~7 µs a layer for 8 rows in bfloat16 on the project's CPU.

`ComputeOnce` (inductor's `post_grad_custom_post_pass`) puts a storage point after every cos and sin of the graph
(`inductor_prims.force_stride_order` at the node's own strides: inductor computes the node into a buffer there and
its consumers read that buffer). Nothing else changes: the same float32 values are computed by the same vectorised
code, once, and each consumer reads them where it computed them before (tests/test_compute_once.py compares the
logits bit for bit). On the default target in bfloat16, one thread: an 8-row verification pass ~1.09 -> 1.00 ms, a
one-row pass ~0.72 -> 0.68 ms (docs/fastpath.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch._inductor import inductor_prims
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

#: The ops whose results are stored once per pass.
TRANSCENDENTAL = (torch.ops.aten.cos.default, torch.ops.aten.sin.default)


class ComputeOnce(CustomGraphPass):
    """The graph pass of the module's docstring; `uuid` keys inductor's cache on this file."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in TRANSCENDENTAL or not node.users:
                continue
            value = node.meta.get("val")
            if value is None:
                continue
            with graph.inserting_after(node):
                stored = graph.call_function(inductor_prims.force_stride_order, (node, tuple(value.stride())))
            stored.meta["val"] = value
            node.replace_all_uses_with(stored, delete_user_cb=lambda user: user is not stored)

    def uuid(self) -> bytes:
        return hashlib.sha256(get_hash_for_files((str(Path(__file__).resolve()),))).digest()
