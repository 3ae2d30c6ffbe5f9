"""Public API: errors for bad input, seeding, text helpers, loading, and the CLI."""

from __future__ import annotations

import pytest
import torch
from models import ScriptedLM, one_hot_table, perturbed, tiny, tiny_tokenizer

import specdec
from specdec.cli import main as cli_main


@pytest.fixture(scope="module")
def target():
    return tiny("llama", layers=2)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed(target, 0.1)


def gen(target, prompt=(1, 2, 3), **kw):
    return specdec.generate(target, list(prompt), **kw)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"gamma": 0}, specdec.ConfigError, "gamma"),
        ({"gamma": -2}, specdec.ConfigError, ">= 1"),
        ({"gamma": 2.5}, specdec.ConfigError, "integer"),
        ({"gamma": "fast"}, specdec.ConfigError, "or 'auto'"),
        ({"temperature": -0.1}, specdec.ConfigError, "temperature"),
        ({"temperature": float("nan")}, specdec.ConfigError, "finite"),
        ({"top_p": 0.0}, specdec.ConfigError, "top_p"),
        ({"top_p": 1.5}, specdec.ConfigError, "(0, 1]"),
        ({"top_k": 0}, specdec.ConfigError, "top_k"),
        ({"max_new_tokens": 0}, specdec.ConfigError, "max_new_tokens"),
        ({"prompt": ()}, specdec.PromptError, "empty"),
        ({"prompt": (1, 96)}, specdec.PromptError, "outside the target's vocabulary"),
        ({"prompt": (-1,)}, specdec.PromptError, "outside"),
        ({"prompt": "hello"}, specdec.PromptError, "generate_text"),
        ({"max_new_tokens": 600}, specdec.PromptError, "exceeds the target's context of 512"),
    ],
)
def test_bad_input_raises_one_clear_error(target, kwargs, error, words):
    prompt = kwargs.pop("prompt", (1, 2, 3))
    with pytest.raises(error, match=None) as info:
        specdec.generate(target, prompt if isinstance(prompt, str) else list(prompt), **kwargs)
    assert words in str(info.value)
    assert isinstance(info.value, specdec.SpecdecError)
    assert isinstance(info.value, ValueError)  # the stdlib category is kept for callers that catch it


OPTION_ERRORS = [({"gamma": 0}, "gamma"), ({"temperature": -0.1}, "temperature"), ({"top_k": 0}, "top_k"),
                 ({"max_new_tokens": 0}, "max_new_tokens"), ({"seed": "1"}, "seed"),
                 ({"eos_token_id": "x"}, "eos_token_id"), ({"logprobs": -1}, "logprobs")]


@pytest.mark.parametrize(("kwargs", "words"), OPTION_ERRORS)
def test_one_options_object_checks_every_entry_point(target, kwargs, words):
    """`DecodeOptions` holds the checks: the options object itself, generate, stream, SpeculativeDecoder,
    generate_batch and BatchDecoder.add raise the same error, before any work."""
    entry_points = [
        lambda: specdec.DecodeOptions(**kwargs),
        lambda: specdec.BatchDecoder(target).add(0, [1, 2, 3], **kwargs),
    ]
    if "logprobs" not in kwargs:  # reported by batched decoding only
        entry_points += [
            lambda: specdec.generate(target, [1, 2, 3], **kwargs),
            lambda: list(specdec.stream(target, [1, 2, 3], **kwargs)),
            lambda: specdec.SpeculativeDecoder(target, **kwargs),
            lambda: specdec.generate_batch(target, [[1, 2, 3]], **kwargs),
        ]
    messages = set()
    for call in entry_points:
        with pytest.raises(specdec.ConfigError) as info:
            call()
        messages.add(str(info.value))
    assert len(messages) == 1 and words in messages.pop()


def test_options_object_is_frozen_and_normalised(target):
    options = specdec.DecodeOptions(gamma=2, max_new_tokens=5, eos_token_id=[3, 4], seed=torch.tensor(7))
    assert options.eos_token_id == (3, 4) and options.seed == 7 and options.sampling.greedy
    with pytest.raises(AttributeError):
        options.gamma = 3
    decoder = specdec.BatchDecoder(target)
    decoder.add("a", [1, 2, 3], options)
    assert decoder.rows[0].options is options
    lone = specdec.SpeculativeDecoder(target, options=options)
    assert list(lone.stream([1, 2, 3])) == specdec.generate(target, [1, 2, 3], gamma=2, max_new_tokens=5,
                                                             eos_token_id=[3, 4], seed=7).tokens
    with pytest.raises(specdec.ConfigError, match="not both"):
        specdec.SpeculativeDecoder(target, options=options, max_new_tokens=9)


def test_different_vocabularies_are_refused(target):
    other = tiny("llama", vocab=64)
    with pytest.raises(specdec.IncompatibleModelsError, match="same tokenizer"):
        gen(target, drafter=specdec.DraftModel(other))


def test_a_model_whose_cache_cannot_be_rolled_back_is_refused():
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=96, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(specdec.UnsupportedModelError, match="cannot be rolled back"):
        specdec.generate(mamba, [1, 2])
    with pytest.raises(specdec.UnsupportedModelError):
        specdec.DraftModel(mamba)


def test_a_drafter_that_is_not_a_drafter_is_refused(target, draft):
    with pytest.raises(specdec.ConfigError, match="DraftModel"):
        gen(target, drafter=draft)


def test_nan_logits_raise_a_numerical_error(target):
    broken = perturbed(target, 0.0)
    with torch.no_grad():
        broken.lm_head.weight[5, 0] = float("nan")
    with pytest.raises(specdec.NumericalError, match="NaN or infinite logits"):
        gen(broken)


class PoisonedLM(ScriptedLM):
    """A scripted LM whose logit for token 3 at one position is replaced by `value` (NaN or ±inf)."""

    def __init__(self, position: int, value: float):
        super().__init__(one_hot_table(list(range(1, 8)) * 10), 8)
        self.position, self.value = position, value

    def forward(self, input_ids=None, position_ids=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_to_keep,
                              **kwargs)
        positions = position_ids[0].tolist()[-out.logits.shape[1] :]  # the positions whose logits are returned
        if self.position in positions:
            out.logits[0, positions.index(self.position), 3] = self.value
        return out


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("poisoned", ["target", "draft"])
@pytest.mark.parametrize(("temperature", "compile"),
                         [(0.0, False), (1.0, False), (0.0, "static"), (1.0, "static")])
def test_non_finite_logits_anywhere_raise_a_numerical_error(value, poisoned, temperature, compile):
    """Prompt of 4 tokens, γ = 4, drafts that agree: the target's first pass scores positions 3..7, and the
    poisoned position 5 is in the middle of it (not its last row); the draft model computes position 5 on
    its own. Either way the bad logit is caught, in greedy and in sampling mode, with either KV cache."""
    bad = PoisonedLM(5, value)
    clean = PoisonedLM(-1, value)  # the same model, no position poisoned
    target, draft = (bad, clean) if poisoned == "target" else (clean, bad)

    def run():
        return specdec.generate(target, [1, 2, 3, 4], drafter=specdec.DraftModel(draft), gamma=4,
                                max_new_tokens=8, temperature=temperature, seed=0, eos_token_id=[],
                                compile=compile)

    with pytest.raises(specdec.NumericalError, match="NaN or infinite logits at positions"):
        run()
    bad.position = -1
    assert len(run().tokens) == 8


def test_unknown_model_path(tmp_path):
    with pytest.raises(specdec.ModelLoadError, match="cannot load"):
        specdec.load(str(tmp_path / "no-such-model"))


def test_same_seed_same_output_different_seeds_differ(target, draft):
    kw = dict(drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=40, temperature=1.0, top_k=50)
    a = gen(target, seed=7, **kw).tokens
    b = gen(target, seed=7, **kw).tokens
    c = gen(target, seed=8, **kw).tokens
    assert a == b
    assert a != c


def test_stats_are_consistent_over_many_seeds(target, draft):
    """The counters add up for every seed, including runs whose last round drafts nothing (γ capped to 0
    by max_new_tokens): such a round ends in the target's own token, counted in `target_only`."""
    drafter = specdec.DraftModel(draft)
    capped = 0
    for seed in range(40):
        out = gen(target, drafter=drafter, gamma=4, max_new_tokens=30, temperature=0.8, seed=seed)
        s = out.stats
        assert s.new_tokens == len(out.tokens) == 30
        assert s.target_forwards == s.rounds == len(s.gammas)
        assert s.draft_forwards == s.drafted  # a draft model: one forward per drafted token (catch-up included)
        assert s.accepted + s.rounds == s.new_tokens  # each round: accepted drafts + one recovered/bonus token
        assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
        assert s.mean_accepted_tokens == pytest.approx(30 / s.target_forwards)
        assert s.recovered + s.bonus + s.target_only == s.rounds, (seed, s.as_dict())
        assert s.target_only == s.gammas.count(0)
        assert sum(s.accepted_at) == s.accepted and sum(s.drafted_at) == s.drafted == sum(s.gammas)
        assert s.wall_s > 0 and s.target_s > 0 and s.draft_s > 0
        capped += s.target_only
    assert capped > 0  # some runs ended in a γ = 0 round, so that branch was checked


def test_text_helpers_round_trip():
    tok = tiny_tokenizer()
    model = tiny("llama", vocab=len(tok))
    out = specdec.generate_text(model, tok, "def add(a, b):", max_new_tokens=12,
                                drafter=specdec.DraftModel(perturbed(model, 0.1)), eos_token_id=[])
    assert out.text == tok.decode(out.tokens)
    assert len(out.tokens) == 12
    pieces = list(specdec.stream_text(model, tok, "def add(a, b):", max_new_tokens=12, eos_token_id=[]))
    assert "".join(pieces) == out.text  # plain and speculative greedy agree, piece by piece


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("pair")
    target = tiny("llama", vocab=len(tok), dtype=torch.float32)
    draft = perturbed(target, 0.1)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def test_load_returns_model_and_tokenizer(saved_pair):
    model, tok = specdec.load(str(saved_pair / "target"))
    assert not model.training and model.dtype == torch.float32
    assert tok.decode(tok("x = 1").input_ids) == "x = 1"


def test_cli_generate_streams_text_and_prints_stats(saved_pair, capsys):
    code = cli_main(["generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                     "--prompt", "def add(a, b):", "--max-new-tokens", "10", "--gamma", "3"])
    captured = capsys.readouterr()
    assert code == 0
    assert "α=" in captured.err and "τ=" in captured.err and "target forwards" in captured.err
    assert captured.out.strip()


def test_cli_reports_errors_without_a_traceback(saved_pair, capsys):
    code = cli_main(["generate", "--target", str(saved_pair / "target"), "--prompt", "x", "--gamma", "0"])
    assert code == 2
    assert "gamma" in capsys.readouterr().err


def test_cli_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--target", "--draft", "--prompt", "--gamma", "--max-new-tokens", "--temperature",
                 "--top-k", "--top-p", "--seed"):
        assert flag in text
