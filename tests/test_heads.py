"""EAGLE and Medusa heads: greedy equality on four families, feature bookkeeping, checkpoints, training."""

from __future__ import annotations

import json

import pytest
import torch
from models import hf_greedy, tiny, tiny_tokenizer

import specdec
from specdec.drafters.medusa import DEFAULT_TREE
from specdec.errors import ConfigError, IncompatibleModelsError, ModelLoadError, UnsupportedModelError

ARCHS = ["llama", "qwen2", "mistral", "gemma"]
PROMPT = [(i * 37 + 11) % 96 for i in range(20)]


def drafters(target, tree=False):
    eagle = specdec.EagleHead.init(target, seed=0)
    medusa = specdec.MedusaHeads.init(target, num_heads=4, seed=0)
    if tree:
        return {"eagle": specdec.Eagle(target, eagle, top_k=3, depth=4, max_nodes=10),
                "medusa": specdec.Medusa(target, medusa, tree=DEFAULT_TREE)}
    return {"eagle": specdec.Eagle(target, eagle), "medusa": specdec.Medusa(target, medusa)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_untrained_heads_are_greedy_exact_on_each_family(arch, kind, tree):
    target = tiny(arch, hidden=32, layers=2)
    out = specdec.generate(target, PROMPT, drafter=drafters(target, tree)[kind], gamma=4, max_new_tokens=20)
    assert out.tokens == hf_greedy(target, PROMPT, 20)


def _peaked_target(seed=4):
    """Vocabulary of 8: an untrained head's drafts are accepted sometimes and rejected sometimes."""
    return tiny("llama", hidden=16, layers=2, vocab=8, seed=seed)


def _true_features(target, tokens, layers=None):
    """The target's final features [n, H], or (EAGLE-3) the given hidden-state indices side by side [n, 3H]."""
    with torch.no_grad():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return states[-1][0] if layers is None else torch.cat([states[i][0] for i in layers], dim=-1)


@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_eagle_head_only_ever_reads_target_features_of_committed_tokens(top_k, variant):
    """Scripted rollback: record every target-feature row fed to the head and the head's cache length
    after every commit; rows must be exactly the committed positions, in order, with the target's features
    (EAGLE-3: its three layers' features, fused, of exactly those positions)."""
    target = _peaked_target()
    prompt = [1, 2, 3, 4, 5]
    head = specdec.EagleHead.init(target, seed=0, variant=variant,
                                  feature_layers=(1, 0, 2) if variant == "eagle3" else None)  # low/mid/high, shuffled
    drafter = specdec.Eagle(target, head, top_k=top_k, depth=3, max_nodes=8)
    fed, cache_lengths = [], []
    real_catch_up, real_commit = drafter._catch_up, drafter.commit

    def catch_up(context):
        start, features = drafter.rows, drafter.pending.clone()
        out = real_catch_up(context)
        fed.append((start, features, context.clone()))
        return out

    def commit(context, k, hidden=None):
        real_commit(context, k, hidden=hidden)
        cache_lengths.append((drafter.cache.get_seq_length(), drafter.rows, context.shape[0]))

    drafter._catch_up, drafter.commit = catch_up, commit
    out = specdec.generate(target, prompt, drafter=drafter, gamma=3, max_new_tokens=30)
    assert out.tokens == hf_greedy(target, prompt, 30)
    assert 0 < out.stats.accepted < out.stats.drafted  # drafts were rejected: rollback ran
    full = _true_features(target, prompt + out.tokens, head.feature_layers)
    assert full.shape[1] == head.feature_size
    position = 0
    for start, features, context in fed:
        assert start == position  # no gap, no row fed twice
        n = context.shape[0]
        assert start + features.shape[0] == n - 1  # features of context[:n-1], nothing beyond
        torch.testing.assert_close(features, full[start : n - 1], rtol=1e-9, atol=1e-9)
        position = n - 1
    for cache_len, rows, n in cache_lengths:
        assert cache_len == rows  # no row computed from drafted (possibly rejected) features survives
        assert rows <= n - 2


def _recorded_proposals(target, head, mode, prompts, top_k, depth=4, max_nodes=10, new_tokens=30):
    """Every proposal (tokens, parents) of one Eagle over `prompts`, decoding with compile=`mode`."""
    drafter = specdec.Eagle(target, head, top_k=top_k, depth=depth, max_nodes=max_nodes)
    seen = []
    real = drafter.propose

    def propose(*args):
        proposal = real(*args)
        seen.append((proposal.tokens.tolist(), None if proposal.parents is None else proposal.parents.tolist()))
        return proposal

    drafter.propose = propose
    for prompt in prompts:
        out = specdec.generate(target, prompt, drafter=drafter, gamma=depth, max_new_tokens=new_tokens, compile=mode)
        assert out.tokens == hf_greedy(target, prompt, new_tokens)
        assert 0 < out.stats.accepted < out.stats.drafted  # partial acceptance: catch-up counts vary
    return seen


@pytest.mark.parametrize(("top_k", "variant"), [(1, "eagle"), (3, "eagle"), (3, "eagle3-reduced")],
                         ids=["chain", "tree", "eagle3-reduced-tree"])
def test_eagle_slot_cache_round_proposes_the_eager_trees(top_k, variant):
    """The fixed-shape round (slot cache, padded catch-up, masked tree levels) = the eager DynamicCache code;
    for EAGLE-3 with a reduced draft vocabulary too (fused catch-up features, -inf outside the vocabulary)."""
    target = _peaked_target().double()
    head = specdec.EagleHead.init(target, seed=0, variant=variant.split("-")[0])
    if variant == "eagle3-reduced":
        head = head.with_draft_vocab(target, [1, 2, 3, 5, 7])
    prompts = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [3, 1]]
    assert _recorded_proposals(target, head, "static", prompts, top_k) == \
        _recorded_proposals(target, head, False, prompts, top_k)


@pytest.mark.compile
def test_compiled_eagle_round_proposes_the_eager_trees_and_compiles_once():
    from specdec.runtime.compiled import COMPILED

    target = _peaked_target().double()
    head = specdec.EagleHead.init(target, seed=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [5, 4, 3, 2, 1, 2, 3]]
    assert _recorded_proposals(target, head, True, prompts, 3) == \
        _recorded_proposals(target, head, False, prompts, 3)
    # one graph (pad = depth + 1, 4 levels, top_k 3, 10 nodes, 256 slots) for both requests and every round;
    # the short last rounds run the same code uncompiled
    assert list(COMPILED[head].fns) == [("eagle", 5, 4, 3, 10, 256)]


@pytest.mark.parametrize("tree", [None, DEFAULT_TREE], ids=["chain", "tree"])
def test_medusa_reads_the_feature_of_the_last_committed_position(tree):
    target = _peaked_target()
    prompt = [1, 2, 3, 4, 5]
    drafter = specdec.Medusa(target, specdec.MedusaHeads.init(target, num_heads=4, seed=0), tree=tree)
    seen = []
    real = drafter.propose

    def propose(context, gamma, sampling, generator):
        seen.append((drafter.feature.clone(), context.clone()))
        return real(context, gamma, sampling, generator)

    drafter.propose = propose
    out = specdec.generate(target, prompt, drafter=drafter, gamma=3, max_new_tokens=30)
    assert out.tokens == hf_greedy(target, prompt, 30)
    assert 0 < out.stats.accepted < out.stats.drafted
    full = _true_features(target, prompt + out.tokens)
    for feature, context in seen:
        torch.testing.assert_close(feature, full[context.shape[0] - 2], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_sampling_with_heads_is_reproducible_and_in_vocab(kind):
    target = _peaked_target()
    runs = [specdec.generate(target, [1, 2, 3], drafter=drafters(target, tree=True)[kind], gamma=3, max_new_tokens=16,
                             temperature=1.0, top_k=5, seed=7).tokens for _ in range(2)]
    assert runs[0] == runs[1] and all(0 <= t < 8 for t in runs[0])


def test_one_token_prompt_has_no_features_yet_and_still_decodes():
    target = tiny("llama")
    for drafter in drafters(target).values():
        out = specdec.generate(target, [5], drafter=drafter, gamma=3, max_new_tokens=10)
        assert out.tokens == hf_greedy(target, [5], 10)


# -------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("cls", [specdec.EagleHead, specdec.MedusaHeads])
def test_save_load_round_trip_drafts_the_same_tokens(tmp_path, cls):
    target = tiny("llama")
    head = cls.init(target, seed=1)
    head.save(tmp_path / "h", dtype=None)
    again = cls.load(tmp_path / "h", target)
    for a, b in zip(head.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    make = (lambda h: specdec.Eagle(target, h)) if cls is specdec.EagleHead else (lambda h: specdec.Medusa(target, h))
    first = specdec.generate(target, PROMPT, drafter=make(head), gamma=3, max_new_tokens=12)
    second = specdec.generate(target, PROMPT, drafter=make(again), gamma=3, max_new_tokens=12)
    assert first.tokens == second.tokens and first.stats.accepted == second.stats.accepted
    assert sorted(p.name for p in (tmp_path).iterdir()) == ["h"]  # no temporary directory left behind


def test_eagle3_head_saves_its_variant_layers_and_draft_vocabulary(tmp_path):
    target = tiny("llama", layers=3)
    head = specdec.EagleHead.init(target, seed=1, variant="eagle3", feature_layers=(0, 1, 2))
    reduced = head.with_draft_vocab(target, [5, 1, 7, 1, 40])  # sorted, duplicates dropped: 4 draft tokens
    reduced.save(tmp_path / "h", dtype=None)
    again = specdec.EagleHead.load(tmp_path / "h", target)
    assert (again.variant, again.feature_layers, again.draft_vocab_size) == ("eagle3", (0, 1, 2), 4)
    assert again.draft_to_target.tolist() == [1, 5, 7, 40]
    for (ka, a), (kb, b) in zip(reduced.state_dict().items(), again.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(a, b)
    logits = again.logits(torch.randn(2, 32, dtype=target.dtype), target.get_output_embeddings())  # [2, V]
    assert torch.isfinite(logits).sum(-1).tolist() == [4, 4] and set(logits.argmax(-1).tolist()) <= {1, 5, 7, 40}
    with pytest.raises(ConfigError, match="two or more hidden-state indices in 0..3"):
        specdec.EagleHead.init(target, variant="eagle3", feature_layers=(0, 4))
    with pytest.raises(ConfigError, match="variant='eagle3'"):
        specdec.EagleHead.init(target, feature_layers=(0, 1))
    with pytest.raises(UnsupportedModelError, match="Llama-style"):
        specdec.EagleHead.init(tiny("gpt2"), variant="eagle3")


@pytest.mark.parametrize("cls", [specdec.EagleHead, specdec.MedusaHeads])
@pytest.mark.parametrize("change", [{"hidden": 48}, {"vocab": 64}, {"layers": 3}])
def test_head_for_another_target_is_refused(tmp_path, cls, change):
    head = cls.init(tiny("llama"), seed=0)
    head.save(tmp_path / "h")
    other = tiny("llama", **change)
    with pytest.raises(IncompatibleModelsError, match="trained for another target"):
        cls.load(tmp_path / "h", other)
    with pytest.raises(IncompatibleModelsError):
        (specdec.Eagle if cls is specdec.EagleHead else specdec.Medusa)(other, head)


def test_corrupt_partial_or_wrong_kind_checkpoints_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny("llama")
    specdec.EagleHead.init(target).save(tmp_path / "h")
    weights = tmp_path / "h" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        specdec.EagleHead.load(tmp_path / "h", target)
    specdec.EagleHead.init(target).save(tmp_path / "h")
    tensors = load_file(str(weights))
    tensors.pop("fc.weight")
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match="missing fc.weight"):
        specdec.EagleHead.load(tmp_path / "h", target)
    with pytest.raises(ModelLoadError, match="not a 'medusa'"):
        specdec.MedusaHeads.load(tmp_path / "h", target)
    (tmp_path / "h" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        specdec.EagleHead.load(tmp_path / "h", target)
    with pytest.raises(ModelLoadError, match="not a specdec head"):
        specdec.EagleHead.load(tmp_path / "nowhere", target)


def test_a_failed_write_leaves_nothing_on_disk(tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        specdec.MedusaHeads.init(tiny("llama")).save(tmp_path / "h")
    assert list(tmp_path.iterdir()) == []


def test_bad_drafter_arguments():
    target = tiny("llama")
    with pytest.raises(ConfigError):
        specdec.Eagle(target, specdec.EagleHead.init(target), top_k=0)
    with pytest.raises(ConfigError):
        specdec.Eagle(target, specdec.MedusaHeads.init(target))
    with pytest.raises(ConfigError, match="no parent"):
        specdec.Medusa(target, specdec.MedusaHeads.init(target), tree=[(0,), (1, 0)])
    with pytest.raises(ConfigError):
        specdec.MedusaHeads.init(target, num_heads=0)


def test_head_config_records_the_target_and_is_json(tmp_path):
    target = tiny("qwen2")
    specdec.EagleHead.init(target).save(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["kind"] == "eagle" and config["target"]["model_type"] == "qwen2"
    assert config["body_config"]["num_hidden_layers"] == 1
    assert target.config.num_hidden_layers == 2  # the target's own config is untouched


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_train_head_runs_resumes_and_reports_per_depth_acceptance(tmp_path, kind):
    from specdec.training.heads import HeadTrainConfig, train_head
    from specdec.training.loop import LoopConfig

    tokenizer = tiny_tokenizer()
    target = tiny("llama", vocab=len(tokenizer), dtype=torch.float32)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 4}) for i in range(40)))

    def config(steps, resume=False):
        loop = LoopConfig(steps=steps, lr=1e-3, warmup_steps=1, eval_every=100, checkpoint_every=1,
                          schedule="wsd", decay_steps=1)
        return HeadTrainConfig(kind=kind, out=tmp_path / "run", loop=loop, data=str(data), batch_size=2, seq_len=16,
                               ttt_steps=2, num_heads=2, eval_tokens=64, resume=resume)

    report = train_head(config(3), target, tokenizer, log=lambda s: None)
    assert set(report["final"]) == {"heldout_loss", "accept_d1", "accept_d2"}
    assert all(0 <= report["final"][f"accept_d{d}"] <= 1 for d in (1, 2))
    cls = specdec.MedusaHeads if kind == "medusa" else specdec.EagleHead
    head = cls.load(tmp_path / "run" / "head", target)
    assert getattr(head, "variant", "medusa") == kind
    assert head.meta["steps"] == 3 and head.meta["train_tokens"] == 3 * 2 * 16
    resumed = train_head(config(3, resume=True), target, tokenizer, log=lambda s: None)
    assert resumed["resumed_from"] == 3 and resumed["final"] == report["final"]
    with pytest.raises(ConfigError, match="already holds a checkpoint"):
        train_head(config(3), target, tokenizer, log=lambda s: None)


def test_train_head_rejects_bad_kind_and_missing_data(tmp_path):
    from specdec.training.heads import HeadTrainConfig, train_head
    from specdec.training.loop import LoopConfig

    target = tiny("llama")
    with pytest.raises(ConfigError, match="--kind"):
        train_head(HeadTrainConfig(kind="hydra", out=tmp_path, loop=LoopConfig(steps=1)), target, None)
    with pytest.raises(ConfigError, match="does not exist"):
        train_head(HeadTrainConfig(kind="eagle", out=tmp_path, loop=LoopConfig(steps=1), data=str(tmp_path / "x")),
                   target, tiny_tokenizer())


def test_eagle_unroll_mask_matches_drafting():
    """Unroll 1 of training computes, at row t, what drafting computes for the first drafted row after the
    true rows 0..t-1: the training-time test simulates decoding exactly."""
    from transformers import DynamicCache

    from specdec.training.heads import eagle_unrolls

    target = tiny("llama", hidden=32, layers=2)
    head = specdec.EagleHead.init(target, seed=4)
    batch = torch.tensor([PROMPT[:12]])
    preds, _, _ = eagle_unrolls(head, target, batch, steps=2, noise=0.0)
    feats = _true_features(target, PROMPT[:12])
    embed = target.get_input_embeddings()
    t = 7  # row t of unroll 1 reads the prediction of row t-1 and the token x_{t+1}
    with torch.no_grad():
        cache = DynamicCache()
        rows = head(embed(batch[:, 1 : t + 1]), feats[None, :t], torch.arange(t)[None], cache=cache)  # true rows 0..t-1
        drafted = head(embed(batch[:, t + 1 : t + 2]), rows[:, -1:], torch.tensor([[t]]), cache=cache)
    torch.testing.assert_close(preds[1][0, t], drafted[0, 0])


def test_eagle_refuses_a_model_without_layers():
    class Bare(torch.nn.Module):
        def __init__(self, config):
            super().__init__()

    with pytest.raises(UnsupportedModelError):
        from specdec.heads.eagle import build_body

        build_body(Bare, None)


def test_make_drafter_builds_head_drafters_from_a_saved_head(tmp_path):
    from specdec.drafters import make_drafter

    target = tiny("llama")
    specdec.EagleHead.init(target).save(tmp_path / "e")
    specdec.MedusaHeads.init(target).save(tmp_path / "m")
    eagle = make_drafter("eagle", target=target, head_path=tmp_path / "e")
    assert isinstance(eagle, specdec.Eagle) and eagle.top_k > 1
    assert make_drafter("eagle-chain", target=target, head_path=tmp_path / "e").top_k == 1
    assert make_drafter("medusa", target=target, head_path=tmp_path / "m").tree is not None
    assert make_drafter("medusa-chain", target=target, head_path=tmp_path / "m").tree is None
    specdec.EagleHead.init(target, variant="eagle3").save(tmp_path / "e3")
    eagle3 = make_drafter("eagle3-chain", target=target, head_path=tmp_path / "e3")
    assert eagle3.top_k == 1 and eagle3.head.variant == "eagle3"
    assert eagle3.capabilities.needs_hidden == eagle3.head.feature_layers
    with pytest.raises(IncompatibleModelsError):  # the shipped heads belong to the default target
        make_drafter("medusa", target=target)


@pytest.mark.parametrize("compile", [False, "static"], ids=["eager", "slot-cache"])
def test_adapters_return_the_hidden_states_of_chosen_layers(compile):
    """hidden=(i, j, k): those layers' outputs of the SAME pass side by side (EAGLE-3's fused features);
    hidden=True stays the final state."""
    from specdec.runtime.static_lm import fast_adapter

    target = tiny("llama", hidden=32, layers=3).double()
    tokens = [3, 9, 4, 1, 7, 2]
    with torch.no_grad():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # 4 x [1, 6, 32]
    adapter = fast_adapter(target, compile)
    if compile:
        adapter.ensure_capacity(64)
    adapter.reset()
    fused = adapter.prefill(torch.tensor(tokens[:3]), hidden=(1, 2, -1))  # [3, 96]
    torch.testing.assert_close(fused, torch.cat([states[i][0, :3] for i in (1, 2, -1)], -1))
    scores = adapter.score(torch.tensor(tokens[3:6]), hidden=(1, 2, -1))  # [3, 96]
    torch.testing.assert_close(scores.hidden, torch.cat([states[i][0, 3:6] for i in (1, 2, -1)], -1))
    adapter.crop(3)
    torch.testing.assert_close(adapter.score(torch.tensor(tokens[3:5]), hidden=True).hidden, states[-1][0, 3:5])
