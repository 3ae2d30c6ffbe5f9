"""Grouped-query attention on the key/value heads themselves (runtime/shared_kv_heads.py): a compiled pass's
attention calls read the cache's own heads instead of a copy repeated per query head, with the same bits."""

from __future__ import annotations

import pytest
import torch
from models import tiny
from torch.fx.experimental.proxy_tensor import make_fx

from specdec.core.masks import additive_mask
from specdec.runtime.compiled import COMPILE_OPTIONS
from specdec.runtime.rowwise import load_kernel, row_attention, row_invariant
from specdec.runtime.shared_kv_heads import ShareKVHeads

aten = torch.ops.aten


def repeat_kv(x: torch.Tensor, r: int) -> torch.Tensor:
    """transformers' repeat: each head r times in place ([B, Hkv, L, D] -> [B, Hkv * r, L, D])."""
    b, hkv, length, d = x.shape
    return x[:, :, None, :, :].expand(b, hkv, r, length, d).reshape(b, hkv * r, length, d)


def tile_kv(x: torch.Tensor, r: int) -> torch.Tensor:
    """The heads tiled instead (head h reads key/value head h % Hkv): not what row_attention computes from GQA."""
    b, hkv, length, d = x.shape
    return x[:, None].expand(b, r, hkv, length, d).reshape(b, r * hkv, length, d)


def attention_inputs(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    return [(n.args[1], n.args[2]) for n in graph.nodes if n.target is torch.ops.specdec.row_attention.default]


@pytest.mark.parametrize("repeat, rewritten", [(repeat_kv, True), (tile_kv, False)], ids=["repeat", "tile"])
def test_the_attention_reads_the_unrepeated_heads_only_where_the_repeat_is_transformers(repeat, rewritten):
    load_kernel()
    q, k, v = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)  # 6 query heads on 2
    mask = torch.zeros(1, 1, 3, 5)

    def attend(q, k, v, mask):
        return row_attention(q, repeat(k, 3), repeat(v, 3), mask, 0.5)

    graph_module = make_fx(attend)(q, k, v, mask)  # aten ops with their values' metadata, as a post-grad graph
    before = graph_module(q, k, v, mask)
    ShareKVHeads()(graph_module.graph)
    graph_module.recompile()

    [(key, value)] = attention_inputs(graph_module.graph)
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    assert ((key, value) == (placeholders[1], placeholders[2])) is rewritten
    expands = [n for n in graph_module.graph.nodes if n.target is aten.expand.default]
    assert len(expands) == (0 if rewritten else 2)  # the dropped repeats leave nothing behind
    assert torch.equal(graph_module(q, k, v, mask), before)


class Counting(ShareKVHeads):
    def __init__(self):
        self.unrepeated: list[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        super().__call__(graph)
        self.unrepeated.append(sum(not _repeated_shape(n) for pair in attention_inputs(graph) for n in pair))


def _repeated_shape(node: torch.fx.Node) -> bool:
    return node.meta["val"].shape[1] == 4  # the query heads' count (the tiny models' key/value heads: 2)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 5])
def test_a_compiled_gqa_pass_reads_the_cache_heads_with_the_same_bits(dtype, rows):
    load_kernel()
    model = tiny("qwen2", hidden=64, layers=3, dtype=dtype)  # 4 query heads on 2 key/value heads
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads
    ids = torch.randint(0, model.config.vocab_size, (1, rows))

    def forward(ids):
        positions = torch.arange(ids.shape[1])
        mask = additive_mask(positions[None, :] <= positions[:, None], dtype)[None, None]  # [1, 1, M, M]
        with row_invariant(linear=True):
            return model(ids, attention_mask=mask).logits

    logits = {}
    counting = Counting()
    for name, graph_pass in (("shared", counting), ("repeated", None)):
        torch._dynamo.reset()
        options = {**COMPILE_OPTIONS, "post_grad_custom_pre_pass": graph_pass, "fx_graph_cache": False}
        with torch._dynamo.config.patch(prepare_freezing=True), torch.inference_mode():
            logits[name] = torch.compile(forward, fullgraph=True, dynamic=False, options=options)(ids)
    torch._dynamo.reset()
    assert counting.unrepeated == [6]  # every layer's key and value: 3 layers x 2
    assert torch.equal(logits["shared"], logits["repeated"])


@pytest.mark.filterwarnings("error")  # fx warns when a node is erased twice
def test_a_key_and_value_from_one_repeat_are_both_handed_the_heads_and_the_repeat_dropped_once():
    load_kernel()
    q, kv = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8)

    def attend(q, kv):
        repeated = repeat_kv(kv, 2)
        return row_attention(q, repeated, repeated, None, 0.5)

    graph_module = make_fx(attend)(q, kv)
    before = graph_module(q, kv)
    ShareKVHeads()(graph_module.graph)
    graph_module.recompile()
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    assert attention_inputs(graph_module.graph) == [(placeholders[1], placeholders[1])]
    assert torch.equal(graph_module(q, kv), before)
