"""Temperature 0: speculative output is token-identical to `target.generate(do_sample=False)` (float64)."""

from __future__ import annotations

import pytest
import torch
from methods import LLAMA_STYLE_ONLY, METHODS, build
from models import hf_greedy, perturbed, tiny

import specdec

ARCHS = ["llama", "qwen2", "gpt2", "mistral", "gemma"]
SHORT = [7]
LONG = [(i * 37 + 11) % 96 for i in range(120)]


def partial_draft(target, arch="llama"):
    """A draft that agrees with the target often but not always (noise scale measured per architecture)."""
    return perturbed(target, 0.2 if arch == "gemma" else 0.1)


@pytest.fixture(scope="module")
def targets():
    return {arch: tiny(arch, hidden=32, layers=3) for arch in ARCHS}


def run(target, prompt, drafter, gamma, max_new_tokens=24, **kw):
    return specdec.generate(target, prompt, drafter=drafter, gamma=gamma, max_new_tokens=max_new_tokens,
                            temperature=0.0, **kw)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
def test_partially_agreeing_draft(targets, arch, gamma):
    target = targets[arch]
    draft = partial_draft(target, arch)
    prompt = LONG[:20]
    out = run(target, prompt, specdec.DraftModel(draft), gamma)
    assert out.tokens == hf_greedy(target, prompt, 24)
    assert 0 < out.stats.accepted < out.stats.drafted  # the partial-acceptance path ran


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_draft_equal_to_target_accepts_everything(targets, arch, prompt):
    target = targets[arch]
    out = run(target, prompt, specdec.DraftModel(target), gamma=5)
    assert out.tokens == hf_greedy(target, prompt, 24)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.target_forwards == 4  # 24 tokens = 4 rounds of 5 accepted + 1 bonus


@pytest.mark.parametrize("arch", ARCHS)
def test_smaller_draft_of_same_architecture(targets, arch):
    target = targets[arch]
    draft = tiny(arch, hidden=16, layers=1, seed=5)
    out = run(target, LONG[:40], specdec.DraftModel(draft), gamma=3)
    assert out.tokens == hf_greedy(target, LONG[:40], 24)


@pytest.mark.parametrize(("target_arch", "draft_arch"), [("llama", "gpt2"), ("qwen2", "llama"), ("gpt2", "mistral")])
def test_unrelated_draft_of_another_architecture(targets, target_arch, draft_arch):
    target = targets[target_arch]
    draft = tiny(draft_arch, hidden=16, layers=1, seed=9)
    out = run(target, SHORT, specdec.DraftModel(draft), gamma=2)
    assert out.tokens == hf_greedy(target, SHORT, 24)
    assert out.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eos_inside_an_accepted_run(targets, arch):
    target = targets[arch]
    free = hf_greedy(target, SHORT, 24)
    stop = next(i for i in range(2, 24) if free[i] not in free[:i])  # first occurrence of that token
    eos = free[stop]
    out = run(target, SHORT, specdec.DraftModel(target), gamma=8, eos_token_id=eos)
    assert out.tokens == free[: stop + 1] == hf_greedy(target, SHORT, 24, eos=eos)
    assert out.stats.new_tokens == stop + 1


def test_eos_from_generation_config_and_empty_list_disables_it(targets):
    target = targets["llama"]
    free = hf_greedy(target, SHORT, 24)
    target.generation_config.eos_token_id = free[3]
    try:
        stopped = run(target, SHORT, specdec.DraftModel(target), gamma=4)
        unstopped = run(target, SHORT, specdec.DraftModel(target), gamma=4, eos_token_id=[])
    finally:
        target.generation_config.eos_token_id = None
    assert stopped.tokens == free[: free.index(free[3]) + 1]
    assert unstopped.tokens == free


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
def test_max_new_tokens_is_never_exceeded(targets, max_new_tokens):
    target = targets["qwen2"]
    out = run(target, LONG[:10], specdec.DraftModel(target), gamma=8, max_new_tokens=max_new_tokens)
    assert out.tokens == hf_greedy(target, LONG[:10], max_new_tokens)
    assert len(out.tokens) == max_new_tokens


def test_sliding_window_attention_matches_generate():
    target = tiny("mistral", hidden=32, layers=2, sliding_window=8)
    draft = partial_draft(target)
    prompt = LONG[:30]
    out = run(target, prompt, specdec.DraftModel(draft), gamma=4, max_new_tokens=30)
    assert out.tokens == hf_greedy(target, prompt, 30)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_registered_method(targets, method, arch):
    if method.startswith(LLAMA_STYLE_ONLY) and arch == "gpt2":
        pytest.skip("EAGLE-3's midlayer and DFlash's layers need a Llama-style layer (separate q/k/v, rotary "
                    "positions); GPT-2 is refused")
    target = targets[arch]
    draft = partial_draft(target)
    prompt = (LONG[:12] * 3)[:30]  # repeats, so n-gram drafters find matches
    drafter, options = build(method, target, draft)
    out = specdec.generate(target, prompt, drafter=drafter, **{"gamma": 3, "max_new_tokens": 32, **options})
    assert out.tokens == hf_greedy(target, prompt, 32)


def test_plain_decoding_is_one_token_per_forward(targets):
    out = run(targets["llama"], LONG[:10], None, gamma=4)
    assert out.tokens == hf_greedy(targets["llama"], LONG[:10], 24)
    assert out.stats.mean_accepted_tokens == 1.0
    assert out.stats.target_forwards == 24 and out.stats.drafted == 0


def test_stream_yields_the_generate_tokens(targets):
    target = targets["llama"]
    draft = partial_draft(target)
    streamed = list(specdec.stream(target, LONG[:10], drafter=specdec.DraftModel(draft), gamma=3,
                                   max_new_tokens=20))
    assert streamed == run(target, LONG[:10], specdec.DraftModel(draft), 3, 20).tokens


def test_accepts_a_1d_or_batch_of_one_tensor_prompt(targets):
    target = targets["llama"]
    ref = run(target, LONG[:10], None, 1, 8).tokens
    assert run(target, torch.tensor(LONG[:10]), None, 1, 8).tokens == ref
    assert run(target, torch.tensor([LONG[:10]]), None, 1, 8).tokens == ref
