"""A new user's first hour: clear one-line errors, fast --help, threads, the demo's contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from models import tiny, tiny_tokenizer

import specdec
from specdec.cli import main as cli_main


@pytest.fixture(scope="module")
def target():
    return tiny("llama", layers=2)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"eos_token_id": [1, "x"]}, "eos_token_id"),
    ({"eos_token_id": True}, "eos_token_id"),
    ({"seed": "a"}, "seed"),
    ({"seed": 1.5}, "seed"),
])
def test_bad_eos_and_seed_are_specdec_errors(target, kwargs, words):
    with pytest.raises(specdec.ConfigError, match=words):
        specdec.generate(target, [1, 2, 3], max_new_tokens=2, **kwargs)


def test_integer_like_eos_and_seed_are_accepted(target):
    np = pytest.importorskip("numpy")
    a = specdec.generate(target, [1, 2, 3], max_new_tokens=4, eos_token_id=np.int64(5), seed=np.int64(3),
                         temperature=1.0).tokens
    b = specdec.generate(target, [1, 2, 3], max_new_tokens=4, eos_token_id=[5], seed=3, temperature=1.0).tokens
    assert a == b


def test_batch_encoding_of_one_sequence_is_accepted_and_a_batch_is_refused():
    tokenizer = tiny_tokenizer(300)
    target = tiny("llama", layers=1, vocab=len(tokenizer))
    one = tokenizer("def add(a, b):")
    expected = specdec.generate(target, one["input_ids"], max_new_tokens=4).tokens
    assert specdec.generate(target, one, max_new_tokens=4).tokens == expected
    assert specdec.generate(target, tokenizer("def add(a, b):", return_tensors="pt"), max_new_tokens=4).tokens == expected
    for bad in (tokenizer(["def add", "for i"]), [[1, 2], [3, 4]], ["a"], {"ids": [1]}):
        with pytest.raises(specdec.PromptError, match="input_ids"):
            specdec.generate(target, bad, max_new_tokens=2)


def test_help_does_not_import_torch():
    code = ("import sys\nfrom specdec.cli import main\nfor c in ([], ['generate'], ['demo'], ['bench'], ['verify'], "
            "['train'], ['distill']):\n    try:\n        main(c + ['--help'])\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_train_help_is_clean(capsys):
    for command in ("train", "distill"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        out = capsys.readouterr().out
        assert "%%" not in out and "(default: None)" not in out
        assert "(default: 1000)" in out or command == "distill"


@pytest.mark.parametrize("device", ["foo", "cuda"])
def test_bad_device_is_one_line(capsys, device):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert cli_main(["generate", "--prompt", "x", "--device", device]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and "--device cpu" in err and "\n" not in err


@pytest.mark.parametrize(("args", "words"), [
    (["--gamma", "0"], "--gamma"), (["--repeats", "0"], "--repeats"), (["--prompt-index", "-1"], "0..3"),
    (["--prompt-index", "-1000"], "0..3"), (["--method", "foo"], "draft-g3"), (["--threads", "0"], "--threads"),
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--temperature", "0"], "> 0"),
])
def test_demo_validates_before_anything_prints(capsys, args, words):
    assert cli_main(["demo", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and words in captured.err


def test_threads_option(monkeypatch):
    from specdec.errors import ConfigError
    from specdec.runtime.threads import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="threads"):
        set_threads(0)


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    from specdec.hub.tokenizer_check import check_draft_tokenizer, check_draft_tokenizer_at

    words = ["<unk>", "def", "class", "return", "import", "x"]
    a, same, b = _word_tokenizer(words), _word_tokenizer(words), _word_tokenizer(words[:1] + words[:0:-1])
    assert len(a) == len(b)
    check_draft_tokenizer(a, same, target_name="t", draft_name="d")  # same vocabulary: fine
    with pytest.raises(specdec.IncompatibleModelsError, match="--draft-tokenizer"):
        check_draft_tokenizer(a, b, target_name="t", draft_name="d")
    b.save_pretrained(tmp_path / "draft")
    with pytest.raises(specdec.IncompatibleModelsError, match=f"both have {len(a)} tokens"):
        check_draft_tokenizer_at(a, str(tmp_path / "draft"), target_name="t")
    check_draft_tokenizer_at(a, str(tmp_path / "no-tokenizer-here"), target_name="t")  # nothing to compare


def _word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_every_demo_candidate_is_exact_and_calibration_picks_the_fastest(target):
    from specdec.bench.candidates import CANDIDATES, Calibration, Models, calibrate

    models = Models(target, tiny("llama", layers=1), None)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7]]
    settings = dict(max_new_tokens=12, temperature=0.0, eos_token_id=[], seed=0)
    candidates = [c for c in CANDIDATES if c.opt_in is None]  # the compiled one: tests/test_fastpath.py
    for candidate in candidates:
        plain = list(candidate.decoder(models, speculative=False, **settings).stream(prompts[0]))
        assert list(candidate.decoder(models, **settings).stream(prompts[0])) == plain, candidate.name
    result = calibrate(models, candidates, prompts, max_new_tokens=8)
    assert set(result.speedups) == {c.name for c in candidates}
    assert all(len(v) == 2 and min(v) > 0 for v in result.speedups.values())
    picked = Calibration({"a": [1.0, 4.0], "b": [1.9, 1.9]})  # geometric means 2.0 and 1.9
    assert picked.best() == "a" and picked.score("a") == pytest.approx(2.0)


def test_bench_says_why_the_acceptance_plot_is_empty():
    from specdec.bench.report import acceptance_note

    few = {"configs": [{"method": "draft", "gamma": 4, "acceptance_by_position": [0.5] * 4,
                        "drafted_at": [3, 3, 2, 1]}]}
    assert "at most 3 times" in acceptance_note(few)
    enough = {"configs": [{"method": "draft", "gamma": 4, "acceptance_by_position": [0.5], "drafted_at": [40]}]}
    assert acceptance_note(enough) is None
    assert acceptance_note({"configs": [{"method": "plain", "gamma": None, "acceptance_by_position": []}]}) is None


def test_demo_json_contract(capsys):
    pytest.importorskip("rich")
    from specdec.hub.default_pair import assets_present

    if not assets_present():
        pytest.skip("default assets missing")
    rc = cli_main(["demo", "--json", "--max-new-tokens", "8", "--repeats", "1", "--method", "draft-g3"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["greedy_identical"] is True and data["method"] == "draft-g3"
    for key in ("median_speedup_vs_hf_generate", "median_speedup_vs_plain"):
        assert isinstance(data[key], float) and data[key] > 0
    assert len(data["prompts"]) == 4 and {"code-0", "edit-0"} <= {p["prompt"] for p in data["prompts"]}
