"""The tables of a compiled pass computed once (runtime/compute_once.py): every cos and sin of the graph, and the
mask its attention calls read, get a storage point that their consumers read, and the logits are the same bits as
without the pass."""

from __future__ import annotations

import pytest
import torch
from models import tiny
from torch._inductor import inductor_prims
from torch.fx.experimental.proxy_tensor import make_fx

from specdec.core.masks import additive_mask
from specdec.runtime.compiled import COMPILE_OPTIONS
from specdec.runtime.compute_once import ComputeOnce
from specdec.runtime.fuse_linears import FuseRowLinears
from specdec.runtime.rowwise import load_kernel, row_invariant


def stored(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The storage points of a graph: the nodes ComputeOnce inserts."""
    return [node for node in graph.nodes
            if node.op == "call_function" and node.target is inductor_prims.force_stride_order]


def test_each_cos_and_sin_is_read_through_one_storage_point_by_all_its_consumers():
    def tables(x):
        cos, sin = x.cos(), x.sin()
        return cos * 2, cos + 1, sin * 3, sin - cos, x.exp()

    x = torch.randn(3, 8)
    graph_module = make_fx(tables)(x)  # aten ops, each node with its value's metadata (as a post-grad graph)
    before = graph_module(x)

    ComputeOnce()(graph_module.graph)
    graph_module.recompile()

    points = stored(graph_module.graph)
    assert [point.args[0].target for point in points] == [torch.ops.aten.cos.default, torch.ops.aten.sin.default]
    for point in points:
        source = point.args[0]
        assert list(source.users) == [point]  # every consumer reads the stored table
        assert point.args[1] == tuple(source.meta["val"].stride())
    assert len(points[0].users) == 3 and len(points[1].users) == 2  # cos: *2, +1, sin - cos; sin: *3, sin - cos
    after = graph_module(x)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


class Counting(ComputeOnce):
    def __init__(self):
        self.seen: list[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        super().__call__(graph)
        self.seen.append(len(stored(graph)))


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_a_compiled_model_pass_stores_its_rotary_tables_and_mask_once_with_the_same_bits(dtype):
    load_kernel()
    model = tiny("llama", hidden=64, layers=3, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, 7))

    def forward(ids):
        positions = torch.arange(ids.shape[1])
        mask = additive_mask(positions[None, :] <= positions[:, None], dtype)[None, None]  # [1, 1, M, M], computed
        with row_invariant(linear=True):
            return model(ids, attention_mask=mask).logits

    logits = {}
    counting = Counting()
    for name, graph_pass in (("once", counting), ("inlined", None)):
        torch._dynamo.reset()
        options = {**COMPILE_OPTIONS, "joint_custom_pre_pass": FuseRowLinears(),
                   "post_grad_custom_post_pass": graph_pass, "fx_graph_cache": False}
        with torch._dynamo.config.patch(prepare_freezing=True), torch.inference_mode():
            logits[name] = torch.compile(forward, fullgraph=True, dynamic=False, options=options)(ids)
    torch._dynamo.reset()
    assert torch.equal(logits["once"], logits["inlined"])
    assert counting.seen == [3]  # the model's one cos table, one sin table and one mask, for all its layers
