"""Model-free and self-speculative drafters (PromptLookup, Bigram, LayerSkip) and adaptive draft lengths."""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from models import ScriptedLM, hf_greedy, one_hot_table, tiny

import specdec
from specdec.core.sampling import SamplingConfig
from specdec.core.stats import DecodeStats
from specdec.drafters import DRAFTER_KINDS, make_drafter
from specdec.drafters.layer_skip import shallow_layer_view
from specdec.engine.adaptive import AdaptiveGamma, HeuristicGamma

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
LAYERS = 4
NEW = 24
# Prompts with repeats, so that prompt lookup finds matches in the prompt (and in looping output).
PROMPTS = {
    "repeats": [5, 6, 7, 8, 9, 10] * 3 + [5, 6],
    "mixed": ([(i * 37 + 11) % 96 for i in range(12)] * 3)[:30],
}
GREEDY = SamplingConfig(0.0)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine 2 threads can be ~50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def targets():
    return {arch: tiny(arch, hidden=32, layers=LAYERS) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(targets):
    """(arch, prompt name) -> transformers' greedy continuation, which plain decoding reproduces."""
    refs = {}
    for arch, model in targets.items():
        for name, prompt in PROMPTS.items():
            refs[arch, name] = hf_greedy(model, prompt, NEW)
            assert specdec.generate(model, prompt, max_new_tokens=NEW).tokens == refs[arch, name]
    return refs


def greedy(target, prompt, drafter, gamma, max_new_tokens=NEW):
    return specdec.generate(target, prompt, drafter=drafter, gamma=gamma, max_new_tokens=max_new_tokens)


DRAFTERS = {
    "prompt-lookup": lambda target: specdec.PromptLookup(max_ngram=3, min_ngram=1),
    "bigram": lambda target: specdec.Bigram.from_model(target),
    "layer-skip": lambda target: specdec.LayerSkip(target, num_layers=LAYERS - 1),
}
#: Variants run on every architecture too, with fewer draft lengths.
VARIANTS = {
    "prompt-lookup-2-4": lambda target: specdec.PromptLookup(max_ngram=4, min_ngram=2, extend_periodic=False),
    "bigram-corpus": lambda target: specdec.Bigram.from_corpus(
        [PROMPTS["mixed"], [(i * 7) % 96 for i in range(200)]], vocab_size=96, smoothing=0.5),
    "layer-skip-1": lambda target: specdec.LayerSkip(target, num_layers=1),
}


# -- greedy equality ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", sorted(DRAFTERS) + sorted(VARIANTS))
def test_greedy_equals_plain_and_transformers(targets, references, arch, kind):
    """Token-identical to plain decoding and to transformers' greedy generate, for several γ (float64)."""
    target = targets[arch]
    if kind in DRAFTERS:
        drafter = DRAFTERS[kind](target)
        runs = [("repeats", 1), ("repeats", 4), ("mixed", 2), ("mixed", 6), ("mixed", "auto")]
    else:
        drafter = VARIANTS[kind](target)
        runs = [("repeats", 3), ("mixed", 5)]
    for name, gamma in runs:
        out = greedy(target, PROMPTS[name], drafter, gamma)  # the drafter is reused: reset() per request
        assert out.tokens == references[arch, name], (kind, name, gamma)
        assert out.stats.drafted > 0, (kind, name, gamma)  # not vacuous


def test_prompt_lookup_gets_partial_acceptances(targets, references):
    accepted = drafted = partial_rounds = 0
    for arch, target in targets.items():
        for name, prompt in PROMPTS.items():
            out = greedy(target, prompt, specdec.PromptLookup(), 4)
            assert out.tokens == references[arch, name]
            s = out.stats
            accepted, drafted = accepted + s.accepted, drafted + s.drafted
            partial_rounds += s.recovered
    assert 0 < accepted < drafted and partial_rounds > 0


def test_prompt_lookup_on_a_looping_target_accepts_most():
    # A scripted target that repeats a 5-token cycle: after one cycle, lookup drafts are all right.
    cycle = [1, 2, 3, 4, 5]
    target = ScriptedLM(one_hot_table(cycle * 20), vocab_size=8)
    out = greedy(target, [1, 2], specdec.PromptLookup(), 4, max_new_tokens=40)
    assert out.tokens == (cycle * 20)[2:42]
    assert out.stats.acceptance_rate > 0.8


# -- n-gram matching -----------------------------------------------------------------------------------
def lookup(context, gamma=4, **kw):
    drafter = specdec.PromptLookup(**kw)
    drafter.reset(torch.tensor(context, dtype=torch.long))
    return drafter.propose(torch.tensor(context, dtype=torch.long), gamma, GREEDY, None).tokens.tolist()


def reference_lookup(tokens, gamma, max_ngram, min_ngram, periodic=True):
    """Brute force: longest n first, most recent earlier occurrence with a follower."""
    length = len(tokens)
    for n in range(min(max_ngram, length), min_ngram - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                ext = list(tokens)
                while len(ext) < end + gamma:
                    ext.append(ext[len(ext) - (length - end)] if periodic else None)
                return [t for t in ext[end:end + gamma] if t is not None]
    return []


@pytest.mark.parametrize(
    ("context", "kw", "expected"),
    [
        ([1, 2, 3, 4], {}, []),  # no match: the last token never appeared before
        ([5], {}, []),  # context shorter than any n-gram with a follower
        ([], {}, []),
        ([1, 5, 1], {"min_ngram": 2}, []),  # only a 1-gram matches, but n >= 2 is required
        ([1, 2, 3, 1, 2], {}, [3, 1, 2, 3]),  # 2-gram (1, 2) matched; its continuation runs periodically
        ([1, 2, 3, 1, 2], {"extend_periodic": False}, [3, 1, 2]),  # stops where the context ends
        ([7, 7], {}, [7, 7, 7, 7]),  # match right before the end (overlapping): period 1
        ([7, 7], {"extend_periodic": False}, [7]),
        ([1, 2, 1, 2, 1], {}, [2, 1, 2, 1]),  # overlapping 3-gram (1, 2, 1)
        ([1, 5, 1, 6, 1], {}, [6, 1, 6, 1]),  # the most recent occurrence wins
        ([1, 2, 3, 9, 4, 3, 8, 1, 2, 3], {}, [9, 4, 3, 8]),  # longest n preferred over a more recent 1-gram
        ([1, 2, 3, 9, 4, 3, 8, 1, 2, 3], {"max_ngram": 1}, [8, 1, 2, 3]),
        ([1, 2, 3, 9, 4, 3, 8, 1, 2, 3], {"num_pred_tokens": 2}, [9, 4]),
    ],
)
def test_ngram_matching(context, kw, expected):
    assert lookup(context, **kw) == expected


def test_incremental_index_matches_brute_force():
    rng = random.Random(0)
    for periodic in (True, False):
        tokens = [rng.randrange(4) for _ in range(6)]
        drafter = specdec.PromptLookup(max_ngram=3, min_ngram=1, extend_periodic=periodic)
        drafter.reset(torch.tensor(tokens))
        for _ in range(60):
            context = torch.tensor(tokens)
            got = drafter.propose(context, 5, GREEDY, None).tokens.tolist()
            assert got == reference_lookup(tokens, 5, 3, 1, periodic), tokens
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 4))]  # a round commits 1..3 tokens
            drafter.commit(torch.tensor(tokens), 0)


def test_prompt_lookup_is_a_point_mass_at_any_temperature():
    context = torch.tensor([1, 2, 3, 1, 2])
    drafter = specdec.PromptLookup()
    drafter.reset(context)
    proposal = drafter.propose(context, 3, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert proposal.tokens.tolist() == [3, 1, 2] and proposal.draft_probs is None


def _lines_run_in(module_file: str, fn) -> int:
    """How many lines of `module_file` run during fn(): a count of work that no machine load changes."""
    import sys

    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == module_file else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def test_prompt_lookup_round_cost_does_not_grow_with_context():
    """A round (propose + commit) runs the same amount of drafter code at a context of 256 or 4096 tokens:
    the n-gram index is extended, never rebuilt or scanned. Counted in lines executed, not timed."""
    import specdec.drafters.prompt_lookup as module

    rng = random.Random(1)
    work = {}
    for length in (256, 4096):
        tokens = torch.tensor([rng.randrange(50) for _ in range(length)])
        drafter = specdec.PromptLookup()
        drafter.reset(tokens[: length - 64])

        def rounds(drafter=drafter, tokens=tokens, length=length):
            for n in range(length - 64, length):
                drafter.propose(tokens[:n], 8, GREEDY, None)
                drafter.commit(tokens[: n + 1], 0)

        work[length] = _lines_run_in(module.__file__, rounds) / 64
    assert 10 < work[256] < 200  # lines per round: a handful of dict operations per n-gram size
    assert work[4096] < 1.2 * work[256]  # O(1) per round, not O(context)


@pytest.mark.parametrize(("kw", "words"), [({"max_ngram": 0}, "max_ngram"), ({"min_ngram": 4}, "min_ngram"),
                                           ({"num_pred_tokens": 0}, "num_pred_tokens")])
def test_prompt_lookup_bad_options(kw, words):
    with pytest.raises(specdec.ConfigError, match=words):
        specdec.PromptLookup(**kw)


# -- bigram --------------------------------------------------------------------------------------------
def test_bigram_from_corpus_counts():
    bigram = specdec.Bigram.from_corpus([0, 1, 0, 1, 2], vocab_size=3, smoothing=0.0)
    # pairs: (0,1) twice, (1,0), (1,2); token 2 is never followed -> uniform row
    expected = torch.tensor([[0, 1, 0], [0.5, 0, 0.5], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    assert torch.allclose(bigram.probs(torch.arange(3)).double(), expected, atol=1e-6)
    smoothed = specdec.Bigram.from_corpus([0, 1, 0, 1, 2], vocab_size=3, smoothing=1.0)
    expected = torch.tensor([[1, 3, 1], [2, 1, 2], [1, 1, 1]], dtype=torch.float64)
    expected /= expected.sum(-1, keepdim=True)  # (count + 1) / (row count + 3)
    assert torch.allclose(smoothed.probs(torch.arange(3)).double(), expected, atol=1e-6)
    # separate sequences: no pair across the boundary (1 -> 2 is not counted)
    split = specdec.Bigram.from_corpus([[0, 1], [2, 0]], vocab_size=3, smoothing=0.0)
    assert torch.allclose(split.probs(torch.tensor([0, 2])).double(),
                          torch.tensor([[0, 1, 0], [1, 0, 0]], dtype=torch.float64), atol=1e-6)
    # greedy chain: 0 -> 1 -> 0 (tie between 0 and 2 broken towards the lower id) -> 1
    proposal = bigram.propose(torch.tensor([0]), 3, GREEDY, None)
    assert proposal.tokens.tolist() == [1, 0, 1] and proposal.draft_probs is None


def test_bigram_sparse_top_k_and_save_load(tmp_path):
    sparse = specdec.Bigram.from_corpus([0, 1, 0, 1, 2], vocab_size=3, smoothing=0.0, top_k=1)
    assert sparse.is_sparse
    # row 1 keeps its top entry (0: 0.5); the other 0.5 is spread over the 2 remaining tokens
    assert torch.allclose(sparse.probs(torch.tensor([1])).double(),
                          torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(sparse.probs(torch.arange(3)).sum(-1), torch.ones(3))
    dense = specdec.Bigram.from_corpus([0, 1, 0, 1, 2], vocab_size=3, smoothing=0.3)
    for i, table in enumerate((dense, sparse)):
        path = tmp_path / f"b{i}.safetensors"
        table.save(path)
        loaded = specdec.Bigram.load(path)
        assert loaded.is_sparse == table.is_sparse
        assert torch.allclose(loaded.probs(torch.arange(3)), table.probs(torch.arange(3)), atol=1e-6)
    with pytest.raises(specdec.ConfigError):
        specdec.Bigram.load(tmp_path / "missing.safetensors")


def test_bigram_from_model_rows_are_the_targets_one_token_predictions(targets):
    target = targets["llama"]
    bigram = specdec.Bigram.from_model(target, batch_size=40)
    for token in (0, 17, 95):
        logits = target(torch.tensor([[token]])).logits[0, -1]
        assert torch.allclose(bigram.probs(torch.tensor([token]))[0].double(), torch.softmax(logits, -1),
                              atol=1e-5)
    sparse = specdec.Bigram.from_model(target, top_k=8)
    assert sparse.is_sparse
    assert torch.equal(sparse._argmax, bigram._argmax)


def test_bigram_samples_from_the_warped_table_it_returns():
    table = torch.softmax(torch.randn(10, 10, generator=torch.Generator().manual_seed(0)), -1)
    bigram = specdec.Bigram(table)
    sampling = SamplingConfig(0.7, top_k=5)
    proposal = bigram.propose(torch.tensor([3]), 4, sampling, torch.Generator().manual_seed(1))
    prev = torch.cat([torch.tensor([3]), proposal.tokens[:-1]])
    assert proposal.draft_probs.shape == (4, 10)
    assert torch.allclose(proposal.draft_probs, sampling.warp(table.log()[prev]), atol=1e-6)
    assert bool((proposal.draft_probs[torch.arange(4), proposal.tokens] > 0).all())


# -- layer skip ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS + ["gemma"])
def test_full_depth_view_reproduces_the_target(arch):
    target = tiny(arch, hidden=32, layers=3)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    view = shallow_layer_view(target, 3)
    assert torch.equal(view(ids).logits, target(ids).logits)
    shallow = shallow_layer_view(target, 1)
    assert not torch.allclose(shallow(ids).logits, target(ids).logits)


def _fade_last_layer(model, scale=1e-3):
    """A copy whose deepest layer barely writes to the residual stream (like a trained model's late layers)."""
    model = copy.deepcopy(model)
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    with torch.no_grad():
        for name, param in layers[-1].named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "attn.c_proj.weight", "mlp.c_proj.weight")):
                param.mul_(scale)
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_layer_skip_depth_drives_acceptance(arch):
    target = _fade_last_layer(tiny(arch, hidden=32, layers=LAYERS))
    prompt = PROMPTS["mixed"]
    deep = greedy(target, prompt, specdec.LayerSkip(target, num_layers=LAYERS - 1), 4, 32)
    shallow = greedy(target, prompt, specdec.LayerSkip(target, num_layers=1), 4, 32)
    assert deep.tokens == shallow.tokens == hf_greedy(target, prompt, 32)
    assert deep.stats.acceptance_rate > 0.9
    assert deep.stats.acceptance_rate > shallow.stats.acceptance_rate + 0.2


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_layer_skip_leaves_the_target_untouched(targets, references, arch):
    target = targets[arch]
    config_before = target.config.to_dict()
    layers_before = list(target.modules())
    ids = torch.tensor([PROMPTS["mixed"]])
    logits_before = target(ids).logits
    drafter = specdec.LayerSkip(target, num_layers=2)
    greedy(target, PROMPTS["mixed"], drafter, 3)
    assert target.config.to_dict() == config_before
    assert list(target.modules()) == layers_before
    assert torch.equal(target(ids).logits, logits_before)
    # Concurrently: the target generates on another thread while the drafter drafts.
    drafter.reset(ids[0])
    results = {}
    thread = threading.Thread(target=lambda: results.update(ref=hf_greedy(target, PROMPTS["mixed"], NEW)))
    thread.start()
    for _ in range(20):
        proposal = drafter.propose(ids[0], 3, GREEDY, None)
        drafter.commit(ids[0], 0)
    thread.join()
    assert results["ref"] == references[arch, "mixed"]
    assert len(proposal) == 3


def test_layer_skip_at_temperature_returns_its_warped_probs(targets):
    target = targets["llama"]
    drafter = specdec.LayerSkip(target, num_layers=2)
    context = torch.tensor(PROMPTS["mixed"])
    drafter.reset(context)
    sampling = SamplingConfig(0.8, top_p=0.9)
    proposal = drafter.propose(context, 3, sampling, torch.Generator().manual_seed(0))
    assert proposal.draft_probs.shape == (3, 96)
    first = sampling.warp(shallow_layer_view(target, 2)(context[None]).logits[0, -1:])
    assert torch.allclose(proposal.draft_probs[:1], first, atol=1e-9)


@pytest.mark.parametrize("num_layers", [0, LAYERS, -1, True, 1.5])
def test_layer_skip_bad_depth(targets, num_layers):
    with pytest.raises(specdec.ConfigError, match="num_layers"):
        specdec.LayerSkip(targets["llama"], num_layers=num_layers)


def test_layer_skip_unsupported_models():
    with pytest.raises(specdec.UnsupportedModelError, match="decoder layers"):
        specdec.LayerSkip(ScriptedLM(one_hot_table([1, 2]), vocab_size=8))
    with pytest.raises(specdec.ConfigError, match="at least 2"):
        specdec.LayerSkip(tiny("llama", layers=1))


# -- make_drafter / CLI --------------------------------------------------------------------------------
def test_make_drafter_builds_every_kind(targets, tmp_path):
    target = targets["llama"]
    assert set(DRAFTER_KINDS) == {"draft", "prompt-lookup", "bigram", "layer-skip", "draft-tree", "multi-draft",
                                  "eagle", "eagle-chain", "medusa", "medusa-chain", "draft-tli", "draft-slem",
                                  "multi-draft-specinfer", "multi-draft-spectr", "eagle3", "eagle3-chain",
                                  "draft-vocab", "self-draft-int8", "self-draft-int4", "self-draft-w4a8",
                                  "self-draft-w8a8", "mtp", "mtp-tree", "suffix", "dflash", "dflash-tree",
                                  "parallel"}  # mtp: tests/test_mtp.py
    suffix = make_drafter("suffix", max_nodes=7, tree_depth=5, suffix_cache_tokens=100)
    assert (suffix.max_nodes, suffix.max_depth, suffix.cache.max_tokens) == (7, 5, 100)
    tree = make_drafter("draft-tree", draft=target, tree_top_k=2, tree_depth=3, max_nodes=7)
    assert (tree.top_k, tree.depth, tree.max_nodes) == (2, 3, 7)
    assert make_drafter("multi-draft", draft=target, num_drafts=5, replacement=False).num_drafts == 5
    assert make_drafter("multi-draft-spectr", draft=target, widths=(2, 3)).scheme == "spectr"
    assert make_drafter("multi-draft-specinfer", draft=target, num_drafts=2).replacement
    lookup_drafter = make_drafter("prompt-lookup", target=target, ngram_max=4, ngram_min=2)
    assert (lookup_drafter.max_ngram, lookup_drafter.min_ngram) == (4, 2)
    assert make_drafter("layer-skip", target=target, draft_layers=3).num_layers == 3
    float_target = tiny("llama", hidden=64, layers=2, dtype=torch.float32)
    for weights in ("int8", "int4", "w4a8", "w8a8"):
        self_draft = make_drafter(f"self-draft-{weights}", target=float_target)
        assert isinstance(self_draft, specdec.SelfDraft) and self_draft.weights == weights
        assert self_draft.draft_vocab is None  # the whole vocabulary unless --draft-vocab says otherwise
    reduced = make_drafter("self-draft-w4a8", target=float_target, draft_vocab=[3, 1, 40])
    assert reduced.draft_vocab.tolist() == [1, 3, 40] and reduced.model.get_output_embeddings().out_features == 3
    with pytest.raises(specdec.ConfigError, match="96 token rows"):  # the default ranking fits no 96-token model
        make_drafter("self-draft-int8", target=float_target, draft_vocab=64)
    bigram = make_drafter("bigram", target=target)
    bigram.save(tmp_path / "t.safetensors")
    loaded = make_drafter("bigram", bigram_path=str(tmp_path / "t.safetensors"))
    assert torch.equal(loaded._argmax, bigram._argmax)
    with pytest.raises(specdec.ConfigError, match="--ngram-max"):
        make_drafter("layer-skip", target=target, ngram_max=3)
    with pytest.raises(specdec.ConfigError, match="unknown drafter"):
        make_drafter("hydra", target=target)


def test_cli_generate_with_each_drafter(tmp_path, capsys):
    from models import tiny_tokenizer

    from specdec.cli import main as cli_main

    tok = tiny_tokenizer()
    model = tiny("llama", vocab=len(tok), layers=3, dtype=torch.float32)
    model.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    base = ["generate", "--target", str(tmp_path / "t"), "--prompt", "x = x + 1\nx = x + 1\n",
            "--max-new-tokens", "6"]
    for extra in (["--drafter", "prompt-lookup", "--ngram-max", "2"], ["--drafter", "bigram"], ["--drafter", "suffix"],
                  ["--drafter", "layer-skip", "--draft-layers", "2", "--gamma", "auto"],
                  ["--drafter", "self-draft-int8"], ["--drafter", "self-draft-w4a8", "--draft-vocab", "64"],
                  ["--drafter", "prompt-lookup", "--weights", "int4"]):
        assert cli_main(base + extra) == 0, extra
        assert "τ=" in capsys.readouterr().err
    assert cli_main(base + ["--drafter", "bigram", "--draft-layers", "2"]) == 2
    assert "--draft-layers" in capsys.readouterr().err


def test_cli_generate_drafts_from_a_reduced_vocabulary_on_the_default_pair(capsys):
    from specdec.cli import main as cli_main
    from specdec.hub.default_pair import assets_present

    if not assets_present():
        pytest.skip("the shipped default pair is not installed")
    base = ["generate", "--prompt", "def add(a, b):\n", "--max-new-tokens", "8", "--drafter", "draft-vocab"]
    assert cli_main(base + ["--draft-vocab", "1024"]) == 0
    assert "τ=" in capsys.readouterr().err
    assert cli_main(base + ["--draft-vocab", "9000"]) == 2
    assert "1..8192" in capsys.readouterr().err


# -- adaptive draft length -----------------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def simulate(policy, rounds, accept, draft_cost, target_cost=1.0, stats=None):
    """Drive a policy with synthetic rounds: accept(gamma) -> accepted count; draft_cost per drafted token
    (a number, or a function of the round number). Returns the chosen γs."""
    stats = stats or DecodeStats()
    clock = policy.clock if isinstance(getattr(policy, "clock", None), FakeClock) else FakeClock()
    if hasattr(policy, "clock"):
        policy.clock = clock
    chosen = []
    for _ in range(rounds):
        gamma = policy.choose(stats)
        chosen.append(gamma)
        k = accept(gamma)
        draft_s = gamma * (draft_cost(len(chosen)) if callable(draft_cost) else draft_cost)
        stats.draft_s += draft_s
        target_s = target_cost(gamma) if callable(target_cost) else target_cost
        stats.target_s += target_s
        clock.now += draft_s + target_s
        stats.record_round(gamma, k, "bonus" if k == gamma else "recovered")
        policy.update(stats)
        clock.now += 0.123  # time between rounds (emitting tokens) is not part of a round
    return chosen


# The policy itself (estimates, cost model, fallback, probing) is tested model-free in tests/test_adaptive.py.


def test_auto_gamma_through_the_decode_loop(targets, references):
    target = targets["llama"]
    policy = AdaptiveGamma()
    out = greedy(target, PROMPTS["repeats"], specdec.PromptLookup(), policy)
    assert out.tokens == references["llama", "repeats"]
    assert len(policy.chosen) == out.stats.rounds and out.stats.gammas[0] <= policy.initial
    assert policy.cost_ratio is not None


class _Never:
    def choose(self, stats):
        return 0

    def update(self, stats):
        pass


def test_a_policy_may_draft_nothing(targets, references):
    target = targets["gpt2"]
    out = greedy(target, PROMPTS["mixed"], specdec.LayerSkip(target, 2), _Never())
    assert out.tokens == references["gpt2", "mixed"]
    assert out.stats.drafted == 0 and out.stats.target_forwards == NEW


def test_heuristic_gamma_schedule():
    policy = HeuristicGamma(initial=5)
    pattern = iter([True, True, False, False, False, False, False, False, False, True])
    chosen = simulate(policy, 10, accept=lambda g: g if next(pattern) else 0, draft_cost=0.1)
    assert chosen == [5, 7, 9, 8, 7, 6, 5, 4, 3, 2]
    assert policy.gamma == 4


# -- a reduced draft vocabulary (DraftModel(draft_vocab=...)) ----------------------------------------------
VOCAB_IDS = [i for i in range(96) if i % 3]  # tiny()'s 96 tokens, less every third one


@pytest.fixture(scope="module")
def small_draft():
    return tiny("llama", hidden=16, layers=1, vocab=96, seed=3)


def test_reduced_head_scores_its_rows_and_leaves_the_draft_untouched(small_draft):
    from specdec.drafters.draft_model import reduced_head

    head = small_draft.get_output_embeddings()
    drafter = specdec.DraftModel(small_draft, draft_vocab=VOCAB_IDS)
    assert small_draft.get_output_embeddings() is head and head.weight.shape[0] == 96  # the draft as it was
    ids = torch.tensor([[4, 5, 7, 8]])
    with torch.no_grad():
        full = small_draft(ids).logits  # [1, 4, 96]
        reduced = drafter.model(ids).logits  # [1, 4, N]
    assert reduced.shape[-1] == len(VOCAB_IDS)
    torch.testing.assert_close(reduced, full[..., VOCAB_IDS])
    # one copy per model and vocabulary, shared by every drafter built on them (and so their compiled graphs)
    assert specdec.DraftModel(small_draft, draft_vocab=list(reversed(VOCAB_IDS))).model is drafter.model
    assert reduced_head(small_draft, torch.tensor(VOCAB_IDS)) is drafter.model
    assert specdec.DraftModel(small_draft, draft_vocab=[1, 2]).model is not drafter.model


@pytest.mark.parametrize("compile", [False, "static"])
def test_reduced_vocabulary_proposes_only_its_tokens_with_the_q_it_drew_from(small_draft, compile):
    """Greedy: the argmax over the vocabulary; T > 0: q is zero outside it and sums to 1 (eager and fast path)."""
    drafter = specdec.DraftModel(small_draft, draft_vocab=VOCAB_IDS, compile=compile)
    context = torch.tensor([4, 5, 6, 7, 8, 9])
    drafter.ensure_capacity(64)
    drafter.reset(context)
    greedy_tokens = drafter.propose(context, 5, GREEDY, None).tokens
    with torch.no_grad():
        logits = small_draft(context[None]).logits[0, -1]  # [96]
    assert int(greedy_tokens[0]) == VOCAB_IDS[int(logits[VOCAB_IDS].argmax())]
    drafter.reset(context)
    sampled = drafter.propose(context, 5, SamplingConfig(1.0, top_k=20), torch.Generator().manual_seed(0))
    outside = torch.ones(96, dtype=torch.bool)
    outside[VOCAB_IDS] = False
    assert all(int(t) in VOCAB_IDS for t in torch.cat([greedy_tokens, sampled.tokens]))
    assert sampled.draft_probs.shape == (5, 96)
    assert torch.all(sampled.draft_probs[:, outside] == 0)
    torch.testing.assert_close(sampled.draft_probs.sum(-1).double(), torch.ones(5, dtype=torch.float64))
    assert torch.all(sampled.draft_probs[torch.arange(5), sampled.tokens] > 0)


@pytest.mark.parametrize(("draft_vocab", "words"), [
    ([], "non-empty"), ([0.5, 1.5], "integer"), ([3, 96], "0..95"), ([-1, 3], "0..95"), ("abc", "sequence"),
])
def test_bad_draft_vocabulary_is_one_clear_error(small_draft, draft_vocab, words):
    with pytest.raises(specdec.ConfigError, match=words):
        specdec.DraftModel(small_draft, draft_vocab=draft_vocab)


def test_draft_vocab_kind_reads_the_default_ranking_and_refuses_other_widths(small_draft):
    from specdec.hub.default_pair import assets_present, frequent_tokens

    if not assets_present():
        pytest.skip("the shipped default pair is not installed")
    ids = frequent_tokens(2048)
    assert ids.shape == (2048,) and torch.all(ids[1:] > ids[:-1])  # ascending, distinct
    assert set(frequent_tokens(16).tolist()) <= set(ids.tolist())  # the ranking's head
    with pytest.raises(specdec.ConfigError, match="1..8192"):
        frequent_tokens(0)
    with pytest.raises(specdec.ConfigError, match="96 token rows"):
        make_drafter("draft-vocab", draft=small_draft)  # the default ranking does not fit a 96-token draft
    drafter = make_drafter("draft-vocab", draft=small_draft, draft_vocab=VOCAB_IDS)  # ids fit any draft
    assert drafter.draft_vocab.tolist() == VOCAB_IDS
    with pytest.raises(specdec.ConfigError, match="--draft-vocab does not apply to --drafter draft"):
        make_drafter("draft", draft=small_draft, draft_vocab=8)


def test_frequent_tokens_ranks_any_tokenizer_by_text_and_keeps_its_special_tokens():
    from collections import Counter

    from models import tiny_tokenizer

    tok = tiny_tokenizer()
    texts = ["for i in range(10):\n"] * 3 + ["def add(a, b):\n    return a + b\n"]
    counts = Counter(i for text in texts for i in tok(text, add_special_tokens=False)["input_ids"])
    eos = tok.eos_token_id
    assert eos not in counts and len(counts) > 6
    ids = specdec.frequent_tokens(tok, 6, texts=texts)
    ranked = sorted(counts, key=lambda i: (-counts[i], i))  # most frequent first, ties by id
    assert ids.tolist() == sorted([eos, *ranked[:5]])  # ascending; the end-of-sequence token kept
    offline = specdec.frequent_tokens(tok, 100)  # the interpreter's stdlib source and pydoc's topics
    assert offline.shape == (100,) and torch.all(offline[1:] > offline[:-1]) and int(offline[-1]) < len(tok)
    assert eos in offline.tolist()
    for bad in (0, len(tok) + 1, True):
        with pytest.raises(specdec.ConfigError, match=f"1..{len(tok)}"):
            specdec.frequent_tokens(tok, bad, texts=texts)
    with pytest.raises(specdec.ConfigError, match="no text"):
        specdec.frequent_tokens(tok, 6, texts=[])


def test_a_self_draft_of_another_tokenizer_drafts_from_its_frequent_tokens_with_plain_decodings_tokens():
    from models import tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny("llama", hidden=64, layers=2, vocab=len(tok), dtype=torch.float32)
    with pytest.raises(specdec.ConfigError, match="target_tokenizer=tokenizer"):  # no ranking without a tokenizer
        make_drafter("self-draft-w4a8", target=target, draft_vocab=64)
    drafter = make_drafter("self-draft-w4a8", target=target, draft_vocab=64, target_tokenizer=tok)
    assert drafter.draft_vocab.tolist() == specdec.frequent_tokens(tok, 64).tolist()
    assert drafter.model.get_output_embeddings().out_features == 64
    prompt = tok("def add(a, b):\n")["input_ids"]
    out = specdec.generate(target, prompt, drafter=drafter, gamma=3, max_new_tokens=16)
    assert out.tokens == hf_greedy(target, prompt, 16)


def test_a_reduced_vocabulary_with_another_tokenizer_is_refused(small_draft):
    from models import tiny_tokenizer

    with pytest.raises(specdec.ConfigError, match="target's tokenizer"):
        specdec.DraftModel(small_draft, tokenizer=tiny_tokenizer(300), target_tokenizer=tiny_tokenizer(280),
                           draft_vocab=[1, 2])
