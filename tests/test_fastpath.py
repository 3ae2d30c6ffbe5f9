"""The fast path: slot KV cache (StaticCausalLM) and compiled passes, token-identical to plain greedy decoding.

The suites in test_greedy_equality / test_exactness run the slot cache uncompiled (methods.py "*-static");
here it runs compiled on few shapes (each shape costs seconds to compile on a CPU; the compiled callables are
shared by every test through the model objects of one module-scoped fixture), plus the tree pass, commit,
hidden states, fallbacks and errors on the eager slot cache.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from models import hf_greedy, perturbed, tiny

import specdec
from specdec.core.tree import TreeMask
from specdec.errors import PromptError
from specdec.exactness import check_exactness
from specdec.runtime.causal_lm import CachedCausalLM
from specdec.runtime.compiled import COMPILED, FastPathWarning
from specdec.runtime.slot_cache import POOL
from specdec.runtime.static_lm import LONG_PREFILL_ROWS, PREFILL_ROWS, StaticCausalLM

LONG = [(i * 37 + 11) % 96 for i in range(120)]


@pytest.fixture(scope="module")
def llama_pair():
    target = tiny("llama", hidden=32, layers=2)
    return target, perturbed(target, 0.1)


@pytest.mark.compile
def test_compiled_draft_model_is_token_identical_and_compiles_each_shape_once(llama_pair):
    target, draft = llama_pair
    for prompt in (LONG[:20], LONG[:37]):
        out = specdec.generate(target, prompt, drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=24,
                               compile=True)
        assert out.tokens == hf_greedy(target, prompt, 24)
        assert 0 < out.stats.accepted < out.stats.drafted
    # one verification shape (γ+1 = 4 rows, greedy rule in the graph) for the target, one γ=3 graph for the
    # draft: both reused by the second request, and by the short last rounds (padded to the compiled shapes);
    # one prefill shape each, whatever the prompt's length (20 and 37 tokens: chunks of PREFILL_ROWS, the last
    # padded)
    assert sorted(k[:3] for k in COMPILED[target].fns) == [("prefill", PREFILL_ROWS, 256), ("verify", 4, 256)]
    assert sorted(k[:2] for k in COMPILED[draft].fns) == [("draft", 3), ("prefill", PREFILL_ROWS)]


@pytest.mark.compile
def test_compiled_draft_model_max_new_tokens_cut_and_eos(llama_pair):
    target, draft = llama_pair
    free = hf_greedy(target, LONG[:20], 24)
    eos = free[5]
    out = specdec.generate(target, LONG[:20], drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=24,
                           eos_token_id=eos, compile=True)
    assert out.tokens == free[: free.index(eos) + 1]
    out = specdec.generate(target, LONG[:20], drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=2,
                           compile=True)
    assert out.tokens == free[:2]


def test_sampling_verifies_inside_the_pass_with_the_eager_rule_s_tokens(llama_pair):
    """At T > 0 the slot-cache target verifies a chain in its own pass (warp + verify.rejection_rule, run
    here uncompiled: the same function the compiled graph runs); a seeded request gives the eager
    adapter's tokens, with draft probabilities, point masses (prompt lookup) and plain decoding. A custom
    verify_fn still gets every round's logits on the fast path."""
    target, draft = llama_pair
    options = dict(max_new_tokens=30, seed=5, eos_token_id=[], temperature=0.8, top_k=20, top_p=0.9)
    fast = {}
    for name, drafter, same in (("draft", lambda: specdec.DraftModel(draft), 26),
                                ("lookup", lambda: specdec.PromptLookup(), 30), ("plain", lambda: None, 30)):
        eager = specdec.generate(target, LONG[:20], drafter=drafter(), gamma=3, compile=False, **options)
        dec = specdec.SpeculativeDecoder(target, drafter(), gamma=3, compile="static", **options)
        assert dec.fused_verify
        fast[name] = list(dec.stream(LONG[:20]))
        # (the static draft draws γ uniforms even when the short last round keeps fewer: from there on the
        # two paths' draws differ, each exact)
        assert fast[name][:same] == eager.tokens[:same]
        assert 0 < dec.stats.accepted < dec.stats.drafted or name != "draft"
    calls = []

    def recording(draft_tokens, draft_probs, target_logits, sampling, generator):
        calls.append(target_logits.shape)
        return specdec.engine.verification.verify_round(draft_tokens, draft_probs, target_logits, sampling, generator)

    dec = specdec.SpeculativeDecoder(target, specdec.DraftModel(draft), gamma=3, compile="static",
                                     verify_fn=recording, **options)
    assert not dec.fused_verify
    assert list(dec.stream(LONG[:20])) == fast["draft"]
    assert len(calls) == dec.stats.rounds and calls[0] == (4, target.config.vocab_size)


def test_gamma_auto_compiles_every_shape_before_its_first_round(monkeypatch):
    """gamma="auto" on the fast path drafts only FAST_PATH_GAMMAS, whose shapes (draft graphs, verification
    passes, the draft's catch-up after plain rounds) are compiled before the first round of the first request:
    no round of any request compiles. torch.compile is replaced by the identity here (what is checked is WHEN
    a shape is compiled, and the tokens; the real compiler runs in the tests above)."""
    from specdec.engine.adaptive import FAST_PATH_GAMMAS, AdaptiveGamma

    late: list[str] = []
    rounds = {"started": False}

    def fake_compile(fn, **kwargs):
        if rounds["started"]:
            late.append(getattr(fn, "__name__", repr(fn)))
        return fn

    choose = AdaptiveGamma.choose

    def marking_choose(self, stats):
        rounds["started"] = True
        return choose(self, stats)

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(AdaptiveGamma, "choose", marking_choose)
    target = tiny("llama", hidden=32, layers=2, seed=3)  # own model objects: their own compiled entries
    for noise in (0.05, 3.0):  # a good draft (long drafts) and a bad one (plain rounds, probes, catch-ups)
        draft = perturbed(target, noise, seed=4)
        drafter = specdec.DraftModel(draft)
        rounds["started"] = False
        for prompt in (LONG[:20], LONG[:45], LONG[:20]):
            dec = specdec.SpeculativeDecoder(target, drafter, gamma="auto", max_new_tokens=60, compile=True)
            assert list(dec.stream(prompt)) == hf_greedy(target, prompt, 60)
            # What the policy asked for; the loop may cap the last rounds at the tokens remaining (a shorter γ
            # reuses the next larger compiled shape, which `late` and the compiled shapes below check).
            assert dec.gamma_policy.chosen and set(dec.gamma_policy.chosen) <= {0, *FAST_PATH_GAMMAS}
        if noise > 1:
            assert 0 in dec.gamma_policy.chosen  # plain rounds happened, so the catch-up ran
    assert late == []
    # greedy chains verify in their pass too: verifying passes of every size, and the prefill's chunk
    assert {k[1] for k in COMPILED[target].fns if k[0] == "verify"} == {1, *(g + 1 for g in FAST_PATH_GAMMAS)}
    assert {k[:2] for k in COMPILED[target].fns if k[0] != "verify"} == {("prefill", PREFILL_ROWS)}
    # T > 0: the verifying passes (warp and rejection rule in the graph) are what is compiled up front
    rounds["started"] = False
    dec = specdec.SpeculativeDecoder(target, specdec.DraftModel(perturbed(target, 3.0, seed=4)), gamma="auto",
                                     max_new_tokens=40, compile=True, temperature=1.0, top_k=20, seed=0)
    assert len(list(dec.stream(LONG[:20]))) == 40 and dec.fused_verify
    assert late == []
    assert {k[1] for k in COMPILED[target].fns if k[0] == "verify" and not k[4].greedy} == {
        1, *(g + 1 for g in FAST_PATH_GAMMAS)}


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "mistral", "gemma"])
def test_compiled_other_architectures(arch):
    target = tiny(arch, hidden=32, layers=2)
    draft = perturbed(target, 0.2 if arch == "gemma" else 0.1)
    out = specdec.generate(target, LONG[:20], drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=24,
                           compile=True)
    assert out.tokens == hf_greedy(target, LONG[:20], 24)


@pytest.mark.compile
@pytest.mark.exactness_positive(checks=1, alpha=1e-4)
def test_compiled_plain_and_sampling_are_exact(llama_pair):
    target, draft = llama_pair
    assert specdec.generate(target, LONG[:20], max_new_tokens=16, compile=True).tokens == \
        hf_greedy(target, LONG[:20], 16)
    small = tiny("llama", hidden=16, layers=2, vocab=8, seed=3)
    result = check_exactness(small, [1, 2, 1], specdec.DraftModel(perturbed(small, 0.3, seed=11)),
                              gamma=2, temperature=1.0, top_k=6, top_p=0.9, max_new_tokens=3, samples=3000,
                              seed=7, alpha=1e-4, eos_token_id=[], compile=True)
    assert result.passed, result.summary()


@pytest.mark.compile
@pytest.mark.exactness_positive(checks=1, alpha=1e-4)
def test_compiled_reduced_draft_vocabulary_is_exact():
    """The compiled draft chain over a reduced vocabulary (its column -> token map in the graph, q spread back to
    the whole vocabulary by the drafter) passes the statistical test at T > 0 with top-k and top-p."""
    small = tiny("llama", hidden=16, layers=2, vocab=8, seed=3)
    drafter = specdec.DraftModel(perturbed(small, 0.3, seed=11), draft_vocab=[0, 1, 2, 4, 5, 7])
    result = check_exactness(small, [1, 2, 1], drafter, gamma=2, temperature=1.0, top_k=6, top_p=0.9,
                             max_new_tokens=3, samples=3000, seed=7, alpha=1e-4, eos_token_id=[], compile=True)
    assert result.passed, result.summary()


@pytest.mark.compile
@pytest.mark.slow
def test_compiled_sampling_verifies_in_one_graph_with_the_slot_cache_s_tokens(llama_pair):
    """compile=True at T > 0: one verifying graph per (rows, sampling config), reused by the short last
    rounds (padded) and by a point-mass drafter; tokens as the uncompiled slot cache's for a seed."""
    target, draft = llama_pair
    options = dict(max_new_tokens=24, seed=3, eos_token_id=[], temperature=1.0, top_k=20, top_p=0.9, gamma=3)
    for drafter in (lambda: specdec.DraftModel(draft), lambda: specdec.PromptLookup()):
        static = specdec.generate(target, LONG[:20], drafter=drafter(), compile="static", **options)
        compiled = specdec.generate(target, LONG[:20], drafter=drafter(), compile=True, **options)
        assert compiled.tokens == static.tokens
    sampling = specdec.core.sampling.SamplingConfig(1.0, 20, 0.9)
    assert ("verify", 4, 256, False, sampling) in COMPILED[target].fns
    # one verifying graph for this sampling config (greedy ones, which other tests of this target compile, apart)
    assert not [key for key in COMPILED[target].fns
                if key[0] == "verify" and key[4] == sampling and key != ("verify", 4, 256, False, sampling)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral", "gemma"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_slot_cache_greedy_equality(arch, gamma):
    target = tiny(arch, hidden=32, layers=2)
    draft = perturbed(target, 0.2 if arch == "gemma" else 0.1)
    for prompt in ([7], LONG[:40]):
        out = specdec.generate(target, prompt, drafter=specdec.DraftModel(draft), gamma=gamma,
                               max_new_tokens=20, compile="static")
        assert out.tokens == hf_greedy(target, prompt, 20)


def test_sliding_window_model_falls_back_with_one_warning_and_same_tokens():
    target = tiny("mistral", hidden=32, layers=2, sliding_window=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder = specdec.SpeculativeDecoder(target, specdec.DraftModel(perturbed(target, 0.1)), gamma=4,
                                             max_new_tokens=30, compile=True)
        tokens = list(decoder.stream(LONG[:30]))
    assert isinstance(decoder.target, CachedCausalLM)
    messages = {str(w.message) for w in caught if issubclass(w.category, FastPathWarning)}
    assert len(messages) == 1 and "sliding-window" in messages.pop()
    assert tokens == hf_greedy(target, LONG[:30], 30)


def test_prompt_longer_than_the_static_cache_fails_before_any_work():
    target = tiny("llama", hidden=32, layers=2)
    lm = StaticCausalLM(target, compile=False, max_len=48)
    decoder = specdec.SpeculativeDecoder(lm, None, max_new_tokens=16)
    with pytest.raises(PromptError, match="48") as info:
        list(decoder.stream(LONG[:40]))
    assert "max_len" in str(info.value)
    assert lm.length == 0 and lm.prefill_s == 0.0  # nothing ran


def test_bad_compile_value_is_a_config_error():
    with pytest.raises(specdec.SpecdecError, match="compile"):
        specdec.generate(tiny("llama"), [1, 2], compile="yes")


def _lm(target):
    lm = StaticCausalLM(target, compile=False)
    lm.ensure_capacity(64)
    return lm


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma"])
def test_tree_pass_matches_per_branch_chain_passes(arch):
    target = tiny(arch, hidden=32, layers=2)
    prompt = torch.tensor(LONG[:12])
    # root r, children a (1) and b (2), a's child c (3), b's child d (4): branches r-a-c and r-b-d
    tokens = torch.tensor([LONG[12], 5, 9, 17, 33])
    parents = torch.tensor([-1, -1, 0, 1])
    tree = TreeMask.from_parents(parents)
    lm = _lm(target)
    lm.prefill(prompt)
    scores = lm.score(tokens, tree=tree, hidden=True)
    for branch in ([0, 1, 3], [0, 2, 4]):
        ref = _lm(target)
        ref.prefill(prompt)
        chain = ref.score(tokens[branch], hidden=True)
        torch.testing.assert_close(scores.logits[branch], chain.logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(scores.hidden[branch], chain.hidden, rtol=0, atol=1e-10)
    # keep the path b-d (rows 0, 2, 4): the cache then continues exactly like a chain through it
    start = 12
    lm.commit(start, torch.tensor([0, 2, 4]))
    assert lm.length == start + 3
    nxt = lm.forward(torch.tensor([41]))
    chain = _lm(target)
    chain.prefill(torch.cat([prompt, tokens[[0, 2, 4]]]))
    torch.testing.assert_close(nxt, chain.forward(torch.tensor([41])), rtol=0, atol=1e-10)


@pytest.mark.compile
def test_a_compiled_prefill_in_chunks_gives_every_row_the_bits_of_any_other_chunking(llama_pair):
    """A compiled prefill runs in padded chunks of PREFILL_ROWS rows (LONG_PREFILL_ROWS while many remain); near a
    full cache its last chunk re-feeds earlier rows (or runs unpadded when there are too few). None of it changes
    a row's states, nor what is decoded after."""
    target = llama_pair[0]
    prompt = torch.tensor(LONG[:45])

    def prefilled(max_len: int, n: int):
        lm = StaticCausalLM(target, compile=True, max_len=max_len)
        states = lm.prefill(prompt[:n], hidden=True)  # [n, H]
        return lm, states

    roomy, expected = prefilled(256, 45)  # chunks of 0..31 and 32..44 (padded)
    assert expected.shape == (45, 32)
    tight, states = prefilled(50, 45)  # the last chunk's padding would pass slot 49: re-feeds rows 18..31
    assert torch.equal(states, expected)
    assert tight.length == roomy.length == 45
    token = torch.tensor([7])
    assert torch.equal(tight.forward(token), roomy.forward(token))  # and the same caches behind them
    short, states = prefilled(20, 10)  # 10 rows, 32 do not fit and none precede: one unpadded pass
    assert torch.equal(states, expected[:10])
    assert ("prefill", 10, 20, True) in COMPILED[target].fns

    prompt = torch.tensor(LONG[:110])  # more than 3 * PREFILL_ROWS rows: one LONG_PREFILL_ROWS pass where it fits
    roomy, expected = prefilled(256, 110)
    assert ("prefill", LONG_PREFILL_ROWS, 256, True) in COMPILED[target].fns
    tight, states = prefilled(120, 110)  # 128 rows do not fit: chunks of 32, the last re-feeding 8 rows
    assert ("prefill", LONG_PREFILL_ROWS, 120, True) not in COMPILED[target].fns
    assert torch.equal(states, expected) and tight.length == roomy.length == 110
    assert torch.equal(tight.forward(token), roomy.forward(token))


def test_hidden_states_feed_the_lm_head():
    target = tiny("llama", hidden=32, layers=2)
    lm = _lm(target)
    lm.prefill(torch.tensor(LONG[:10]))
    scores = lm.score(torch.tensor(LONG[10:14]), hidden=True)
    with torch.inference_mode():
        torch.testing.assert_close(target.get_output_embeddings()(scores.hidden), scores.logits)


@pytest.mark.compile
def test_a_request_takes_a_finished_request_s_cache_zeroed_with_the_same_tokens():
    """The fast path's adapter gives its cache back to the pool when dropped; the next request of that model and
    size takes it, zeroed, and decodes as with a new cache."""
    target = tiny("llama", hidden=32, layers=2, dtype=torch.float32)
    options = dict(max_new_tokens=16, eos_token_id=[], compile=True)
    first = specdec.generate(target, LONG[:37], **options).tokens
    (kept,) = POOL.held(target)
    assert any(bool(layer.keys.any()) for layer in kept.layers)  # that request's keys
    lm = StaticCausalLM(target, compile=True)
    lm.ensure_capacity(37 + 16 + 8)
    assert lm.cache is kept and not POOL.held(target)
    assert not any(bool(layer.keys.any() or layer.values.any()) for layer in kept.layers)
    del lm  # gives it back
    assert POOL.held(target) == [kept]
    specdec.generate(target, LONG[5:42], **options)  # another request's keys in the cache
    again = specdec.generate(target, LONG[:37], **options).tokens
    assert again == first == hf_greedy(target, LONG[:37], 16)


def test_chain_commit_is_a_crop_and_matches_the_eager_adapter():
    target = tiny("qwen2", hidden=32, layers=2)
    lm, eager = _lm(target), CachedCausalLM(target)
    for a in (lm, eager):
        a.prefill(torch.tensor(LONG[:10]))
    torch.testing.assert_close(lm.forward(torch.tensor(LONG[10:15])), eager.forward(torch.tensor(LONG[10:15])))
    lm.commit(10, torch.arange(2))
    eager.crop(12)
    assert lm.length == eager.length == 12
    torch.testing.assert_close(lm.forward(torch.tensor([3, 4])), eager.forward(torch.tensor([3, 4])))


def test_bench_knows_the_compiled_methods():
    from specdec.bench.runner import Config, is_gamma_free, make_configs, parse_methods

    methods = parse_methods("plain-compiled,draft-compiled,prompt-lookup-compiled,hf-plain-compiled")
    configs = make_configs(methods, [3, 4])
    assert [c.label for c in configs] == ["plain-compiled", "draft-compiled@3", "draft-compiled@4",
                                          "prompt-lookup-compiled@3", "prompt-lookup-compiled@4",
                                          "hf-plain-compiled"]
    assert Config("draft-compiled", 4).kind == "draft" and Config("plain-compiled", None).kind is None
    assert is_gamma_free("draft-auto-compiled") and not is_gamma_free("draft-compiled")
    with pytest.raises(specdec.ConfigError):
        parse_methods("hf-assisted-compiled")


def _plus_one(model, x):
    return x + 1


def test_compiled_passes_keep_the_guards_on_their_arguments_only():
    """`argument_guards` (the compiled passes' guard filter) keeps dynamo's guards on a call's arguments (inputs,
    cache tensors, flags) and drops those on the model's modules, parameters, buffers, hooks and config, and on
    globals, which the compile froze or traced in."""
    from types import SimpleNamespace  # noqa: PLC0415

    from specdec.runtime.compiled import argument_guards  # noqa: PLC0415

    names = {"args[1]": True, "args[5].layers[0].keys": True, "args[7].greedy": True,
             "args[0]._modules['model']._modules['layers']": False,
             "args[0]._modules['lm_head']._parameters['weight']": False, "args[0]._buffers['inv_freq']": False,
             "args[0]._forward_hooks": False, "args[0].config": False, "args[0].config._attn_implementation": False,
             "dict(type(args[0].config).__mro__[1].__dict__)": False, "args[0].configured": True}
    entries = [SimpleNamespace(name=name, is_global=False) for name in names]
    assert argument_guards(entries) == list(names.values())
    assert argument_guards([SimpleNamespace(name="G['torch']", is_global=True)]) == [False]


@pytest.mark.compile
def test_a_compiled_shape_runs_without_re_checking_every_guard_and_a_mismatch_recompiles_loudly(monkeypatch):
    """Calls of an already-compiled key skip dynamo's full guard check (each key its own code object, keeping
    the guards on its arguments alone); a call that matches no entry is retried with full guards and flagged as
    an unplanned recompile, never run on a wrong graph."""
    from specdec.runtime import compiled, rowwise  # noqa: PLC0415

    rowwise.load_kernel()  # the fast path's graph passes name its ops, also where this test runs alone
    monkeypatch.setattr(compiled, "UNPLANNED_RECOMPILES", [])
    model = tiny("llama", hidden=16, layers=1)
    keys = [("pass", rows, 0, False, False) for rows in (4, 5)]  # as the slot cache names its shapes
    four, five = (compiled.compile_once(model, key, _plus_one) for key in keys)
    x4, x5 = torch.arange(4.0), torch.arange(5.0)
    assert torch.equal(four(model, x4), x4 + 1) and torch.equal(five(model, x5), x5 + 1)  # compiled: two entries
    for _ in range(2):  # each key's entry is picked among the two by the differentiating guards alone
        assert torch.equal(four(model, x4), x4 + 1) and torch.equal(five(model, x5), x5 + 1)
    assert not compiled.UNPLANNED_RECOMPILES
    x6 = torch.arange(6.0)
    assert torch.equal(four(model, x6), x6 + 1)  # no entry matches: recompiled, not run on the 4-row graph
    assert compiled.UNPLANNED_RECOMPILES == [keys[0]]


@pytest.mark.compile
def test_float32_compiled_speculative_equals_compiled_plain_on_the_default_pair():
    """In float32 every compiled pass runs the packed kernel (runtime/fuse_linears.packs): a verification pass's
    rows have a decoding pass's bits, so a draft chain (over the whole vocabulary or a reduced one), a token tree
    and EAGLE give compiled plain decoding's tokens."""
    from specdec.bench.workloads import code_prompts  # noqa: PLC0415
    from specdec.hub.default_pair import default_assets_dir, frequent_tokens  # noqa: PLC0415
    from specdec.hub.loading import load_tokenizer  # noqa: PLC0415

    target, draft, _ = specdec.load_default(dtype=torch.float32)
    prompts = [p.ids for p in code_prompts(load_tokenizer(default_assets_dir() / "tokenizer"), 8, seed=1)[:2]]
    drafters = {"draft-6": (specdec.DraftModel(draft), {"gamma": 6}),
                "draft-vocab-6": (specdec.DraftModel(draft, draft_vocab=frequent_tokens(2048)), {"gamma": 6}),
                "tree": (specdec.DraftTree(draft), {}),
                "eagle": (specdec.Eagle(target, specdec.load_default_heads(target)["eagle"]), {})}
    for prompt in prompts:
        plain = specdec.generate(target, prompt, max_new_tokens=48, temperature=0.0, eos_token_id=[],
                                 compile=True).tokens
        for name, (drafter, options) in drafters.items():
            out = specdec.generate(target, prompt, drafter=drafter, max_new_tokens=48, temperature=0.0,
                                   eos_token_id=[], compile=True, **options)
            assert out.tokens == plain, name
