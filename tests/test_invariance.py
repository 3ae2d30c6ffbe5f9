"""Identical in low precision: in bfloat16 (and float16) a token's logits do not depend on how many tokens its pass
scored or what else was in it, so greedy speculative output is token-identical to plain decoding on the same path,
and a batched row to the request decoded alone (runtime/attention.py; docs/exactness.md, "Identical in low
precision").

The checks with power run the shipped default pair in bfloat16 on held-out prompts where PyTorch's own attention
kernels make speculative and plain decoding part ways (the negative control shows it on the same prompts). The
tiny random models check that every method runs, and agrees with plain decoding, in both low-precision dtypes."""

from __future__ import annotations

import pytest
import torch
from methods import LLAMA_STYLE_ONLY, METHODS, build
from models import perturbed, tiny

import specdec
import specdec.runtime.causal_lm
import specdec.runtime.compiled
from specdec.bench.workloads import code_prompts
from specdec.hub.default_pair import default_assets_dir
from specdec.hub.loading import load_tokenizer

NEW = 48
#: Held-out prompts (code_prompts(seed=1), of 24) on which, with PyTorch's own kernels (not row-invariant), a token
#: tree or a draft chain of the shipped pair in bfloat16 leaves plain decoding within 47-119 tokens.
DIVERGING = (8, 11, 17, 22)
#: Tokens the negative control decodes: the divergences above lie within them.
CONTROL_NEW = 128


@pytest.fixture(scope="module")
def default_bf16():
    target, draft, tokenizer = specdec.load_default(dtype=torch.bfloat16)
    prompts = code_prompts(tokenizer, 24, seed=1)
    return target, draft, [prompts[i].ids for i in DIVERGING]


def greedy(target, prompt, drafter=None, max_new_tokens=NEW, **options):
    return specdec.generate(target, prompt, drafter=drafter, max_new_tokens=max_new_tokens, temperature=0.0,
                            eos_token_id=[], **options).tokens


DEFAULT_PAIR_METHODS = {
    "draft-4": lambda target, draft: (specdec.DraftModel(draft), {"gamma": 4}),
    "draft-tree": lambda target, draft: (specdec.DraftTree(draft), {}),
    "prompt-lookup": lambda target, draft: (specdec.PromptLookup(), {"gamma": 4}),
}


@pytest.mark.parametrize("path", [False, "static"], ids=["eager", "static"])
@pytest.mark.parametrize("method", sorted(DEFAULT_PAIR_METHODS))
def test_default_pair_speculative_equals_plain(default_bf16, method, path):
    target, draft, prompts = default_bf16
    for prompt in prompts:
        drafter, options = DEFAULT_PAIR_METHODS[method](target, draft)
        assert greedy(target, prompt, drafter, compile=path, **options) == greedy(target, prompt, compile=path)


@pytest.mark.parametrize("path", [False, "static"], ids=["eager", "static"])
def test_default_pair_batched_rows_are_the_requests_alone(default_bf16, path):
    target, draft, prompts = default_bf16
    alone = [greedy(target, prompt, compile=path) for prompt in prompts]
    for drafter in (None, specdec.DraftModel(draft)):
        outs = specdec.generate_batch(target, prompts, drafter=drafter, gamma=4, max_new_tokens=NEW,
                                      eos_token_id=[], compile=path)
        assert [o.tokens for o in outs] == alone


@pytest.mark.compile
def test_compiled_batched_rows_are_the_requests_alone(default_bf16):
    """The compiled batched path against compiled requests alone. A request alone prefills in compiled chunks,
    so a batch must prefill its rows the same way: with one eager batched prefill instead (other roundings of
    the norms and rotary), the last of these prompts left its request alone at token 50-odd."""
    target, draft, _ = default_bf16
    tokenizer = load_tokenizer(default_assets_dir() / "tokenizer")
    prompts = [p.ids for p in code_prompts(tokenizer, 16, seed=1)[12:]]
    alone = [greedy(target, prompt, max_new_tokens=64, compile=True) for prompt in prompts]
    for drafter in (None, specdec.DraftModel(draft)):
        outs = specdec.generate_batch(target, prompts, drafter=drafter, gamma=4, max_new_tokens=64,
                                      eos_token_id=[], compile=True)
        assert [o.tokens for o in outs] == alone


def test_without_the_row_invariant_the_check_fails(default_bf16, monkeypatch):
    """Negative control: the eager adapter with the model's own (PyTorch) attention, same prompts: a token tree's
    output leaves plain decoding's, so the checks above can see a difference."""
    monkeypatch.setattr(specdec.runtime.causal_lm, "EAGER_INVARIANT_DTYPES", ())
    target, draft, prompts = default_bf16
    assert any(greedy(target, prompt, specdec.DraftTree(draft), CONTROL_NEW) != greedy(target, prompt, None, CONTROL_NEW)
               for prompt in prompts)


@pytest.mark.compile
@pytest.mark.parametrize("method", ["draft-4", "draft-tree", "prompt-lookup", "eagle"])
def test_compiled_speculative_equals_compiled_plain(default_bf16, method, monkeypatch):
    monkeypatch.setattr(specdec.runtime.compiled, "UNPLANNED_RECOMPILES", [])  # this test's own recompiles
    target, draft, prompts = default_bf16
    if method == "eagle":
        drafter, options = specdec.Eagle(target, specdec.load_default_heads(target)["eagle"]), {}
    else:
        drafter, options = DEFAULT_PAIR_METHODS[method](target, draft)
    for prompt in prompts[:2]:
        plain = greedy(target, prompt, compile=True)
        assert greedy(target, prompt, drafter, compile=True, **options) == plain
        assert greedy(target, prompt, compile=True) == plain  # plain decoding did not change on the way
    assert not specdec.runtime.compiled.UNPLANNED_RECOMPILES


# -- every method, tiny models, both low-precision dtypes ------------------------------------------------------
LOW = [torch.bfloat16, torch.float16]
PROMPT = [(i * 37 + 11) % 96 for i in range(30)]


@pytest.fixture(scope="module")
def tiny_pairs():
    out = {}
    for arch in ("llama", "gpt2"):
        for dtype in LOW:
            kw = {"num_key_value_heads": 2} if arch == "llama" else {}  # Llama: grouped-query attention
            target = tiny(arch, hidden=64, layers=3, **kw)
            out[arch, dtype] = (target.to(dtype), perturbed(target, 0.1).to(dtype))
    return out


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("method", sorted(set(METHODS) - {"plain"}))
def test_every_method_in_low_precision(tiny_pairs, arch, dtype, method):
    if arch == "gpt2" and method.startswith(LLAMA_STYLE_ONLY):
        pytest.skip("EAGLE-3's midlayer and DFlash's layers need a Llama-style layer; GPT-2 is refused")
    target, draft = tiny_pairs[arch, dtype]
    drafter, options = build(method, target, draft)
    plain = greedy(target, PROMPT, compile=options.get("compile", False), max_new_tokens=40)
    assert greedy(target, PROMPT, drafter, max_new_tokens=40, **options) == plain
