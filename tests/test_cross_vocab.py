"""Drafts with another tokenizer (TLI and SLEM): the mapping, greedy equality, statistical exactness with
negative controls, LM-head padding, the text API and bad input."""

from __future__ import annotations

import gc

import pytest
import torch
from methods import CROSS_VOCAB_METHODS, build_cross_vocab
from faulty import OutsideIntersection, UnnormalisedIntersection
from models import hf_greedy, tiny
from vocab_models import letter_tokenizers, permuted, stdlib_tokenizers, transplant

import specdec
from specdec.drafters.cross_vocab import CrossVocabDraft
from specdec.exactness import check_exactness
from specdec.hub.vocab import MAPPING_CACHE, token_bytes, vocab_mapping

ARCHS = ["llama", "qwen2", "gpt2", "gemma"]
CODE = "    def parse(self, text):\n        return self."


@pytest.fixture(scope="module")
def tokenizers():
    target_tok, draft_tok = stdlib_tokenizers()
    return {"merges": (target_tok, draft_tok), "permuted": (target_tok, permuted(target_tok))}


# ----------------------------------------------------------------------------------------------- mapping


def test_mapping_pairs_tokens_that_spell_the_same_bytes(tokenizers):
    target_tok, draft_tok = tokenizers["merges"]
    mapping = vocab_mapping(draft_tok, target_tok)
    assert 0 < mapping.size < len(target_tok) and not mapping.identical
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    for token in ["Ġreturn", "Ġself", "ĊĠĠĠ", "a"]:
        assert int(mapping.draft_to_target[d_vocab[token]]) == t_vocab[token]
    assert int(mapping.draft_to_target[draft_tok.eos_token_id]) == target_tok.eos_token_id
    d, t = mapping.shared_draft, mapping.shared_target
    assert all(mapping.draft_bytes[i] == mapping.target_bytes[j] for i, j in zip(d.tolist(), t.tolist())
               if mapping.draft_bytes[i] is not None)
    assert bool((mapping.target_to_draft[t] == d).all())  # one-to-one


def test_space_markers_are_normalised_between_byte_level_and_sentencepiece():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specdec.training.tokenizer import train_tokenizer

    text = ["def add(a, b):\n    return a + b\n", "for item in items:\n    print(item)\n"] * 30
    byte_level = train_tokenizer(text, vocab_size=300)
    sp = Tokenizer(models.BPE(byte_fallback=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    sp.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>"],
                                                      show_progress=False))
    sp = PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>")
    assert "▁return" in sp.get_vocab() and "Ġreturn" in byte_level.get_vocab()
    mapping = vocab_mapping(sp, byte_level)
    assert int(mapping.draft_to_target[sp.get_vocab()["▁return"]]) == byte_level.get_vocab()["Ġreturn"]
    assert int(mapping.draft_to_target[sp.eos_token_id]) == byte_level.eos_token_id  # by role
    assert token_bytes(sp)[sp.get_vocab()["▁return"]] == b" return"


def test_mapping_is_built_once_per_pair_and_dropped_with_the_tokenizers():
    target_tok, draft_tok = letter_tokenizers()
    assert vocab_mapping(draft_tok, target_tok) is vocab_mapping(draft_tok, target_tok)
    other = permuted(stdlib_tokenizers()[0], seed=3)
    vocab_mapping(other, target_tok)
    assert other in MAPPING_CACHE
    del other
    gc.collect()
    assert len([k for k in MAPPING_CACHE if len(k) == 700]) <= 1  # the permuted tokenizer's entry went with it


def test_same_tokenizer_gives_a_plain_draft_model(tokenizers):
    target_tok, _ = tokenizers["merges"]
    draft = tiny("llama", vocab=len(target_tok), hidden=16, layers=1)
    drafter = specdec.DraftModel(draft, tokenizer=target_tok, target_tokenizer=target_tok)
    assert type(drafter) is specdec.DraftModel
    assert isinstance(specdec.DraftModel(draft, tokenizer=tokenizers["permuted"][1],
                                         target_tokenizer=target_tok), CrossVocabDraft)


# -------------------------------------------------------------------------------------- greedy equality


@pytest.fixture(scope="module")
def targets(tokenizers):
    vocab = len(tokenizers["merges"][0])
    return {arch: tiny(arch, vocab=vocab, hidden=32, layers=2) for arch in ARCHS}


@pytest.mark.parametrize("pair", ["merges", "permuted"])
@pytest.mark.parametrize("method", sorted(CROSS_VOCAB_METHODS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_plain_decoding(tokenizers, targets, arch, method, pair):
    target_tok, draft_tok = tokenizers[pair]
    target = targets[arch]
    draft = transplant(target, len(draft_tok), vocab_mapping(draft_tok, target_tok).draft_to_target, noise=0.02)
    prompt = target_tok(CODE)["input_ids"]
    for gamma in (1, 3, 6):
        drafter = build_cross_vocab(method, draft, draft_tok, target_tok)
        out = specdec.generate(target, prompt, drafter=drafter, gamma=gamma, max_new_tokens=24)
        assert out.tokens == hf_greedy(target, prompt, 24), (arch, method, pair, gamma)
        assert out.stats.drafted > 0


def test_permuted_copy_is_often_accepted(tokenizers, targets):
    """A draft that is the target with its ids shuffled: TLI drafts the target's own argmax whenever the
    draft reads the same tokens, so acceptance is far above an unrelated draft's."""
    target_tok, draft_tok = tokenizers["permuted"]
    target = targets["llama"]
    draft = transplant(target, len(draft_tok), vocab_mapping(draft_tok, target_tok).draft_to_target)
    prompt = target_tok(CODE)["input_ids"]
    out = specdec.generate(target, prompt, drafter=specdec.DraftModel(draft, tokenizer=draft_tok,
                                                                       target_tokenizer=target_tok, method="tli"),
                           gamma=3, max_new_tokens=24)
    far = tiny("llama", vocab=len(draft_tok), hidden=16, layers=1, seed=7)
    unrelated = specdec.generate(target, prompt, gamma=3, max_new_tokens=24, drafter=specdec.DraftModel(
        far, tokenizer=draft_tok, target_tokenizer=target_tok, method="tli"))
    assert out.tokens == unrelated.tokens == hf_greedy(target, prompt, 24)
    assert out.stats.acceptance_rate > 0.25 > unrelated.stats.acceptance_rate


def test_draft_stream_follows_the_committed_text(tokenizers, targets):
    """After every round the draft's cache holds a prefix of the draft's tokenisation of the committed text."""
    target_tok, draft_tok = tokenizers["merges"]
    target = targets["qwen2"]
    draft = transplant(target, len(draft_tok), vocab_mapping(draft_tok, target_tok).draft_to_target)
    drafter = specdec.DraftModel(draft, tokenizer=draft_tok, target_tokenizer=target_tok, method="slem")
    decoder = specdec.SpeculativeDecoder(target, drafter, gamma=4, max_new_tokens=30)
    prompt = target_tok(CODE)["input_ids"]
    tokens = []
    for token in decoder.stream(prompt):
        tokens.append(token)
        drafter._sync(torch.tensor(prompt + tokens))
        text = target_tok.decode(prompt + tokens, skip_special_tokens=True)
        complete = draft_tok.decode(drafter._stream.ids, skip_special_tokens=True)
        assert text.startswith(complete.rstrip("\ufffd"))
        assert drafter._fed == drafter._stream.ids[: len(drafter._fed)]
        assert drafter.lm.length == len(drafter._fed)


# ------------------------------------------------------------------------------ statistical exactness

N = 3000
ALPHA = 1e-4
NEGATIVE_P = 1e-6
PROMPT_TEXT = "abcab"
SETTINGS = {
    "T1.0-g2-L3": (1.0, None, None, 2, 3, False),
    "T0.5-top4-g3-L4-eos": (0.5, 4, None, 3, 4, True),
    "T1.5-top6-p0.8-g5-L3-eos": (1.5, 6, 0.8, 5, 3, True),
}


@pytest.fixture(scope="module")
def letters():
    """Target (V=8) on the letter tokenizer with EOS configured; a partly agreeing draft on the other one."""
    target_tok, draft_tok = letter_tokenizers()
    target = tiny("llama", hidden=16, layers=2, vocab=len(target_tok), seed=3)
    target.generation_config.eos_token_id = target_tok.eos_token_id
    mapping = vocab_mapping(draft_tok, target_tok)
    near = transplant(target, len(draft_tok), mapping.draft_to_target, noise=0.3, seed=11)
    far = tiny("llama", hidden=16, layers=2, vocab=len(draft_tok), seed=17)
    return target, near, far, target_tok, draft_tok


def _check(target, drafter, prompt, setting, **kw):
    temperature, top_k, top_p, gamma, max_new, use_eos = SETTINGS[setting]
    return check_exactness(target, prompt, drafter, gamma=gamma, temperature=temperature, top_k=top_k,
                           top_p=top_p, max_new_tokens=max_new, eos_token_id=None if use_eos else [],
                           samples=N, seed=1234, alpha=ALPHA, **kw)


@pytest.mark.exactness_positive(checks=1, alpha=ALPHA)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("method", sorted(CROSS_VOCAB_METHODS))
def test_cross_vocab_methods_are_exact(letters, method, setting):
    target, near, _, target_tok, draft_tok = letters
    drafter = build_cross_vocab(method, near, draft_tok, target_tok)
    result = _check(target, drafter, target_tok(PROMPT_TEXT)["input_ids"], setting, method=method)
    assert result.mode == "enumerate"
    assert result.passed, result.summary()
    assert result.detectable_tv < 0.12, result.summary()
    assert 0 < result.accepted < result.drafted, result.summary()


@pytest.mark.statistical
@pytest.mark.parametrize("faulty", [UnnormalisedIntersection, OutsideIntersection])
def test_negative_controls_are_caught(letters, faulty):
    target, _, far, target_tok, draft_tok = letters
    drafter = faulty(far, tokenizer=draft_tok, target_tokenizer=target_tok, method="tli")
    result = _check(target, drafter, target_tok(PROMPT_TEXT)["input_ids"], "T1.0-g2-L3")
    assert not result.passed
    assert result.p_value < NEGATIVE_P, result.summary()


# ------------------------------------------------------------------------------------ padding, text, CLI


@pytest.mark.parametrize(("target_rows", "draft_rows"), [(704, 700), (700, 704)])
def test_same_tokenizer_with_padded_lm_heads(tokenizers, target_rows, draft_rows):
    """Widths within the padding rule (or one tokenizer given for both) pair; padding rows are never drafted
    (a draft row past the target's head would crash the target's embedding lookup)."""
    target_tok, _ = tokenizers["merges"]
    target = tiny("llama", vocab=target_rows, hidden=32, layers=2)
    draft = tiny("llama", vocab=draft_rows, hidden=32, layers=2)
    state = {}
    for key, value in target.state_dict().items():  # the draft is the target on the rows both have
        if value.shape[0] == target_rows:
            extra = torch.randn(max(0, draft_rows - target_rows), *value.shape[1:], dtype=value.dtype) * 9
            value = torch.cat([value[:draft_rows], extra])
        state[key] = value
    draft.load_state_dict(state)
    prompt = target_tok(CODE)["input_ids"]
    ref = hf_greedy(target, prompt, 20)
    for drafter in (specdec.DraftModel(draft),
                    specdec.DraftModel(draft, tokenizer=target_tok, target_tokenizer=target_tok)):
        out = specdec.generate(target, prompt, drafter=drafter, gamma=4, max_new_tokens=20)
        assert out.tokens == ref
        assert out.stats.acceptance_rate > 0.5
        out = specdec.generate(target, prompt, drafter=drafter, gamma=4, max_new_tokens=20, temperature=1.5,
                               seed=0)
        assert len(out.tokens) == 20


def test_a_tokenizer_proves_padding_beyond_the_size_rule(tokenizers):
    target_tok, _ = tokenizers["merges"]
    target = tiny("llama", vocab=1024, hidden=32, layers=2)
    head = torch.nn.Linear(32, 1024, bias=True, dtype=torch.float64)
    with torch.no_grad():  # a trained model never picks its padding rows: give them a very low logit
        head.weight.copy_(target.lm_head.weight)
        head.bias.zero_()
        head.bias[len(target_tok):] = -1e4
    target.lm_head = head
    draft = tiny("llama", vocab=768, hidden=16, layers=1)
    with pytest.raises(specdec.IncompatibleModelsError, match="tokenizer=draft_tokenizer"):
        specdec.generate(target, [1, 2], drafter=specdec.DraftModel(draft), max_new_tokens=4)
    prompt = target_tok(CODE)["input_ids"]
    drafter = specdec.DraftModel(draft, tokenizer=target_tok, target_tokenizer=target_tok)
    out = specdec.generate(target, prompt, drafter=drafter, gamma=3, max_new_tokens=12)
    assert out.tokens == hf_greedy(target, prompt, 12)


def test_text_api_pairs_the_draft_tokenizer_with_the_target_tokenizer(tokenizers, targets):
    target_tok, draft_tok = tokenizers["merges"]
    target = targets["llama"]
    draft = transplant(target, len(draft_tok), vocab_mapping(draft_tok, target_tok).draft_to_target)
    plain = specdec.generate_text(target, target_tok, CODE, max_new_tokens=16)
    drafter = specdec.DraftModel(draft, tokenizer=draft_tok)
    out = specdec.generate_text(target, target_tok, CODE, drafter=drafter, max_new_tokens=16)
    assert out.tokens == plain.tokens and out.text == plain.text
    streamed = "".join(specdec.stream_text(target, target_tok, CODE, max_new_tokens=16,
                                           drafter=specdec.DraftModel(draft, tokenizer=draft_tok, method="slem")))
    assert streamed == plain.text


# ------------------------------------------------------------------------------------------- bad input


def test_tokenizer_larger_than_the_model_is_refused(tokenizers):
    target_tok, draft_tok = tokenizers["merges"]
    small = tiny("llama", vocab=300, hidden=16, layers=1)
    with pytest.raises(specdec.IncompatibleModelsError, match="tokenizer saved with the draft model"):
        specdec.DraftModel(small, tokenizer=draft_tok, target_tokenizer=target_tok)
    draft = tiny("llama", vocab=len(draft_tok), hidden=16, layers=1)
    drafter = specdec.DraftModel(draft, tokenizer=draft_tok, target_tokenizer=target_tok)
    with pytest.raises(specdec.IncompatibleModelsError, match="tokenizer saved with the target model"):
        specdec.generate(small, [1, 2], drafter=drafter, max_new_tokens=2)


def test_empty_intersection_is_refused():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    def word_level(words):
        tok = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(words)}, merges=[]))
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    with pytest.raises(specdec.IncompatibleModelsError, match="share no token"):
        vocab_mapping(word_level(["x", "y", "z"]), word_level(["a", "b", "c"]))


def test_tokenizer_without_a_decoder_is_refused(tokenizers):
    from transformers import PreTrainedTokenizerFast

    target_tok, draft_tok = tokenizers["merges"]
    backend = draft_tok.backend_tokenizer.__class__.from_str(draft_tok.backend_tokenizer.to_str())
    backend.decoder = None
    broken = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    draft = tiny("llama", vocab=len(broken), hidden=16, layers=1)
    with pytest.raises(specdec.IncompatibleModelsError, match="no working decoder"):
        specdec.DraftModel(draft, tokenizer=broken, target_tokenizer=target_tok)


def test_missing_tokenizers_and_bad_method(tokenizers):
    target_tok, draft_tok = tokenizers["merges"]
    draft = tiny("llama", vocab=len(draft_tok), hidden=16, layers=1)
    target = tiny("llama", vocab=len(target_tok), hidden=16, layers=1)
    with pytest.raises(specdec.ConfigError, match="tokenizer=draft_tokenizer"):
        specdec.DraftModel(draft, target_tokenizer=target_tok)
    with pytest.raises(specdec.ConfigError, match="target_tokenizer="):
        specdec.generate(target, [1, 2], drafter=specdec.DraftModel(draft, tokenizer=draft_tok), max_new_tokens=2)
    with pytest.raises(specdec.ConfigError, match="method must be one of"):
        specdec.DraftModel(draft, tokenizer=draft_tok, target_tokenizer=target_tok, method="union")


def test_auto_picks_by_the_shared_vocabulary(tokenizers):
    target_tok, draft_tok = tokenizers["merges"]
    draft = tiny("llama", vocab=len(draft_tok), hidden=16, layers=1)
    drafter = specdec.DraftModel(draft, tokenizer=draft_tok, target_tokenizer=target_tok)
    assert drafter.method == "auto" and drafter.active == "tli"  # 93% of the draft's tokens are shared
    letters_target, letters_draft = letter_tokenizers()
    from specdec.drafters import cross_vocab

    small = tiny("llama", vocab=len(letters_draft), hidden=16, layers=1)
    old = cross_vocab.AUTO_MIN_SHARED
    cross_vocab.AUTO_MIN_SHARED = 0.9
    try:
        assert specdec.DraftModel(small, tokenizer=letters_draft, target_tokenizer=letters_target).active == "slem"
    finally:
        cross_vocab.AUTO_MIN_SHARED = old


# ------------------------------------------------------------------------------------------ CLI, bench


@pytest.fixture(scope="module")
def saved_cross_pair(tokenizers, tmp_path_factory):
    """A target and a draft with another tokenizer, each saved with its own tokenizer."""
    target_tok, draft_tok = tokenizers["merges"]
    root = tmp_path_factory.mktemp("cross")
    target = tiny("llama", vocab=len(target_tok), hidden=32, layers=2, dtype=torch.float32)
    draft = transplant(target, len(draft_tok), vocab_mapping(draft_tok, target_tok).draft_to_target, noise=0.02)
    for name, model, tok in (("target", target, target_tok), ("draft", draft, draft_tok)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root, target, draft


@pytest.mark.parametrize("drafter", ["draft", "draft-tli", "draft-slem"])
def test_cli_generate_uses_the_drafts_own_tokenizer(saved_cross_pair, capsys, drafter):
    from specdec.cli import main

    root, target, _ = saved_cross_pair
    code = main(["generate", "--target", str(root / "target"), "--draft", str(root / "draft"), "--drafter",
                 drafter, "--draft-tokenizer", str(root / "draft"), "--prompt", CODE, "--max-new-tokens", "12"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    target_tok = stdlib_tokenizers()[0]
    reference = target_tok.decode(hf_greedy(target, target_tok(CODE)["input_ids"], 12))
    assert captured.out.rstrip("\n") == reference.rstrip("\n")


def test_bench_runs_tli_slem_and_hf_universal_assisted_generation(saved_cross_pair, tokenizers):
    from specdec.bench.runner import BenchSettings, run_benchmark
    from specdec.bench.workloads import BenchPrompt

    _, target, draft = saved_cross_pair
    target_tok, draft_tok = tokenizers["merges"]
    prompts = [BenchPrompt(name="p0", ids=target_tok(CODE)["input_ids"], text=CODE)]
    settings = BenchSettings(methods=["plain", "draft-tli", "draft-slem", "hf-assisted"], gammas=[3],
                             max_new_tokens=12, repeats=1, warmup=0)
    results = run_benchmark(target, draft, prompts, settings, progress=False, tokenizers=(draft_tok, target_tok))
    assert {c["label"] for c in results["configs"]} == {"plain", "draft-tli@3", "draft-slem@3", "hf-assisted@3"}
    assert all(r["identical_to_hf_plain"] for r in results["runs"])
    assert all(r["drafted"] > 0 for r in results["runs"] if r["method"] != "plain")


def test_auto_tries_both_methods_then_keeps_one(tokenizers, targets):
    target_tok, draft_tok = tokenizers["merges"]
    target = targets["gpt2"]
    draft = transplant(target, len(draft_tok), vocab_mapping(draft_tok, target_tok).draft_to_target, noise=0.02)
    drafter = specdec.DraftModel(draft, tokenizer=draft_tok, target_tokenizer=target_tok)
    used = []
    original = drafter.propose

    def spy(*args, **kwargs):
        used.append(drafter.active)
        return original(*args, **kwargs)

    drafter.propose = spy
    prompt = target_tok(CODE)["input_ids"]
    out = specdec.generate(target, prompt, drafter=drafter, gamma=2, max_new_tokens=40)
    assert out.tokens == hf_greedy(target, prompt, 40)
    assert used[:8] == ["tli"] * 4 + ["slem"] * 4 and drafter._probe == {}
    assert len(set(used[8:])) == 1  # decided for the rest of the request


# ------------------------------------------------------------------------- the shipped cross-vocab draft


@pytest.mark.parametrize("method", ["tli", "slem"])
def test_shipped_cross_vocab_draft_with_the_default_target(method):
    """Real trained models (float64): the 4096-token draft drafts for the 8192-token default target."""
    from pathlib import Path

    from specdec.hub.default_pair import assets_present, load_default

    path = Path(specdec.__file__).parent / "assets" / "cross_vocab_draft"
    if not assets_present() or not (path / "model.safetensors").is_file():
        pytest.skip("model assets not present")
    target, _, target_tok = load_default()
    draft, draft_tok = specdec.load(str(path))
    target, draft = target.double(), draft.double()
    mapping = vocab_mapping(draft_tok, target_tok)
    assert mapping.size == 3934
    prompt = target_tok("import os\n\n\ndef main(argv):\n    parser = ")["input_ids"]
    drafter = specdec.DraftModel(draft, tokenizer=draft_tok, target_tokenizer=target_tok, method=method)
    out = specdec.generate(target, prompt, drafter=drafter, gamma=3, max_new_tokens=40, eos_token_id=[])
    assert out.tokens == hf_greedy(target, prompt, 40)
    assert out.stats.acceptance_rate > 0.2, out.stats
