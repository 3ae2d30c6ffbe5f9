"""Statistical exactness: every decoding method samples continuations from the exact warped target.

Each check draws N continuations of one prompt through the real decode loop and compares them with the
target's distribution computed exactly (all continuations, or per-prefix next-token distributions for the
larger vocabulary), see `specdec.exactness` and docs/exactness.md. The reference warps the target's
logits with `specdec.exactness.warp.reference_warp`, not with the decoder's `SamplingConfig.warp`, so a
warp bug shows here too (docs/testing.md).

Thresholds and error rates
- Positive checks (a correct method must PASS): N = 3000 draws each, FAIL when p < ALPHA = 6e-5. The
  Pearson chi-square p-value is calibrated near that level (1.15e-4 measured at a nominal 1e-4 in 200 000
  null simulations with 674 cells), so with POSITIVE_CHECKS = 4 settings x 27 methods in tests/methods.py +
  the conditional-mode case + the JSON case + the CLI's 2 methods (at ALPHA) + every method once more in
  bfloat16 (27, at 2e-5) + 5 in test_trees.py / test_multi_draft.py / test_fastpath.py + 9 in
  test_cross_vocab.py + 6 in test_seq2seq.py (at 1e-4) + the Whisper token tree and the MTP chain of
  test_mtp.py (at 1e-5) = 161 checks (+5 per method added to the registry), the probability that a correct
  implementation fails any of them is at most 112 x 6e-5 + 27 x 2e-5 + 20 x 1e-4 + 2 x 1e-5 = 0.928% (Bonferroni)
  for a random seed (two more methods in the registry take it to 0.98%, a third past 1%: lower ALPHA
  then). Every
  test declares the positive checks it runs (@positive, i.e. @pytest.mark.exactness_positive); an autouse
  fixture in conftest.py counts the checks each test actually runs against that, and
  test_family_wise_false_failure_rate_is_bounded sums the declarations of every test module. Seeds are
  fixed, so a given commit passes or fails deterministically (gamma="auto" excepted: its γ choices follow
  measured timings). Each positive check also asserts its power: every deviation of TV >= 0.12 on the
  test's cells is detected with probability >= 0.8 (typically 0.065-0.095 here).
- Negative controls (10 deliberately broken verifiers/drafters from tests/faulty.py, plus one in
  conditional mode) must FAIL with p < 1e-6 at the same N; measured p-values are 5e-21 or smaller, but for the one-pass block
  drafters' rows read off by one (3e-14 for DFlash's, 1e-94 for PARD's).
- Statistics unit tests (p-value uniformity, power) use their own stated tolerances on fixed seeds.
Runtime: about 15 minutes of one core on the Zen 4 (913 s of test time in `make test`, 2026-12-05): 169 checks of
N draws, 2-20 s each (the draws run through the memo engine, ~1000-2000 draws/s; EAGLE's head is not memoised,
so its checks take 12-20 s).
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from methods import (
    CROSS_VOCAB_METHODS,
    DEVICE_STATISTICAL,
    METHODS,
    MTP_STATISTICAL,
    QUANTIZED_STATISTICAL,
    SEQ2SEQ_METHODS,
    SEQ2SEQ_TREE_STATISTICAL,
    build,
)
from faulty import (
    FAULTY_VERIFIERS,
    ShiftedMarginalBlockDraft,
    ShiftedMarginalParallelDraft,
    UnmappedDraftVocab,
    UnwarpedDraft,
)
from models import perturbed, tiny
from scipy import stats

import specdec
from specdec.core.sampling import SamplingConfig
from specdec.exactness import (
    check_exactness,
    detectable_tv,
    enumerate_continuations,
    multinomial_test,
    pool_cells,
    pooled_conditional_test,
    power_at,
)
from specdec.exactness.engine import SlotTokens, TokenCache, draw, find_models, torch_threads
from specdec.exactness.gof import Group

pytestmark = pytest.mark.statistical  # the whole module: draws and chi-square tests (make test runs it)

ALPHA = 6e-5  # per positive check (8e-5 until the 23rd method would have taken the bound past 1%)
NEGATIVE_P = 1e-6  # every negative control must reach this
N = 3000  # draws per check
VOCAB = 8
PROMPT = [1, 2, 1, 1, 2]  # repeats, so n-gram drafters propose "1", the target's most likely next token

#: (temperature, top_k, top_p, gamma, max_new_tokens, eos): γ >= max_new_tokens exercises the cut of the
#: last round's drafts; eos=True uses the target's generation_config EOS (its second most likely first token,
#: which the drafters rarely propose); eos="top" makes the most likely first token the EOS, so drafters
#: propose it and it is often accepted with more drafts after it in the same round (the loop must stop there).
SETTINGS = {
    "T1.0-g2-L3": (1.0, None, None, 2, 3, False),
    "T0.5-top4-g3-L4-eos": (0.5, 4, None, 3, 4, True),
    "T1.5-top6-p0.8-g5-L3-eos": (1.5, 6, 0.8, 5, 3, True),
    "T1.0-top5-g3-L4-eos-drafted": (1.0, 5, None, 3, 4, "top"),
}


CROSS_VOCAB_CHECKS = 3 * len(CROSS_VOCAB_METHODS)  # tests/test_cross_vocab.py: 3 settings per method
SEQ2SEQ_CHECKS = 2 * len(SEQ2SEQ_METHODS)  # tests/test_seq2seq.py: 2 settings per encoder-decoder method
#: tests/test_seq2seq.py: one setting per tree method on Whisper, each at the lower level TREE_ALPHA
SEQ2SEQ_TREE_CHECKS = len(SEQ2SEQ_TREE_STATISTICAL)
TREE_ALPHA = 1e-5
#: tests/test_mtp.py: one check per MTP method in MTP_STATISTICAL (MTP targets are their own), at MTP_ALPHA there
MTP_CHECKS = len(MTP_STATISTICAL)
MTP_ALPHA = 1e-5
#: tests/test_cuda.py: one check per method in DEVICE_STATISTICAL with the models on a GPU, at DEVICE_ALPHA there
DEVICE_CHECKS = len(DEVICE_STATISTICAL)
DEVICE_ALPHA = 1e-5
#: tests/test_quantize.py: one check per weight format in QUANTIZED_STATISTICAL (target and draft packed), and one
#: of a self-draft of a target on packed bfloat16 weights, at QUANTIZED_ALPHA there
QUANTIZED_CHECKS = len(QUANTIZED_STATISTICAL) + 1
QUANTIZED_ALPHA = 1e-5
BF16_ALPHA = 2e-5  # test_every_method_is_exact_in_bfloat16


def positive(checks: int = 1, alpha: float = ALPHA):
    """Declares a test (each of its parametrizations) to run `checks` statistical checks at level `alpha`
    that a correct implementation must pass: a false failure of each has probability <= alpha."""
    return pytest.mark.exactness_positive(checks=checks, alpha=alpha)


#: Checks a correct implementation must pass: every setting for every method, the conditional-mode case,
#: the JSON case and the CLI's two methods here; in tests/test_trees.py the duplicate-children case and the
#: sibling-mask control's correct run; SpecTr's one-node check in tests/test_multi_draft.py; the two compiled
#: checks in tests/test_fastpath.py and the one in tests/test_layer_graphs.py; every setting of
#: tests/test_cross_vocab.py for every cross-vocabulary method.
#: `test_family_wise_false_failure_rate_is_bounded` counts the declared ones in the collected suite, and
#: every test's actual checks are counted as it runs (conftest.py).
#: Those declared in other modules (trees 2, multi-draft 1, fast path 3, cross-vocab, seq2seq) run at 1e-4, and
#: the seq2seq token-tree check at TREE_ALPHA.
OTHER_CHECKS = 2 + 1 + 3 + CROSS_VOCAB_CHECKS + SEQ2SEQ_CHECKS
BF16_CHECKS = len(METHODS)  # every method once more in bfloat16, at BF16_ALPHA
POSITIVE_CHECKS = (len(SETTINGS) * len(METHODS) + 1 + 1 + 2 + OTHER_CHECKS + SEQ2SEQ_TREE_CHECKS + BF16_CHECKS
                   + MTP_CHECKS + DEVICE_CHECKS + QUANTIZED_CHECKS)
#: Bonferroni bound on the chance that a correct implementation fails any of them.
FWER_BOUND = ((POSITIVE_CHECKS - OTHER_CHECKS - SEQ2SEQ_TREE_CHECKS - BF16_CHECKS - MTP_CHECKS - DEVICE_CHECKS
               - QUANTIZED_CHECKS) * ALPHA + OTHER_CHECKS * 1e-4 + SEQ2SEQ_TREE_CHECKS * TREE_ALPHA
              + BF16_CHECKS * BF16_ALPHA + MTP_CHECKS * MTP_ALPHA + DEVICE_CHECKS * DEVICE_ALPHA
              + QUANTIZED_CHECKS * QUANTIZED_ALPHA)


def test_family_wise_false_failure_rate_is_bounded(request):
    """The Bonferroni bound over the positive checks that every test module of the suite declares (each
    parametrization counted, whatever -k selects); an autouse fixture in conftest.py makes each test declare
    the checks it actually runs."""
    declared = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        module = request.node.parent if path == Path(__file__) else pytest.Module.from_parent(request.session,
                                                                                              path=path)
        for item in module.collect():
            marker = item.get_closest_marker("exactness_positive")
            if marker is not None:
                declared.append((marker.kwargs["checks"], marker.kwargs["alpha"]))
    assert sum(c for c, _ in declared) == POSITIVE_CHECKS, "update POSITIVE_CHECKS and docs/exactness.md"
    bound = sum(c * a for c, a in declared)
    assert bound == pytest.approx(FWER_BOUND)
    assert bound <= 0.01, "too many positive checks for ALPHA: lower ALPHA (and raise N for power)"


@pytest.fixture(scope="module")
def pair():
    """Target (V=8, 2 layers so layer-skip applies, float64) with an EOS of decent probability, and a
    perturbed copy as draft (partial acceptance)."""
    target = tiny("llama", hidden=16, layers=2, vocab=VOCAB, seed=3)
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([PROMPT])).logits[0, -1], -1)
    eos = int(first.argsort(descending=True)[1])  # the second most likely first token
    target.generation_config.eos_token_id = eos
    draft = perturbed(target, 0.3, seed=11)
    return target, draft, eos


def _most_likely_first_token(target) -> int:
    with torch.no_grad():
        return int(target(torch.tensor([PROMPT])).logits[0, -1].argmax())


def _eos_option(target, use_eos):
    """eos_token_id for a setting: [] (none), None (the generation config's), or [the most likely token]."""
    if use_eos == "top":
        return [_most_likely_first_token(target)]
    return None if use_eos else []


def _check(target, drafter, setting, **kw):
    temperature, top_k, top_p, gamma, max_new, use_eos = SETTINGS[setting]
    options = dict(gamma=gamma, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new,
                   eos_token_id=_eos_option(target, use_eos), samples=N, seed=1234, alpha=ALPHA)
    options.update(kw)
    return check_exactness(target, PROMPT, drafter, **options)


# ---------------------------------------------------------------------------------------------- positives


@positive()
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_is_exact(pair, name, setting):
    target, draft, eos = pair
    drafter, extra = build(name, target, draft)
    result = _check(target, drafter, setting, method=name, **extra)
    assert result.mode == "enumerate"
    assert result.passed, result.summary()
    assert result.p_value >= ALPHA
    assert result.detectable_tv < 0.12, result.summary()  # the check has power
    if SETTINGS[setting][5] == "top":
        assert result.settings["eos"] == [_most_likely_first_token(target)] != [eos]
    elif SETTINGS[setting][5]:
        assert result.settings["eos"] == [eos]
    if drafter is not None:  # drafts were both accepted and rejected: every verification path ran
        assert 0 < result.accepted < result.drafted, result.summary()
    if isinstance(drafter, specdec.DraftModel) and not isinstance(drafter, specdec.SelfDraft) and setting == "T1.0-g2-L3":
        # the perturbed draft: partial acceptance, so rejection and recovery paths ran a lot (a self-draft is the
        # target itself quantized: rejections are rarer, and `accepted < drafted` above says they happened)
        assert 0.1 < result.acceptance_rate < 0.95, result.summary()


#: bfloat16: every method once more, on the setting with top-k and top-p, at its own lower level (so that the
#: family-wise bound holds with them; the power assertion still holds at N draws).
BF16_SETTING = "T1.5-top6-p0.8-g5-L3-eos"


@pytest.fixture(scope="module")
def bf16_pair(pair):
    target, draft, eos = pair
    return copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(draft).to(torch.bfloat16), eos


@positive(alpha=BF16_ALPHA)
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_is_exact_in_bfloat16(bf16_pair, name):
    """The same sampling exactness with the models in bfloat16 (logits, probabilities and the rule in float:
    low precision changes the distribution's values, never whether the sampler matches it)."""
    target, draft, _ = bf16_pair
    drafter, extra = build(name, target, draft)
    result = _check(target, drafter, BF16_SETTING, method=name, alpha=BF16_ALPHA, **extra)
    assert result.passed, result.summary()
    assert result.p_value >= BF16_ALPHA
    assert result.detectable_tv < 0.12, result.summary()
    if drafter is not None:
        assert 0 < result.accepted < result.drafted, result.summary()


@positive()
def test_conditional_mode_with_a_larger_vocabulary():
    """V=64, 3 tokens: 262 144 continuations, too many to enumerate; per-prefix next-token tests instead."""
    target = tiny("llama", hidden=16, layers=2, vocab=64, seed=5)
    draft = perturbed(target, 0.3, seed=6)
    result = check_exactness(target, [7, 8, 9], specdec.DraftModel(draft), gamma=2, temperature=1.0, top_p=0.9,
                             max_new_tokens=3, samples=N, seed=99, alpha=ALPHA, eos_token_id=[])
    assert result.mode == "conditional"
    assert result.passed, result.summary()
    assert 0.1 < result.acceptance_rate < 0.95
    assert result.test.n > 2.9 * N  # every drawn token is an observation


# -------------------------------------------------------------------------------------- negative controls

FAR_SEED = 17


@pytest.fixture(scope="module")
def far_draft(pair):
    """An unrelated draft model: acceptance around 0.3, so rejections (and residual sampling) are frequent."""
    return tiny("llama", hidden=16, layers=2, vocab=VOCAB, seed=FAR_SEED)


NEGATIVE = {
    # name: (verify_fn name, which draft, setting)
    "no_residual": ("no_residual", "far", "T1.0-g2-L3"),
    "residual_abs": ("residual_abs", "far", "T1.0-g2-L3"),
    "residual_unnormalised": ("residual_unnormalised", "far", "T1.0-g2-L3"),
    "accepted_off_by_one": ("accepted_off_by_one", "far", "T1.0-g2-L3"),
    # full acceptance must be frequent for the bonus token to matter: the close draft
    "bonus_wrong_position": ("bonus_wrong_position", "near", "T1.0-g2-L3"),
    # warping on one side only only matters away from T=1 and without truncation being trivial
    "target_unwarped": ("target_unwarped", "far", "T0.5-top4-g3-L4-eos"),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_negative_control_is_caught(pair, far_draft, name):
    target, near, _ = pair
    fn, which, setting = NEGATIVE[name]
    draft = far_draft if which == "far" else near
    result = _check(target, specdec.DraftModel(draft), setting, verify_fn=FAULTY_VERIFIERS[fn])
    assert not result.passed
    assert result.p_value < NEGATIVE_P, result.summary()
    assert result.tv > result.test.tv_null_mean  # more deviation than an exact sampler shows on average


def test_negative_control_in_bfloat16_is_caught(bf16_pair, far_draft):
    """The bfloat16 checks have teeth: the rule without its residual is caught there too."""
    target, _, _ = bf16_pair
    draft = copy.deepcopy(far_draft).to(torch.bfloat16)
    result = _check(target, specdec.DraftModel(draft), BF16_SETTING, verify_fn=FAULTY_VERIFIERS["no_residual"],
                    alpha=BF16_ALPHA)
    assert not result.passed
    assert result.p_value < NEGATIVE_P, result.summary()


@pytest.mark.slow
def test_negative_control_on_the_fast_path_is_caught(pair, far_draft):
    """On the slot cache the default rule runs inside the target's pass; a verify_fn still replaces it
    (~90 s: the memo engine does not serve the slot cache, so every draw runs the models)."""
    target, _, _ = pair
    result = _check(target, specdec.DraftModel(far_draft), "T1.0-g2-L3", verify_fn=FAULTY_VERIFIERS["no_residual"],
                    compile="static")
    assert result.p_value < NEGATIVE_P, result.summary()


def test_negative_control_unwarped_draft_is_caught(pair, far_draft):
    """The drafter samples from its unwarped distribution but reports the warped one."""
    target, _, _ = pair
    result = _check(target, UnwarpedDraft(far_draft), "T0.5-top4-g3-L4-eos")
    assert result.p_value < NEGATIVE_P, result.summary()


def test_negative_control_unmapped_draft_vocabulary_is_caught(pair, far_draft):
    """The drafter draws from its reduced vocabulary but reports q by head column, not by token id."""
    target, _, _ = pair
    vocab = range(1, far_draft.get_output_embeddings().weight.shape[0], 2)  # odd ids: column j is token 2j + 1
    result = _check(target, UnmappedDraftVocab(far_draft, draft_vocab=vocab), "T0.5-top4-g3-L4-eos")
    assert result.p_value < NEGATIVE_P, result.summary()


def test_negative_control_block_marginals_read_off_by_one_are_caught(pair):
    """A one-pass block drafter (DFlash, PARD) that reports the next position's marginal as a token's q."""
    target, draft, _ = pair
    head = specdec.DFlashHead.init(target, seed=0, block_size=6)
    with torch.no_grad():  # untrained offsets' marginals are close (p ~ 0.05 for the bug): make them differ, as
        head.mask_embedding.mul_(4)  # a trained head's do
    result = _check(target, ShiftedMarginalBlockDraft(target, head), "T1.5-top6-p0.8-g5-L3-eos")
    assert result.p_value < NEGATIVE_P, result.summary()
    model = specdec.ParallelDraft.adapt(draft)
    with torch.no_grad():  # an untrained mask row is the mean embedding: its rows' marginals barely differ
        rows = model.get_input_embeddings().weight
        rows[-1] = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0), dtype=rows.dtype) * (
            3 * rows[:-1].std())
    result = _check(target, ShiftedMarginalParallelDraft(model), "T1.5-top6-p0.8-g5-L3-eos")
    assert result.p_value < NEGATIVE_P, result.summary()


def test_negative_control_in_conditional_mode():
    target = tiny("llama", hidden=16, layers=2, vocab=64, seed=5)
    far = tiny("llama", hidden=16, layers=2, vocab=64, seed=FAR_SEED)
    result = check_exactness(target, [7, 8, 9], specdec.DraftModel(far), gamma=2, temperature=1.0, top_p=0.9,
                             max_new_tokens=3, samples=N, seed=99, alpha=ALPHA, eos_token_id=[],
                             verify_fn=FAULTY_VERIFIERS["no_residual"])
    assert result.mode == "conditional"
    assert result.p_value < NEGATIVE_P, result.summary()


def test_greedy_is_a_point_mass_and_a_wrong_token_is_impossible(pair):
    target, draft, _ = pair
    ok = check_exactness(target, PROMPT, specdec.DraftModel(draft), gamma=3, temperature=0.0, max_new_tokens=4,
                         samples=50, eos_token_id=[])
    assert ok.passed and ok.test.cells == 1 and ok.tv == 0.0

    def flip_last(draft_tokens, draft_probs, target_logits, sampling, generator):
        verdict = specdec.engine.verification.verify_round(draft_tokens, draft_probs, target_logits, sampling, generator)
        return type(verdict)(verdict.num_accepted, (verdict.next_token + 1) % VOCAB, verdict.outcome)

    bad = check_exactness(target, PROMPT, specdec.DraftModel(draft), gamma=3, temperature=0.0, max_new_tokens=4,
                          samples=50, eos_token_id=[], verify_fn=flip_last)
    assert not bad.passed and bad.test.impossible == 50 and bad.p_value == 0.0


# ------------------------------------------------------------------------------ reference and engine


def test_enumeration_sums_to_one_and_respects_eos_and_the_cut(pair):
    target, _, eos = pair
    for sampling, max_new in [(SamplingConfig(1.0), 3), (SamplingConfig(0.7, 3, 0.9), 4)]:
        enum = enumerate_continuations(target, PROMPT, sampling, {eos}, max_new)
        assert abs(enum.probs.sum() - 1.0) < 1e-12
        assert (enum.probs > 0).all()
        for seq in enum.sequences:
            assert 1 <= len(seq) <= max_new
            assert eos not in seq[:-1]
            assert len(seq) == max_new or seq[-1] == eos
        if sampling.top_k:
            assert len(enum) <= sampling.top_k ** max_new
    # No EOS: exactly the V^L sequences of length L.
    enum = enumerate_continuations(target, PROMPT, SamplingConfig(1.0), set(), 2)
    assert sorted(enum.sequences) == list(itertools.product(range(VOCAB), repeat=2))


def test_enumeration_probabilities_match_incremental_decoding(pair):
    """Each continuation's probability equals the product of warped conditionals computed independently,
    one token at a time through the decoder's KV-cached model adapter."""
    from specdec.runtime.causal_lm import CachedCausalLM

    target, _, eos = pair
    sampling = SamplingConfig(0.8, 5, 0.95)
    enum = enumerate_continuations(target, PROMPT, sampling, {eos}, 3)
    lm = CachedCausalLM(target)
    rng = np.random.default_rng(0)
    with torch_threads(1):
        for i in rng.choice(len(enum), size=12, replace=False):
            _check_one(lm, sampling, enum.sequences[i], enum.probs[i])


def _check_one(lm, sampling, seq, expected):
    """P(seq) as the product of warped conditionals, one token per forward."""
    lm.reset()
    lm.prefill(torch.tensor(PROMPT[:-1]))
    logits = lm.forward(torch.tensor(PROMPT[-1:]))
    prob = 1.0
    for token in seq:
        prob *= float(sampling.warp(logits)[0, token])
        logits = lm.forward(torch.tensor([token]))
    assert expected == pytest.approx(prob, rel=1e-9)


def test_memo_engine_draws_what_real_forwards_draw(pair):
    """Same seed, float64: the memo engine and real KV-cached forwards give the same continuations."""
    target, draft, _ = pair
    runs = {}
    for engine in ("memo", "cache"):
        drafter = specdec.DraftModel(draft)

        def make():
            return specdec.SpeculativeDecoder(target, drafter, gamma=3, max_new_tokens=4, temperature=1.0, seed=5,
                                              eos_token_id=[])

        runs[engine] = draw(make, PROMPT, 60, models=find_models(target, drafter), engine=engine)
    assert runs["memo"].engine == "memo" and runs["cache"].engine == "cache"
    assert runs["memo"].sequences == runs["cache"].sequences
    assert runs["memo"].accepted == runs["cache"].accepted
    assert "forward" not in target.__dict__ and "forward" not in draft.__dict__  # unpatched afterwards


def _memo_and_cache_draws(pair, name):
    """The same 60 seeded draws of method `name` through the memo engine and through real forwards: ({engine:
    draws}, {engine: the type of the target adapter's cache after the draws})."""
    target, draft, _ = pair
    runs, caches = {}, {}
    for engine in ("memo", "cache"):
        drafter, options = build(name, target, draft)
        decoders = []

        def make():
            decoders.append(specdec.SpeculativeDecoder(target, drafter, max_new_tokens=4, temperature=1.0, seed=5,
                                                       eos_token_id=[], **{"gamma": 3, **options}))
            return decoders[-1]

        runs[engine] = draw(make, PROMPT, 60, models=find_models(target, drafter), engine=engine)
        caches[engine] = type(decoders[-1].target.cache)
    return runs, caches


@pytest.mark.parametrize("name", ["plain-static", "draft-model-static", "draft-tree-static"])
def test_memo_engine_answers_the_slot_cache(pair, name):
    """compile="static": the memo answers the slot cache's masked calls (its caches become SlotTokens), and
    draws what real forwards on the slot cache draw, same seed, float64."""
    runs, caches = _memo_and_cache_draws(pair, name)
    assert runs["memo"].engine == "memo" and caches["memo"] is SlotTokens and caches["cache"] is not SlotTokens
    assert runs["memo"].sequences == runs["cache"].sequences
    assert runs["memo"].accepted == runs["cache"].accepted


@pytest.mark.parametrize("name", ["eagle", "medusa", "eagle-static"])
def test_memo_engine_answers_the_target_s_hidden_states(pair, name):
    """Heads read the target's features: the memo answers those calls too (the target's cache becomes a memo
    one), and draws what real forwards draw, same seed, float64."""
    runs, caches = _memo_and_cache_draws(pair, name)
    assert runs["memo"].engine == "memo" and caches["memo"] in (TokenCache, SlotTokens)
    assert caches["cache"] not in (TokenCache, SlotTokens)
    assert runs["memo"].sequences == runs["cache"].sequences
    assert runs["memo"].accepted == runs["cache"].accepted


@positive()  # does not assert PASS; counted anyway
def test_result_to_dict_is_json(pair):
    target, draft, _ = pair
    result = check_exactness(target, PROMPT, specdec.DraftModel(draft), gamma=2, max_new_tokens=2, samples=200,
                             eos_token_id=[], alpha=ALPHA)
    data = json.loads(json.dumps(result.to_dict()))
    for key in ("method", "settings", "samples", "p_value", "tv", "tv_ci", "detectable_tv", "verdict"):
        assert key in data
    assert data["verdict"] in ("PASS", "FAIL") and data["samples"] == 200


# ----------------------------------------------------------------------------------------- statistics


def test_pearson_p_value_is_uniform_under_the_null():
    rng = np.random.default_rng(2024)
    probs = rng.dirichlet(np.full(40, 0.5))
    pvals = np.array([multinomial_test(rng.multinomial(600, probs), probs, alpha=1e-3, rng=rng).p_value
                      for _ in range(500)])
    assert stats.kstest(pvals, "uniform").pvalue > 1e-3
    assert 0.02 <= (pvals < 0.05).mean() <= 0.09


def test_pooled_conditional_p_value_is_uniform_under_the_null():
    """Observations from many different distributions (one per 'prefix'), pooled into one group."""
    rng = np.random.default_rng(7)
    dists = rng.dirichlet(np.ones(6), size=300)  # 300 prefixes, 6 tokens
    counts = rng.integers(1, 6, size=300)
    mean = counts @ dists
    cov = np.diag(mean) - (dists * counts[:, None]).T @ dists
    pvals = []
    for _ in range(400):
        observed = np.zeros(6)
        for d, c in zip(dists, counts):
            observed += rng.multinomial(c, d)
        pvals.append(pooled_conditional_test([Group(observed, mean, cov)], alpha=1e-3, rng=rng).p_value)
    assert stats.kstest(pvals, "uniform").pvalue > 1e-3


def test_pooling_keeps_expected_counts_at_least_five():
    rng = np.random.default_rng(1)
    expected = rng.exponential(3.0, size=200)
    expected[:5] = 0.0
    labels = pool_cells(expected)
    assert (labels[:5] == -1).all()
    sums = np.bincount(labels[labels >= 0], weights=expected[labels >= 0])
    assert (sums >= 5.0).all()


def test_power_is_monotone_in_n_and_matches_simulation():
    for df in (1, 10, 300):
        tvs = [detectable_tv(n, df, 1e-4) for n in (100, 1000, 10_000, 100_000)]
        assert all(a > b for a, b in zip(tvs, tvs[1:]))
        powers = [power_at(0.05, n, df, 1e-4) for n in (100, 1000, 10_000, 100_000)]
        assert all(a <= b for a, b in zip(powers, powers[1:]))
        assert power_at(detectable_tv(5000, df, 1e-4), 5000, df, 1e-4) == pytest.approx(0.8, abs=1e-6)
    # Simulation: the worst-case deviation of TV = detectable_tv (mass moved in proportion to p between
    # two halves of the mass) is detected in about 80% of runs at alpha = 1e-3.
    rng = np.random.default_rng(3)
    probs = np.full(20, 1 / 20)
    n, alpha = 2000, 1e-3
    delta = detectable_tv(n, len(probs) - 1, alpha)
    alt = probs * np.where(np.arange(20) < 10, 1 + 2 * delta, 1 - 2 * delta)
    assert 0.5 * np.abs(alt - probs).sum() == pytest.approx(delta)
    hits = np.mean([multinomial_test(rng.multinomial(n, alt), probs, alpha=alpha, rng=rng).p_value < alpha
                    for _ in range(400)])
    assert 0.7 <= hits <= 0.92


def test_impossible_outcomes_fail_with_p_zero():
    probs = np.array([0.5, 0.5, 0.0])
    result = multinomial_test(np.array([50, 49, 1]), probs, alpha=1e-4)
    assert result.p_value == 0.0 and result.impossible == 1


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory, pair):
    target, draft, _ = pair
    root = tmp_path_factory.mktemp("verify")
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root


@positive(checks=2)
def test_cli_verify_json_and_exit_code(saved_pair, capsys):
    from specdec.cli import main

    rc = main(["verify", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
               "--drafter", "draft", "--drafter", "plain", "--prompt-ids", "1,2,3", "--samples", "400",
               "--top-k", "5", "--eos", "none", "--dtype", "float64", "--alpha", str(ALPHA), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["passed"]
    assert [r["method"] for r in out["results"]] == ["draft", "plain"]
    assert out["results"][0]["settings"]["top_k"] == 5


def test_cli_verify_table_and_failure_exit_code(saved_pair, capsys, monkeypatch):
    import specdec.exactness as exactness
    from specdec.cli import main

    real = exactness.check_exactness

    def broken(*args, **kwargs):
        return real(*args, verify_fn=FAULTY_VERIFIERS["no_residual"], **kwargs)

    monkeypatch.setattr(exactness, "check_exactness", broken)
    rc = main(["verify", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
               "--prompt-ids", "1,2,3", "--samples", "1500", "--max-new-tokens", "2", "--dtype", "float64"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in out and "draft" in out
