"""`specdec.check_greedy` / `specdec verify --greedy`: the identical fraction, and each divergence's position and
the plain pass's top-2 gap there (docs/exactness.md, "Greedy divergence check").

Positive: exact methods in bfloat16 report 100%. Negative controls: a broken verifier (tests/faulty.py) is
reported at the right position with a large margin; the shipped pair in bfloat16 with logits that round
one ulp apart in passes of several positions diverges at a near-tie, which the report tells apart."""

from __future__ import annotations

import json

import pytest
import torch
from faulty import accepted_off_by_one
from methods import build
from models import perturbed, tiny

import specdec
from specdec.bench.workloads import code_prompts
from specdec.cli import main as cli_main
from specdec.exactness import NEAR_TIE_ULPS
from specdec.exactness.greedy import plain_reference, ulp

NEW = 40
PROMPTS = {f"p{k}": [(i * 37 + 11 + 5 * k) % 96 for i in range(30)] for k in range(3)}


@pytest.fixture(scope="module")
def bf16_pair():
    target = tiny("llama", hidden=64, layers=3, num_key_value_heads=2)
    return target.to(torch.bfloat16), perturbed(target, 0.1).to(torch.bfloat16)


@pytest.mark.parametrize("method", ["draft-model", "draft-tree", "prompt-lookup", "draft-model-static"])
def test_an_exact_method_is_identical_on_every_prompt(bf16_pair, method):
    target, draft = bf16_pair
    drafter, options = build(method, target, draft)
    report = specdec.check_greedy(target, PROMPTS, drafter, method=method, max_new_tokens=NEW, eos_token_id=[],
                                  **options)
    assert report.passed and report.identical_fraction == 1.0 and report.identical == report.prompts == 3
    assert report.drafted > 0 and not report.notes  # the drafter drafted: the run could see a difference
    assert report.tokens_compared == report.plain_steps == 3 * NEW
    assert report.dtype == "bfloat16" and report.to_dict()["identical_fraction"] == 1.0


def test_batched_rows_are_each_request_alone(bf16_pair, monkeypatch):
    import specdec.exactness.greedy as greedy

    target, draft = bf16_pair
    rows = []

    def spy(target, prompts, *args, **kwargs):
        rows.append(len(prompts))
        return specdec.generate_batch(target, prompts, *args, **kwargs)

    monkeypatch.setattr(greedy, "generate_batch", spy)
    for drafter in (None, specdec.DraftModel(draft)):
        report = specdec.check_greedy(target, PROMPTS, drafter, gamma=4, max_new_tokens=NEW, eos_token_id=[],
                                      batch_size=2)
        assert report.passed and report.batch_size == 2 and report.identical == 3
    assert rows == [2, 1, 2, 1]  # the method ran batched, 2 rows at a time


def test_a_plain_reference_is_decoded_once_for_several_methods(bf16_pair):
    target, draft = bf16_pair
    reference = plain_reference(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert reference.tokens == tuple(tuple(specdec.generate(target, p, max_new_tokens=NEW, eos_token_id=[]).tokens)
                                     for p in PROMPTS.values())
    for drafter in (specdec.DraftModel(draft), specdec.DraftTree(draft)):
        report = specdec.check_greedy(target, PROMPTS, drafter, max_new_tokens=NEW, eos_token_id=[],
                                      reference=reference)
        assert report.passed and report.plain_steps == 3 * NEW
    broken = specdec.check_greedy(target, PROMPTS, specdec.DraftModel(draft), gamma=4, max_new_tokens=NEW,
                                  eos_token_id=[], reference=reference, verify_fn=accepted_off_by_one)
    assert broken.divergences and all(d.gap is not None and not d.near_tie for d in broken.divergences)
    for other in ({"max_new_tokens": NEW - 1, "eos_token_id": []}, {"max_new_tokens": NEW, "eos_token_id": None},
                  {"max_new_tokens": NEW, "eos_token_id": [], "compile": "static"}):
        with pytest.raises(specdec.ConfigError, match="reference"):
            specdec.check_greedy(target, PROMPTS, reference=reference, **other)
    with pytest.raises(specdec.ConfigError, match="reference"):
        specdec.check_greedy(target, dict(list(PROMPTS.items())[:2]), reference=reference, max_new_tokens=NEW,
                             eos_token_id=[])


def _first_difference(a, b):
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def test_a_broken_verifier_is_reported_at_its_position_with_the_plain_gap():
    """Negative control: keeping the rejected draft token emits a token the target does not pick. The report
    names each prompt, the first differing position and the plain pass's logits there (recomputed here)."""
    target = tiny("llama", hidden=64, layers=3)  # float64: no rounding to blame
    draft = perturbed(target, 0.1)
    report = specdec.check_greedy(target, PROMPTS, specdec.DraftModel(draft), gamma=4, max_new_tokens=NEW,
                                  eos_token_id=[], verify_fn=accepted_off_by_one)
    assert not report.passed and report.identical_fraction < 1.0
    assert report.identical + len(report.divergences) == 3
    for d in report.divergences:
        prompt = PROMPTS[d.prompt]
        plain = specdec.generate(target, prompt, max_new_tokens=NEW, eos_token_id=[]).tokens
        method = list(specdec.SpeculativeDecoder(target, specdec.DraftModel(draft), gamma=4, max_new_tokens=NEW,
                                                 eos_token_id=[], verify_fn=accepted_off_by_one).stream(prompt))
        assert d.position == _first_difference(plain, method)
        assert (d.plain_token, d.method_token) == (plain[d.position], method[d.position])
        with torch.no_grad():
            logits = target(torch.tensor([prompt + plain[: d.position]])).logits[0, -1]  # [V]
        top = logits.topk(2).values
        assert d.gap == pytest.approx(float(top[0] - top[1]), abs=1e-9)
        assert d.margin == pytest.approx(float(top[0] - logits[d.method_token]), abs=1e-9)
        assert d.margin >= d.gap > 0 and not d.near_tie  # a wrong token, not a rounding


def one_ulp_off_in_passes_of_several_positions(module, args, logits):  # [B, T, V] -> [B, T, V]
    """A forward hook that makes the logits' rounding depend on the pass's shape, as a blocked kernel's does: in
    passes of more than one position, each logit moves by -1, 0 or +1 ulp of its dtype (by token id)."""
    if logits.shape[-2] == 1:
        return logits
    wide = logits.float()
    _, exponent = torch.frexp(wide)
    step = torch.finfo(logits.dtype).eps * torch.exp2((exponent - 1).float())  # one ulp at each logit
    ids = torch.arange(logits.shape[-1])
    return (wide + (ids * 2654435761 % 3 - 1).float() * step).to(logits.dtype)


def test_a_pass_that_is_not_row_invariant_diverges_at_a_near_tie():
    """Negative control: the shipped pair in bfloat16 whose multi-position passes round their logits one ulp apart
    from single-position passes (not row invariant, on every CPU alike): a token tree leaves plain decoding on a
    held-out prompt, and the report calls it a near-tie."""
    target, draft, tokenizer = specdec.load_default(dtype=torch.bfloat16)
    hook = target.get_output_embeddings().register_forward_hook(one_ulp_off_in_passes_of_several_positions)
    try:
        prompt = code_prompts(tokenizer, 24, seed=1)[0]  # the tree leaves it at position 7
        report = specdec.check_greedy(target, {prompt.name: prompt.ids}, specdec.DraftTree(draft),
                                      max_new_tokens=64, eos_token_id=[])
    finally:
        hook.remove()
    assert report.identical_fraction == 0.0
    (d,) = report.divergences
    assert d.prompt == "code-0" and 0 <= d.position < 64 and d.plain_token != d.method_token
    assert d.near_tie and d.gap <= d.margin <= NEAR_TIE_ULPS * d.ulp


def test_ulp():
    assert ulp(12.5, torch.bfloat16) == 0.0625 and ulp(-12.5, torch.bfloat16) == 0.0625
    assert ulp(1.0, torch.float32) == 2.0**-23 and ulp(0.75, torch.float16) == 2.0**-11


def test_bad_input_is_refused(bf16_pair):
    target, draft = bf16_pair
    for prompts, error in (([], specdec.PromptError), ([5, 9, 3], specdec.PromptError), ("def f", specdec.ConfigError),
                           ({"a": "def f"}, specdec.PromptError), (None, specdec.ConfigError)):
        with pytest.raises(error, match="prompt"):
            specdec.check_greedy(target, prompts, max_new_tokens=2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(specdec.ConfigError, match="batch_size"):
            specdec.check_greedy(target, PROMPTS, batch_size=bad, max_new_tokens=2)
    with pytest.raises(specdec.ConfigError, match="without batch_size"):
        specdec.check_greedy(target, PROMPTS, specdec.DraftModel(draft), batch_size=2, verify_fn=accepted_off_by_one)


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory, bf16_pair):
    root = tmp_path_factory.mktemp("greedy")
    for name, model in zip(("target", "draft"), bf16_pair):
        model.save_pretrained(root / name)
    return root


def test_cli_greedy_json(saved_pair, capsys):
    ids = [",".join(map(str, p)) for p in PROMPTS.values()]
    rc = cli_main(["verify", "--greedy", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                   "--drafter", "draft", "--drafter", "prompt-lookup", "--prompt-ids", ids[0], "--prompt-ids", ids[1],
                   "--dtype", "bfloat16", "--max-new-tokens", "24", "--eos", "none", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["passed"]
    assert [(r["method"], r["prompts"], r["identical_fraction"], r["dtype"]) for r in out["results"]] == [
        ("draft", 2, 1.0, "bfloat16"), ("prompt-lookup", 2, 1.0, "bfloat16")]


def test_cli_greedy_on_packed_weights(saved_pair, capsys, monkeypatch):
    """`specdec verify --greedy --weights int8`: target and draft loaded on int8 packed weights, as `generate
    --weights` loads them, and checked as that model."""
    import specdec.exactness as exactness
    from specdec.runtime.weights import packed_formats

    seen, real = [], exactness.check_greedy

    def spy(target, prompts, drafter, **kwargs):
        seen.append((packed_formats(target), packed_formats(drafter.model)))
        return real(target, prompts, drafter, **kwargs)

    monkeypatch.setattr(exactness, "check_greedy", spy)
    ids = [",".join(map(str, p)) for p in PROMPTS.values()]
    rc = cli_main(["verify", "--greedy", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                   "--drafter", "draft", "--prompt-ids", ids[0], "--prompt-ids", ids[1], "--dtype", "bfloat16",
                   "--weights", "int8", "--max-new-tokens", "24", "--eos", "none", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["passed"] and out["weights"] == "int8"
    assert seen == [({"int8"}, {"int8"})] and out["results"][0]["identical_fraction"] == 1.0


def test_cli_greedy_reports_a_divergence_and_exits_1(saved_pair, capsys, monkeypatch):
    import specdec.exactness as exactness

    real = exactness.check_greedy
    monkeypatch.setattr(exactness, "check_greedy",
                        lambda *args, **kwargs: real(*args, verify_fn=accepted_off_by_one, **kwargs))
    rc = cli_main(["verify", "--greedy", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                   "--prompt-ids", ",".join(map(str, PROMPTS["p0"])), "--dtype", "bfloat16", "--max-new-tokens",
                   "24", "--eos", "none"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "top-2 gap" in out and "a bug" in out


@pytest.mark.parametrize(("args", "words"), [
    (["--greedy", "--temperature", "0.7"], ["--temperature", "temperature 0"]),
    (["--greedy", "--top-k", "5"], ["--top-k"]),
    (["--greedy", "--batch-size", "0"], ["--batch-size", ">= 1"]),
    (["--greedy", "--prompt-ids", "1,x"], ["--prompt-ids", "integers"]),
    (["--greedy", "--prompt-ids", "1,2", "--num-prompts", "4"], ["--num-prompts", "--prompts"]),
    (["--batch-size", "8", "--prompt-ids", "1,2"], ["--batch-size", "--greedy"]),
    (["--prompt-ids", "1,2", "--prompt-ids", "3"], ["one prompt", "--greedy"]),
])
def test_cli_greedy_bad_options_are_one_line(saved_pair, capsys, args, words):
    rc = cli_main(["verify", "--target", str(saved_pair / "target"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and all(w in err for w in words), err
