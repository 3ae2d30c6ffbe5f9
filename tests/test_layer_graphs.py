"""One graph per decoder layer (runtime/layer_graphs.py): which models compile that way, the layers' calls routed
only while a pass compiles, and the fast path's promises kept: compiled plain decoding is HF's greedy output, a
speculative decoder gives its tokens, sampling is exact, and no compiled shape compiles twice."""

from __future__ import annotations

import pytest
import torch
from models import hf_greedy, perturbed, tiny
from seq2seq_models import tiny_seq2seq

import specdec
from specdec.core.sampling import SamplingConfig
from specdec.exactness import check_exactness
from specdec.runtime import compiled, layer_graphs, static_lm
from specdec.runtime.batch_static import StaticBatchedCausalLM
from specdec.runtime.layer_graphs import LayerRegions
from specdec.runtime.static_lm import StaticCausalLM

PROMPT = [(i * 37 + 11) % 96 for i in range(20)]


@pytest.fixture
def every_model_by_layer(monkeypatch):
    """Every model large enough to compile one graph per layer (the tiny test models included)."""
    monkeypatch.setattr(layer_graphs, "LAYER_GRAPHS_MIN_BYTES", 0)


def test_small_models_and_encoder_decoders_compile_whole(every_model_by_layer, monkeypatch):
    model = tiny("llama", hidden=16, layers=3)
    assert LayerRegions(model).layers == tuple(model.model.layers)
    assert not LayerRegions(tiny_seq2seq("t5"))  # two stacks of layers
    monkeypatch.setattr(layer_graphs, "LAYER_GRAPHS_MIN_BYTES", 1 << 40)
    assert not LayerRegions(model)


def test_layers_are_routed_only_inside_the_block_and_run_their_own_forward_eagerly(every_model_by_layer):
    model = tiny("llama", hidden=16, layers=3)
    regions = LayerRegions(model)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        plain = model(ids).logits
        with regions.routed():
            assert all(layer.forward is call for layer, call in zip(model.model.layers, regions.calls))
            routed = model(ids).logits
    assert not any("forward" in vars(layer) for layer in model.model.layers)
    assert torch.equal(routed, plain)


def test_a_layer_calls_arguments_reach_the_region_as_leaves_and_come_back_whole():
    hidden, cos, sin = torch.ones(2), torch.zeros(2), torch.full((2,), 2.0)
    args = (hidden, None)
    kwargs = {"attention_mask": None, "position_embeddings": (cos, sin), "use_cache": False, "empty": ()}
    spec, leaves = layer_graphs._flatten(args, kwargs)
    assert [type(leaf) for leaf in leaves] == [torch.Tensor, type(None), type(None), torch.Tensor, torch.Tensor, bool]
    back_args, back_kwargs = layer_graphs._unflatten(spec, tuple(leaves))
    assert len(back_args) == 2 and back_args[0] is hidden and back_args[1] is None
    assert list(back_kwargs) == list(kwargs)
    assert back_kwargs["position_embeddings"][0] is cos and back_kwargs["position_embeddings"][1] is sin
    assert back_kwargs["attention_mask"] is None and back_kwargs["use_cache"] is False and back_kwargs["empty"] == ()
    assert layer_graphs._unflatten(*layer_graphs._flatten((), {})) == ((), {})
    size = torch.Size([2, 3])  # a tuple of another type goes as one leaf, whole
    assert layer_graphs._unflatten(*layer_graphs._flatten((), {"size": size}))[1]["size"] is size


@pytest.mark.compile
def test_compiled_by_layer_is_hf_greedy_and_speculative_gives_its_tokens(every_model_by_layer, monkeypatch):
    monkeypatch.setattr(compiled, "UNPLANNED_RECOMPILES", [])
    monkeypatch.setattr(static_lm, "ONE_ROW_GRAPH_AFTER", 1)
    target = tiny("llama", hidden=32, layers=3, seed=5)
    draft = perturbed(target, 0.1)
    entry_layers = LayerRegions(target).layers
    assert entry_layers
    expected = hf_greedy(target, PROMPT, 24)
    # Before the model has a one-row graph, a drafted request's rounds that draft nothing run padded on the graph of
    # symbolic row count; once one has (ONE_ROW_GRAPH_AFTER), the next request compiles it up front.
    auto = specdec.DraftModel(draft)
    first = specdec.generate(target, PROMPT, drafter=auto, gamma="auto", max_new_tokens=24, compile=True)
    assert first.tokens == expected and 0 in first.stats.gammas
    assert not {key for key in compiled.COMPILED[target].fns if key[1] == 1}
    assert compiled.COMPILED[target].padded_one_rows >= 1
    second = specdec.generate(target, PROMPT, drafter=auto, gamma="auto", max_new_tokens=24, compile=True)
    assert second.tokens == expected and second.stats.prefill_compile_s > 0
    assert {key[:2] for key in compiled.COMPILED[target].fns if key[1] == 1} == {("verify", 1)}
    assert specdec.generate(target, PROMPT, max_new_tokens=24, compile=True).tokens == expected
    assert compiled.COMPILED[target].layers.layers == entry_layers
    drafters = {3: specdec.DraftModel(draft), "auto": specdec.DraftModel(draft),  # "auto": widths 1, 3, 5 and 8
                2: specdec.DraftTree(draft, top_k=2, depth=3, max_nodes=6)}  # tree passes of 7 rows
    for gamma, drafter in drafters.items():
        for _ in range(2):  # the second request runs the graphs the first compiled
            out = specdec.generate(target, PROMPT, drafter=drafter, gamma=gamma, max_new_tokens=24, compile=True)
            assert out.tokens == expected
            assert out.stats.drafted > 0 and (gamma == "auto" or out.stats.accepted < out.stats.drafted)
        assert out.stats.compile_s == 0
    widths = {key[1] for key in compiled.COMPILED[target].fns if key[0] in ("prefill", "pass", "verify")}
    assert widths == {1, "3+"}  # every pass of 3 rows or more ran a graph whose row count is symbolic
    assert not compiled.UNPLANNED_RECOMPILES  # routing the layers for a compile leaves no guard to fail
    assert not any("forward" in vars(layer) for layer in target.model.layers)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_by_layer_gives_each_row_the_bits_of_a_one_row_pass(every_model_by_layer, monkeypatch, dtype):
    """The region runs the row-invariant kernels (a region is traced outside the pass's torch-function mode, so it
    enters the mode itself): a pass's logits are, row by row, those of one-row passes, at every width the graph of
    symbolic row count runs, scored alone or verified in the same graph."""
    monkeypatch.setattr(compiled, "UNPLANNED_RECOMPILES", [])
    target = tiny("llama", hidden=64, layers=2, vocab=96, seed=2, dtype=dtype)
    rows = torch.tensor(PROMPT[12:20])
    one = StaticCausalLM(target, compile=True, max_len=64)
    one.prefill(torch.tensor(PROMPT[:12]))
    alone = torch.cat([one.forward(rows[i : i + 1]) for i in range(8)])  # [8, V]
    assert compiled.COMPILED[target].layers
    for width in (4, 3, 5, 8):  # one graph of each kind for them all, its row count symbolic
        many = StaticCausalLM(target, compile=True, max_len=64)
        many.buckets = (1, 3, 4, 5, 8)  # unpadded
        many.prefill(torch.tensor(PROMPT[:12]))
        assert torch.equal(many.score(rows[:width]).logits, alone[:width])
        many.crop(12)
        scores, _ = many.score_and_verify(rows[:width], None, SamplingConfig(), None)
        assert torch.equal(scores.logits, alone[:width])
    many.crop(12)
    many.buckets = (3, 4, 5, 8)  # a one-row pass padded onto the graph of symbolic row count (ONE_ROW_GRAPH_AFTER)
    scores, _ = many.score_and_verify(rows[:1], None, SamplingConfig(), None)
    assert torch.equal(scores.logits, alone[:1])
    assert {key[:2] for key in compiled.COMPILED[target].fns} == {
        ("prefill", "3+"), ("pass", 1), ("pass", "3+"), ("verify", "3+")}
    assert not compiled.UNPLANNED_RECOMPILES


@pytest.mark.compile
def test_a_model_compiled_by_layer_is_not_frozen_so_a_new_process_takes_its_passes_from_the_caches(
        every_model_by_layer, monkeypatch):
    """A graph whose weights are inputs has nothing to freeze, and with freezing on AOTAutograd's cache refused it,
    so every new process traced it again (`compiled.LAYER_GRAPH_OPTIONS`). A second model object of the same weights
    stands in for a new process: its pass is served by AOTAutograd's cache, with the same logits. A model compiled
    whole keeps freezing and the pass that fuses and packs its linears."""
    model = tiny("llama", hidden=16, layers=3)
    options = compiled.Compiled(model).options()
    assert options["freezing"] is False and "joint_custom_pre_pass" not in options
    monkeypatch.setattr(layer_graphs, "LAYER_GRAPHS_MIN_BYTES", 1 << 40)
    options = compiled.Compiled(model).options()
    assert options["freezing"] is True and "joint_custom_pre_pass" in options
    monkeypatch.setattr(layer_graphs, "LAYER_GRAPHS_MIN_BYTES", 0)
    counts = torch._dynamo.utils.counters["aot_autograd"]
    rows = torch.tensor(PROMPT[12:15])
    logits = []
    for _ in range(2):
        target = tiny("llama", hidden=32, layers=2, vocab=96, seed=3)
        assert compiled.COMPILED.get(target) is None
        hits, bypassed = counts["autograd_cache_hit"], counts["autograd_cache_bypass"]
        one = StaticCausalLM(target, compile=True, max_len=64)
        one.buckets = (3,)
        one.prefill(torch.tensor(PROMPT[:12]))
        logits.append(one.score(rows).logits)
        assert counts["autograd_cache_bypass"] == bypassed
    assert counts["autograd_cache_hit"] >= hits + 2  # the second model's prefill and scoring pass
    assert torch.equal(logits[0], logits[1])


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_batched_rows_by_layer_are_the_requests_alone(every_model_by_layer, dtype):
    """A server's batched fast path (`StaticBatchedCausalLM`) on a model compiled by layer: each row of a batch's
    3-token pass gets, bit for bit, the logits its request alone gets from one-token passes on the single-row fast
    path (its prefill the same compiled chunks, its pass the graph of symbolic row count)."""
    target = tiny("llama", hidden=32, layers=2, vocab=96, seed=4, dtype=dtype)
    lengths = (12, 9, 15)
    prompts = [torch.tensor(PROMPT[:n]) for n in lengths]
    steps = [torch.tensor(PROMPT[n : n + 3]) for n in lengths]
    batch = StaticBatchedCausalLM(target, compile=True, max_len=64)
    batch.add_rows(prompts)
    together = batch.forward(steps)  # [3, 3, V]
    for prompt, step, row in zip(prompts, steps, together):
        alone = StaticCausalLM(target, compile=True, max_len=64)
        alone.prefill(prompt)
        assert torch.equal(torch.cat([alone.forward(step[j : j + 1]) for j in range(3)]), row)
    assert compiled.COMPILED[target].layers
    assert {key[:2] for key in compiled.COMPILED[target].fns} >= {("prefill", "3+"), ("batch-pass", "2+")}


class _Alternating:
    """A γ policy that drafts 2, nothing, 4, nothing, ...: rounds that draft nothing at fixed places."""

    gammas = (2, 4)

    def choose(self, stats) -> int:
        return (2, 0, 4, 0)[stats.rounds % 4]

    def update(self, stats) -> None:
        pass


@pytest.mark.compile
def test_a_padded_one_row_pass_samples_what_the_one_row_graph_samples(every_model_by_layer, monkeypatch):
    """At T > 0 a round that drafts nothing, run padded on the graph of symbolic row count (ONE_ROW_GRAPH_AFTER),
    draws its token with the same uniforms from the same logits as on the one-row graph: a seeded request gives the
    same tokens either way."""
    monkeypatch.setattr(compiled, "UNPLANNED_RECOMPILES", [])
    target = tiny("llama", hidden=32, layers=3, seed=5)
    sampled = dict(drafter=specdec.DraftModel(perturbed(target, 0.1)), gamma=_Alternating(), max_new_tokens=24,
                   temperature=1.0, top_k=20, top_p=0.9, seed=7, compile=True)
    monkeypatch.setattr(static_lm, "ONE_ROW_GRAPH_AFTER", 1 << 30)
    padded = specdec.generate(target, PROMPT, **sampled)
    assert padded.stats.gammas.count(0) >= 4
    assert not {key for key in compiled.COMPILED[target].fns if key[1] == 1}
    monkeypatch.setattr(static_lm, "ONE_ROW_GRAPH_AFTER", 0)
    own = specdec.generate(target, PROMPT, **sampled)
    assert {key[:2] for key in compiled.COMPILED[target].fns if key[1] == 1} == {("verify", 1)}
    assert own.stats.gammas == padded.stats.gammas
    assert own.tokens == padded.tokens


@pytest.mark.compile
@pytest.mark.exactness_positive(checks=1, alpha=1e-4)
def test_compiled_by_layer_sampling_is_exact(every_model_by_layer):
    small = tiny("llama", hidden=16, layers=2, vocab=8, seed=3)
    result = check_exactness(small, [1, 2, 1], specdec.DraftModel(perturbed(small, 0.3, seed=11)),
                             gamma=2, temperature=1.0, top_k=6, top_p=0.9, max_new_tokens=3, samples=3000,
                             seed=7, alpha=1e-4, eos_token_id=[], compile=True)
    assert compiled.COMPILED[small].layers
    assert result.passed, result.summary()
