"""One-pass block drafters: `BlockDraft` (a DFlash head on the target's features) and `ParallelDraft` (PARD).

Both propose γ per-position marginals from ONE forward. Their exactness is the registry's (tests/methods.py:
greedy identity in float64 and the statistical suite, with the off-by-one-row negative control in
test_exactness.py); here: the bookkeeping (the head only ever holds context rows of committed tokens, the masks
never stay in a cache), the fast path's round proposing the eager code's tokens, training passes computing what
drafting computes, batching, checkpoints and clear errors.
"""

from __future__ import annotations

import json

import pytest
import torch
from models import perturbed, tiny, tiny_tokenizer

import specdec
from specdec.core.masks import additive_mask
from specdec.core.sampling import SamplingConfig
from specdec.engine.batch import BatchDecoder, generate_batch
from specdec.errors import ConfigError, IncompatibleModelsError, UnsupportedModelError

# A vocabulary of 8: untrained heads' drafts are accepted sometimes and rejected sometimes (ragged acceptance).
PROMPTS = [[(i * 5 + 3) % 8 for i in range(n)] for n in (9, 1, 14, 4, 2)]


@pytest.fixture(scope="module")
def target():
    return tiny("llama", hidden=16, layers=2, vocab=8, seed=4)


def _block(target, top_k=1, **kw):
    return specdec.BlockDraft(target, specdec.DFlashHead.init(target, seed=0, block_size=6), top_k=top_k,
                              max_nodes=8, **kw)


def _parallel(target, seed=2):
    return specdec.ParallelDraft(specdec.ParallelDraft.adapt(perturbed(target, 0.3, seed=seed)))


def _recorded(drafter) -> list:
    """Wrap drafter.propose so that every proposal (tokens, parents) is recorded."""
    seen, real = [], drafter.propose

    def wrapper(*args):
        out = real(*args)
        seen.append((out.tokens.tolist(), None if out.parents is None else out.parents.tolist()))
        return out

    drafter.propose = wrapper
    return seen


# --------------------------------------------------------------------------------------------- BlockDraft


@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
def test_block_head_only_holds_context_rows_of_committed_tokens(target, top_k):
    """After every round the head's cache holds exactly `rows` context rows, rows + pending = n − 1, and each
    context row it was fed is the target's feature of that committed position (float64)."""
    drafter = _block(target, top_k)
    fed = []
    real = drafter.head.forward

    def spy(features, block, position_ids, attention_mask, cache=None):
        fed.append((features[0].clone(), position_ids[0, : features.shape[1]].tolist()))
        return real(features, block, position_ids, attention_mask, cache)

    drafter.head.forward = spy
    state = []
    commit = drafter.commit

    def checked(context, k, *, hidden=None):
        commit(context, k, hidden=hidden)
        state.append((drafter.rows, drafter.pending.shape[0], drafter.cache.get_seq_length(), context.shape[0]))

    drafter.commit = checked
    prompt = PROMPTS[2]
    out = specdec.generate(target, prompt, drafter=drafter, gamma=4, max_new_tokens=20)
    assert 0 < out.stats.accepted < out.stats.drafted  # partial acceptance: rejected drafts were never fed
    for rows, pending, cached, n in state:
        assert rows + pending == n - 1 and cached == rows  # the block's rows left the cache
    sequence = torch.tensor(prompt + out.tokens)
    with torch.no_grad():
        states = target(sequence[None], output_hidden_states=True).hidden_states
    truth = torch.cat([states[i][0] for i in drafter.head.feature_layers], dim=-1)  # [L, F]
    positions = [p for _, ps in fed for p in ps]
    assert positions == list(range(len(positions)))  # in order, without gaps or repeats
    got = torch.cat([f for f, _ in fed])
    assert torch.allclose(got, truth[: got.shape[0]], atol=1e-9)


@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
def test_block_slot_cache_round_proposes_the_eager_tokens(target, top_k):
    """The fixed-shape round (compile="static") proposes exactly the eager round's chain / tree every round."""
    eager, static = _block(target, top_k), _block(target, top_k)
    seen_eager, seen_static = _recorded(eager), _recorded(static)
    for prompt in PROMPTS[:3]:
        a = specdec.generate(target, prompt, drafter=eager, gamma=4, max_new_tokens=18)
        b = specdec.generate(target, prompt, drafter=static, gamma=4, max_new_tokens=18, compile="static")
        assert a.tokens == b.tokens
    assert seen_eager == seen_static and len(seen_eager) > 6
    assert any(p is not None for _, p in seen_eager) == (top_k > 1)


@pytest.mark.compile
def test_compiled_block_round_proposes_the_eager_tokens_and_compiles_once(target):
    """compile=True: the compiled round proposes the eager chain every round, one graph for both requests (pad =
    γ + 1, γ, top_k, max_nodes, 256 slots); the short last rounds run the same code uncompiled."""
    from specdec.runtime.compiled import COMPILED

    head = specdec.DFlashHead.init(target, seed=0, block_size=6)
    seen = {}
    for mode in (False, True):
        drafter = specdec.BlockDraft(target, head)
        seen[mode] = _recorded(drafter)
        for prompt in PROMPTS[:2]:
            specdec.generate(target, prompt, drafter=drafter, gamma=4, max_new_tokens=14, compile=mode)
    assert seen[True] == seen[False] and len(seen[False]) > 4
    assert list(COMPILED[head].fns) == [("block", 5, 4, 1, 32, 256)]


def test_block_sampled_chain_draws_each_position_from_its_own_marginal(target):
    """T > 0: q row j is the warped marginal of block row j (the eager round's logits), and the token is a draw
    from it: the same generator state gives the same tokens as sampling those rows directly."""
    drafter = _block(target)
    context = torch.tensor(PROMPTS[2])
    with torch.no_grad():
        states = target(context[None, :-1], output_hidden_states=True).hidden_states
    features = torch.cat([states[i][0] for i in drafter.head.feature_layers], dim=-1)
    sampling = SamplingConfig(temperature=0.9, top_k=5)
    drafter.reset(context, hidden=features)
    proposal = drafter.propose(context, 4, sampling, torch.Generator().manual_seed(3))
    twin = _block(target)
    twin.reset(context, hidden=features)
    logits = twin._eager_round(context, 4)  # [4, V]
    probs = sampling.warp(logits)
    assert torch.equal(proposal.draft_probs, probs)
    from specdec.core.sampling import sample

    assert torch.equal(proposal.tokens, sample(probs, torch.Generator().manual_seed(3)))
    assert proposal.draft_probs.shape == (4, 8)


def test_block_training_pass_computes_what_drafting_computes(target):
    """`training.dflash.block_pass` (all blocks of a window in one pass, 4D mask) gives, for each block, the
    outputs of a drafting pass over that block's context rows and the block alone."""
    from specdec.training.dflash import block_pass, draw_blocks
    from specdec.training.heads import target_features

    head = specdec.DFlashHead.init(target, seed=1, num_layers=2, block_size=6)
    batch = torch.randint(0, 8, (2, 20), generator=torch.Generator().manual_seed(0))
    starts, sizes = draw_blocks(2, 20, 4, 6, torch.Generator().manual_seed(1))
    with torch.no_grad():
        features, _ = target_features(target, batch, head.feature_layers)
        out = block_pass(head, target, batch, starts, sizes, features)  # [B, N, bs, H]
        embed = target.get_input_embeddings()
        for b in range(2):
            for n in range(4):
                a, s = int(starts[b, n]), int(sizes[b, n])
                visible = torch.ones(a + s, a + s, dtype=torch.bool)
                visible[:a] = torch.ones(a, a + s, dtype=torch.bool).tril()
                positions = torch.cat([torch.arange(a), a + torch.arange(s)])[None]
                block = head.block_embeds(embed(batch[b, a : a + 1]), s - 1)
                alone = head(features[b : b + 1, :a], block, positions,
                             additive_mask(visible, block.dtype)[None, None], transformers_cache())
                assert torch.allclose(alone[0], out[b, n, :s], atol=1e-10)


def transformers_cache():
    from transformers import DynamicCache

    return DynamicCache()


class OldKeywordAttention(torch.nn.Module):
    """A target's attention as transformers before 5.24 wrote it: its cache keyword is `past_key_values`, and an
    unknown keyword (`cache=`) falls into **kwargs unread."""

    def __init__(self, attention):
        super().__init__()
        self.inner = attention

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        return self.inner(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                          cache=past_key_values)


def test_draw_blocks_roots_lie_in_the_window_from_low_and_fit_it():
    from specdec.training.dflash import draw_blocks

    for low in (1, 9):
        starts, sizes = draw_blocks(64, 20, 5, 6, torch.Generator().manual_seed(low), full=True, low=low)
        assert starts.shape == (64, 5) and int(starts.min()) == low and int(starts.max()) == 18
        assert bool((starts.diff(dim=1) > 0).all())  # distinct, ascending
        assert bool((sizes == (20 - starts).clamp(max=6)).all())  # full blocks where they fit, cut at the end


def test_block_layers_pass_their_cache_under_the_keyword_the_attention_takes(target):
    """With attention modules of the older keyword the head drafts what it drafts with today's (it once passed
    `cache=` only: there the block attended to no context rows and the mask's shape did not match)."""
    prompt = PROMPTS[0]
    want = specdec.generate(target, prompt, drafter=_block(target), gamma=5, max_new_tokens=16)
    drafter = _block(target)
    for layer in drafter.head.layers:
        layer.self_attn = OldKeywordAttention(layer.self_attn)
    got = specdec.generate(target, prompt, drafter=drafter, gamma=5, max_new_tokens=16)
    assert got.tokens == want.tokens
    assert (got.stats.accepted, got.stats.rounds) == (want.stats.accepted, want.stats.rounds)


def test_block_gamma_is_capped_by_the_block_size_and_options_are_checked(target):
    drafter = _block(target)
    assert drafter.capabilities.default_gamma == 5  # the default 7, capped by the block of 6 rows
    assert drafter.capabilities.needs_hidden == drafter.head.feature_layers == (1, 2)
    out = specdec.generate(target, PROMPTS[0], drafter=drafter, gamma=9, max_new_tokens=12)
    assert out.stats.drafted <= 5 * out.stats.rounds
    with pytest.raises(ConfigError, match="top_k"):
        _block(target, top_k=0)
    with pytest.raises(ConfigError, match="DFlashHead"):
        specdec.BlockDraft(target, specdec.EagleHead.init(target))
    with pytest.raises(ConfigError, match="feature_layers"):
        specdec.DFlashHead.init(target, feature_layers=(9,))
    with pytest.raises(ConfigError, match="block_size"):
        specdec.DFlashHead.init(target, block_size=1)
    with pytest.raises(UnsupportedModelError, match="Llama"):
        specdec.DFlashHead.init(tiny("gpt2"))


def test_block_head_with_broken_weights_raises_one_numerical_error(target):
    """A head whose weights are NaN yields NaN logits: the round raises the head's own NumericalError (checked
    by `rowwise.all_finite`), and the target is left as it was."""
    head = specdec.DFlashHead.init(target, seed=0, block_size=6)
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(float("nan"))
    before = [p.clone() for p in target.parameters()]
    with pytest.raises(specdec.NumericalError, match="DFlash head produced NaN or infinite logits"):
        specdec.generate(target, PROMPTS[0], drafter=specdec.BlockDraft(target, head), max_new_tokens=4)
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))


def test_dflash_head_saves_loads_and_refuses_another_target(target, tmp_path):
    head = specdec.DFlashHead.init(target, seed=3, num_layers=2, block_size=6)
    head.meta = {"steps": 1}
    head.save(tmp_path / "h", dtype=None)
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["kind"] == "dflash" and config["num_layers"] == 2 and config["block_size"] == 6
    loaded = specdec.DFlashHead.load(tmp_path / "h", target)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    assert loaded.meta == {"steps": 1} and target.config.num_hidden_layers == 2
    with pytest.raises(IncompatibleModelsError):
        specdec.DFlashHead.load(tmp_path / "h", tiny("llama", hidden=16, layers=3, vocab=8))


def test_train_head_dflash_runs_resumes_and_reports_per_position_acceptance(tmp_path):
    from specdec.training.heads import HeadTrainConfig, train_head
    from specdec.training.loop import LoopConfig

    tokenizer = tiny_tokenizer()
    model = tiny("llama", vocab=len(tokenizer), dtype=torch.float32)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 4}) for i in range(40)))

    def config(resume=False):
        loop = LoopConfig(steps=3, lr=1e-3, warmup_steps=1, eval_every=100, checkpoint_every=1, schedule="wsd",
                          decay_steps=1)
        return HeadTrainConfig(kind="dflash", out=tmp_path / "run", loop=loop, data=str(data), batch_size=2,
                               seq_len=16, eval_tokens=64, resume=resume, block_size=4, anchors=3, self_distill=4,
                               prompt_len=8)

    report = train_head(config(), model, tokenizer, log=lambda s: None)
    text_metrics = {"heldout_loss", "block_tau", "accept_d1", "accept_d2", "accept_d3"}
    assert set(report["final"]) == text_metrics | {f"own_{key}" for key in text_metrics}
    assert 1.0 <= report["final"]["block_tau"] <= 4.0 and 1.0 <= report["final"]["own_block_tau"] <= 4.0
    head = specdec.DFlashHead.load(tmp_path / "run" / "head", model)
    assert head.block_size == 4 and head.meta["steps"] == 3
    cache = tmp_path / "run" / "cache"  # the target's own continuations of train and held-out prompts
    assert list(cache.glob("selfgen-train-4x16-p8-s0.npy")) and list(cache.glob("selfgen-heldout-8x16-p8-s0.npy"))
    resumed = train_head(config(resume=True), model, tokenizer, log=lambda s: None)
    assert resumed["resumed_from"] == 3 and resumed["final"] == report["final"]


# --------------------------------------------------------------------------------------------- ParallelDraft


def test_parallel_adapt_adds_one_mask_row_never_proposed(target):
    draft = perturbed(target, 0.3, seed=2)
    adapted = specdec.ParallelDraft.adapt(draft)
    assert adapted.get_input_embeddings().weight.shape[0] == 9 and draft.get_input_embeddings().weight.shape[0] == 8
    drafter = specdec.ParallelDraft(adapted)
    assert drafter.mask_token_id == 8 and drafter.vocab_size == 8
    out = specdec.generate(target, PROMPTS[2], drafter=drafter, gamma=4, max_new_tokens=16, temperature=1.5, seed=1)
    assert max(out.tokens) < 8
    context = torch.tensor(PROMPTS[2])
    drafter.reset(context)
    proposal = drafter.propose(context, 4, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert proposal.draft_probs.shape == (4, 8)  # q over the target's tokens: the mask has no column
    assert torch.allclose(proposal.draft_probs.sum(-1), torch.ones(4, dtype=proposal.draft_probs.dtype))
    assert drafter.lm.length == context.shape[0]  # the masks' rows left the cache, the committed ones stay
    with pytest.raises(IncompatibleModelsError, match="mask"):
        specdec.generate(target, PROMPTS[0], drafter=specdec.ParallelDraft(draft), max_new_tokens=4)


def test_parallel_slot_cache_proposes_the_eager_tokens(target):
    eager, static = _parallel(target), _parallel(target)
    seen_eager, seen_static = _recorded(eager), _recorded(static)
    for prompt in PROMPTS[:3]:
        a = specdec.generate(target, prompt, drafter=eager, gamma=5, max_new_tokens=18)
        b = specdec.generate(target, prompt, drafter=static, gamma=5, max_new_tokens=18, compile="static")
        assert a.tokens == b.tokens and 0 < a.stats.accepted < a.stats.drafted
    assert seen_eager == seen_static and len(seen_eager) > 6


def test_parallel_training_pass_computes_what_drafting_computes(target):
    """`training.parallel.parallel_pass` (every block's masks appended, 4D mask) gives, for a root a, the logits
    a drafting pass over x_0..x_a and the masks gives."""
    from specdec.training.parallel import draw_roots, parallel_pass

    model = specdec.ParallelDraft.adapt(perturbed(target, 0.3, seed=2))
    batch = torch.randint(0, 8, (2, 16), generator=torch.Generator().manual_seed(0))
    roots = draw_roots(2, 16, 3, torch.Generator().manual_seed(1))
    masks = 4
    with torch.no_grad():
        logits = parallel_pass(model, batch, roots, masks, 8)  # [B, L + N·M, V]
        for b in range(2):
            for n in range(3):
                a = int(roots[b, n])
                ids = torch.cat([batch[b, : a + 1], torch.full((masks,), 8)])
                alone = model(input_ids=ids[None]).logits[0, -masks - 1 :, :8]  # the root's row, then the masks'
                assert torch.allclose(alone[0], logits[b, a], atol=1e-10)
                assert torch.allclose(alone[1:], logits[b, 16 + n * masks : 16 + (n + 1) * masks], atol=1e-10)


# --------------------------------------------------------------------------------------------- batching


BATCHED = {
    "dflash-chain": lambda t: _block(t),
    "dflash-tree": lambda t: _block(t, top_k=3),
    "parallel": lambda t: _parallel(t),
}


@pytest.mark.parametrize("method", list(BATCHED))
def test_greedy_rows_match_lone_requests_across_joins(target, method):
    """float64, T = 0: rows join between rounds; each is token-identical to a lone generate with the same drafter
    and accepts the same drafts (ragged)."""
    make = BATCHED[method]
    opts = dict(gamma=3, max_new_tokens=16)
    lone = [specdec.generate(target, p, drafter=make(target), **opts) for p in PROMPTS]
    decoder = BatchDecoder(target, make(target))
    got = {i: [] for i in range(len(PROMPTS))}
    pending = list(enumerate(PROMPTS))
    decoder.add_many([(i, p, opts) for i, p in pending[:2]])
    pending = pending[2:]
    stats = {row.key: row.stats for row in decoder.rows}
    rounds = 0
    while len(decoder) or pending:
        if rounds % 2 == 1 and pending:
            decoder.add(*pending.pop(0), **opts)
            stats[decoder.rows[-1].key] = decoder.rows[-1].stats
        for event in decoder.step():
            assert event.error is None
            got[event.key].extend(event.tokens)
        rounds += 1
    for i, want in enumerate(lone):
        assert got[i] == want.tokens, i
        assert (stats[i].accepted, stats[i].drafted) == (want.stats.accepted, want.stats.drafted), i
    accepted = [o.stats.accepted for o in lone]
    assert sum(accepted) > 0 and any(o.stats.accepted < o.stats.drafted for o in lone)


@pytest.mark.parametrize("method", ["dflash-chain", "parallel"])
def test_sampled_rows_draw_what_a_lone_request_draws(target, method):
    make = BATCHED[method]
    opts = dict(gamma=3, max_new_tokens=14, temperature=0.9, top_k=6, top_p=0.9)
    seeds = [21, 22, 23, 24, 25]
    lone = [specdec.generate(target, p, drafter=make(target), seed=s, **opts).tokens for p, s in zip(PROMPTS, seeds)]
    batched = generate_batch(target, PROMPTS, drafter=make(target), seed=seeds, **opts)
    assert [o.tokens for o in batched] == lone


# --------------------------------------------------------------------------------------------- CLI / registry


def test_make_drafter_builds_the_new_kinds_and_refuses_a_plain_draft_for_parallel(target, tmp_path):
    from specdec.drafters import DRAFTER_KINDS, make_drafter

    assert {"dflash", "dflash-tree", "parallel"} <= set(DRAFTER_KINDS)
    head = specdec.DFlashHead.init(target, block_size=6)
    head.save(tmp_path / "h")
    assert make_drafter("dflash", target=target, head_path=str(tmp_path / "h")).top_k == 1
    assert make_drafter("dflash-tree", target=target, head_path=str(tmp_path / "h")).top_k > 1
    adapted = specdec.ParallelDraft.adapt(perturbed(target, 0.3))
    assert isinstance(make_drafter("parallel", target=target, draft=adapted), specdec.ParallelDraft)
    assert isinstance(make_drafter("parallel", target=target, parallel_draft=adapted), specdec.ParallelDraft)
    with pytest.raises(ConfigError, match="does not apply"):
        make_drafter("parallel", target=target, head_path="x")
