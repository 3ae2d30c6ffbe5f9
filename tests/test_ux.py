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
    candidates = [c for c in CANDIDATES if not c.compiled]  # the compiled ones: tests/test_fastpath.py
    for candidate in candidates:
        plain = list(candidate.decoder(models, speculative=False, **settings).stream(prompts[0]))
        assert list(candidate.decoder(models, **settings).stream(prompts[0])) == plain, candidate.name
    result = calibrate(models, candidates, prompts, max_new_tokens=8)
    assert set(result.speedups) == {c.name for c in candidates}
    assert all(len(v) == 2 and min(v) > 0 for v in result.speedups.values())
    picked = Calibration({"a": [1.0, 4.0], "b": [1.9, 1.9]})  # geometric means 2.0 and 1.9
    assert picked.best() == "a" and picked.score("a") == pytest.approx(2.0)


@pytest.mark.compile
def test_a_compiled_candidate_sized_once_serves_prompts_of_every_length(target):
    """With `Models.capacity` (the demo sets it), a compiled candidate keeps one drafter and one target adapter,
    their caches sized once, across requests of different lengths; each request is identical to plain decoding on
    the same path."""
    from specdec.bench.candidates import CANDIDATES, Models, get_candidate

    models = Models(target, tiny("llama", layers=1), None, capacity=96)
    candidate = get_candidate("draft-g6-compiled", CANDIDATES)
    settings = dict(max_new_tokens=10, temperature=0.0, eos_token_id=[], seed=0)
    for prompt in ([1, 2, 3, 4, 1, 2, 3], [5, 6, 7], list(range(1, 40))):
        plain = list(candidate.decoder(models, speculative=False, **settings).stream(prompt))
        assert list(candidate.decoder(models, **settings).stream(prompt)) == plain
    assert list(models.drafters) == ["draft-g6-compiled"] and list(models.adapters) == ["compiled"]
    assert {c.name for c in CANDIDATES if c.compiled and c.calibrated} == {"draft-g6-compiled",
                                                                            "draft-vocab-g6-compiled"}


def test_a_compiled_candidate_uncompiled_runs_the_same_method_without_compiling(target, monkeypatch):
    """The demo's sampled stream: a compiled candidate with `uncompiled=True` decodes on the fast path's caches with
    eager passes (compile="static"), its own drafter, exact (greedy: plain decoding on that path), compiling
    nothing."""
    import torch

    from specdec.bench.candidates import CANDIDATES, Models, get_candidate

    compiles = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: compiles.append(a) or (lambda *x, **y: None))
    models = Models(target, tiny("llama", layers=1), None, capacity=96)
    candidate = get_candidate("draft-g6-compiled", CANDIDATES)
    settings = dict(max_new_tokens=10, temperature=0.0, eos_token_id=[], seed=0)
    prompt = [1, 2, 3, 4, 1, 2, 3]
    spec = candidate.decoder(models, uncompiled=True, **settings)
    assert spec.compile == "static"
    plain = list(candidate.decoder(models, speculative=False, uncompiled=True, **settings).stream(prompt))
    assert list(spec.stream(prompt)) == plain and len(plain) == 10
    sampled = candidate.decoder(models, uncompiled=True, **{**settings, "temperature": 0.7})
    assert len(list(sampled.stream(prompt))) == 10 and sampled.stats.target_forwards < 10
    assert compiles == [] and list(models.adapters) == ["static"] and models.drafters == {}


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
    from specdec.runtime.rowwise import kernel_tier

    assert data["kernel_tier"] == kernel_tier() and data["cpu"]  # the CPU class the figures hold for


# -- issue 21: the first hour of a user ------------------------------------------------------------------------
def _one_line_error(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec") and "error:" in err and "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def _default_pair_or_skip():
    from specdec.hub.default_pair import assets_present

    if not assets_present():
        pytest.skip("default assets missing")


def test_a_draft_with_its_own_tokenizer_is_translated_as_help_says(capsys):
    """--draft whose saved tokenizer differs: drafted through the translation (no --draft-tokenizer needed)."""
    from pathlib import Path

    _default_pair_or_skip()
    draft = str(Path(specdec.__file__).parent / "assets" / "cross_vocab_draft")
    assert cli_main(["generate", "--draft", draft, "--prompt", "import os", "--max-new-tokens", "6"]) == 0
    assert "[draft" in capsys.readouterr().err
    # A cross-tokenizer kind with nothing to translate from: refused in flags, not Python argument names.
    assert cli_main(["generate", "--drafter", "draft-tli", "--prompt", "x", "--max-new-tokens", "2"]) == 2
    err = _one_line_error(capsys, "--draft-tokenizer")
    assert "draft_tokenizer=" not in err and "target_tokenizer" not in err
    # A drafter that runs the draft model untranslated still refuses another tokenizer.
    assert cli_main(["generate", "--draft", draft, "--drafter", "draft-tree", "--prompt", "x",
                     "--max-new-tokens", "2"]) == 2
    _one_line_error(capsys, "--drafter draft-tree", "different tokenizer")


def test_compile_time_is_reported_apart_from_decoding_speed():
    from specdec.core.stats import DecodeStats

    stats = DecodeStats(new_tokens=10, wall_s=12.5, prefill_s=1.5, compile_s=10.5, prefill_compile_s=0.5)
    assert stats.tokens_per_s == pytest.approx(10.0)  # 10 tokens in 12.5 - 1.5 - (10.5 - 0.5) = 1 s of rounds
    assert DecodeStats(new_tokens=10, wall_s=2.0, prefill_s=1.0).tokens_per_s == pytest.approx(10.0)


def test_generate_reports_compiling_apart(monkeypatch, capsys, target):
    """The decoder measures the compile time paid during the call (here a stub: half of all time counts as
    compiling) and leaves it out of tokens/s; the CLI prints it beside, not inside, the speed."""
    import time

    import specdec.engine.decoding

    t0 = time.perf_counter()
    monkeypatch.setattr(specdec.engine.decoding, "compile_seconds", lambda: 0.5 * (time.perf_counter() - t0))
    out = specdec.generate(target, [1, 2, 3], max_new_tokens=4)
    assert out.stats.compile_s > out.stats.prefill_compile_s > 0
    wall_only = out.stats.new_tokens / (out.stats.wall_s - out.stats.prefill_s)
    assert out.stats.tokens_per_s > wall_only
    _default_pair_or_skip()
    assert cli_main(["generate", "--drafter", "plain", "--prompt", "x", "--max-new-tokens", "3"]) == 0
    stats_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "tokens/s (compile" in stats_line and "not counted" in stats_line


def test_verify_warns_when_the_drafter_never_drafted(capsys):
    """Prompt lookup on a prompt with no repeated n-gram drafts nothing: PASS, but a test without power."""
    from specdec.exactness import check_exactness

    model = tiny("llama", layers=1, vocab=16)
    # Greedy (T = 0): a deterministic check, outside the statistical suite's family-wise bound.
    result = check_exactness(model, [1, 2, 3], specdec.PromptLookup(), temperature=0.0, max_new_tokens=2,
                             samples=20, seed=0)
    assert result.drafted == 0 and result.power_warning and "no power" in result.power_warning
    assert result.power_warning in result.notes and result.to_dict()["power_warning"] == result.power_warning
    plain = check_exactness(model, [1, 2, 3], None, temperature=0.0, max_new_tokens=2, samples=20, seed=0)
    assert plain.power_warning is None  # plain decoding drafts nothing by design


def test_verify_cli_says_no_power(capsys):
    _default_pair_or_skip()
    rc = cli_main(["verify", "--drafter", "prompt-lookup", "--prompt", "def ", "--samples", "20",
                   "--max-new-tokens", "2", "--temperature", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and "no power" in out


def test_bench_plots_keep_one_style_per_method_and_no_line_hides_another(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from specdec.bench.report import write_plots

    def config(method, gamma, speedup, accept=()):
        return {"method": method, "gamma": gamma, "speedup_vs_hf_plain": speedup, "acceptance_by_position": list(accept),
                "drafted_at": [100] * len(accept), "alpha_token": 0.5 if accept else None}

    same = (0.8, 0.6, 0.4)  # specdec's draft and HF assisted accept exactly the same tokens
    results = {"configs": [config("hf-plain", None, 1.0), config("plain", None, 0.95),
                           config("hf-assisted", 2, 1.3, same), config("draft", 2, 1.3, same),
                           config("prompt-lookup", 2, 1.1, (0.2, 0.1))],
               "theory": {"configs": [{"method": m, "gamma": 2, "tau_measured": 2.0, "tau_predicted": 2.1}
                                      for m in ("prompt-lookup", "draft")]}}
    drawn: dict[str, set] = {}
    real_plot, real_hline = Axes.plot, Axes.axhline

    def record(label, kwargs):
        if label and not label.endswith("predicted"):
            method = label.split(" ")[0]
            drawn.setdefault(method, set()).add((kwargs.get("color"), kwargs.get("marker"), str(kwargs.get("linestyle"))))

    def plot(self, *args, **kwargs):
        record(kwargs.get("label"), kwargs)
        return real_plot(self, *args, **kwargs)

    def axhline(self, *args, **kwargs):
        record(kwargs.get("label"), kwargs)
        return real_hline(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", plot)
    monkeypatch.setattr(Axes, "axhline", axhline)
    write_plots(results, tmp_path)
    colors = {method: {style[0] for style in styles} for method, styles in drawn.items()}
    assert all(len(c) == 1 for c in colors.values()), colors  # one colour per method in every plot
    assert len({c for cs in colors.values() for c in cs}) == len(colors)  # and a colour per method
    draft, assisted = drawn["draft"], drawn["hf-assisted"]
    assert {(m, ls) for _, m, ls in draft if m} .isdisjoint({(m, ls) for _, m, ls in assisted if m})


def test_chat_on_the_default_pair_works_out_of_the_box():
    _default_pair_or_skip()
    _, _, tokenizer = specdec.load_default()
    text = tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text == "system: be brief\nuser: hi\nassistant:"


def test_eagle3_is_not_listed_where_no_head_is_shipped(capsys):
    from pathlib import Path

    from specdec.drafters import DRAFTER_KINDS

    shipped = (Path(specdec.__file__).parent / "assets" / "default" / "eagle3" / "config.json").is_file()
    for command in ("generate", "verify", "serve"):
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        usage = capsys.readouterr().out.split("--drafter {", 1)[1].split("}", 1)[0].split(",")
        assert ("eagle3" in usage) == shipped and "eagle" in usage
    assert "eagle3" in DRAFTER_KINDS  # still accepted, with --head DIR
    # specdec bench: neither listed nor in "all" (bench has no --head: it would fail), still accepted by name
    from specdec.bench import parse_methods

    assert cli_main(["bench", "--list-methods"]) == 0
    listed = capsys.readouterr().out.split()
    assert "eagle" in listed and "eagle-compiled" in listed
    assert any(m.startswith("eagle3") for m in listed) == shipped
    assert any(m.startswith("eagle3") for m in parse_methods("all")) == shipped
    assert parse_methods("eagle3,eagle3-chain-compiled") == ["eagle3", "eagle3-chain-compiled"]


@pytest.mark.parametrize(("args", "words"), [
    (["--port", "99999"], ["--port", "0..65535"]),
    (["--port", "x"], ["--port"]),
    (["--host", "no-such-host.invalid"], ["--host"]),
    (["--chat-template", "/no/such/file.jinja"], ["--chat-template"]),
    (["--gamma", "0"], ["--gamma"]),
])
def test_serve_refuses_careless_options_in_one_line_before_loading(monkeypatch, capsys, args, words):
    import specdec.cli.generate

    monkeypatch.setattr(specdec.cli.generate, "load_models", lambda args: pytest.fail("models loaded"))
    with_exit = args == ["--port", "x"]  # argparse's own check
    if with_exit:
        with pytest.raises(SystemExit) as info:
            cli_main(["serve", *args])
        assert info.value.code == 2
    else:
        assert cli_main(["serve", *args]) == 2
    _one_line_error(capsys, *words)


def test_serve_reports_a_busy_port_before_loading_the_models(monkeypatch, capsys):
    import socket

    import specdec.cli.generate

    pytest.importorskip("uvicorn")
    monkeypatch.setattr(specdec.cli.generate, "load_models", lambda args: pytest.fail("models loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli_main(["serve", "--port", str(port)]) == 2
    _one_line_error(capsys, "already in use", str(port))


def test_serve_without_fastapi_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now fails; uvicorn is still there
    assert cli_main(["serve"]) == 2
    _one_line_error(capsys, 'pip install "specdec[server]"', "fastapi")


def test_a_hub_id_without_network_fails_fast(monkeypatch, capsys):
    import time

    from huggingface_hub import constants

    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://specdec-no-such-hub.invalid")  # cannot resolve
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    start = time.monotonic()
    assert cli_main(["generate", "--target", "specdec-test/no-such-model", "--prompt", "x"]) == 2
    assert time.monotonic() - start < 15  # the hub client's retries take ~50 s
    _one_line_error(capsys, "cannot be reached", "specdec-test/no-such-model")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert cli_main(["generate", "--target", "specdec-test/no-such-model", "--prompt", "x"]) == 2
    _one_line_error(capsys, "HF_HUB_OFFLINE")


def test_version_and_help_text(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        cli_main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"specdec {specdec.__version__}"
    monkeypatch.setenv("COLUMNS", "1000")  # one option per line
    from specdec.cli import COMMANDS

    for command in COMMANDS:
        with pytest.raises(SystemExit):
            cli_main([command, "--help"])
        out = capsys.readouterr().out
        assert "(default: None)" not in out, command
        assert all(line.count("(default") <= 1 for line in out.splitlines()), command


def test_each_shipped_file_is_stored_once():
    """One copy of each tokenizer: the pairs' models share it from their tokenizer/ directory."""
    import hashlib
    from pathlib import Path

    root = Path(specdec.__file__).parent / "assets"
    seen: dict[str, Path] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.stat().st_size > 4096:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            assert digest not in seen, f"{path} duplicates {seen[digest]}"
            seen[digest] = path


def test_the_shipped_seq2seq_tokenizer_loads_by_name():
    from specdec.hub.default_pair import SEQ2SEQ_DIR
    from specdec.hub.loading import load_tokenizer

    if not (SEQ2SEQ_DIR / "tokenizer" / "tokenizer.json").is_file():
        pytest.skip("seq2seq assets missing")
    tokenizer = load_tokenizer("default-seq2seq")
    assert tokenizer.mask_token == "<mask>" and len(tokenizer) == 8193


def test_serve_compile_keeps_the_model_name(monkeypatch, capsys):
    """--compile once renamed the served model to the last logger's name ("specdec.serve")."""
    import specdec.server
    from specdec.cli import build_parser
    from specdec.cli.serve import build_app

    _default_pair_or_skip()
    seen = {}
    monkeypatch.setattr(specdec.server, "create_app", lambda *args, **kwargs: seen.update(kwargs))
    build_app(build_parser().parse_args(["serve", "--compile", "--drafter", "none"]))
    assert seen["model_name"] == "specdec-default" and seen["compile"] is True
    assert "[specdec] decoding with 1 thread" in capsys.readouterr().err
