"""The accelerator path: every method with its models on a GPU, greedy and sampled.

The rest of the suite runs on the CPU; these tests run where torch sees a CUDA device and are skipped elsewhere
(with the reason). `SPECDEC_TEST_DEVICE` names another device to run them on: `cpu` checks this module itself on a
machine with no GPU (docs/testing.md).

- Greedy: every method of tests/methods.py, with a float64 target and a partially agreeing draft on the device,
  gives the tokens of transformers' greedy `generate` on the same device, and those of the same models on the CPU
  (`SelfDraft`, whose int8/int4 kernels are CPU kernels, refuses a GPU target with one clear error); and every
  MTP_METHODS entry on a target with a native MTP layer (refused with one error under a transformers older than
  `Mtp` needs, as a GPU image's own can be).
- Compiled (compile=True) on the device, plain decoding, the draft model, a tree and an EAGLE head give
  transformers' greedy tokens; on a GPU every pass runs as a CUDA graph, none skipped.
- Batched rows on the device give what each row gives alone.
- Sampled (T > 0 with top-k and top-p): the statistical exactness check of tests/test_exactness.py for a chain, a
  token tree, a multi-draft tree and the slot cache on the device, at their own level (counted in the suite's
  family-wise bound), with a negative control (the rule without its residual) that must fail there.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from faulty import FAULTY_VERIFIERS
from methods import DEVICE_STATISTICAL, METHODS, MTP_METHODS, build, build_mtp
from models import hf_greedy, perturbed, tiny, tiny_mtp
from packaging.version import Version
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

import specdec
from specdec.engine.batch import generate_batch
from specdec.errors import ConfigError
from specdec.exactness import check_exactness
from specdec.heads.mtp import MIN_TRANSFORMERS, TRANSFORMERS_VERSION

DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cuda")


def _available(device: str) -> bool:
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        return torch.backends.mps.is_available()
    return kind == "cpu"


pytestmark = pytest.mark.skipif(not _available(DEVICE),
                                reason=f"no {DEVICE} device here (SPECDEC_TEST_DEVICE=cpu runs these tests on the CPU)")

PROMPT = [(i * 37 + 11) % 96 for i in range(20)]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def cpu_pair():
    target = tiny("llama", hidden=32, layers=3)
    return target, perturbed(target, 0.1)


@pytest.fixture(scope="module")
def pair(cpu_pair):
    target, draft = cpu_pair
    return copy.deepcopy(target).to(DEVICE), copy.deepcopy(draft).to(DEVICE)


@pytest.fixture(scope="module")
def references(cpu_pair, pair):
    """transformers' greedy continuation of PROMPT: (on the device, on the CPU)."""
    return hf_greedy(pair[0], PROMPT, NEW_TOKENS), hf_greedy(cpu_pair[0], PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_greedy_output_is_plain_decoding_on_the_device(pair, references, name):
    target, draft = pair
    if name.startswith("self-draft") and torch.device(DEVICE).type != "cpu":
        with pytest.raises(ConfigError, match="device='cpu'"):  # its int4 kernels are CPU kernels: one clear refusal
            build(name, target, draft)
        return
    drafter, extra = build(name, target, draft)
    options = dict(gamma=3, max_new_tokens=NEW_TOKENS, temperature=0.0) | extra
    out = specdec.generate(target, PROMPT, drafter=drafter, **options)
    on_device, on_cpu = references
    assert out.tokens == on_device
    assert out.tokens == on_cpu  # float64: the device computes the CPU's tokens
    if drafter is not None:
        assert out.stats.drafted > 0  # proposals were scored and verified on the device


#: The fast path compiled (compile=True): the target's passes and the draft model's steps, a tree's verification
#: and an EAGLE head's fixed-shape round.
COMPILED = ("plain-static", "draft-model-static", "suffix-static", "eagle-static")


@pytest.mark.compile
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_greedy_output_on_the_device_is_plain_decoding(pair, references, name):
    """Compiled on a GPU, every pass runs as a CUDA graph (runtime/compiled.py, CUDA_GRAPHS): inductor skips none
    (a pass that wrote an input not at a static address would be skipped) and records them, and the tokens are
    transformers' greedy ones in float64."""
    target, draft = pair
    drafter, extra = build(name, target, draft)
    skips = counters["inductor"]["cudagraph_skips"]
    out = specdec.generate(target, PROMPT, drafter=drafter, gamma=3, max_new_tokens=NEW_TOKENS, temperature=0.0,
                           **(extra | {"compile": True}))
    assert out.tokens == references[0]
    if torch.device(DEVICE).type == "cuda":
        assert counters["inductor"]["cudagraph_skips"] == skips
        manager = cudagraph_trees.get_manager(torch.device(DEVICE).index or 0, create_if_none_exists=False)
        assert manager is not None and manager.roots, "no pass was recorded as a CUDA graph"


@pytest.mark.compile
@pytest.mark.parametrize("name", ["plain", "draft-model"])
def test_compiled_batched_rows_on_the_device_are_plain_decoding(pair, references, name):
    """The batched fast path compiled on the device (`StaticBatchedCausalLM`, whose rows are views of one cache's
    buffers): as CUDA graphs on a GPU, none skipped, each row transformers' greedy tokens in float64."""
    target, draft = pair
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:17]]
    skips = counters["inductor"]["cudagraph_skips"]
    batched = generate_batch(target, prompts, drafter=build(name, target, draft)[0], gamma=3,
                             max_new_tokens=NEW_TOKENS, compile=True)
    assert batched[0].tokens == references[0]
    assert [o.tokens for o in batched[1:]] == [hf_greedy(target, p, NEW_TOKENS) for p in prompts[1:]]
    if torch.device(DEVICE).type == "cuda":
        assert counters["inductor"]["cudagraph_skips"] == skips


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    """A float64 target with a native MTP layer (DeepSeek-V3 family, saved as a release is and loaded back) on the
    CPU and on the device; `Mtp` reads the layer from the checkpoint onto the target's device."""
    target = tiny_mtp(tmp_path_factory.mktemp("mtp"), "deepseek_v3", hidden=16, vocab=8, seed=2)
    return target, copy.deepcopy(target).to(DEVICE)


@pytest.mark.parametrize("name", sorted(MTP_METHODS))
def test_mtp_greedy_output_is_plain_decoding_on_the_device(mtp_pair, name):
    on_cpu, target = mtp_pair
    prompt = [(i * 37 + 11) % 8 for i in range(20)]
    if Version(TRANSFORMERS_VERSION) < Version(MIN_TRANSFORMERS):  # a GPU image's own transformers can be older
        with pytest.raises(specdec.UnsupportedModelError, match=f">={MIN_TRANSFORMERS}"):
            build_mtp(name, target)
        return
    drafter, extra = build_mtp(name, target)
    out = specdec.generate(target, prompt, drafter=drafter, **({"gamma": 3, "max_new_tokens": NEW_TOKENS} | extra))
    assert out.tokens == hf_greedy(target, prompt, NEW_TOKENS)
    assert out.tokens == hf_greedy(on_cpu, prompt, NEW_TOKENS)
    assert out.stats.drafted > 0


@pytest.mark.parametrize("name", ["plain", "draft-model", "prompt-lookup"])
def test_batched_rows_on_the_device_match_lone_requests(pair, name):
    target, draft = pair
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:17]]
    lone = [specdec.generate(target, p, drafter=build(name, target, draft)[0], gamma=3, max_new_tokens=16).tokens
            for p in prompts]
    batched = generate_batch(target, prompts, drafter=build(name, target, draft)[0], gamma=3, max_new_tokens=16)
    assert [o.tokens for o in batched] == lone


# ------------------------------------------------------------------------------------------------ sampled

ALPHA = 1e-5  # per check (DEVICE_ALPHA): tests/test_exactness.py counts these in the suite's family-wise bound
N = 3000
VOCAB = 8
SAMPLED_PROMPT = [1, 2, 1, 1, 2]
SETTING = dict(gamma=3, temperature=1.5, top_k=6, top_p=0.8, max_new_tokens=3, eos_token_id=[])


@pytest.fixture(scope="module")
def small_pair():
    """V=8 target and a perturbed draft (partial acceptance), float64, on the device; and an unrelated draft."""
    target = tiny("llama", hidden=16, layers=2, vocab=VOCAB, seed=3)
    near = perturbed(target, 0.3, seed=11)
    far = tiny("llama", hidden=16, layers=2, vocab=VOCAB, seed=17)
    return target.to(DEVICE), near.to(DEVICE), far.to(DEVICE)


@pytest.mark.exactness_positive(checks=1, alpha=ALPHA)
@pytest.mark.statistical
@pytest.mark.parametrize("name", DEVICE_STATISTICAL)
def test_sampling_on_the_device_is_exact(small_pair, name):
    target, near, _ = small_pair
    drafter, extra = build(name, target, near)
    result = check_exactness(target, SAMPLED_PROMPT, drafter, samples=N, seed=1234, alpha=ALPHA, method=name,
                             **SETTING, **extra)
    assert result.passed, result.summary()
    assert result.detectable_tv < 0.12, result.summary()  # the check has power
    assert 0 < result.accepted < result.drafted, result.summary()  # accept, reject and recover all ran


@pytest.mark.statistical
def test_negative_control_on_the_device_is_caught(small_pair):
    target, _, far = small_pair
    result = check_exactness(target, SAMPLED_PROMPT, specdec.DraftModel(far), samples=N, seed=1234, alpha=ALPHA,
                             verify_fn=FAULTY_VERIFIERS["no_residual"], **SETTING)
    assert not result.passed
    assert result.p_value < 1e-6, result.summary()
