"""Encoder-decoder targets (T5, BART, Marian, Whisper): greedy equality with `model.generate`, the statistical
exactness suite, decoder-cache rollback after every round, and bad input (docs/seq2seq.md)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from methods import SEQ2SEQ_METHODS, SEQ2SEQ_TREE_METHODS, SEQ2SEQ_TREE_STATISTICAL
from faulty import FAULTY_VERIFIERS
from models import perturbed, tiny
from seq2seq_models import ARCHS, FRAMES, MELS, encoder_inputs, hf_greedy_seq2seq, tiny_seq2seq

import specdec
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal
from specdec.engine.decoding import SpeculativeDecoder
from specdec.exactness import check_exactness
from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, decoder_start_ids

SOURCE = [(i * 37 + 11) % 90 + 3 for i in range(16)]  # source token ids (text encoders)
#: Noise scale (x each weight's std) that makes a perturbed copy agree with the target often but not always.
PARTIAL = {"t5": 0.02, "bart": 0.1, "marian": 0.2, "whisper": 0.1}


@pytest.fixture(scope="module")
def pairs():
    """arch -> (target, partially agreeing draft, smaller draft of the same family, encoder inputs)."""
    out = {}
    for arch in ARCHS:
        target = tiny_seq2seq(arch, hidden=32, layers=2, seed=0)
        out[arch] = (target, perturbed(target, PARTIAL[arch]), tiny_seq2seq(arch, hidden=16, layers=1, seed=5),
                     encoder_inputs(arch, SOURCE))
    return out


def run(target, drafter, enc, gamma=3, max_new_tokens=24, prompt=None, **kw):
    return specdec.generate(target, prompt, drafter=drafter, gamma=gamma, max_new_tokens=max_new_tokens,
                            temperature=0.0, encoder_inputs=enc, **kw)


def reference(target, enc, max_new_tokens=24, prompt=None, eos=None):
    return hf_greedy_seq2seq(target, enc, prompt or decoder_start_ids(target), max_new_tokens, eos=eos)


# ------------------------------------------------------------------------------------------ greedy equality


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_partially_agreeing_draft_matches_generate(pairs, arch, gamma):
    target, draft, _, enc = pairs[arch]
    out = run(target, specdec.DraftModel(draft), enc, gamma)
    assert out.tokens == reference(target, enc)
    assert 0 < out.stats.accepted < out.stats.drafted  # the rollback path ran


@pytest.mark.parametrize("arch", ARCHS)
def test_smaller_draft_of_the_same_family(pairs, arch):
    target, _, small, enc = pairs[arch]
    out = run(target, specdec.DraftModel(small), enc, gamma=4)
    assert out.tokens == reference(target, enc)
    assert out.stats.drafted > 0


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "w4a8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_target_on_packed_weights_decodes_as_its_own_greedy_decoding(pairs, arch, weights):
    """Encoder-decoder targets run on packed weights too (specdec.load(weights=...)), T5's included, whose feed-forward
    asks its output projection for a float weight (a packed layer keeps none: None, which T5 then leaves alone):
    speculative decoding with a packed draft is token-identical to HF's greedy decoding of the packed target."""
    from specdec.runtime.weights import PackedLinear, pack_model

    target, draft, _, enc = pairs[arch]
    target, draft = (pack_model(copy.deepcopy(m).float(), weights, group=16) for m in (target, draft))
    enc = {name: x.float() if x.is_floating_point() else x for name, x in enc.items()}  # (Whisper's features)
    assert sum(isinstance(m, PackedLinear) for m in target.modules()) > 8
    out = run(target, specdec.DraftModel(draft), enc, gamma=3)
    assert out.tokens == reference(target, enc)
    assert out.stats.drafted > 0


@pytest.mark.parametrize("method", sorted(SEQ2SEQ_METHODS))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_registered_seq2seq_method(pairs, arch, method):
    target, draft, _, enc = pairs[arch]
    drafter, options = build_seq2seq(method, target, draft)
    out = specdec.generate(target, None, drafter=drafter, encoder_inputs=enc,
                           **{"gamma": 3, "max_new_tokens": 24, **options})
    assert out.tokens == reference(target, enc)


def build_seq2seq(name, target, draft, methods=SEQ2SEQ_METHODS):
    built = methods[name](target, draft)
    return (built[0], dict(built[1])) if isinstance(built, tuple) else (built, {})


@pytest.mark.parametrize("method", sorted(SEQ2SEQ_TREE_METHODS))
def test_trees_and_heads_on_a_decoder_that_takes_positions(pairs, method):
    """Whisper's decoder takes decoder_position_ids and a 4D mask: a tree is scored in one pass."""
    target, draft, _, enc = pairs["whisper"]
    drafter, options = build_seq2seq(method, target, draft, SEQ2SEQ_TREE_METHODS)
    decoder = SpeculativeDecoder(target, drafter, gamma=3, max_new_tokens=24, encoder_inputs=enc, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back to chains
        assert list(decoder.stream(None)) == reference(target, enc)
    assert decoder.target.supports_tree(4)
    if method != "prompt-lookup-branches":  # random features: lookup may find nothing to copy
        assert decoder.stats.accepted > 0


@pytest.mark.parametrize("method", sorted(SEQ2SEQ_TREE_METHODS))
def test_trees_and_heads_beside_a_decoder_on_packed_weights(pairs, method):
    """Whisper's target and draft on int8 weights: trees scored in one pass and Medusa's heads running the packed LM
    head decode as HF's greedy decoding of the packed target."""
    from specdec.runtime.weights import pack_model

    target, draft, _, enc = pairs["whisper"]
    target, draft = (pack_model(copy.deepcopy(m).float(), "int8", group=16) for m in (target, draft))
    enc = {name: x.float() if x.is_floating_point() else x for name, x in enc.items()}
    drafter, options = build_seq2seq(method, target, draft, SEQ2SEQ_TREE_METHODS)
    decoder = SpeculativeDecoder(target, drafter, gamma=3, max_new_tokens=24, encoder_inputs=enc, **options)
    assert list(decoder.stream(None)) == reference(target, enc)


def test_tree_commit_keeps_the_accepted_branch_in_the_decoder_cache(pairs):
    """Score a two-branch tree, keep the second branch: the cache then equals a chain pass along it."""
    target, _, _, enc = pairs["whisper"]
    tree_lm, chain_lm = CachedSeq2SeqLM(target), CachedSeq2SeqLM(target)
    start = torch.tensor(decoder_start_ids(target))
    for lm in (tree_lm, chain_lm):
        lm.reset(encoder_inputs=enc)
        lm.prefill(start)
    tree = specdec.core.tree.TreeMask.from_parents(torch.tensor([-1, -1, 0, 1]))
    tree_lm.score(torch.tensor([7, 4, 5, 6, 8]), tree=tree)
    tree_lm.commit(1, torch.tensor([0, 2, 4]))  # the root, node 1 (5), node 3 (8)
    chain_lm.forward(torch.tensor([7, 5, 8]))
    assert tree_lm.length == chain_lm.length == 4
    for a, b in zip(tree_lm.cache.self_attention_cache.layers, chain_lm.cache.self_attention_cache.layers):
        assert torch.allclose(a.keys, b.keys) and torch.allclose(a.values, b.values)
    nxt = torch.tensor([9])
    assert torch.allclose(tree_lm.forward(nxt), chain_lm.forward(nxt))


@pytest.mark.parametrize("arch", ["t5", "whisper"])
def test_eos_inside_an_accepted_run(pairs, arch):
    target, _, _, enc = pairs[arch]
    free = reference(target, enc)
    stop = next(i for i in range(1, 24) if free[i] not in free[:i])
    eos = free[stop]
    out = run(target, specdec.DraftModel(target), enc, gamma=8, eos_token_id=eos)
    assert out.tokens == free[: stop + 1] == reference(target, enc, eos=eos)


def test_explicit_decoder_prompt_and_max_new_tokens(pairs):
    target, draft, _, enc = pairs["bart"]
    prompt = decoder_start_ids(target) + [7, 8]
    for max_new in (1, 5):
        out = run(target, specdec.DraftModel(draft), enc, gamma=4, max_new_tokens=max_new, prompt=prompt)
        assert out.tokens == reference(target, enc, max_new, prompt=prompt)
        assert len(out.tokens) == max_new


def test_stream_and_a_second_request_on_another_source(pairs):
    target, draft, _, enc = pairs["t5"]
    drafter = specdec.DraftModel(draft)
    streamed = list(specdec.stream(target, None, drafter=drafter, gamma=3, max_new_tokens=16, encoder_inputs=enc))
    assert streamed == reference(target, enc, 16)
    other = encoder_inputs("t5", SOURCE[::-1])
    assert run(target, drafter, other, max_new_tokens=16).tokens == reference(target, other, 16)  # re-encoded


def test_prompt_lookup_copies_from_the_source():
    lookup = specdec.PromptLookup(max_ngram=2, min_ngram=1)
    lookup.reset(torch.tensor([0, 5]), encoder_input_ids=torch.tensor([9, 5, 6, 7, 8]))
    proposal = lookup.propose(torch.tensor([0, 5]), 3, specdec.SamplingConfig(0.0), None)
    assert proposal.tokens.tolist() == [6, 7, 8]  # what followed "5" in the source
    lookup.reset(torch.tensor([0, 5, 1, 5]), encoder_input_ids=torch.tensor([9, 5, 6, 7, 8]))
    proposal = lookup.propose(torch.tensor([0, 5, 1, 5]), 3, specdec.SamplingConfig(0.0), None)
    assert proposal.tokens.tolist() == [1, 5, 1]  # the decoded context's own match wins


def test_source_lookup_drafts_on_a_copying_target():
    """A T5 whose decoder output repeats the source: lookup in the source proposes and is accepted."""
    target = tiny_seq2seq("t5", hidden=32, layers=2, seed=0)
    enc = encoder_inputs("t5", SOURCE)
    free = reference(target, enc, 12)
    copying = {"input_ids": torch.tensor([free[:8] + SOURCE[:4]])}  # the continuation is in the source
    out = run(target, specdec.PromptLookup(max_ngram=3), copying, gamma=4, max_new_tokens=12)
    assert out.tokens == reference(target, copying, 12)
    assert out.stats.drafted > 0


def test_compile_falls_back_to_the_eager_adapter_with_one_warning(pairs):
    target, draft, _, enc = pairs["marian"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(target, specdec.DraftModel(draft), enc, compile=True, max_new_tokens=12)
    fast = [w for w in caught if issubclass(w.category, specdec.FastPathWarning)]
    assert len(fast) == 1 and "encoder-decoder" in str(fast[0].message)
    assert out.tokens == reference(target, enc, 12)


# ------------------------------------------------------------------------------- scripted decoder rollback


class ScriptedDraft(Drafter):
    """Proposes the target's own greedy tokens with a wrong one at `wrong_at[round]` (None: all right), and
    records the target adapter's caches after every commit."""

    vocab_size = None
    capabilities = DrafterCapabilities(accepts_encoder_inputs=True)

    def __init__(self, truth, wrong_at, vocab):
        self.truth, self.wrong_at, self.vocab = truth, wrong_at, vocab
        self.target: CachedSeq2SeqLM | None = None
        self.log: list[dict] = []

    def reset(self, prompt_ids, **encoder):
        self.prompt_len, self.round, self.log, self.expected = prompt_ids.shape[0], 0, [], 0

    def propose(self, context, gamma, sampling, generator):
        done = context.shape[0] - self.prompt_len
        draft = list(self.truth[done : done + gamma])
        wrong = self.wrong_at[self.round % len(self.wrong_at)]
        if wrong is not None and wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % self.vocab
        self.expected = len(draft) if wrong is None else min(wrong, len(draft))
        return Proposal(torch.tensor(draft, dtype=torch.long))

    def commit(self, context, num_accepted):
        cache = self.target.cache
        layer = cache.cross_attention_cache.layers[0]
        self.log.append(dict(n=context.shape[0], k=num_accepted, expected=self.expected, length=self.target.length,
                             self_len=cache.self_attention_cache.get_seq_length(),
                             cross_len=cache.cross_attention_cache.get_seq_length(), cross_ptr=layer.keys.data_ptr(),
                             cross_keys=layer.keys.clone()))
        self.round += 1
        self.expected = 0  # a round the decoder drafts nothing for (the last token) does not call propose


@pytest.mark.parametrize("arch", ["t5", "whisper"])
def test_decoder_cache_rolls_back_every_round_and_cross_attention_is_untouched(pairs, arch):
    target, _, _, enc = pairs[arch]
    truth = reference(target, enc, 30)
    drafter = ScriptedDraft(truth, wrong_at=[0, 2, None, 1, 3, None], vocab=target.config.vocab_size)
    decoder = SpeculativeDecoder(target, drafter, gamma=4, max_new_tokens=30, encoder_inputs=enc)
    drafter.target = decoder.target
    assert list(decoder.stream(None)) == truth
    source_len = decoder.target.encoder_outputs.last_hidden_state.shape[1]
    first = drafter.log[0]
    assert len(drafter.log) >= 6
    for entry in drafter.log:
        assert entry["k"] == entry["expected"]  # rejected exactly where the script put the wrong token
        assert entry["length"] == entry["self_len"] == entry["n"] - 1  # the last committed token is not cached
        assert entry["cross_len"] == source_len
        assert entry["cross_ptr"] == first["cross_ptr"] and torch.equal(entry["cross_keys"], first["cross_keys"])


# ----------------------------------------------------------------------------------- statistical exactness

ALPHA = 1e-4
TREE_ALPHA = 1e-5  # the tree checks: a lower level keeps the suite's family-wise bound under 0.01
N = 3000
VOCAB = 8
STAT_SOURCE = {"input_ids": [[2, 3, 4, 2, 3, 5, 6, 2]]}
#: (temperature, top_k, top_p, gamma, max_new_tokens, eos): as tests/test_exactness.py SETTINGS.
SETTINGS = {
    "T1.0-top6-g2-L3": (1.0, 6, None, 2, 3, False),
    "T0.7-p0.9-g3-L4-eos": (0.7, None, 0.9, 3, 4, True),
}


@pytest.fixture(scope="module")
def small_vocab_pair():
    """A V=8 T5 (float64) with an EOS of decent probability after the decoder start, and a perturbed draft."""
    target = tiny_seq2seq("t5", hidden=16, layers=1, vocab=VOCAB, seed=3)
    with torch.no_grad():
        first = torch.softmax(target(input_ids=torch.tensor(STAT_SOURCE["input_ids"]),
                                     decoder_input_ids=torch.tensor([[0]])).logits[0, -1], -1)
    target.generation_config.eos_token_id = int(first.argsort(descending=True)[1])
    return target, perturbed(target, 0.3, seed=11)


def _stat_check(target, drafter, setting, **kw):
    temperature, top_k, top_p, gamma, max_new, use_eos = SETTINGS[setting]
    return check_exactness(target, [0], drafter, gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p,
                           max_new_tokens=max_new, eos_token_id=None if use_eos else [], samples=N, seed=1234,
                           alpha=ALPHA, encoder_inputs=STAT_SOURCE, **kw)


@pytest.mark.exactness_positive(checks=1, alpha=ALPHA)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", sorted(SEQ2SEQ_METHODS))
def test_every_seq2seq_method_is_exact(small_vocab_pair, name, setting):
    target, draft = small_vocab_pair
    drafter, extra = build_seq2seq(name, target, draft)
    result = _stat_check(target, drafter, setting, method=name, **extra)
    assert result.mode == "enumerate" and result.engine == "memo"
    assert result.passed, result.summary()
    assert result.detectable_tv < 0.12, result.summary()
    if drafter is not None:
        assert 0 < result.accepted < result.drafted, result.summary()


@pytest.fixture(scope="module")
def small_vocab_whisper():
    """A V=8 Whisper (float64) with an EOS of decent probability after the decoder start, and a perturbed draft."""
    target = tiny_seq2seq("whisper", hidden=16, layers=1, vocab=VOCAB, seed=3)
    enc = encoder_inputs("whisper", seed=4)
    with torch.no_grad():
        start = torch.tensor([decoder_start_ids(target)])
        first = torch.softmax(target(**enc, decoder_input_ids=start).logits[0, -1], -1)
    target.generation_config.eos_token_id = int(first.argsort(descending=True)[1])
    return target, perturbed(target, 0.3, seed=11), enc


@pytest.mark.exactness_positive(checks=1, alpha=TREE_ALPHA)
@pytest.mark.parametrize("name", SEQ2SEQ_TREE_STATISTICAL)
def test_trees_on_whisper_are_exact(small_vocab_whisper, name):
    """One setting (T = 1, top-k 6) per tree method: the tree passes and commits through Whisper's decoder."""
    target, draft, enc = small_vocab_whisper
    drafter, extra = build_seq2seq(name, target, draft, SEQ2SEQ_TREE_METHODS)
    temperature, top_k, top_p, gamma, max_new, use_eos = SETTINGS["T1.0-top6-g2-L3"]
    result = check_exactness(target, decoder_start_ids(target), drafter, gamma=gamma, temperature=temperature,
                             top_k=top_k, top_p=top_p, max_new_tokens=max_new,
                             eos_token_id=None if use_eos else [], samples=N, seed=1234, alpha=TREE_ALPHA,
                             encoder_inputs=enc, method=name, **extra)
    assert result.mode == "enumerate" and result.engine == "memo"
    assert result.passed, result.summary()
    assert result.detectable_tv < 0.12, result.summary()
    assert 0 < result.accepted < result.drafted, result.summary()


@pytest.mark.statistical
def test_seq2seq_negative_control_is_caught(small_vocab_pair):
    """A verifier that keeps one accepted token too many is caught through the encoder-decoder path too."""
    target, draft = small_vocab_pair
    result = _stat_check(target, specdec.DraftModel(draft), "T1.0-top6-g2-L3",
                         verify_fn=FAULTY_VERIFIERS["accepted_off_by_one"])
    assert result.p_value < 1e-6, result.summary()


# -------------------------------------------------------------------------------------------- bad input


def test_bad_pairings_and_inputs_raise_one_clear_error(pairs):
    target, _, _, enc = pairs["t5"]
    causal = tiny("llama", hidden=16, layers=1, vocab=target.config.vocab_size)
    with pytest.raises(specdec.IncompatibleModelsError, match="decoder-only"):
        run(target, specdec.DraftModel(causal), enc)
    with pytest.raises(specdec.IncompatibleModelsError, match="encoder-decoder"):
        specdec.generate(causal, [1, 2], drafter=specdec.DraftModel(target))
    with pytest.raises(specdec.PromptError, match="encoder_inputs="):
        specdec.generate(target, None)
    with pytest.raises(specdec.ConfigError, match="decoder-only"):
        specdec.generate(causal, [1, 2], encoder_inputs=enc)
    with pytest.raises(specdec.PromptError, match="input_ids"):
        run(target, None, {"input_features": torch.zeros(1, MELS, FRAMES)})
    with pytest.raises(specdec.IncompatibleModelsError, match="vocabulary"):
        run(target, specdec.DraftModel(tiny_seq2seq("t5", hidden=16, layers=1, vocab=80)), enc)
    with pytest.raises(specdec.IncompatibleModelsError, match="PromptLookup"):
        run(target, specdec.Bigram.from_corpus(torch.arange(50) % 96, 96), enc)
    with pytest.raises(specdec.UnsupportedModelError, match="relative position bias"):
        run(target, specdec.DraftTree(pairs["t5"][1]), enc)  # T5: no tree positions without forking the model
    bart, bart_draft, _, bart_enc = pairs["bart"]
    with pytest.raises(specdec.UnsupportedModelError, match="absolute position from the cache length"):
        run(bart, specdec.PromptLookup(branches=2), bart_enc)
    with pytest.raises(specdec.UnsupportedModelError, match="tree"):
        run(bart, specdec.Medusa(bart, specdec.MedusaHeads.init(bart), tree=[(0,), (1,)]), bart_enc)
    with pytest.raises(specdec.UnsupportedModelError, match="encoder-decoder"):
        specdec.Bigram.from_model(target)
    whisper = pairs["whisper"][0]
    for shape in [(1, MELS + 1, FRAMES), (1, MELS, FRAMES - 2)]:
        with pytest.raises(specdec.PromptError, match=rf"\[{MELS}, {FRAMES}\]"):
            run(whisper, None, {"input_features": torch.zeros(shape, dtype=torch.float64)})


# ------------------------------------------------------------------------------------ load, text API, CLI


@pytest.fixture(scope="module")
def saved_t5_pair(tmp_path_factory):
    """A tiny T5 target and a smaller T5 draft saved with the default tokenizer (8192 tokens), float32."""
    from pathlib import Path

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(specdec.__file__).parent / "assets/default/tokenizer")
    root = tmp_path_factory.mktemp("t5pair")
    for name, hidden, layers, seed in [("target", 32, 2, 0), ("draft", 16, 1, 5)]:
        model = tiny_seq2seq("t5", hidden=hidden, layers=layers, vocab=len(tokenizer), seed=seed, dtype=torch.float32)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


def test_load_text_api_and_cli_read_the_prompt_with_the_encoder(saved_t5_pair, capsys):
    from specdec.cli import main as cli_main

    target_dir, draft_dir = saved_t5_pair
    target, tokenizer = specdec.load(target_dir)
    draft, _ = specdec.load(draft_dir)
    assert target.config.is_encoder_decoder and draft.config.is_encoder_decoder
    whisper_dir = target_dir.parent / "whisper"
    tiny_seq2seq("whisper", dtype=torch.float32).save_pretrained(whisper_dir)
    assert type(specdec.hub.loading.load_model(whisper_dir)).__name__ == "WhisperForConditionalGeneration"
    prompt = "def add(a, b):\n    return a + b"
    source = tokenizer(prompt)
    enc = {"input_ids": torch.tensor([source["input_ids"]]), "attention_mask": torch.tensor([source["attention_mask"]])}
    expected = reference(target, enc, 10)
    out = specdec.generate_text(target, tokenizer, prompt, drafter=specdec.DraftModel(draft), max_new_tokens=10)
    assert out.tokens == expected
    assert "".join(specdec.stream_text(target, tokenizer, prompt, max_new_tokens=10)) == out.text
    assert cli_main(["generate", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt", prompt,
                     "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == tokenizer.decode(expected, skip_special_tokens=True).rstrip("\n")


def test_bench_runs_an_encoder_decoder_pair_against_hf_assisted(saved_t5_pair):
    from specdec.bench.runner import BenchSettings, run_benchmark
    from specdec.bench.workloads import user_prompts

    target, tokenizer = specdec.load(saved_t5_pair[0])
    draft, _ = specdec.load(saved_t5_pair[1])
    prompts = user_prompts(tokenizer, ["def add(a, b):\n    return a + b"])
    settings = BenchSettings(methods=["plain", "draft", "prompt-lookup", "hf-plain", "hf-assisted"], gammas=[3],
                             max_new_tokens=6, repeats=1, warmup=0, forward_costs=True)
    results = run_benchmark(target, draft, prompts, settings, progress=False)
    assert all(r["identical_to_hf_plain"] for r in results["runs"])  # every method = HF's greedy decoder output
    assert {c["method"] for c in results["configs"]} == set(settings.methods)
    assert results["forward_costs"]["target_ms"][1] > 0


def test_shipped_pair_loads_by_name_and_drafts_exactly(capsys):
    """The shipped BART pair (assets/seq2seq): load by name, greedy float64 identity to HF generate on a held-out
    masked chunk (a bench prompt), the draft's tokens mostly accepted, and `specdec generate --target
    default-seq2seq` using its draft."""
    from specdec.cli import main as cli_main

    target, draft, tokenizer = specdec.load_default_seq2seq(dtype=torch.float64)
    same, same_tokenizer = specdec.load("default-seq2seq")
    assert type(same) is type(target) and len(same_tokenizer) == len(tokenizer) == target.config.vocab_size
    prompt = (" <mask><mask>docs.python.org/library/unittest.html\n\nCopy<mask><mask>c) 1999-2003 Steve Purcell\n"
              "Copyright (c) 2<mask><mask><mask>0 Python So<mask><mask><mask>ation\n")
    ids = tokenizer(prompt)["input_ids"]
    assert tokenizer.mask_token_id in ids
    out = specdec.generate(target, None, drafter=specdec.DraftModel(draft), gamma=4, max_new_tokens=24,
                           encoder_inputs={"input_ids": ids})
    assert out.tokens == reference(target, {"input_ids": torch.tensor([ids])}, 24, eos=0)
    assert out.stats.acceptance_rate > 0.5  # the output copies the source: the draft is mostly right
    assert cli_main(["generate", "--target", "default-seq2seq", "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    assert "[draft (γ=4)]" in capsys.readouterr().err
