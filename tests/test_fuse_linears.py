"""The compiled path's graph pass (runtime/fuse_linears.py): the row-invariant linear's calls that read one input
become one call on the concatenated weights, with the same bits, and nothing else is fused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import tiny

from specdec.runtime import fuse_linears
from specdec.runtime.compiled import COMPILE_OPTIONS
from specdec.runtime.fuse_linears import FuseRowLinears
from specdec.runtime.rowwise import load_kernel, packed_linear_serves, row_invariant


@pytest.fixture
def unpacked(monkeypatch):
    """The pass without packing (as on a CPU the packed kernel does not serve): fusion alone."""
    monkeypatch.setattr(fuse_linears, "packs", lambda weight, nbytes=None: False)


def row_linear_calls(graph: torch.fx.Graph) -> int:
    return sum(node.op == "call_function" and node.target is torch.ops.specdec.row_linear.default
               for node in graph.nodes)


class Projections(torch.nn.Module):
    """q/k/v-like projections of x (constant weights, one with and one without biases), one of another input, and
    one whose weight is an input of the graph (not a constant: not fused)."""

    def __init__(self, bias: bool):
        super().__init__()
        torch.manual_seed(0)
        for name, n in (("wq", 24), ("wk", 8), ("wv", 8), ("wo", 16)):
            self.register_buffer(name, torch.randn(n, 16, dtype=torch.bfloat16))
        self.register_buffer("bq", torch.randn(24, dtype=torch.bfloat16) if bias else None)
        self.register_buffer("bk", torch.randn(8, dtype=torch.bfloat16) if bias else None)
        self.register_buffer("bv", torch.randn(8, dtype=torch.bfloat16) if bias else None)

    def forward(self, x, y, w_input):
        op = torch.ops.specdec.row_linear.default
        q, k, v = op(x, self.wq, self.bq), op(x, self.wk, self.bk), op(x, self.wv, self.bv)
        return q, k * 2, v, op(y, self.wo, None), op(x, w_input, None)


def traced(bias: bool, rows: int):
    """Projections, inputs for it (x of `rows` rows), and its traced graph module."""
    load_kernel()
    module = Projections(bias)
    inputs = (torch.randn(rows, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16),
              torch.randn(4, 16, dtype=torch.bfloat16))  # x, y, w_input
    return module, inputs, torch.fx.symbolic_trace(module)


@pytest.mark.parametrize("bias", [False, True])
def test_calls_sharing_an_input_and_constant_weights_become_one_with_the_same_bits(bias, unpacked):
    module, inputs, graph_module = traced(bias, rows=3)
    before = module(*inputs)
    assert row_linear_calls(graph_module.graph) == 5
    FuseRowLinears()(graph_module.graph)
    graph_module.graph.lint()
    graph_module.recompile()
    # q, k, v -> one call; the projection of y alone and the one with an input weight stay
    assert row_linear_calls(graph_module.graph) == 3
    after = graph_module(*inputs)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_copies_are_made_once_and_shared_and_large_weights_are_not_copied(monkeypatch, unpacked):
    load_kernel()
    module = Projections(bias=False)
    inputs = (torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16),
              torch.randn(4, 16, dtype=torch.bfloat16))
    shared: dict = {}
    outputs = []
    for _ in range(2):  # two passes of one model share the concatenated weight
        graph_module = torch.fx.symbolic_trace(module)
        FuseRowLinears(shared=shared)(graph_module.graph)
        graph_module.recompile()
        outputs.append(graph_module(*inputs))
    (copy,) = shared.values()
    assert copy.shape == (40, 16) and len(shared) == 1
    assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))
    monkeypatch.setattr(fuse_linears, "MAX_COPY_BYTES", 40 * 16 * 2 - 1)  # q, k, v: 40 rows of 16 bf16
    graph_module = torch.fx.symbolic_trace(module)
    FuseRowLinears()(graph_module.graph)
    assert row_linear_calls(graph_module.graph) == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 7, 33])  # a decoding pass, a verification pass, a prefill chunk
@pytest.mark.parametrize("bias", [False, True])
def test_packing_runs_every_constant_weight_on_the_packed_kernel(bias, rows, dtype):
    if not packed_linear_serves(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip(f"packed_linear does not serve {dtype} on this CPU")
    module, (x, y, w_input), _ = traced(bias, rows=rows)
    module, x, y, w_input = module.to(dtype), x.to(dtype), y.to(dtype), w_input.to(dtype)
    graph_module = torch.fx.symbolic_trace(module)
    FuseRowLinears()(graph_module.graph)
    graph_module.recompile()
    packed = [n for n in graph_module.graph.nodes if n.target is torch.ops.specdec.packed_linear.default]
    assert len(packed) == 2 and row_linear_calls(graph_module.graph) == 1  # qkv and wo; not the input weight
    q, k, v, o, _ = graph_module(x, y, w_input)
    ops = torch.ops.specdec
    qkv = ops.packed_linear(x, ops.pack_weight(torch.cat([module.wq, module.wk, module.wv])),
                            torch.cat([module.bq, module.bk, module.bv]) if bias else None, 40)
    assert torch.equal(torch.cat([q, k / 2, v], dim=-1), qkv)
    assert torch.equal(o, ops.packed_linear(y, ops.pack_weight(module.wo), None, 16))
    torch.testing.assert_close(o, ops.row_linear(y, module.wo, None), atol=0.1, rtol=0.02)


def test_whether_a_weight_is_packed_depends_on_the_weight_alone():
    """Every compiled pass of a path decides alike: by the weight's dtype (where the kernel serves it on this CPU)
    and size, never by the pass."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        weight = torch.zeros(64, 32, dtype=dtype)
        assert fuse_linears.packs(weight) == packed_linear_serves(weight)
        assert not fuse_linears.packs(weight, nbytes=fuse_linears.MAX_COPY_BYTES + 1)
    assert not packed_linear_serves(torch.zeros(64, 32, dtype=torch.float16))
    assert not packed_linear_serves(torch.zeros(64, 32, dtype=torch.float64))


def test_a_bias_on_some_calls_only_is_not_fused(unpacked):
    load_kernel()
    module = Projections(bias=True)
    module.bk = None  # q and v have biases, k has none
    graph_module = torch.fx.symbolic_trace(module)
    FuseRowLinears()(graph_module.graph)
    assert row_linear_calls(graph_module.graph) == 5


class Counting(FuseRowLinears):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        before = row_linear_calls(graph)
        super().__call__(graph)
        self.seen.append((before, row_linear_calls(graph)))


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_a_compiled_model_pass_makes_fewer_calls_with_the_same_bits(arch, unpacked):
    load_kernel()
    model = tiny(arch, hidden=64, layers=2, dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 7))

    def forward(ids):
        with row_invariant(linear=True):
            return model(ids).logits

    logits = {}
    counting = Counting()
    for name, graph_pass in (("fused", counting), ("separate", None)):
        torch._dynamo.reset()
        options = {**COMPILE_OPTIONS, "joint_custom_pre_pass": graph_pass, "fx_graph_cache": False}
        with torch._dynamo.config.patch(prepare_freezing=True), torch.inference_mode():
            logits[name] = torch.compile(forward, fullgraph=True, dynamic=False, options=options)(ids)
    torch._dynamo.reset()
    assert torch.equal(logits["fused"], logits["separate"])
    layers = model.config.num_hidden_layers
    # per layer q, k, v, o, gate, up, down -> qkv, o, gate_up, down; and the LM head
    assert counting.seen == [(7 * layers + 1, 4 * layers + 1)]


@pytest.mark.compile
def test_a_compiled_pass_reads_its_own_model_s_weights_after_a_model_of_the_same_shape(tmp_path, monkeypatch):
    """The pass's copies (packed or concatenated weights) are constants of the compiled graph, so inductor's cache
    key names their values: a model of the same shape with other weights, compiled later against the same cache
    (here one process, one cache directory), runs its own weights, not the first model's copies."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    import specdec  # noqa: PLC0415

    prompt = list(range(5, 25))
    for seed in (1, 2):
        model = tiny("llama", hidden=64, layers=2, vocab=256, seed=seed, dtype=torch.float32)
        eager = specdec.generate(model, prompt, max_new_tokens=12).tokens
        assert specdec.generate(model, prompt, max_new_tokens=12, compile=True).tokens == eager, seed


def test_the_cache_key_names_the_kernels_build_and_the_rules_of_packing(monkeypatch):
    """A graph compiled for one kernel build (its tier: the packed layout; its rules: which weights are packed) is
    never served to another: the pass's uuid, part of inductor's cache key, changes with the build and with
    rowwise.py, and stays put otherwise."""
    from specdec.runtime import rowwise  # noqa: PLC0415

    fuse = FuseRowLinears(weights="w")
    here = fuse.uuid()
    assert FuseRowLinears(weights="w").uuid() == here
    assert FuseRowLinears(weights="v").uuid() != here
    other = next(t for t in rowwise.TIER_FLAGS if t != rowwise.kernel_tier())
    monkeypatch.setattr(rowwise, "kernel_tier", lambda: other)
    assert fuse.uuid() != here
    monkeypatch.undo()
    hashed = []
    monkeypatch.setattr(fuse_linears, "get_hash_for_files",
                        lambda paths: hashed.extend(paths) or b"")
    fuse.uuid()
    assert {Path(p).name for p in hashed} == {"fuse_linears.py", "rowwise.py"}


@pytest.mark.compile
def test_passes_loaded_from_inductor_s_cache_read_one_shared_set_of_copies(tmp_path, monkeypatch):
    """The copies are folded in by freezing whenever a pass is compiled or loaded from inductor's cache, from the
    model's shared set: passes loaded from the cache (here a prefill and a verification pass) make
    the same copies as when compiled, one per weight for all of them, and are never served copies stored with a
    cached graph (one more set of weights per compiled shape)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    import specdec  # noqa: PLC0415
    from specdec.runtime.compiled import COMPILED  # noqa: PLC0415

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = tiny("llama", hidden=64, layers=2, vocab=256, seed=3, dtype=torch.float32)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: prompt lookup drafts, so verification passes run
    runs = []
    for _ in range(2):  # compiled, then loaded from the cache
        torch._dynamo.reset()
        COMPILED.pop(model, None)  # the model's passes and copies start over
        counters.clear()
        tokens = specdec.generate(model, prompt, max_new_tokens=16, compile=True, drafter=specdec.PromptLookup(),
                                  gamma=3).tokens
        entry = COMPILED[model]
        runs.append((tokens, len(entry.fns), sorted(tuple(c.shape) for c in entry.copies.values()),
                     counters["inductor"]["fxgraph_cache_hit"]))
    (tokens, passes, copies, hits), (tokens2, passes2, copies2, hits2) = runs
    assert passes >= 2 and hits == 0 and hits2 == passes2 == passes  # the second run loaded every pass
    layers = model.config.num_hidden_layers
    assert len(copies) == 4 * layers + 1 and copies2 == copies  # qkv, o, gate_up, down per layer; the LM head
    assert tokens2 == tokens == specdec.generate(model, prompt, max_new_tokens=16).tokens
