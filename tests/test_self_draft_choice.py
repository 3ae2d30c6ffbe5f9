"""The drafter for a target with no draft: its own quantized copy where that measures faster (choose_self_draft),
measured once per model and machine and cached, and the CLI's default with --target and no --draft."""

import pytest
import torch
from models import tiny, tiny_tokenizer

import specdec
from specdec.cli import main as cli_main
from specdec.engine import self_draft_choice
from specdec.engine.self_draft_choice import PAYS, choose_self_draft
from specdec.runtime.weights import pack_model

PROMPT = torch.tensor([5, 9, 2, 7, 11, 3])


def measured_as(monkeypatch, plain, drafted, alpha=0.9, same=True):
    """Replace the measurement by fixed figures; returns the list of its calls."""
    calls = []

    def fake(target, drafter, prompt_ids, compile):
        calls.append((drafter, compile))
        return plain, drafted, alpha, same

    monkeypatch.setattr(self_draft_choice, "_measure", fake)
    return calls


def test_the_measurement_decodes_both_ways_and_caches_a_verdict_per_model_and_path():
    target = tiny("llama", dtype=torch.float32)
    first = choose_self_draft(target, PROMPT)
    assert first.plain > 0 and first.self_draft > 0 and not first.cached
    assert (first.drafter is not None) == (first.self_draft >= PAYS * first.plain)
    assert first.reason.startswith("SelfDraft(w4a8)" if first.drafter is not None else "plain decoding")
    again = choose_self_draft(target, PROMPT)  # from the cache: the same figures, nothing decoded
    assert again.cached and (again.plain, again.self_draft, again.alpha) == (first.plain, first.self_draft, first.alpha)
    assert "measured earlier" in again.reason
    other = tiny("llama", dtype=torch.float32, seed=1)  # same config, other weights: a model of its own
    assert not choose_self_draft(other, PROMPT).cached
    assert not choose_self_draft(target, PROMPT, compile="static").cached  # another path: measured on it


@pytest.mark.parametrize(("drafted", "pays"), [(130.0, True), (100.0 * PAYS - 1.0, False)])
def test_the_self_draft_is_chosen_when_it_gains_the_margin(monkeypatch, drafted, pays):
    calls = measured_as(monkeypatch, 100.0, drafted)
    target = tiny("llama", dtype=torch.float32)
    choice = choose_self_draft(target, PROMPT)
    assert isinstance(choice.drafter, specdec.SelfDraft) if pays else choice.drafter is None
    assert choice.speedup == pytest.approx(drafted / 100.0) and len(calls) == 1
    cached = choose_self_draft(target, PROMPT)
    assert cached.cached and (cached.drafter is not None) == pays and len(calls) == 1
    assert choose_self_draft(target, PROMPT, remeasure=True).cached is False and len(calls) == 2


def test_a_self_draft_that_never_drafted_is_not_chosen(monkeypatch):
    measured_as(monkeypatch, 100.0, 120.0, alpha=None)
    choice = choose_self_draft(tiny("llama", dtype=torch.float32), PROMPT)
    assert choice.drafter is None and "drafted nothing" in choice.reason


def test_tokens_that_differ_from_plain_decoding_are_never_used(monkeypatch):
    measured_as(monkeypatch, 100.0, 300.0, same=False)
    target = tiny("llama", dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="identity promise"):
        choice = choose_self_draft(target, PROMPT)
    assert choice.drafter is None and "differed" in choice.reason
    measured_as(monkeypatch, 100.0, 300.0)
    assert not choose_self_draft(target, PROMPT).cached  # nothing was cached from the failed measurement


def test_a_continuation_too_short_to_time_is_measured_on_a_later_prompt(monkeypatch):
    target = tiny("llama", dtype=torch.float32)
    target.generation_config.eos_token_id = int(target.generate(PROMPT[None], max_new_tokens=1, do_sample=False)[0, -1])
    choice = choose_self_draft(target, PROMPT)  # the first greedy token is the EOS
    assert choice.drafter is None and choice.plain is None and "not measured" in choice.reason
    calls = measured_as(monkeypatch, 100.0, 130.0)
    assert choose_self_draft(target, PROMPT).drafter is not None and len(calls) == 1


def test_targets_a_self_draft_cannot_serve_are_left_to_plain_decoding(monkeypatch):
    from seq2seq_models import tiny_seq2seq

    calls = measured_as(monkeypatch, 100.0, 300.0)
    packed = pack_model(tiny("llama", dtype=torch.float32), "int8", group=16)
    assert "on int8 weights" in choose_self_draft(packed, PROMPT).reason
    assert "encoder-decoder" in choose_self_draft(tiny_seq2seq("t5"), PROMPT).reason
    assert not calls


def test_a_target_on_packed_float_weights_gets_a_verdict_of_its_own(monkeypatch):
    """load(weights="bfloat16") keeps the float weights its self-draft is quantized from: it is measured, under a
    cache key of its own (the packed model decodes other bits than the model it was packed from)."""
    calls = measured_as(monkeypatch, 100.0, 130.0)
    assert choose_self_draft(tiny("llama", dtype=torch.float32), PROMPT).drafter is not None
    packed = pack_model(tiny("llama", dtype=torch.float32), "bfloat16")
    choice = choose_self_draft(packed, PROMPT)
    assert isinstance(choice.drafter, specdec.SelfDraft) and not choice.cached and len(calls) == 2


@pytest.fixture
def saved_model(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny("llama", layers=1, vocab=len(tokenizer), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def test_the_cli_drafts_with_the_self_draft_where_it_pays_with_the_same_tokens(monkeypatch, saved_model, capsys):
    args = ["generate", "--target", saved_model, "--prompt", "def f(", "--max-new-tokens", "12", "--dtype", "float32"]
    assert cli_main([*args, "--drafter", "plain"]) == 0
    plain = capsys.readouterr()
    measured_as(monkeypatch, 100.0, 150.0)
    assert cli_main(args) == 0  # the default with --target and no --draft: auto
    drafted = capsys.readouterr()
    assert "[specdec] SelfDraft(w4a8): 1.50x" in drafted.err and "[self-draft-w4a8 (γ=auto)]" in drafted.err
    assert drafted.out == plain.out
    measured_as(monkeypatch, 100.0, 90.0)
    assert cli_main([*args, "--drafter", "auto", "--gamma", "3"]) == 0  # the cached verdict: it pays
    assert "measured earlier" in capsys.readouterr().err
    assert cli_main([*args, "--drafter", "plain", "--seed", "1"]) == 0
    assert "[plain]" in capsys.readouterr().err


def test_the_cli_says_plain_decoding_was_chosen_and_why(monkeypatch, saved_model, capsys):
    measured_as(monkeypatch, 100.0, 90.0)
    assert cli_main(["generate", "--target", saved_model, "--prompt", "x", "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "plain decoding: SelfDraft(w4a8) ran 0.90x" in err and "[plain]" in err


def test_drafter_options_without_a_drafter_that_takes_them_are_refused(saved_model, capsys):
    for extra in ([], ["--drafter", "auto"]):
        code = cli_main(["generate", "--target", saved_model, "--prompt", "x", "--draft-layers", "1", *extra])
        assert code == 2 and "need --drafter" in capsys.readouterr().err


def test_the_server_drafts_with_the_self_draft_where_it_pays(monkeypatch, saved_model, capsys):
    """`specdec serve --target MODEL` with no --draft: --drafter auto, measured once at start-up on a fixed prompt."""
    pytest.importorskip("fastapi")
    from specdec.cli import build_parser
    from specdec.cli.serve import build_app

    calls = measured_as(monkeypatch, 100.0, 150.0)
    serve = ["serve", "--target", saved_model, "--port", "0", "--dtype", "float32"]
    scheduler = build_app(build_parser().parse_args(serve)).state.scheduler
    assert scheduler.speculative and isinstance(calls[0][0], specdec.SelfDraft) and calls[0][1] is False
    assert "[specdec] SelfDraft(w4a8): 1.50x" in capsys.readouterr().err
    assert not build_app(build_parser().parse_args([*serve, "--drafter", "none"])).state.scheduler.speculative
    measured_as(monkeypatch, 100.0, 90.0)
    other = tiny("llama", layers=1, vocab=len(tiny_tokenizer()), dtype=torch.float32, seed=4)
    other.save_pretrained(saved_model)  # another model in the same place: measured, and plain decoding chosen
    assert not build_app(build_parser().parse_args(serve)).state.scheduler.speculative
    assert "plain decoding: SelfDraft(w4a8) ran 0.90x" in capsys.readouterr().err
    with pytest.raises(specdec.ConfigError, match="need --drafter with a kind that takes them"):
        build_app(build_parser().parse_args([*serve, "--draft-layers", "1"]))
