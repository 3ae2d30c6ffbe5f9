"""Grouped-query attention on the key/value heads themselves: the copy of the KV cache per query head dropped.

A model with fewer key/value heads than query heads (GQA: Qwen2.5-0.5B has 14 query heads on 2 key/value heads)
hands its attention call keys and values repeated to one head per query head. Transformers' sdpa path does so with
`repeat_kv` (an unsqueeze, an expand and a reshape, which copies) whenever a mask is passed and the call is traced,
as every fast-path pass is. The copy is of the whole cache, every slot up to its capacity, in every layer: at the
0.5B shape with 512 slots, 1.8 MB written and read a layer, 44 MB a pass, ~3.4 ms of a 53 ms one-row w8a8 pass on
one core of the Xeon model 207 (`perf`, docs/fastpath.md). `specdec::row_attention` reads GQA as it is: query head
h attends with key/value head h / (H / Hkv), which is the head `repeat_kv` copied into place h.

`ShareKVHeads` (inductor's `post_grad_custom_pre_pass`) hands each attention call the keys and values from before
the repeat where its key or value is exactly such a repeat (`repeated`): [B, Hkv, L, D] -> unsqueeze(2) -> expand to
[B, Hkv, r, L, D] -> clone (optional) -> reshape or view to [B, Hkv * r, L, D]. Each query row then reads the same
values in the same order, so the logits are the same bits (tests/test_shared_kv_heads.py); the repeat, now read by
nothing, is dropped.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from specdec.runtime.rowwise import load_kernel

aten = torch.ops.aten
RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
CLONES = (aten.clone.default,)


def _call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def repeated(node: torch.fx.Node) -> torch.fx.Node | None:
    """The [B, Hkv, L, D] tensor whose heads `node` repeats (each r times, in place h * r .. h * r + r - 1), or None
    where `node` is not exactly such a repeat."""
    if not _call(node, RESHAPES):
        return None
    expanded = node.args[0]
    if _call(expanded, CLONES):
        expanded = expanded.args[0]
    if not _call(expanded, (aten.expand.default,)):
        return None
    unsqueezed = expanded.args[0]
    if not _call(unsqueezed, (aten.unsqueeze.default,)) or unsqueezed.args[1] % 5 != 2:  # dim 2 (or -3) of 5
        return None
    source = unsqueezed.args[0]
    if not isinstance(source, torch.fx.Node) or any("val" not in n.meta for n in (source, expanded, node)):
        return None
    if source.meta["val"].dim() != 4 or expanded.meta["val"].dim() != 5:
        return None
    b, hkv, length, d = source.meta["val"].shape
    b5, hkv5, r, length5, d5 = expanded.meta["val"].shape
    if (b5, hkv5, length5, d5) != (b, hkv, length, d):
        return None
    return source if tuple(node.meta["val"].shape) == (b, hkv * r, length, d) else None


class ShareKVHeads(CustomGraphPass):
    """The graph pass of the module's docstring; `uuid` keys inductor's cache on this file."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        load_kernel()  # (loaded already when a pass compiles; it names the attention op)
        attention = torch.ops.specdec.row_attention.default
        dropped = []
        for call in graph.nodes:
            if call.op != "call_function" or call.target is not attention:
                continue
            args = list(call.args)
            for i in (1, 2):  # key, value
                source = repeated(args[i]) if isinstance(args[i], torch.fx.Node) else None
                if source is not None:
                    dropped.append(args[i])
                    args[i] = source
            call.args = tuple(args)
        for node in dict.fromkeys(dropped):  # the repeats no call reads now: the reshape, clone, expand, unsqueeze
            while isinstance(node, torch.fx.Node) and not node.users and node.op == "call_function":
                source = node.args[0]
                graph.erase_node(node)
                node = source

    def uuid(self) -> bytes:
        return hashlib.sha256(get_hash_for_files((str(Path(__file__).resolve()),))).digest()
