"""Batched decoding with drafters that read the target's features (Eagle, Medusa) and with LayerSkip: each row is
what `specdec.generate` gives for that prompt alone, and no head ever reads a feature of a rejected draft."""

from __future__ import annotations

import pytest
import torch
from models import tiny, tiny_tokenizer
from transformers import DynamicCache

import specdec
from specdec.drafters.batched import BatchedDraftModel
from specdec.drafters.batched_heads import BatchedEagle, BatchedHeads, BatchedMedusa
from specdec.drafters.medusa import DEFAULT_TREE
from specdec.engine.batch import BatchDecoder, generate_batch

# A vocabulary of 8 makes untrained heads' drafts accepted sometimes and rejected sometimes (ragged acceptance).
PROMPTS = [[(i * 5 + 3) % 8 for i in range(n)] for n in (9, 1, 14, 4, 2)]


@pytest.fixture(scope="module")
def target():
    return tiny("llama", hidden=16, layers=2, vocab=8, seed=4)


DRAFTERS = {
    "eagle-chain": lambda t: specdec.Eagle(t, specdec.EagleHead.init(t, seed=0)),
    "eagle-tree": lambda t: specdec.Eagle(t, specdec.EagleHead.init(t, seed=0), top_k=3, depth=3, max_nodes=8),
    "eagle3-tree": lambda t: specdec.Eagle(t, specdec.EagleHead.init(t, seed=0, variant="eagle3"), top_k=3, depth=3,
                                           max_nodes=8),
    "medusa-chain": lambda t: specdec.Medusa(t, specdec.MedusaHeads.init(t, num_heads=3, seed=0)),
    "medusa-tree": lambda t: specdec.Medusa(t, specdec.MedusaHeads.init(t, num_heads=4, seed=0), tree=DEFAULT_TREE),
    "layer-skip": lambda t: specdec.LayerSkip(t, num_layers=1),
}


def _check_row_state(decoder: BatchDecoder) -> None:
    """Per row, after every round: the target caches context[:n-1]; a head's state covers exactly the committed
    positions (Eagle: head-cache rows computed from target features + pending features = n-1, and no row computed
    from a drafted feature survives); LayerSkip's draft cache at most context[:n-1]."""
    assert decoder.target.lengths.tolist() == [row.n - 1 for row in decoder.rows]
    for row in decoder.rows:
        fork = row.drafter
        if isinstance(fork, specdec.Eagle):
            assert fork.rows + fork.pending.shape[0] == row.n - 1
            assert fork.cache.get_seq_length() == fork.rows
        elif isinstance(fork, specdec.Medusa):
            assert fork.feature is not None or row.n == 1
    if isinstance(decoder.drafters, BatchedDraftModel):
        assert decoder.drafters.lm.rows == len(decoder)
        assert all(d <= row.n - 1 for d, row in zip(decoder.drafters.lm.lengths.tolist(), decoder.rows))
    forks = [id(row.drafter) for row in decoder.rows if row.drafter is not None]
    assert len(set(forks)) == len(forks)  # one fork per row, never shared


def _recorded(obj, name: str, pick) -> list:
    """Wrap obj.<name> so that every call appends pick(args, result) (a list) to the returned list."""
    seen, real = [], getattr(obj, name)

    def wrapper(*args):
        out = real(*args)
        seen.extend(pick(args, out))
        return out

    setattr(obj, name, wrapper)
    return seen


def _plain(proposals) -> list:
    """Non-empty proposals as comparable lists (tokens, parents)."""
    return [(p.tokens.tolist(), None if p.parents is None else p.parents.tolist()) for p in proposals if len(p)]


@pytest.mark.parametrize("method", list(DRAFTERS))
def test_greedy_rows_match_lone_requests_across_joins_and_leaves(target, method):
    """float64, T = 0: rows join every other round and one is cancelled; every other row is token-identical to a
    lone generate with the same drafter and accepts the same drafts (ragged), with state checked every round."""
    make = DRAFTERS[method]
    opts = dict(gamma=3, max_new_tokens=18)
    lone, lone_proposals = [], []
    for prompt in PROMPTS:
        drafter = make(target)
        lone_proposals.append(_recorded(drafter, "propose", lambda args, p: [p]))
        lone.append(specdec.generate(target, prompt, drafter=drafter, **opts))
    decoder = BatchDecoder(target, make(target))
    proposals = {i: [] for i in range(len(PROMPTS))}
    heads = isinstance(decoder.drafters, BatchedHeads)
    if heads:  # what every row's head proposed, round by round (batched head passes)
        def by_row(args, out):
            for row, p in zip(args[0], out):
                proposals[row.key].append(p)
            return []

        _recorded(decoder.drafters, "propose", by_row)
    got = {i: [] for i in range(len(PROMPTS))}
    pending = list(enumerate(PROMPTS))
    decoder.add_many([(i, p, opts) for i, p in pending[:2]])
    pending = pending[2:]
    stats = {row.key: row.stats for row in decoder.rows}
    rounds, cancelled = 0, None
    while len(decoder) or pending:
        if rounds % 2 == 1 and pending:
            decoder.add(*pending.pop(0), **opts)
            stats[decoder.rows[-1].key] = decoder.rows[-1].stats
        if rounds == 2:
            decoder.remove([1])  # a client went away
            cancelled = list(got[1])
        for event in decoder.step():
            assert event.error is None
            got[event.key].extend(event.tokens)
        rounds += 1
        _check_row_state(decoder)
    assert got[1] == cancelled == lone[1].tokens[: len(cancelled)]
    for i, want in enumerate(lone):
        if i != 1:
            assert got[i] == want.tokens, i
            # Same rounds, same ragged acceptance as the lone request.
            assert (stats[i].accepted, stats[i].drafted) == (want.stats.accepted, want.stats.drafted), i
            assert stats[i].target_forwards == want.stats.target_forwards, i
            if heads:  # and the same draft every round
                assert _plain(proposals[i]) == _plain(lone_proposals[i]), i
    accepted = [o.stats.accepted for o in lone]
    assert sum(accepted) > 0 and len(set(accepted)) > 1  # drafts accepted, by different amounts per row
    assert any(o.stats.accepted < o.stats.drafted for o in lone)  # and rejected: rollback ran


@pytest.mark.parametrize("method", ["eagle-chain", "eagle-tree", "medusa-tree", "layer-skip"])
def test_sampled_rows_draw_what_a_lone_request_draws(target, method):
    """T > 0 with top-k / top-p: a seeded row makes exactly the draws of the lone seeded request."""
    make = DRAFTERS[method]
    opts = dict(gamma=3, max_new_tokens=16, temperature=0.9, top_k=6, top_p=0.9)
    seeds = [21, 22, 23, 24, 25]
    lone = [specdec.generate(target, p, drafter=make(target), seed=s, **opts).tokens for p, s in zip(PROMPTS, seeds)]
    batched = generate_batch(target, PROMPTS, drafter=make(target), seed=seeds, **opts)
    assert [o.tokens for o in batched] == lone
    assert len({tuple(t) for t in lone}) == len(lone)


@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
def test_batched_eagle_rows_only_ever_read_target_features_of_committed_tokens(target, top_k):
    """Scripted bookkeeping per row, after every round: the row's head cache holds exactly the rows a head computes
    from the target's own features of the row's committed tokens (recomputed here from one plain forward), and
    its pending features are the target's features of the committed positions after them; so no feature of a
    rejected draft, and no row computed from a drafted feature, survives a round (γ capped differently every
    round, plain rounds included, as the server's goodput policy does)."""
    opts = dict(gamma=3, max_new_tokens=20)
    head = specdec.EagleHead.init(target, seed=0)
    decoder = BatchDecoder(target, specdec.Eagle(target, head, top_k=top_k, depth=3, max_nodes=8))
    embed = target.get_input_embeddings()
    checked = 0

    def check_rows():
        nonlocal checked
        for row in decoder.rows:
            fork, n = row.drafter, row.n
            context = row.context[:n]
            with torch.no_grad():
                full = target(context[None], output_hidden_states=True).hidden_states[-1][0]  # [n, H]
            torch.testing.assert_close(fork.pending, full[fork.rows : n - 1], rtol=1e-9, atol=1e-9)
            if fork.rows:
                cache = DynamicCache()
                with torch.no_grad():
                    head(embed(context[1 : fork.rows + 1])[None], full[None, : fork.rows],
                         torch.arange(fork.rows)[None], cache=cache)
                torch.testing.assert_close(fork.cache.layers[0].keys, cache.layers[0].keys, rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(fork.cache.layers[0].values, cache.layers[0].values, rtol=1e-9,
                                           atol=1e-9)
                checked += 1

    got = {i: [] for i in range(len(PROMPTS))}
    caps = [None, 0, 2, None, 1]  # the server's load-based γ caps, plain rounds (γ = 0) included
    rounds = 0
    while len(decoder) or rounds < len(PROMPTS):
        if rounds < len(PROMPTS):  # a row joins every round while the others decode
            decoder.add(rounds, PROMPTS[rounds], **opts)
        for event in decoder.step(gamma_cap=caps[rounds % len(caps)]):
            got[event.key].extend(event.tokens)
        rounds += 1
        _check_row_state(decoder)
        check_rows()
    lone = [specdec.generate(target, p, drafter=specdec.Eagle(target, head, top_k=top_k, depth=3, max_nodes=8),
                             **opts) for p in PROMPTS]
    for i, want in enumerate(lone):
        assert got[i] == want.tokens
    assert any(0 < o.stats.accepted < o.stats.drafted for o in lone)  # drafts were rejected: rollback ran
    assert checked > 20


def test_layer_skip_and_heads_are_batched_not_refused(target):
    decoder = BatchDecoder(target, specdec.LayerSkip(target, num_layers=1))
    # one batched draft forward per step, over the target's first layer
    assert isinstance(decoder.drafters, BatchedDraftModel)
    assert isinstance(BatchDecoder(target, DRAFTERS["eagle-tree"](target)).drafters, BatchedEagle)
    assert isinstance(BatchDecoder(target, DRAFTERS["medusa-tree"](target)).drafters, BatchedMedusa)
    assert BatchDecoder(target, DRAFTERS["medusa-tree"](target)).trees


def test_a_medusa_server_streams_what_lone_requests_give():
    """`specdec serve` with a Medusa drafter, driven by the official openai client: concurrent greedy requests get
    the lone greedy text; `speculative.method` "medusa" is accepted and another method refused with a 400."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from test_server import LiveServer

    from specdec.cli import build_parser
    from specdec.server import create_app

    tokenizer = tiny_tokenizer()
    model = tiny("llama", hidden=32, layers=2, vocab=len(tokenizer))
    heads = specdec.MedusaHeads.init(model, num_heads=3, seed=0)
    server = LiveServer(create_app(model, tokenizer, specdec.Medusa(model, heads, tree=DEFAULT_TREE[:10]),
                                   model_name="medusa"))
    prompts = [[(i * 31 + j * 7 + 3) % 250 for j in range(6 + i)] for i in range(4)]
    try:
        def one(i):
            out = server.client.completions.create(model="medusa", prompt=prompts[i], max_tokens=10, temperature=0,
                                                   extra_body={"speculative": {"method": "medusa"}})
            return out.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(one, range(4)))
        with pytest.raises(openai.BadRequestError, match="speculative.method"):
            server.client.completions.create(model="medusa", prompt=prompts[0], max_tokens=4,
                                             extra_body={"speculative": {"method": "eagle"}})
    finally:
        server.stop()
    for prompt, text in zip(prompts, texts):
        want = specdec.generate(model, prompt, max_new_tokens=10).tokens
        assert text == tokenizer.decode(want, skip_special_tokens=True)
    for kind in ("eagle", "medusa", "layer-skip"):  # the CLI offers them (building loads the default pair)
        assert build_parser().parse_args(["serve", "--drafter", kind]).drafter == kind
