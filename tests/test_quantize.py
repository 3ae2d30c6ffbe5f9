"""Models on packed weights (runtime/weights.py, specdec.load(weights=...)): float32, bfloat16, int8, int4, w4a8,
w8a8;
and SelfDraft.

The identity promise holds per precision: a quantized target's speculative output is token-identical to its own
plain decoding on the same path (eager, static slot cache, batched), for drafts of any kind; and at T > 0 it samples
exactly the quantized target's distribution (one statistical check per format, with a negative control). SelfDraft
is exact at T > 0 through tests/methods.py (the statistical suite); here its construction, sharing and refusals.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from faulty import FAULTY_VERIFIERS
from methods import METHODS, QUANTIZED_STATISTICAL, build, reduced_eagle3
from models import MOE_ARCHS, perturbed, tiny, tiny_moe
from torch import nn

import specdec
from specdec.errors import ConfigError
from specdec.exactness import check_exactness
from specdec.runtime.heap import HUGE_PAGE
from specdec.runtime.weights import (
    FLOATS,
    PackedExperts,
    PackedLinear,
    experts_layout,
    pack_model,
    quantized_copy,
    stacked_experts,
)

PROMPTS = [[5, 17, 3, 40, 8], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66]]
#: The statistical checks' level (test_exactness.py counts them as QUANTIZED_CHECKS at QUANTIZED_ALPHA).
QUANTIZED_ALPHA = 1e-5


def _quantized(weights: str, seed: int = 0):
    return pack_model(tiny("llama", hidden=64, layers=2, seed=seed, dtype=torch.float32), weights, group=16)


@pytest.mark.parametrize("mode", [False, "static"], ids=["eager", "static"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "w4a8", "w8a8"])
def test_speculative_decoding_of_a_quantized_target_is_its_plain_decoding(weights, mode):
    target = _quantized(weights)
    draft = pack_model(perturbed(tiny("llama", hidden=64, layers=2, dtype=torch.float32), 0.2), weights, group=16)
    assert all(not isinstance(m, nn.Linear) for m in target.modules())
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, drafter=None, max_new_tokens=24, compile=mode)
        for drafter, gamma in ((specdec.DraftModel(draft), 4), (specdec.PromptLookup(), 3)):
            spec = specdec.generate(target, prompt, drafter=drafter, gamma=gamma, max_new_tokens=24, compile=mode)
            assert spec.tokens == plain.tokens, (weights, mode, prompt, type(drafter).__name__)
            assert spec.stats.target_forwards <= plain.stats.target_forwards


#: Methods of tests/methods.py built beside a quantized target from the float models, as they are made in use: an
#: EAGLE-3 head's reduced LM head copies float rows the packed target no longer has (the head is made with the float
#: target, then used with the packed one), and ParallelDraft.adapt grows a float draft, packed after.
FROM_FLOAT = {
    "eagle3": lambda float_target, float_draft, weights, target: specdec.Eagle(target, reduced_eagle3(float_target),
                                                                               top_k=2, depth=4, max_nodes=8),
    "parallel": lambda float_target, float_draft, weights, target: specdec.ParallelDraft(
        pack_model(specdec.ParallelDraft.adapt(float_draft), weights, group=16)),
}


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "w4a8"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_decodes_a_quantized_target_as_its_plain_decoding(method, weights):
    """Every registered method (tests/methods.py: draft models, trees, multi-draft, heads that read the target's
    features and run its packed LM head, block drafters, suffix trees), with its target and draft on packed weights,
    is token-identical to plain decoding of that packed target."""
    if method.startswith("self-draft"):
        pytest.skip("SelfDraft copies a float target (test_self_draft_* above; a packed one is refused)")
    float_target = tiny("llama", hidden=64, layers=2, dtype=torch.float32)
    float_draft = perturbed(float_target, 0.2, seed=4)
    target, draft = (pack_model(copy.deepcopy(m), weights, group=16) for m in (float_target, float_draft))
    prompt = [5, 17, 3, 40, 8, 5, 17, 3, 40, 8, 9, 11]  # repeats, so n-gram drafters find matches
    plain = specdec.generate(target, prompt, max_new_tokens=20)
    if method in FROM_FLOAT:
        drafter, options = FROM_FLOAT[method](float_target, float_draft, weights, target), {}
    else:
        drafter, options = build(method, target, draft)
    out = specdec.generate(target, prompt, drafter=drafter, **{"gamma": 3, "max_new_tokens": 20, **options})
    assert out.tokens == plain.tokens, (method, weights)


@pytest.mark.parametrize("head", ["eagle", "medusa", "dflash"])
def test_heads_beside_a_quantized_target_batch_as_lone_requests(head):
    """Heads that read a packed target's features and run its packed LM head, in a batch (drafters/batched_heads.py
    for EAGLE and Medusa; a DFlash block per row): every row's tokens are its lone plain decoding."""
    target = _quantized("int8", seed=2)
    lone = [specdec.generate(target, p, max_new_tokens=16).tokens for p in PROMPTS]
    drafter, options = build(head, target, None)
    batched = specdec.generate_batch(target, PROMPTS, drafter=drafter, gamma=3, max_new_tokens=16, **options)
    assert [out.tokens for out in batched] == lone


@pytest.mark.parametrize("weights", ["int8", "int4", "w4a8", "w8a8"])
def test_batched_rows_of_a_quantized_target_are_its_lone_requests(weights):
    target = _quantized(weights, seed=2)
    lone = [specdec.generate(target, p, max_new_tokens=16).tokens for p in PROMPTS]
    draft = pack_model(perturbed(tiny("llama", hidden=64, layers=2, dtype=torch.float32), 0.2), weights, group=16)
    batched = specdec.generate_batch(target, PROMPTS, drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=16)
    assert [out.tokens for out in batched] == lone


def test_self_draft_shares_the_targets_tensors_and_leaves_it_float():
    target = tiny("llama", hidden=64, layers=2, dtype=torch.float32)
    before = {name: p.clone() for name, p in target.named_parameters()}
    drafter = specdec.SelfDraft(target, weights="int4", group=16)
    twin = drafter.model
    assert twin is not target
    assert twin.get_input_embeddings().weight is target.get_input_embeddings().weight  # shared, not copied
    assert twin.model.norm.weight is target.model.norm.weight
    packed = [m for m in twin.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.bits == 4 for m in packed if m is not twin.get_output_embeddings())
    assert twin.get_output_embeddings().bits == 8  # the LM head stays at int8 under int4
    assert all(isinstance(m, nn.Linear) for m in target.modules() if isinstance(m, (nn.Linear, PackedLinear)))
    for name, p in target.named_parameters():
        assert torch.equal(p, before[name]), name
    prompt = PROMPTS[0]
    plain = specdec.generate(target, prompt, max_new_tokens=20)
    spec = specdec.generate(target, prompt, drafter=drafter, gamma=4, max_new_tokens=20)
    assert spec.tokens == plain.tokens and spec.stats.accepted > 0


@pytest.mark.parametrize(("arch", "dtype", "packed"),
                         [("llama", torch.float32, "float32"), ("llama", torch.float32, "bfloat16"),
                          ("qwen2", torch.bfloat16, "bfloat16")],
                         ids=["f32-on-f32", "f32-on-bf16", "bf16-tied-bias-on-bf16"])
def test_a_self_draft_of_a_target_on_packed_float_weights_quantizes_the_weights_it_computes_with(arch, dtype, packed):
    """load(weights="float32" | "bfloat16") keeps every float weight, in the panels' layout: the self-draft reads
    them back (PackedLinear.dense_weight) and is the copy it would be of the same weights unpacked, tensor for
    tensor; it drafts in the packed target's cache with plain decoding's tokens."""
    kw = dict(hidden=64, layers=2, seed=3, dtype=dtype, tie_word_embeddings=arch == "qwen2")
    unpacked, target = tiny(arch, **kw), pack_model(tiny(arch, **kw), packed)
    with torch.no_grad():  # the unpacked model's linear weights rounded as the packing rounds them
        for m in unpacked.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(m.weight.to(FLOATS[packed]))
    for linear, read_back in zip([m for m in unpacked.modules() if isinstance(m, nn.Linear)],
                                 [m for m in target.modules() if isinstance(m, PackedLinear)]):
        assert torch.equal(read_back.dense_weight(), linear.weight.to(read_back.dense_weight().dtype))
    drafter = specdec.SelfDraft(target, weights="w4a8", group=16)
    want = specdec.SelfDraft(unpacked, weights="w4a8", group=16).model.state_dict()
    got = drafter.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=20, compile="static")
        decoder = specdec.SpeculativeDecoder(target, drafter, gamma=4, max_new_tokens=20, compile="static")
        assert list(decoder.stream(prompt)) == plain.tokens
        assert drafter.shares_cache and decoder.stats.accepted > 0


@pytest.mark.parametrize("weights", ["int8", "int4", "w4a8", "w8a8"])
def test_self_draft_on_the_slot_cache_is_plain_decoding(weights):
    target = tiny("llama", hidden=64, layers=2, seed=5, dtype=torch.float32)
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, max_new_tokens=20, compile="static")
        spec = specdec.generate(target, prompt, drafter=specdec.SelfDraft(target, weights=weights, group=16), gamma=4,
                                max_new_tokens=20, compile="static")
        assert spec.tokens == plain.tokens and spec.stats.accepted > 0


class _Watched(specdec.SelfDraft):
    """A SelfDraft that checks, around every proposal, that drafting left the target's committed slots alone."""

    decoder = None  # the SpeculativeDecoder whose target adapter it drafts for

    def propose(self, context, gamma, sampling, generator):
        cache, n = self.decoder.target.cache, context.shape[0]
        before = [(layer.keys[:, :, : n - 1].clone(), layer.values[:, :, : n - 1].clone()) for layer in cache.layers]
        proposal = super().propose(context, gamma, sampling, generator)
        for (keys, values), layer in zip(before, cache.layers):
            assert torch.equal(keys, layer.keys[:, :, : n - 1]) and torch.equal(values, layer.values[:, :, : n - 1])
        return proposal


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("weights", ["int4", "w8a8"])
def test_self_draft_drafts_in_the_target_s_slot_cache(weights, temperature):
    """On the slot cache a lone request's self-draft has no cache of its own and never prefills: it reads the target's
    keys and values of the committed tokens and writes only past them, so the target decodes as it does alone."""
    target = tiny("llama", hidden=64, layers=2, seed=5, dtype=torch.float32)
    drafter = _Watched(target, weights=weights, group=16)
    opts = dict(max_new_tokens=24, temperature=temperature, top_k=20, seed=3, compile="static")
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, **opts)
        decoder = drafter.decoder = specdec.SpeculativeDecoder(target, drafter, gamma=4, **opts)
        tokens = list(decoder.stream(prompt))
        assert drafter.shares_cache and drafter.lm.cache is decoder.target.cache
        assert drafter.lm.prefill_s == 0  # nothing prefilled: the target's keys and values were there
        assert decoder.stats.draft_forwards <= 4 * decoder.stats.rounds  # γ steps a round at most, no catch-up
        assert 0 < decoder.stats.accepted
        if temperature == 0:
            assert tokens == plain.tokens


def test_self_draft_keeps_its_own_cache_for_another_target_and_gets_it_back():
    target = tiny("llama", hidden=64, layers=2, seed=5, dtype=torch.float32)
    other = tiny("llama", hidden=64, layers=2, seed=6, dtype=torch.float32)  # same shape, other weights
    drafter = specdec.SelfDraft(target, weights="int8", group=16)
    for model, shares in ((target, True), (other, False), (target, True)):
        plain = specdec.generate(model, PROMPTS[0], max_new_tokens=16, compile="static")
        decoder = specdec.SpeculativeDecoder(model, drafter, gamma=3, max_new_tokens=16, compile="static")
        assert list(decoder.stream(PROMPTS[0])) == plain.tokens
        assert drafter.shares_cache == shares and (drafter.lm.cache is decoder.target.cache) == shares
        assert (drafter.lm.prefill_s > 0) != shares  # its own cache: it prefilled the prompt itself


def test_batched_self_draft_drafts_in_the_batch_s_cache_as_rows_join_and_leave():
    """Batched on the slot cache (a small one, so rounds compact and grow it) the self-draft keeps no cache: each row
    is its lone request's output, and the target holds each row's context but the root every round."""
    from specdec.drafters.self_draft import BatchedSelfDraft
    from specdec.engine.batch import BatchDecoder
    from specdec.runtime.batch_static import StaticBatchedCausalLM

    target = tiny("llama", hidden=64, layers=2, seed=5, dtype=torch.float32)
    drafter = specdec.SelfDraft(target, weights="w8a8", group=16)
    prompts = [PROMPTS[0], PROMPTS[1] * 9, PROMPTS[2], [7]]
    lone = [specdec.generate(target, p, max_new_tokens=16 + i, compile="static").tokens for i, p in enumerate(prompts)]
    decoder = BatchDecoder(target, drafter, compile="static")
    decoder.target = StaticBatchedCausalLM(target, max_len=40, compile=False, grow=True)
    form = decoder.drafters
    assert isinstance(form, BatchedSelfDraft) and form.host is decoder.target
    got, pending, rounds = {i: [] for i in range(len(prompts))}, list(enumerate(prompts)), 0
    while pending or len(decoder):
        if pending and rounds % 2 == 0:
            i, prompt = pending.pop(0)
            decoder.add(i, prompt, gamma=3, max_new_tokens=16 + i)
        for event in decoder.step():
            got[event.key].extend(event.tokens)
        rounds += 1
        assert decoder.target.lengths.tolist() == [row.n - 1 for row in decoder.rows]
    assert form.lm.prefill_s == 0 and form.lm.forwards > 0  # it drafted, and never prefilled a row
    assert [got[i] for i in range(len(prompts))] == lone
    assert decoder.target.max_len > 40  # the cache grew (and compacted before) while the draft read it


def test_batched_self_draft_rows_draw_what_a_lone_self_draft_draws():
    """T > 0 with top-k/top-p: a seeded row of the batch, its draft in the batch's cache, makes the same draws as the
    lone request whose draft is in its own target's cache (the same q, from the same keys and values)."""
    target = tiny("llama", hidden=64, layers=2, seed=5, dtype=torch.float32)
    drafter = specdec.SelfDraft(target, weights="int4", group=16)
    opts = dict(gamma=4, max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.9, compile="static")
    seeds = [11, 12, 13]
    lone = [specdec.generate(target, p, drafter=drafter, seed=s, **opts) for p, s in zip(PROMPTS, seeds)]
    batched = specdec.generate_batch(target, PROMPTS, drafter=drafter, seed=seeds, **opts)
    assert [o.tokens for o in batched] == [o.tokens for o in lone]
    assert [o.stats.accepted for o in batched] == [o.stats.accepted for o in lone]
    assert all(0 < o.stats.accepted < o.stats.drafted for o in lone)  # rejections happened: q was read


def test_self_draft_with_a_reduced_vocabulary_quantizes_its_reduced_head():
    target = tiny("llama", hidden=64, layers=2, dtype=torch.float32)
    ids = list(range(0, 96, 2))
    drafter = specdec.SelfDraft(target, weights="int8", group=16, draft_vocab=ids)
    head = drafter.model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.out_features == len(ids) and head.bits == 8
    plain = specdec.generate(target, PROMPTS[2], max_new_tokens=16)
    assert specdec.generate(target, PROMPTS[2], drafter=drafter, gamma=3, max_new_tokens=16).tokens == plain.tokens


@pytest.mark.parametrize("weights", ["int8", "int4", "w4a8", "w8a8"])
def test_quantized_weight_reads_every_integer_layout_back(weights):
    """Outputs that fill no whole last panel and inputs that fill no whole last group: the layer's q and scales read
    back from its panels are those it was packed from."""
    from specdec.runtime.weights import QUANTIZED, quantize_weight

    torch.manual_seed(6)
    linear = nn.Linear(70, 203, bias=False)
    want = quantize_weight(linear.weight, QUANTIZED[weights], 16)
    got = PackedLinear.pack(linear, weights, 16).quantized_weight()
    assert (got.bits, got.group) == (want.bits, want.group)
    assert torch.equal(got.q, want.q) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "w4a8", "w8a8"])
def test_a_layer_of_some_outputs_computes_each_as_the_whole_layer_does(weights, dtype):
    """PackedLinear.outputs(ids): the same bits as the whole layer's outputs at ids, at 1 and 5 rows (a bfloat16
    model's bfloat16 weights in the pairs layout where the CPU has it); ids in every panel, and ids out of order
    that leave panels out (only the panels holding ids are read back)."""
    torch.manual_seed(7)
    linear = nn.Linear(70, 203).to(dtype)
    layer = PackedLinear.pack(linear, weights, 16)
    for ids in (torch.tensor([0, 5, 63, 64, 130, 131, 202]), torch.tensor([202, 3, 131, 130])):
        part = layer.outputs(ids)
        assert (part.out_features, part.weights, part.group) == (ids.numel(), weights, layer.group)
        assert part.packed.dtype == layer.packed.dtype and part.packed.dim() == layer.packed.dim()
        for rows in (1, 5):
            x = torch.randn(rows, 70).to(dtype)
            assert torch.equal(part(x), layer(x)[:, ids]), (ids, rows)


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "w4a8"])
def test_a_draft_on_packed_weights_drafts_from_a_reduced_vocabulary(weights):
    """DraftModel(draft_vocab=...) of a draft loaded with weights=: its reduced head is the packed head's rows; its
    logits over them are the whole head's, and speculative decoding with it is plain decoding."""
    target = tiny("llama", hidden=64, layers=2, seed=1, dtype=torch.float32)
    draft = pack_model(perturbed(tiny("llama", hidden=64, layers=2, dtype=torch.float32), 0.2), weights, group=16)
    ids = list(range(0, 96, 2))
    drafter = specdec.DraftModel(draft, draft_vocab=ids)
    head = drafter.model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.out_features == len(ids) and head.weights == draft.lm_head.weights
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(drafter.model(prompt).logits, draft(prompt).logits[..., ids])
    for mode in (False, "static"):
        plain = specdec.generate(target, PROMPTS[2], max_new_tokens=16, compile=mode)
        spec = specdec.generate(target, PROMPTS[2], drafter=drafter, gamma=3, max_new_tokens=16, compile=mode)
        assert spec.tokens == plain.tokens, mode


def test_a_self_draft_of_a_packed_target_quantizes_its_reduced_head_from_the_packed_rows():
    """SelfDraft(draft_vocab=...) of a target on packed bfloat16 weights: its head is the rows of the whole
    self-draft's head, packed alike; it drafts in the target's cache with plain decoding's tokens."""
    target = pack_model(tiny("qwen2", hidden=64, layers=2, seed=3, dtype=torch.bfloat16), "bfloat16")
    ids = torch.arange(1, 96, 3)
    drafter = specdec.SelfDraft(target, weights="w4a8", group=16, draft_vocab=ids)
    whole = specdec.SelfDraft(target, weights="w4a8", group=16).model.get_output_embeddings()
    head = drafter.model.get_output_embeddings()
    assert head.weights == whole.weights == "w8a8"  # the head of a w4a8 copy (LM_HEAD_BITS, `head_format`)
    assert torch.equal(head.packed, whole.outputs(ids).packed)
    plain = specdec.generate(target, PROMPTS[0], max_new_tokens=20, compile="static")
    decoder = specdec.SpeculativeDecoder(target, drafter, gamma=4, max_new_tokens=20, compile="static")
    assert list(decoder.stream(PROMPTS[0])) == plain.tokens
    assert drafter.shares_cache and decoder.stats.accepted > 0


def test_refusals_name_the_fix():
    target = tiny("llama", hidden=64, layers=2, dtype=torch.float32)
    with pytest.raises(ConfigError, match="choose 'int8', 'int4', 'w4a8', 'w8a8'"):
        specdec.SelfDraft(target, weights="int3")
    with pytest.raises(ConfigError, match="choose float32, bfloat16, int8, int4"):
        pack_model(target, "int2")
    quantized = pack_model(tiny("llama", hidden=64, layers=2, dtype=torch.float32), "int8", group=16)
    with pytest.raises(ConfigError, match="packed as int8 already; make the copy from a model loaded with "
                       "weights='float32' or 'bfloat16'"):
        quantized_copy(quantized, "int4")
    with pytest.raises(ConfigError, match="float weights are not kept"):
        quantized.model.layers[0].mlp.up_proj.dense_weight()
    with pytest.raises(ConfigError, match="not quantized: read them with dense_weight"):
        pack_model(tiny("llama", hidden=64, layers=2, dtype=torch.float32), "bfloat16").lm_head.quantized_weight()
    with pytest.raises(ConfigError, match="CPU kernels only"):
        specdec.load("unused", device="meta", weights="int8")


def test_dense_weight_reads_the_bfloat16_pairs_layout_back():
    """The pairs layout (AVX512_BF16, AMX: [panels, pair rows, PANEL, 2], k padded to whole pairs or tiles) read back,
    on any CPU: a layer given such a buffer, built from the layout's definition, returns the weight it was built
    from."""
    from specdec.runtime.rowwise import load_kernel

    load_kernel()
    panel, n, k, pair_rows = torch.ops.specdec.panel_width(), 37, 21, 16  # pair rows as AMX pads 21 inputs
    weight = torch.randn(n, k).to(torch.bfloat16)
    padded = torch.zeros(-(-n // panel) * panel, pair_rows * 2, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    pairs = padded.view(-1, panel, pair_rows, 2).permute(0, 2, 1, 3).contiguous()  # [p][i][n][j] = w[p·PANEL+n, 2i+j]
    layer = PackedLinear(pairs, None, k, n, "bfloat16")
    assert torch.equal(layer.dense_weight(), weight)


def test_pack_model_drops_the_float_weights_it_packed():
    model = tiny("llama", hidden=64, layers=2, dtype=torch.float32)  # an untied LM head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    pack_model(model, "int4", group=16)
    assert all(m.weight is None for m in linears)  # nothing left holds a float copy
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == len(linears)


def test_pack_model_returns_the_packings_temporaries_after_every_layer_a_tied_head_too(monkeypatch):
    import specdec.runtime.weights as weights_module

    model = tiny("qwen2", hidden=64, layers=2, dtype=torch.float32, tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    released = []
    monkeypatch.setattr(weights_module, "release_free_memory", lambda: released.append(True))
    pack_model(model, "int4", group=16)
    assert len(released) == linears  # the tied head, packed last, too: its blocks' float32 copies
    assert model.get_input_embeddings().weight is not None  # the embedding the tied head read stays


# ------------------------------------------------------------------------------------------ mixture of experts


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "w4a8"])
@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_the_experts_of_a_moe_model_are_packed_in_the_format(arch, weights):
    """weights= packs a mixture-of-experts layer's stacked experts too (most of such a model's weights): no float
    experts are left, every expert's projections are in the format asked for, and the logits are the float model's up
    to the format's rounding (float32: the kernel's order of additions only)."""
    model = tiny_moe(arch)
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        want = model(x).logits
    packed = pack_model(copy.deepcopy(model), weights, group=16)
    experts = [m for m in packed.modules() if isinstance(m, PackedExperts)]
    assert len(experts) == len(stacked_experts(model)) > 0 and not stacked_experts(packed)
    assert {e.weights for e in experts} == {weights}
    if weights in FLOATS:  # the logits: a quantized model's differ more where its rounding flips a token's experts
        with torch.no_grad():
            got = packed(x).logits
        error = float((got - want).abs().max() / want.abs().max())
        assert error < {"float32": 1e-5, "bfloat16": 0.02}[weights], error
        return
    for packed_experts, name in zip(experts, stacked_experts(model)):  # each expert's weights are its own, rounded
        stacks = experts_layout(model.get_submodule(name))
        for e in range(packed_experts.num_experts):
            for layer, stack in zip(packed_experts.expert(e), stacks):
                error = [float((layer.quantized_weight().dequantize() - w).norm() / w.norm()) for w in stack.detach()]
                assert min(error) == error[e] < 0.2, (name, e, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "w4a8", "w8a8"])
def test_each_token_through_packed_experts_gets_the_bits_it_gets_alone(weights, dtype):
    """The experts of a pass of 9 tokens, each routed to 2 of 4 experts: every token's output is the same bits as in
    a pass of its own, and transformers' own experts module computes the same values (float32 weights)."""
    model = tiny_moe("qwen3_moe", dtype=dtype)
    own = model.model.layers[0].mlp.experts
    experts = PackedExperts.pack(own, weights, group=16)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=generator).to(dtype)  # [T, H]
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(9)])  # [T, 2]
    routing = torch.rand(9, 2, generator=generator).to(dtype)  # [T, 2]
    whole = experts(x, index, routing)  # [T, H]
    for t in range(9):
        assert torch.equal(experts(x[t : t + 1], index[t : t + 1], routing[t : t + 1]), whole[t : t + 1]), t
    if weights == "float32" and dtype == torch.float32:
        with torch.no_grad():
            torch.testing.assert_close(whole, own(x, index, routing), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [False, "static"], ids=["eager", "static"])
@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4", "w4a8"])
def test_speculative_decoding_of_a_quantized_moe_target_is_its_plain_decoding(weights, mode):
    """A MoE target on packed weights (its experts too), a draft and a self-draft: token-identical to its plain
    decoding, eagerly and on the slot cache (compiled: test_a_compiled_quantized_moe_target_...)."""
    float_target = tiny_moe("qwen2_moe", hidden=64)
    target = pack_model(copy.deepcopy(float_target), weights, group=16)
    draft = pack_model(perturbed(float_target, 0.2), weights, group=16)
    self_draft = specdec.SelfDraft(float_target, weights="int4", group=16)
    assert any(isinstance(m, PackedExperts) for m in self_draft.model.modules())
    assert stacked_experts(float_target)  # the self-draft's target keeps its float experts
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, drafter=None, max_new_tokens=24, compile=mode)
        for drafter, gamma in ((specdec.DraftModel(draft), 4), (specdec.PromptLookup(), 3)):
            spec = specdec.generate(target, prompt, drafter=drafter, gamma=gamma, max_new_tokens=24, compile=mode)
            assert spec.tokens == plain.tokens, (weights, mode, prompt, type(drafter).__name__)
        plain = specdec.generate(float_target, prompt, drafter=None, max_new_tokens=24, compile=mode)
        spec = specdec.generate(float_target, prompt, drafter=self_draft, gamma=3, max_new_tokens=24, compile=mode)
        assert spec.tokens == plain.tokens and 0 < spec.stats.accepted, (weights, mode, prompt)


@pytest.mark.compile
def test_a_compiled_quantized_moe_target_decodes_speculatively_as_plainly():
    """compile=True: the experts' grouping by expert is one opaque operation in the graph (`expert_linear`); a bfloat16
    MoE target on int8 weights decodes with a draft token-identically to its compiled plain decoding."""
    float_target = tiny_moe("qwen2_moe", hidden=64, dtype=torch.bfloat16)
    target = pack_model(copy.deepcopy(float_target), "int8", group=16)
    draft = pack_model(perturbed(float_target, 0.2), "int8", group=16)
    plain = specdec.generate(target, PROMPTS[0], drafter=None, max_new_tokens=20, compile=True)
    spec = specdec.generate(target, PROMPTS[0], drafter=specdec.DraftModel(draft), gamma=4, max_new_tokens=20,
                            compile=True)
    assert spec.tokens == plain.tokens and 0 < spec.stats.accepted < spec.stats.drafted


def test_a_self_draft_of_a_moe_target_on_packed_bfloat16_weights_quantizes_its_experts_from_them():
    """SelfDraft of a MoE target loaded with weights="bfloat16": its experts are read back from the packed bfloat16
    ones and quantized (the target's stay as they are), and it decodes as the target's plain decoding."""
    target = pack_model(tiny_moe("qwen2_moe", hidden=64, dtype=torch.bfloat16), "bfloat16")
    self_draft = specdec.SelfDraft(target, weights="int4", group=16)
    assert {e.weights for e in self_draft.model.modules() if isinstance(e, PackedExperts)} == {"int4"}
    assert {e.weights for e in target.modules() if isinstance(e, PackedExperts)} == {"bfloat16"}
    for prompt in PROMPTS:
        plain = specdec.generate(target, prompt, drafter=None, max_new_tokens=20, compile="static")
        spec = specdec.generate(target, prompt, drafter=self_draft, gamma=3, max_new_tokens=20, compile="static")
        assert spec.tokens == plain.tokens and 0 < spec.stats.accepted, prompt


def _clamped(experts: nn.Module) -> nn.Module:
    class Clamped(type(experts)):  # a gating that clamps (as gpt-oss's): equal to the standard one near zero
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights).clamp(-7.0, 7.0)

    return Clamped


def _weighted_first(experts: nn.Module) -> nn.Module:
    class WeightedFirst(type(experts)):  # routing weights on the experts' input (as Llama 4): another function
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states * top_k_weights.sum(-1, keepdim=True), top_k_index,
                                   torch.ones_like(top_k_weights))

    return WeightedFirst


@pytest.mark.parametrize("variant", [_clamped, _weighted_first], ids=["clamped", "weighted-first"])
def test_experts_that_compute_otherwise_are_refused_before_anything_is_packed(variant):
    """An experts module of the standard layout whose forward computes something else: ConfigError naming the fix,
    and the model is left as it was (no layer packed)."""
    model = tiny_moe("mixtral")
    experts = model.model.layers[1].mlp.experts
    experts.__class__ = variant(experts)
    with pytest.raises(ConfigError, match="cannot pack .*load this model without weights="):
        pack_model(model, "int8", group=16)
    assert not any(isinstance(m, (PackedLinear, PackedExperts)) for m in model.modules())
    assert len(stacked_experts(model)) == 2


#: 12 experts, so that an order of the experts' keys by name (10 and 11 before 2) would show
EXPERTS_12 = {"mixtral": dict(num_local_experts=12), "qwen3_moe": dict(num_experts=12),
              "deepseek_v3": dict(n_routed_experts=12)}


@pytest.mark.parametrize("files", ["safetensors", "safetensors-shards", "bin"])
@pytest.mark.parametrize("arch", sorted(EXPERTS_12))
def test_a_moe_checkpoint_is_streamed_one_expert_at_a_time_into_the_whole_model_packed(tmp_path, arch, files):
    """A MoE checkpoint keeps one key per expert and projection, which from_pretrained stacks (gate_proj and up_proj
    into gate_up_proj): load(weights=) streams them, each expert's matrix read just before it is packed, and gets
    tensor for tensor what from_pretrained + pack_model give (12 experts, in shards, in `.bin` files too)."""
    from transformers import AutoModelForCausalLM

    from specdec.hub.loading import load_model
    from specdec.hub.streamed import checkpoint_tensors, load_streamed

    tiny_moe(arch, **EXPERTS_12[arch]).save_pretrained(tmp_path, **(
        {"max_shard_size": "20KB"} if files == "safetensors-shards" else {}))
    if files == "bin":
        _as_bin(tmp_path)
    assert any(".experts.11." in key for key in checkpoint_tensors(tmp_path))
    streamed = load_streamed(tmp_path, torch.float32, "int4")
    assert streamed is not None and not stacked_experts(streamed)
    whole = pack_model(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval(), "int4")
    got, want = streamed.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    loaded = load_model(tmp_path, dtype=torch.float32, weights="int4")
    assert all(torch.equal(t, want[n]) for n, t in loaded.state_dict().items())


@pytest.mark.parametrize("missing", ["experts.3.up_proj", "experts.*.gate_proj"])
def test_a_moe_checkpoint_missing_an_expert_is_left_to_from_pretrained(tmp_path, missing):
    """One expert's key missing, or one projection of every expert of a layer: not streamed (from_pretrained then
    says what is wrong, in its own words)."""
    import fnmatch

    from safetensors.torch import load_file, save_file

    from specdec.hub.streamed import load_streamed

    tiny_moe("qwen3_moe").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    gone = fnmatch.filter(state, f"model.layers.1.mlp.{missing}.weight")
    assert gone
    for key in gone:
        del state[key]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert load_streamed(tmp_path, torch.float32, "int8") is None


def _saved(tmp_path, arch: str, dtype: torch.dtype, **save):
    """A tiny model of `arch` saved to tmp_path (safetensors unless save says otherwise), with an EOS in its
    generation config (so that the streamed load is seen to read it)."""
    model = tiny(arch, hidden=64, layers=2, dtype=dtype, tie_word_embeddings=arch == "qwen2")
    model.generation_config.eos_token_id = 7
    model.save_pretrained(tmp_path, **save)
    return tmp_path


@pytest.mark.parametrize("packed, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_rows_read_back_from_the_panels_are_those_of_the_whole_weight(packed, dtype):
    """PackedLinear.dense_rows(r0, r1) reads back rows [r0, r1) from the panels that hold them alone: the same
    values as dense_weight()'s rows, for spans inside one panel, across panels and up to a last, partial panel."""
    from specdec.runtime.rowwise import load_kernel

    load_kernel()
    panel = torch.ops.specdec.panel_width()
    n, k = 3 * panel + 5, 37
    linear = nn.Linear(k, n, bias=False, dtype=dtype)
    layer = PackedLinear.pack(linear, packed)
    whole = layer.dense_weight()
    assert torch.equal(whole, linear.weight.detach())
    for r0, r1 in [(0, n), (0, panel), (1, 2), (panel - 1, panel + 1), (panel, 3 * panel), (2 * panel + 3, n)]:
        assert torch.equal(layer.dense_rows(r0, r1), whole[r0:r1]), (r0, r1)


@pytest.mark.parametrize("weights", ["int8", "w4a8"])
def test_a_quantized_copy_read_back_a_block_at_a_time_is_the_same_copy(monkeypatch, weights):
    """quantized_copy reads each float-packed layer back a block of rows at a time as it packs it (its `fill`
    gives PackedLinear.pack a reader of dense_rows), never whole: blocks of one panel give the copy of one block a
    layer, tied head included."""
    from specdec.runtime import weights as weights_module

    target = pack_model(tiny("qwen2", hidden=64, layers=2, seed=5, dtype=torch.bfloat16, tie_word_embeddings=True),
                        "bfloat16")
    want = quantized_copy(target, weights, group=16).state_dict()
    calls = []
    real = PackedLinear.dense_rows
    monkeypatch.setattr(PackedLinear, "dense_rows", lambda self, r0, r1: calls.append(r1 - r0) or real(self, r0, r1))
    monkeypatch.setattr(weights_module, "QUANTIZE_BLOCK", 1)  # blocks of one panel of rows
    got = quantized_copy(target, weights, group=16).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    panel = torch.ops.specdec.panel_width()
    layers = [m for m in target.modules() if isinstance(m, PackedLinear)]
    assert len(calls) == sum(-(-m.out_features // panel) for m in layers) and max(calls) <= panel


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4", "w4a8"])
@pytest.mark.parametrize("chunk_panels", [0, 2], ids=["a-block-a-read", "two-blocks-a-read"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "f32-saved-bf16-loaded"])
@pytest.mark.parametrize("files", ["safetensors", "bin"])
def test_a_large_weight_is_read_a_chunk_of_rows_at_a_time_into_the_same_packing(tmp_path, monkeypatch, weights,
                                                                                 chunk_panels, dtype, files):
    """A linear weight of more than READ_CHUNK bytes is read from the checkpoint (safetensors or `.bin`) a chunk of
    rows at a time while it is packed (hub/streamed.py's Rows), never whole: the model is the whole model packed,
    whether each read holds one of the packing's blocks (a chunk smaller than a block) or several, and whether its
    chunks are converted from the checkpoint's dtype, and the reads cover each weight's rows once, in order."""
    from transformers import AutoModelForCausalLM

    from specdec.hub import streamed
    from specdec.runtime import weights as weights_module
    from specdec.runtime.rowwise import load_kernel

    load_kernel()
    tiny("llama", hidden=64, layers=1, vocab=1000, dtype=torch.float32).save_pretrained(tmp_path)
    if files == "bin":
        _as_bin(tmp_path)
    panel = torch.ops.specdec.panel_width()
    monkeypatch.setattr(weights_module, "QUANTIZE_BLOCK", 1)  # blocks of one panel of rows
    row_bytes = 64 * dtype.itemsize  # a row of 64 inputs in the model's dtype
    monkeypatch.setattr(streamed, "READ_CHUNK", max(1, chunk_panels * panel * row_bytes))
    calls, chunks = {}, {}
    real = streamed.Rows.__call__

    def spy(self, r0, r1):
        before = self.chunk
        out = real(self, r0, r1)
        calls.setdefault(self.name, []).append((r0, r1))
        chunks[self.name] = chunks.get(self.name, 0) + (self.chunk is not before)
        return out

    monkeypatch.setattr(streamed.Rows, "__call__", spy)
    streamed_model = streamed.load_streamed(tmp_path, dtype, weights)
    whole = pack_model(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval(), weights)
    got, want = streamed_model.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    chunked = {f"{n}.weight" for n, m in whole.named_modules() if isinstance(m, PackedLinear)
               and m.in_features * m.out_features * dtype.itemsize > streamed.READ_CHUNK}
    assert "lm_head.weight" in chunked and calls.keys() == chunked
    for name, spans in calls.items():
        rows = whole.get_submodule(name.removesuffix(".weight")).out_features
        assert [r0 for r0, _ in spans] == [0, *(r1 for _, r1 in spans[:-1])] and spans[-1][1] == rows, name
        assert chunks[name] == (len(spans) if chunk_panels == 0 else -(-rows // (chunk_panels * panel))), name
    assert len(calls["lm_head.weight"]) == -(-1000 // panel) > chunks["lm_head.weight"] or chunk_panels == 0


def _as_bin(path: Path, legacy: bool = False) -> Path:
    """Checkpoint directory `path` with its safetensors rewritten as PyTorch's `.bin` files, shard for shard and with
    their index, as older releases ship them (zip format; legacy: the format before it)."""
    import json

    from safetensors.torch import load_file

    def bin_name(name: str) -> str:
        return "pytorch_" + name.replace(".safetensors", ".bin")

    for file in path.glob("*.safetensors"):
        torch.save(load_file(file), path / bin_name(file.name), _use_new_zipfile_serialization=not legacy)
        file.unlink()
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {name: bin_name(file) for name, file in data["weight_map"].items()}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(data))
        index.unlink()
    return path


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "w4a8", "w8a8"])
@pytest.mark.parametrize("files", ["safetensors", "bin"])
@pytest.mark.parametrize("arch, dtype, save", [("llama", torch.float32, {}),
                                                ("qwen2", torch.bfloat16, {"max_shard_size": "60KB"})],
                         ids=["llama-f32", "qwen2-tied-bias-bf16-shards"])
def test_a_checkpoint_streamed_into_packed_weights_is_the_whole_model_packed(tmp_path, arch, dtype, save, files,
                                                                             weights):
    """load(weights=...) reads a checkpoint layer by layer (hub/streamed.py), from safetensors or from zip-format
    `.bin` files: every tensor, the generation config and the logits are those of from_pretrained + pack_model; a
    tied head stays tied; shards and biases are read."""
    from transformers import AutoModelForCausalLM

    from specdec.hub.loading import load_model
    from specdec.hub.streamed import checkpoint_tensors, load_streamed

    path = _saved(tmp_path, arch, dtype, **save)
    if files == "bin":
        _as_bin(path)
    index = "model.safetensors.index.json" if files == "safetensors" else "pytorch_model.bin.index.json"
    assert (path / index).is_file() == bool(save) and any(path.glob(f"*.{files}"))
    streamed = load_streamed(path, dtype, weights)
    assert streamed is not None
    whole = pack_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), weights)
    got, want = streamed.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert streamed.generation_config.eos_token_id == whole.generation_config.eos_token_id == 7
    if arch == "qwen2":  # a tied head is not in the checkpoint: it was packed from the embedding read by its name
        assert "lm_head.weight" not in checkpoint_tensors(path)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(streamed(ids).logits, whole(ids).logits)
    loaded = load_model(path, dtype=dtype, weights=weights)
    assert all(torch.equal(t, want[n]) for n, t in loaded.state_dict().items())
    assert not loaded.training


def test_a_bin_is_read_from_where_torch_load_finds_each_tensor(tmp_path):
    """hub/streamed.py reads a zip-format `.bin` from the offsets `pickled_layout` finds, without torch.load: every
    tensor (of any dtype, a scalar, an empty one, two sharing one storage, one starting inside its storage) and any
    span of rows is what torch.load gives; a tensor not laid out contiguously makes the file one it does not read."""
    from specdec.hub.streamed import pickled_layout, read

    shared = torch.randn(6, 4, dtype=torch.float64)
    tensors = {"bf16": torch.randn(5, 3).to(torch.bfloat16), "ints": torch.arange(7), "scalar": torch.tensor(2.5),
               "empty": torch.empty(0, 4), "tied": shared, "tied_again": shared, "inside": shared[2:5],
               "flags": torch.tensor([True, False, True])}
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    layout = pickled_layout(tmp_path / "pytorch_model.bin")
    assert layout is not None and layout.keys() == tensors.keys()
    assert layout["tied"].offset == layout["tied_again"].offset == layout["inside"].offset - 2 * 4 * 8
    want = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    for name, tensor in want.items():
        got = read(layout[name], name, tensor.dtype)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
    assert torch.equal(read(layout["tied"], "tied", torch.float64, (1, 4)), shared[1:4])
    assert torch.equal(read(layout["bf16"], "bf16", torch.float32, (2, 5)), tensors["bf16"][2:5].float())
    torch.save({"transposed": torch.randn(4, 6).t()}, tmp_path / "strided.bin")
    assert pickled_layout(tmp_path / "strided.bin") is None


@pytest.mark.parametrize("files", ["safetensors", "bin"])
def test_a_checkpoint_under_other_names_is_streamed_as_from_pretrained_renames_it(tmp_path, files):
    """Keys from_pretrained renames on load are read under the model's names, and keys it leaves unread stay unread:
    a checkpoint saved from the base model (no `model.` prefix; the head tied, so absent) with a stale per-layer
    rotary buffer, as older releases have, streams into the model from_pretrained + pack_model give."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from specdec.hub.streamed import load_streamed

    path = _saved(tmp_path, "qwen2", torch.bfloat16)
    tensors = {name.removeprefix("model."): t for name, t in load_file(path / "model.safetensors").items()}
    assert not any(name.startswith("model.") for name in tensors) and "lm_head.weight" not in tensors
    tensors["layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(8, dtype=torch.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if files == "bin":
        _as_bin(path)
    streamed = load_streamed(path, torch.bfloat16, "int8")
    assert streamed is not None
    want = pack_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), "int8").state_dict()
    got = streamed.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("arch", ["t5", "bart", "whisper", "marian"])
def test_an_encoder_decoder_checkpoint_is_streamed_as_from_pretrained_loads_it(tmp_path, monkeypatch, arch):
    """load(weights=...) streams encoder-decoder checkpoints too (T5's tied embeddings, BART's biases, Whisper's
    convolutions and speech auto class): every tensor and buffer, and the greedy decoding, are those of
    from_pretrained + pack_model. Marian's checkpoint leaves out its sinusoidal position tables, which the model
    computes: not streamed, loaded whole, as before."""
    from seq2seq_models import encoder_inputs, tiny_seq2seq
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    from specdec.hub.loading import load_model
    from specdec.hub.streamed import load_streamed

    auto_class = AutoModelForSpeechSeq2Seq if arch == "whisper" else AutoModelForSeq2SeqLM
    tiny_seq2seq(arch, hidden=64, dtype=torch.float32).save_pretrained(tmp_path)
    whole = pack_model(auto_class.from_pretrained(tmp_path, dtype=torch.bfloat16).eval(), "int8")
    streamed = load_streamed(tmp_path, torch.bfloat16, "int8")
    if arch != "marian":
        monkeypatch.setattr(auto_class, "from_pretrained", None)  # (load_model streams: a whole load would fail)
    loaded = load_model(tmp_path, dtype=torch.bfloat16, weights="int8")
    monkeypatch.undo()
    if arch == "marian":
        assert streamed is None
        streamed = loaded
    want, got = dict(whole.named_buffers()) | whole.state_dict(), dict(streamed.named_buffers()) | streamed.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert all(torch.equal(t, want[n]) for n, t in loaded.state_dict().items())
    enc = {n: x.to(torch.bfloat16) if x.is_floating_point() else x
           for n, x in encoder_inputs(arch, list(range(3, 19))).items()}
    tokens = [specdec.generate(m, None, encoder_inputs=enc, max_new_tokens=12).tokens for m in (streamed, whole)]
    assert tokens[0] == tokens[1]


def test_a_checkpoint_streaming_cannot_read_exactly_is_loaded_whole(tmp_path):
    """Weights in the legacy (pre-zip) .bin format, a quantized checkpoint, or tensors under names from_pretrained
    does not map to the model's: load_streamed declines (None), and load(weights=...) loads the float model whole
    and packs it, as before (a MoE checkpoint missing an expert: test_a_moe_checkpoint_missing_an_expert_...)."""
    import json

    from safetensors.torch import load_file, save_file

    from specdec.hub.loading import load_model
    from specdec.hub.streamed import load_streamed

    legacy = _as_bin(_saved(tmp_path / "legacy", "llama", torch.float32), legacy=True)
    assert (legacy / "pytorch_model.bin").is_file()
    assert load_streamed(legacy, torch.float32, "int8") is None
    assert isinstance(load_model(legacy, weights="int8").model.layers[0].mlp.up_proj, PackedLinear)
    quantized = _saved(tmp_path / "quantized", "llama", torch.float32)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (quantized / "config.json").write_text(json.dumps(config))
    assert load_streamed(quantized, torch.float32, "int8") is None
    renamed = _saved(tmp_path / "renamed", "llama", torch.float32)
    tensors = load_file(renamed / "model.safetensors")
    tensors["model.norm.gamma"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    assert load_streamed(renamed, torch.float32, "int8") is None


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 64), (4, 2)])
def test_quantizing_in_blocks_of_rows_gives_the_bits_of_one_block(monkeypatch, bits, group):
    """quantize_weight bounds its float32 temporaries by quantizing QUANTIZE_BLOCK values of rows at a time; any
    block size (one row, a few, odd) gives what the whole matrix at once gives."""
    from specdec.runtime import weights

    torch.manual_seed(3)
    w = torch.randn(301, 131).bfloat16()
    monkeypatch.setattr(weights, "QUANTIZE_BLOCK", 1 << 40)
    whole = weights.quantize_weight(w, bits, group)
    for block in (1, 777, 5000):
        monkeypatch.setattr(weights, "QUANTIZE_BLOCK", block)
        got = weights.quantize_weight(w, bits, group)
        assert torch.equal(got.q, whole.q) and torch.equal(got.scales, whole.scales), block


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_weight_is_the_formula_and_leaves_its_input_as_it_was(bits, dtype):
    """quantize_weight works in place on a buffer of its own: its values are the formula's, spelled out here with
    fresh tensors (per group of inputs, zero-padded to whole groups: int8's scale the largest magnitude / 127; int4's
    the first largest-magnitude value / -8; q = round half to even of w / scale, clamped; a zero group's scale 0 and
    q 0), and its input is unchanged."""
    from specdec.runtime import weights

    torch.manual_seed(5)
    for k in (150, 128):  # padded, and whole groups
        w = torch.randn(37, k).to(dtype)
        w[3, :64] = 0  # a zero group
        w[4, 7], w[4, 9] = -2.5, 2.5  # a tie in magnitude: the first decides int4's sign
        w[5, 70], w[5, 71] = 3.0, -3.0  # the same, the positive first
        w[6] = torch.arange(k) % 7 - 3  # integers: a tie in every group
        w[7, :64] = -0.0  # a zero group of negative zeros: its scale's sign is the first zero's
        before = w.clone()
        got = weights.quantize_weight(w, bits, 64)
        assert torch.equal(w, before)
        groups = -(-k // 64)
        padded = torch.nn.functional.pad(w.float(), (0, 64 * groups - k)).view(37, groups, 64)
        if bits == 8:
            scales, lo, hi = padded.abs().amax(-1) / 127, -127, 127
        else:
            scales, lo, hi = padded.gather(-1, padded.abs().argmax(-1, keepdim=True)).squeeze(-1) / -8, -8, 7
        q = torch.round(padded / torch.where(scales == 0, 1.0, scales).unsqueeze(-1)).clamp(lo, hi)
        assert torch.equal(got.scales, scales) and torch.equal(got.scales.signbit(), scales.signbit())
        assert torch.equal(got.q, q.to(torch.int8).view(37, -1)[:, :k])
        assert got.scales[3, 0] == 0 and not got.q[3, :64].any()


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "w4a8", "w8a8"])
def test_packing_in_blocks_of_panels_gives_the_bits_of_one_block(monkeypatch, weights):
    """PackedLinear.pack packs whole panels of outputs a block at a time (QUANTIZE_BLOCK values); any block size,
    with outputs that fill no whole last panel, gives the packed tensor of the layer packed at once."""
    from specdec.runtime import weights as weights_module

    torch.manual_seed(4)
    linear = nn.Linear(70, 203).to(torch.bfloat16)
    monkeypatch.setattr(weights_module, "QUANTIZE_BLOCK", 1 << 40)
    whole = PackedLinear.pack(linear, weights, 16)
    for block in (1, 70 * 20, 70 * 130):
        monkeypatch.setattr(weights_module, "QUANTIZE_BLOCK", block)
        got = PackedLinear.pack(linear, weights, 16)
        assert got.packed.dtype == whole.packed.dtype and torch.equal(got.packed, whole.packed), block
        assert torch.equal(got.bias, whole.bias)


@pytest.mark.parametrize("files", ["safetensors", "bin"])
def test_a_hub_id_in_the_hub_cache_is_streamed_from_its_snapshot(tmp_path, monkeypatch, files):
    """load(weights=...) of a hub id (offline: the hub cache alone) finds its snapshot there and streams it, from
    safetensors or `.bin`: the model comes from load_streamed on the snapshot directory, and is the whole model
    packed."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM

    from specdec.hub import streamed
    from specdec.hub.loading import load_model

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--specdec-test--tiny"
    snapshot = _saved(repo / "snapshots" / revision, "llama", torch.float32)
    if files == "bin":
        _as_bin(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert streamed.local_checkpoint("specdec-test/tiny", True) == snapshot
    assert streamed.local_checkpoint("specdec-test/not-cached", True) is None
    read_from = []
    real = streamed.load_streamed
    monkeypatch.setattr(streamed, "load_streamed", lambda path, *rest: read_from.append(path) or real(path, *rest))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # (a whole load would fail)
    model = load_model("specdec-test/tiny", dtype=torch.float32, weights="int8")
    monkeypatch.undo()
    assert read_from == [snapshot]
    whole = pack_model(AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval(), "int8").state_dict()
    got = model.state_dict()
    assert got.keys() == whole.keys() and all(torch.equal(t, whole[n]) for n, t in got.items())


def _sampling_pair(weights: str):
    """A V = 8 target and a perturbed draft (partial acceptance), both packed in `weights`, groups of 8 inputs."""
    target = tiny("llama", hidden=16, layers=2, vocab=8, seed=3, dtype=torch.float32)
    draft = perturbed(target, 0.3, seed=11)
    return pack_model(target, weights, group=8), pack_model(draft, weights, group=8)


def _sampled(target, draft, **kwargs):
    """`draft`: a model (drafting as DraftModel) or a drafter."""
    drafter = draft if isinstance(draft, specdec.Drafter) else specdec.DraftModel(draft)
    return check_exactness(target, [1, 2, 1, 1, 2], drafter, gamma=3, temperature=1.0, top_k=6,
                           top_p=0.9, max_new_tokens=3, eos_token_id=[], samples=3000, seed=1234,
                           alpha=QUANTIZED_ALPHA, **kwargs)


@pytest.mark.statistical
@pytest.mark.exactness_positive(checks=1, alpha=QUANTIZED_ALPHA)
@pytest.mark.parametrize("weights", QUANTIZED_STATISTICAL)
def test_speculative_sampling_of_a_quantized_target_is_exact(weights):
    """At T > 0 with top-k and top-p, speculative decoding samples the quantized target's own distribution (every
    continuation of 3 tokens enumerated and tested): q and p are the packed draft's and target's."""
    target, draft = _sampling_pair(weights)
    result = _sampled(target, draft)
    assert result.mode == "enumerate"
    assert result.passed, result.summary()
    assert result.detectable_tv < 0.12, result.summary()  # the check has power
    assert 0 < result.accepted < result.drafted, result.summary()  # both verification paths ran


@pytest.mark.statistical
@pytest.mark.exactness_positive(checks=1, alpha=QUANTIZED_ALPHA)
def test_a_self_draft_of_a_target_on_packed_bfloat16_weights_samples_the_target_exactly():
    """At T > 0 with top-k and top-p: q is the int4 copy's (quantized from the packed weights read back), p the
    packed target's; the output is the packed target's distribution (every continuation of 3 tokens tested)."""
    target = pack_model(tiny("llama", hidden=16, layers=2, vocab=8, seed=3, dtype=torch.float32), "bfloat16")
    drafter = specdec.SelfDraft(target, weights="int4", group=8)
    result = _sampled(target, drafter)
    assert result.mode == "enumerate"
    assert result.passed, result.summary()
    assert result.detectable_tv < 0.12, result.summary()
    assert 0 < result.accepted < result.drafted, result.summary()
    control = _sampled(target, drafter, verify_fn=FAULTY_VERIFIERS["no_residual"])
    assert not control.passed and control.p_value < 1e-6, control.summary()


@pytest.mark.statistical
@pytest.mark.parametrize("weights", ["w4a8", "w8a8"])
def test_negative_control_on_quantized_weights_is_caught(weights):
    """The same check has teeth on packed weights: the rule without its residual is caught on a pair of each
    integer format."""
    target, draft = _sampling_pair(weights)
    result = _sampled(target, draft, verify_fn=FAULTY_VERIFIERS["no_residual"])
    assert not result.passed
    assert result.p_value < 1e-6, result.summary()


def test_a_bfloat16_models_bfloat16_weights_use_the_cpus_bfloat16_dot_product():
    """weights="bfloat16" on a bfloat16 model packs the pairs layout where the CPU has a bfloat16 dot product
    (AVX512_BF16's pairs, AMX's tiles): its passes are bfloat16, and they compute on the pairs; a float32 model's
    bfloat16 weights keep the layout a float32 pass reads. A float32 input to a pairs layer is refused by name."""
    from specdec.runtime.rowwise import load_kernel

    load_kernel()
    linear = nn.Linear(40, 70).to(torch.bfloat16)
    pairs = PackedLinear.pack(linear, "bfloat16")
    plain = PackedLinear.pack(linear.float(), "bfloat16")
    assert plain.packed.dim() == 3
    x = torch.randn(3, 40)
    torch.testing.assert_close(plain(x), nn.functional.linear(x, linear.weight.float(), linear.bias.float()),
                               atol=1e-4, rtol=1e-4)
    if pairs.packed.dim() == 3:
        pytest.skip("this CPU's kernels have no bfloat16 dot product: both layouts are the plain one")
    torch.testing.assert_close(pairs(x.bfloat16()).float(), plain(x.bfloat16()).float(), atol=5e-2, rtol=2e-2)
    with pytest.raises(ConfigError, match="packed for bfloat16 passes"):
        pairs(x)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_HUGEPAGE is Linux's")
def test_a_packed_weight_of_a_huge_page_or_more_asks_for_huge_pages():
    """PackedLinear.pack puts a weight of HUGE_PAGE bytes or more on a mapping of its own advised MADV_HUGEPAGE (its
    VmFlags say `hg`, and it is private: a shared mapping is shmem's, whose huge pages are a setting of their own), a
    smaller one where torch's allocator puts it; the layer computes what it did."""
    torch.manual_seed(0)
    linear = nn.Linear(1024, 2048)  # 8 MB of float32 weights
    big = PackedLinear.pack(linear, "float32")
    flags = _vm_flags(big.packed.data_ptr())
    assert big.packed.nbytes >= HUGE_PAGE and "hg" in flags and "sh" not in flags  # (shared memory gets none)
    small = PackedLinear.pack(nn.Linear(64, 64), "float32")
    assert small.packed.nbytes < HUGE_PAGE and "hg" not in _vm_flags(small.packed.data_ptr())
    x = torch.randn(3, 1024)
    assert torch.equal(big(x), torch.ops.specdec.packed_linear(x, big.packed.clone(), big.bias, 2048))
