"""`specdec.Mtp`: drafting with the target's own multi-token-prediction layer (docs/heads.md, "Native MTP layers").

Targets are tiny random configs of each supported family, saved with a random MTP layer in the release's own
checkpoint layout and loaded back with from_pretrained (`models.tiny_mtp`), so every test goes through the path a
real release takes: transformers drops the MTP tensors, `Mtp` reads them back from the checkpoint. What is
checked: the facts about transformers' loading; the loaded layer is the checkpoint's; the drafter's layer passes
are transformers' own `MtpModel` (positions, masks, the sliding window) and every proposal is the layer's chain
on its committed context (no stale cache row survives a rejection); greedy identity in float64 for every family
and every `MTP_METHODS` entry, and in bfloat16 on the fast path; batched rows propose what lone requests do; the
statistical suite with a negative control; and the refusals.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from faulty import LateMtpQ
from methods import MTP_METHODS, MTP_STATISTICAL, build_mtp
from models import MTP_ARCHS, hf_greedy, tiny, tiny_mtp
from packaging.version import Version
from safetensors.torch import load_file, save_file

import specdec
from specdec.engine.batch import BatchDecoder, generate_batch
from specdec.exactness import check_exactness
from specdec.heads.mtp import MIN_TRANSFORMERS, TRANSFORMERS_VERSION, load_mtp

pytestmark = pytest.mark.skipif(Version(TRANSFORMERS_VERSION) < Version(MIN_TRANSFORMERS),
                                reason=f"specdec.Mtp needs transformers >= {MIN_TRANSFORMERS} (this has "
                                       f"{TRANSFORMERS_VERSION}); its refusal there: tests/test_cuda.py")

ARCHS = sorted(MTP_ARCHS)
#: The statistical checks' level (test_exactness.py counts them as MTP_CHECKS at MTP_ALPHA): low, so that the
#: family-wise bound of the whole suite stays under 1% with them.
MTP_ALPHA = 1e-5
N = 3000  # draws per statistical check (as test_exactness.py)
PROMPT = [1, 2, 1, 1, 2]
LONG = [(i * 37 + 11) % 8 for i in range(40)]
#: Per family, a seed whose random MTP layer's greedy drafts are accepted now and then (about one in ten; most
#: seeds' never are) and rejected mostly: rollback after rejections runs a lot.
SEEDS = {"deepseek_v3": 2, "glm4_moe": 1, "glm4_moe_lite": 2, "mellum": 2}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """float64 targets of every supported family, vocabulary 8."""
    return {arch: tiny_mtp(tmp_path_factory.mktemp(arch), arch, hidden=16, vocab=8, seed=SEEDS[arch])
            for arch in ARCHS}


def _features(target, context: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states of context [n] from one plain forward: [n, H]."""
    with torch.no_grad():
        return target(context[None], output_hidden_states=True).hidden_states[-1][0]


def _transformers_chain(target, mtp, context: torch.Tensor, steps: int) -> list[int]:
    """The MTP layer's greedy chain on context [n], recomputed from scratch at every step with transformers' own
    `MtpModel.forward_layer` (no cache kept between steps): row t reads (x_{t+1}, h_t), a drafted row the drafted
    token and the layer's previous output."""
    from transformers.cache_utils import MtpCache

    n = context.shape[0]
    tokens, hidden = context[1:], _features(target, context)[: n - 1]
    out = []
    with torch.no_grad():
        for _ in range(steps):
            rows = tokens.shape[0]
            g = mtp.forward_layer(0, hidden[None], torch.arange(1, rows + 1)[None], MtpCache(config=mtp.config),
                                  input_ids=tokens[None])[0, -1]  # [H]
            token = int(target.get_output_embeddings()(g).argmax())
            out.append(token)
            tokens, hidden = torch.cat([tokens, torch.tensor([token])]), torch.cat([hidden, g[None]])
    return out


# ------------------------------------------------------------------------------------ what transformers does


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_drops_the_mtp_layer_at_load(targets, arch):
    """The release's MTP tensors are in the checkpoint, and from_pretrained leaves them out of the model (the
    class lists the release's MTP keys as ignorable) without a word."""
    target = targets[arch]
    layers = target.config.num_hidden_layers
    saved = load_file(f"{target.config.name_or_path}/model.safetensors")
    prefix = f"model.layers.{layers}." if arch != "mellum" else "mtp."
    assert any(k.startswith(prefix + "eh_proj") or k == "mtp.fc.weight" for k in saved)
    assert len(target.get_decoder().layers) == layers
    assert not any(k.startswith(prefix) or ".mtp" in k for k in target.state_dict())
    release_key = {"deepseek_v3": "model.layers.61.eh_proj.weight", "glm4_moe": "model.layers.92.eh_proj.weight",
                   "glm4_moe_lite": "model.layers.47.eh_proj.weight", "mellum": "mtp.fc.weight"}[arch]
    assert any(re.search(p, release_key) for p in type(target)._keys_to_ignore_on_load_unexpected)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_loaded_layer_is_the_checkpoint_s_and_the_target_is_untouched(targets, arch):
    target = targets[arch]
    before = {k: v.clone() for k, v in target.state_dict().items()}
    config = target.config.to_dict()
    mtp = load_mtp(target)
    saved = load_file(f"{target.config.name_or_path}/model.safetensors")
    n = target.config.num_hidden_layers
    names = ({"eh_proj": "mtp.fc", "enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden",
              "post_norm": "mtp.norm", "mtp_block.input_layernorm": "mtp.layers.0.input_layernorm"}
             if arch == "mellum" else
             {"eh_proj": f"model.layers.{n}.eh_proj", "enorm": f"model.layers.{n}.enorm",
              "hnorm": f"model.layers.{n}.hnorm", "post_norm": f"model.layers.{n}.shared_head.norm",
              "mtp_block.input_layernorm": f"model.layers.{n}.input_layernorm"})
    layer = mtp.layers[0]
    for ours, theirs in names.items():
        assert torch.equal(layer.get_parameter(f"{ours}.weight"), saved[f"{theirs}.weight"].double()), ours
    if arch != "mellum":  # per-expert tensors of the release, stacked by transformers' conversions
        stacked = layer.mtp_block.mlp.experts.down_proj  # [experts, H, I]
        assert torch.equal(stacked[1], saved[f"model.layers.{n}.mlp.experts.1.down_proj.weight"].double())
    assert mtp.embed_tokens is target.get_input_embeddings() and mtp.shared_head is target.get_output_embeddings()
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    assert target.config.to_dict() == config  # nothing written on the target's config (GLM-4.7-Flash: a copy's)


def test_a_sharded_checkpoint_loads_the_same_layer(targets, tmp_path):
    """A release in shards (model.safetensors.index.json): the MTP tensors are found through the index, across
    shards, and give the same layer as the single file."""
    source = targets["deepseek_v3"].config.name_or_path
    state = load_file(f"{source}/model.safetensors")
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: state[k] for k in part}, str(tmp_path / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    single, sharded = load_mtp(targets["deepseek_v3"]), load_mtp(targets["deepseek_v3"], checkpoint=tmp_path)
    for (name, a), (_, b) in zip(single.layers.named_parameters(), sharded.layers.named_parameters()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------- the layer's passes


@pytest.mark.parametrize("arch", ARCHS)
def test_catch_up_passes_are_transformers_mtp_model(targets, arch):
    """Two incremental catch-up passes (prompt, then more committed tokens) give the output transformers'
    MtpModel computes in one pass over the whole context (positions, causal mask, Mellum's sliding window)."""
    from transformers.cache_utils import MtpCache

    target = targets[arch]
    context = torch.tensor(LONG)  # 40 tokens: past Mellum's window of 32
    h = _features(target, context)
    drafter = specdec.Mtp(target)
    drafter.reset(context[:11], hidden=h[:10])
    drafter.catch_up(context[:11])
    drafter.commit(context, 0, hidden=h[10:39])
    got = drafter.catch_up(context)  # [H]
    mtp = load_mtp(target)
    with torch.no_grad():
        want = mtp.forward_layer(0, h[None, :39], torch.arange(1, 40)[None], MtpCache(config=mtp.config),
                                 input_ids=context[None, 1:])[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert drafter.rows == drafter.cache.get_seq_length() == 39 and drafter.forwards == 2


@pytest.mark.parametrize("arch", ["deepseek_v3", "mellum"])
def test_every_proposal_is_the_layer_s_chain_on_its_committed_context(targets, arch):
    """Greedy decoding, γ = 4: each round's proposal equals the chain transformers' MtpModel drafts from scratch
    on that round's committed context, so after every rejection the drafter's cache held exactly the rows of
    the committed tokens (a stale row of a rejected draft would change some later proposal)."""
    target = targets[arch]
    drafter = specdec.Mtp(target)
    seen = []
    real = drafter.propose

    def propose(context, gamma, sampling, generator):
        proposal = real(context, gamma, sampling, generator)
        seen.append((context.clone(), proposal.tokens.tolist()))
        return proposal

    drafter.propose = propose
    out = specdec.generate(target, LONG[:12], drafter=drafter, gamma=4, max_new_tokens=24)
    assert out.tokens == hf_greedy(target, LONG[:12], 24)
    assert 0 < out.stats.accepted < out.stats.drafted  # rejections happened, and acceptances
    mtp = load_mtp(target)
    for context, tokens in seen:
        assert tokens == _transformers_chain(target, mtp, context, len(tokens))


# ---------------------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("method", sorted(MTP_METHODS))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_mtp_method_is_greedy_identical(targets, arch, method):
    """float64, T = 0: token-identical to transformers' greedy generate, for every family and MTP_METHODS entry."""
    target = targets[arch]
    drafter, options = build_mtp(method, target)
    out = specdec.generate(target, LONG[:20], drafter=drafter, **{"gamma": 3, "max_new_tokens": 24, **options})
    assert out.tokens == hf_greedy(target, LONG[:20], 24)
    assert out.stats.drafted > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_target_on_packed_weights_drafts_with_its_layer(tmp_path, arch):
    """load(weights="int8") packs the target's linear layers, its LM head among them; Mtp drafts beside it, its
    layer's outputs scored by that packed head: token-identical to plain decoding of the packed target, alone and
    batched."""
    from specdec.hub.loading import load_model

    tiny_mtp(tmp_path, arch, hidden=64, vocab=64, seed=SEEDS[arch], dtype=torch.float32)
    target = load_model(tmp_path, dtype=torch.float32, weights="int8")
    assert not isinstance(target.get_output_embeddings(), torch.nn.Linear)
    prompts = [[1, 2, 3, 4, 5, 1, 2], [4, 5, 6, 7]]
    plain = [specdec.generate(target, p, max_new_tokens=16).tokens for p in prompts]
    out = specdec.generate(target, prompts[0], drafter=specdec.Mtp(target), gamma=3, max_new_tokens=16)
    assert out.tokens == plain[0] and out.stats.drafted > 0
    batched = generate_batch(target, prompts, drafter=specdec.Mtp(target), gamma=3, max_new_tokens=16)
    assert [o.tokens for o in batched] == plain


@pytest.mark.parametrize("gamma", [1, 2, 6])
def test_greedy_identity_at_other_gammas_and_a_one_token_prompt(targets, gamma):
    target = targets["deepseek_v3"]
    for prompt in (LONG[:1], LONG[:9]):
        out = specdec.generate(target, prompt, drafter=specdec.Mtp(target), gamma=gamma, max_new_tokens=13)
        assert out.tokens == hf_greedy(target, prompt, 13)


def test_bfloat16_on_the_fast_path_is_identical_to_plain(targets):
    """bfloat16, compile="static" (the target's slot cache): the MTP chain and tree give plain decoding's tokens."""
    target = copy.deepcopy(targets["deepseek_v3"]).to(torch.bfloat16)
    plain = specdec.generate(target, LONG[:16], max_new_tokens=24, compile="static").tokens
    for drafter in (specdec.Mtp(target), specdec.Mtp(target, top_k=2, depth=3, max_nodes=6)):
        assert next(drafter.layer.parameters()).dtype == torch.bfloat16
        out = specdec.generate(target, LONG[:16], drafter=drafter, gamma=3, max_new_tokens=24, compile="static")
        assert out.tokens == plain
        assert out.stats.drafted > 0


# ---------------------------------------------------------------------------------------------- batching


@pytest.mark.parametrize("method", ["mtp", "mtp-tree"])
def test_batched_rows_match_lone_requests_across_joins_and_leaves(targets, method):
    """float64, T = 0, rows joining every other round and one leaving: every row is token-identical to the lone
    request with the same drafter, with the same acceptance, and each row's fork holds exactly its committed
    positions after every round (layer cache rows + pending features = n - 1, no drafted row kept)."""
    target = targets["deepseek_v3"]
    prompts = [LONG[i : i + n] for i, n in ((0, 9), (3, 1), (5, 14), (7, 4), (2, 2))]
    opts = dict(gamma=3, max_new_tokens=16)
    lone = [specdec.generate(target, p, drafter=MTP_METHODS[method](target), **opts) for p in prompts]
    decoder = BatchDecoder(target, MTP_METHODS[method](target))
    got = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    decoder.add_many([(i, p, opts) for i, p in pending[:2]])
    pending = pending[2:]
    stats = {row.key: row.stats for row in decoder.rows}
    rounds, cancelled = 0, None
    while len(decoder) or pending:
        if rounds % 2 == 1 and pending:
            decoder.add(*pending.pop(0), **opts)
            stats[decoder.rows[-1].key] = decoder.rows[-1].stats
        if rounds == 2:
            decoder.remove([1])
            cancelled = list(got[1])
        for event in decoder.step():
            assert event.error is None
            got[event.key].extend(event.tokens)
        rounds += 1
        for row in decoder.rows:
            fork = row.drafter
            assert fork.rows + fork.pending.shape[0] == row.n - 1
            assert fork.cache.get_seq_length() == fork.rows
    assert got[1] == cancelled == lone[1].tokens[: len(cancelled)]
    for i, want in enumerate(lone):
        if i != 1:
            assert got[i] == want.tokens, i
            assert (stats[i].accepted, stats[i].drafted) == (want.stats.accepted, want.stats.drafted), i
    assert sum(o.stats.accepted for o in lone) > 0 and any(o.stats.accepted < o.stats.drafted for o in lone)


def test_sampled_batched_rows_draw_what_a_lone_request_draws(targets):
    """T > 0 with top-k / top-p: a seeded row draws exactly the lone seeded request's tokens (one layer pass per
    step for all rows, each row sampling with its own generator)."""
    target = targets["mellum"]
    prompts = [LONG[i : i + n] for i, n in ((0, 9), (3, 1), (5, 12), (7, 4))]
    opts = dict(gamma=3, max_new_tokens=12, temperature=0.9, top_k=6, top_p=0.9)
    seeds = [21, 22, 23, 24]
    lone = [specdec.generate(target, p, drafter=specdec.Mtp(target), seed=s, **opts).tokens
            for p, s in zip(prompts, seeds)]
    batched = generate_batch(target, prompts, drafter=specdec.Mtp(target), seed=seeds, **opts)
    assert [o.tokens for o in batched] == lone
    assert len({tuple(t) for t in lone}) == len(lone)


# ------------------------------------------------------------------------------------------- statistical


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A DeepSeek-V3 target of vocabulary 8 (the statistical suite enumerates its continuations), EOS the second
    most likely first token."""
    target = tiny_mtp(tmp_path_factory.mktemp("v8"), "deepseek_v3", hidden=16, vocab=8, seed=3)
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([PROMPT])).logits[0, -1], -1)
    target.generation_config.eos_token_id = int(first.argsort(descending=True)[1])
    return target


#: (temperature, top_k, top_p, gamma, max_new_tokens) per statistical method: the chain with top-k, top-p and
#: γ > max_new_tokens (the cut of the last round's drafts).
STATISTICAL_SETTINGS = {"mtp": (1.5, 6, 0.8, 5, 3)}


@pytest.mark.statistical
@pytest.mark.exactness_positive(checks=1, alpha=MTP_ALPHA)
@pytest.mark.parametrize("name", MTP_STATISTICAL)
def test_mtp_is_exact(small, name):
    temperature, top_k, top_p, gamma, max_new = STATISTICAL_SETTINGS[name]
    drafter, options = build_mtp(name, small)
    result = check_exactness(small, PROMPT, drafter, method=name, gamma=gamma, temperature=temperature, top_k=top_k,
                             top_p=top_p, max_new_tokens=max_new, samples=N, seed=1234, alpha=MTP_ALPHA, **options)
    assert result.mode == "enumerate"
    assert result.passed, result.summary()
    assert result.detectable_tv < 0.12, result.summary()  # the check has power
    assert 0 < result.accepted < result.drafted, result.summary()


@pytest.mark.statistical
def test_negative_control_late_q_is_caught(small):
    """The chain drawing each draft from its own step's q but reporting the previous step's: caught."""
    result = check_exactness(small, PROMPT, LateMtpQ(small), gamma=2, temperature=1.0, max_new_tokens=3,
                             samples=N, seed=1234, alpha=MTP_ALPHA, eos_token_id=[])
    assert not result.passed
    assert result.p_value < 1e-6, result.summary()


# ------------------------------------------------------------------------------------------------ refusals


def test_a_checkpoint_without_mtp_weights_is_refused(tmp_path):
    target = tiny_mtp(tmp_path / "bare", "deepseek_v3", hidden=16, vocab=8, mtp=False)
    with pytest.raises(specdec.ModelLoadError, match=r"carries no MTP weights \(no tensors under model\.layers\.2\."):
        specdec.Mtp(target)


def test_a_re_saved_target_has_lost_its_mtp_layer(targets, tmp_path):
    """save_pretrained of a loaded release writes no MTP tensors (transformers dropped them): refused, naming the
    fix (the original release, through checkpoint=); that release itself still works."""
    target = targets["glm4_moe"]
    target.save_pretrained(tmp_path / "copy")
    with pytest.raises(specdec.ModelLoadError, match="point checkpoint= at the original release"):
        specdec.Mtp(target, checkpoint=tmp_path / "copy")
    assert specdec.Mtp(target, checkpoint=target.config.name_or_path).vocab_size == 8


def test_partial_mtp_weights_are_refused(targets, tmp_path):
    source = targets["deepseek_v3"].config.name_or_path
    state = load_file(f"{source}/model.safetensors")
    del state["model.layers.2.hnorm.weight"]
    (tmp_path / "partial").mkdir()
    save_file(state, str(tmp_path / "partial" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(specdec.ModelLoadError, match="partial or of another layout.*hnorm"):
        specdec.Mtp(targets["deepseek_v3"], checkpoint=tmp_path / "partial")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x08not a safetensors header")
    with pytest.raises(specdec.ModelLoadError, match="not a readable safetensors file.*re-download"):
        specdec.Mtp(targets["deepseek_v3"], checkpoint=tmp_path / "corrupt")


def test_a_target_without_a_checkpoint_is_refused(targets):
    target = copy.deepcopy(targets["deepseek_v3"])
    target.config.name_or_path = ""
    with pytest.raises(specdec.ModelLoadError, match="was not loaded from a checkpoint.*checkpoint=PATH"):
        specdec.Mtp(target)
    with pytest.raises(specdec.ModelLoadError, match="holds no safetensors weights"):
        specdec.Mtp(target, checkpoint=json.__file__.rsplit("/", 1)[0])  # a directory without weights


def test_unsupported_families_are_refused():
    with pytest.raises(specdec.UnsupportedModelError, match=r"LlamaForCausalLM \(llama\) is not one of them"):
        specdec.Mtp(tiny("llama", hidden=16, layers=2, vocab=8))
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=16, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             num_experts=2, num_experts_per_tok=1, linear_num_value_heads=2, linear_num_key_heads=1,
                             linear_key_head_dim=8, linear_value_head_dim=8)
    with pytest.raises(specdec.UnsupportedModelError, match="ships an MTP layer, but it keeps a recurrent state"):
        specdec.Mtp(Qwen3NextForCausalLM(config))


def test_a_transformers_without_mtp_weight_conversions_is_refused(targets, monkeypatch):
    """transformers 5.17 to 5.19 have `MtpModel` but not its weight conversions (an H200 image with 5.17 raised
    AttributeError from inside the load): one error naming the version and the upgrade instead."""
    monkeypatch.setattr("specdec.heads.mtp.TRANSFORMERS_VERSION", "5.19.0")
    with pytest.raises(specdec.UnsupportedModelError, match=r"has transformers 5\.19\.0: upgrade it .*>=5\.20"):
        specdec.Mtp(targets["deepseek_v3"])


def test_bad_settings_are_refused_before_loading(targets):
    with pytest.raises(specdec.ConfigError, match="Mtp depth must be an integer >= 1"):
        specdec.Mtp(targets["deepseek_v3"], depth=0)
    with pytest.raises(specdec.ConfigError, match="Mtp top_k"):
        specdec.Mtp(targets["deepseek_v3"], top_k=1.5)


# ------------------------------------------------------------------------------------------------ the CLI


def test_make_drafter_and_the_cli_draft_with_mtp(tmp_path, capsys):
    """`--drafter mtp` / `mtp-tree` on a target loaded from its directory (the CLI loads it as a release)."""
    from models import tiny_tokenizer

    from specdec.cli import main as cli_main
    from specdec.drafters import make_drafter

    tokenizer = tiny_tokenizer()
    target = tiny_mtp(tmp_path / "t", "deepseek_v3", hidden=16, vocab=len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "t")
    from specdec.server.app import served_methods

    chain = make_drafter("mtp", target=target)
    tree = make_drafter("mtp-tree", target=target)
    assert (chain.top_k, chain.capabilities.default_gamma, chain.capabilities.tree) == (1, 3, False)
    assert (tree.top_k, tree.depth, tree.max_nodes, tree.capabilities.tree) == (4, 3, 24, True)
    assert served_methods(chain) == ("mtp",) and served_methods(tree) == ("mtp-tree",)  # `serve`'s method names
    with pytest.raises(specdec.ConfigError, match="--head does not apply to --drafter mtp"):
        make_drafter("mtp", target=target, head_path="x")
    code = cli_main(["generate", "--target", str(tmp_path / "t"), "--drafter", "mtp", "--prompt", "def add",
                     "--max-new-tokens", "6", "--dtype", "float32"])
    assert code == 0
    assert "[mtp (γ=3)]" in capsys.readouterr().err  # the run's statistics line
