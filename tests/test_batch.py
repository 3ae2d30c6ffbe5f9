"""Batched speculative decoding: each row is what `specdec.generate` gives for that prompt alone."""

from __future__ import annotations

import pytest
import torch
from models import perturbed, tiny

import specdec
from specdec.drafters.batched import CATCH_UP, WIDTHS, BatchedDraftModel
from specdec.engine.batch import BatchDecoder, fill_from_the_end, generate_batch
from specdec.runtime.batch_lm import BatchedCausalLM
from specdec.runtime.batch_static import StaticBatchedCausalLM

LONG = [(i * 37 + 11) % 96 for i in range(120)]
PROMPTS = [LONG[:20], [7], LONG[:45], LONG[3:9], LONG[:2]]
ARCHS = ["llama", "qwen2", "gpt2"]


@pytest.fixture(scope="module")
def pairs():
    out = {}
    for arch in ARCHS:
        target = tiny(arch, hidden=32, layers=3)
        out[arch] = (target, perturbed(target, 0.1))
    return out


DRAFTERS = {
    "plain": lambda draft: None,
    "draft-model": lambda draft: specdec.DraftModel(draft),
    "prompt-lookup": lambda draft: specdec.PromptLookup(max_ngram=3, min_ngram=1),
    # A tree drafter by its declared capabilities (it was scored as its first branch when batching was decided
    # by concrete class): every row's tree in the batched pass, as a lone request's.
    "prompt-lookup-branches": lambda draft: specdec.PromptLookup(max_ngram=3, min_ngram=1, branches=3),
    # Its rows' trees in the batched pass; no cache of earlier requests here (a row that leaves would feed the
    # others' later proposals, which a lone request does not see; tests/test_suffix.py covers that).
    "suffix": lambda draft: specdec.SuffixDecoding(max_nodes=6, max_depth=4, cache=specdec.SuffixCache(max_tokens=0)),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", list(DRAFTERS))
def test_greedy_rows_match_lone_requests(pairs, arch, method):
    target, draft = pairs[arch]
    make = DRAFTERS[method]
    lone = [specdec.generate(target, p, drafter=make(draft), gamma=3, max_new_tokens=24) for p in PROMPTS]
    batched = generate_batch(target, PROMPTS, drafter=make(draft), gamma=3, max_new_tokens=24)
    for got, want in zip(batched, lone):
        assert got.tokens == want.tokens
        assert got.stats.accepted == want.stats.accepted  # same rounds, same ragged acceptance
        assert got.stats.target_forwards == want.stats.target_forwards
    if method != "plain":
        accepted = [o.stats.accepted for o in batched]
        assert len(set(accepted)) > 1  # rows really accepted different amounts


@pytest.mark.parametrize("method", ["draft-model", "prompt-lookup", "prompt-lookup-branches", "suffix"])
def test_sampled_rows_draw_what_a_lone_request_draws(pairs, method):
    """T > 0 with top-k/top-p: a seeded row makes the same draws as the lone seeded request (exactness per row)."""
    target, draft = pairs["llama"]
    make = DRAFTERS[method]
    opts = dict(gamma=4, max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.9)
    seeds = [11, 12, 13, 14, 15]
    lone = [specdec.generate(target, p, drafter=make(draft), seed=s, **opts).tokens for p, s in zip(PROMPTS, seeds)]
    batched = generate_batch(target, PROMPTS, drafter=make(draft), seed=seeds, **opts)
    assert [o.tokens for o in batched] == lone
    assert len({tuple(t) for t in lone}) == len(lone)


def decoder_on(path: str, target, drafter) -> BatchDecoder:
    """A BatchDecoder whose target is `BatchedCausalLM` ("eager") or the batched fast path's preallocated cache
    run eagerly ("static"; a small cache, so that rounds compact it and, once, grow it)."""
    decoder = BatchDecoder(target, drafter)
    if path == "static":
        decoder.target = StaticBatchedCausalLM(target, max_len=40, compile=False, grow=True)
    return decoder


@pytest.mark.parametrize("path", ["eager", "static"])
def test_rows_join_and_leave_between_rounds(pairs, path):
    """Continuous batching: rows added at different rounds and one cancelled; the others are unaffected."""
    target, draft = pairs["llama"]
    decoder = decoder_on(path, target, specdec.DraftModel(draft))
    lone = {i: specdec.generate(target, p, drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=16 + i).tokens
            for i, p in enumerate(PROMPTS)}
    got = {i: [] for i in range(len(PROMPTS))}
    pending = list(enumerate(PROMPTS))
    rounds = 0
    while pending or len(decoder):
        if pending and rounds % 2 == 0:  # a new row every other round
            i, prompt = pending.pop(0)
            decoder.add(i, prompt, gamma=3, max_new_tokens=16 + i)
        if rounds == 3:
            decoder.remove([0])  # a client went away
            cancelled = list(got[0])
        for event in decoder.step():
            got[event.key].extend(event.tokens)
        rounds += 1
        assert isinstance(decoder.drafters, BatchedDraftModel)  # DraftModel's declared batched form
        assert decoder.target.rows == len(decoder) == decoder.drafters.lm.rows
        # The invariant of the single-row loop, per row: the target caches context[:n-1], the draft at most that.
        assert decoder.target.lengths.tolist() == [row.n - 1 for row in decoder.rows]
        assert all(d <= row.n - 1 for d, row in zip(decoder.drafters.lm.lengths.tolist(), decoder.rows))
        if path == "eager":
            assert decoder.target.slots <= max([row.n for row in decoder.rows], default=0) * 2 + 8  # holes bounded
        else:
            assert decoder.target.slots <= decoder.target.max_len
            assert not len(decoder) or decoder.target.capacity_rows == 1 << (len(decoder) - 1).bit_length()
    assert got[0] == cancelled and lone[0][: len(cancelled)] == cancelled
    for i in range(1, len(PROMPTS)):
        assert got[i] == lone[i]


def test_rows_that_leave_are_filled_from_the_end():
    assert fill_from_the_end(5, [1]) == [0, 4, 2, 3]  # the last row moves into the freed place
    assert fill_from_the_end(5, [4]) == [0, 1, 2, 3]  # nothing moves
    assert fill_from_the_end(6, [1, 3, 5]) == [0, 4, 2]
    assert fill_from_the_end(5, [0, 1]) == [4, 3, 2]
    assert fill_from_the_end(3, [0, 1, 2]) == []


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("keep", [[0, 4, 2], [4, 0, 3], [2, 3]])  # filled from the end (in place), any order, a tail
def test_kept_rows_keep_their_cached_states_when_rows_leave(pairs, path, keep):
    """Every kept row's keys and values at its valid slots, in its token order, are the bits it had before the
    others left (in place or by an index copy, compacted or not)."""
    target, _ = pairs["llama"]
    lm = BatchedCausalLM(target) if path == "eager" else StaticBatchedCausalLM(target, max_len=64, compile=False)
    lm.add_rows([torch.tensor(p) for p in PROMPTS])
    lm.forward([torch.tensor([1, 2, 3][: i % 3 + 1]) for i in range(len(PROMPTS))])  # ragged appends
    lm.crop([n - (i % 2) for i, n in enumerate(lm.lengths.tolist())])  # and holes

    def states(row: int) -> list[torch.Tensor]:
        slots = lm.valid[row].nonzero().flatten()
        if path == "eager":
            return [s[row][:, slots].clone() for s in (*lm.keys, *lm.values)]
        return [s[row][:, slots].clone() for layer in lm.cache.layers for s in (layer.keys, layer.values)]

    before = {row: states(row) for row in keep}
    lengths = lm.lengths.tolist()
    lm.remove_rows(keep)
    assert lm.lengths.tolist() == [lengths[row] for row in keep]
    for place, row in enumerate(keep):
        assert all(torch.equal(a, b) for a, b in zip(states(place), before[row]))


def test_gamma_cap_backs_off_to_plain_decoding_and_stays_exact(pairs):
    target, draft = pairs["llama"]
    decoder = BatchDecoder(target, specdec.DraftModel(draft))
    for i, prompt in enumerate(PROMPTS):
        decoder.add(i, prompt, gamma=4, max_new_tokens=12)
    got = {i: [] for i in range(len(PROMPTS))}
    caps = [4, 0, 2, 0, 1]
    step = 0
    while len(decoder):
        for event in decoder.step(gamma_cap=caps[step % len(caps)]):
            assert event.drafted <= caps[step % len(caps)]
            got[event.key].extend(event.tokens)
        step += 1
    for i, prompt in enumerate(PROMPTS):
        assert got[i] == specdec.generate(target, prompt, max_new_tokens=12).tokens


def test_eos_ends_one_row(pairs):
    target, _ = pairs["llama"]
    free = specdec.generate(target, PROMPTS[0], max_new_tokens=20).tokens
    eos = free[5]
    outs = generate_batch(target, PROMPTS[:3], max_new_tokens=20, eos_token_id=eos)
    assert outs[0].tokens == free[: free.index(eos) + 1]
    for out, prompt in zip(outs, PROMPTS[:3]):
        assert out.tokens == specdec.generate(target, prompt, max_new_tokens=20, eos_token_id=eos).tokens


def test_bad_inputs_raise_specdec_errors(pairs):
    target, _ = pairs["llama"]
    with pytest.raises(specdec.PromptError):
        generate_batch(target, [[1, 2], [500]])
    class Unbatched(specdec.Drafter):  # a user's drafter: batched decoding cannot know how to fork its state
        def propose(self, context, gamma, sampling, generator):
            return specdec.Proposal(context[-1:])

    with pytest.raises(specdec.ConfigError):
        generate_batch(target, [[1, 2]], drafter=Unbatched())
    with pytest.raises(specdec.ConfigError):
        generate_batch(target, [[1], [2]], seed=[1])
    with pytest.raises(specdec.PromptError):
        generate_batch(target, torch.tensor([1, 2]))


def test_padding_never_reaches_positions_a_short_row_does_not_own():
    """A short row prefilled beside a long one is padded to the long row's width; its padding columns must
    not run past its own positions (here: NaN position embeddings from 40 on, as a model without positions
    there would be). The long row fails alone; the short row decodes exactly as a lone request."""
    model = tiny("gpt2", hidden=32, layers=2, vocab=96)
    with torch.no_grad():
        model.transformer.wpe.weight[40:] = float("nan")
    short, long = [(j * 7 + 3) % 90 for j in range(8)], [(j * 5 + 1) % 90 for j in range(45)]
    want = specdec.generate(model, short, max_new_tokens=12).tokens
    decoder = BatchDecoder(model)
    decoder.add_many([("short", short, {"max_new_tokens": 12}), ("long", long, {"max_new_tokens": 4})])
    got, failed = [], []
    while len(decoder):
        for event in decoder.step():
            if event.error is not None:
                failed.append(event.key)
            elif event.key == "short":
                got += event.tokens
    assert failed == ["long"]
    assert got == want


def test_logprobs_are_the_target_log_probabilities_of_the_emitted_tokens(pairs):
    """Under speculation (ragged acceptance), each emitted token's log-probability and the top alternatives equal
    those of one plain forward of the target over prompt + completion (float64), and do not change the tokens."""
    target, draft = pairs["llama"]
    decoder = BatchDecoder(target, specdec.DraftModel(draft))
    prompts = PROMPTS[:3]
    for i, p in enumerate(prompts):
        decoder.add(i, p, gamma=3, max_new_tokens=16, logprobs=None if i == 2 else 3)
    got = {i: ([], [], []) for i in range(len(prompts))}
    while len(decoder):
        for e in decoder.step():
            got[e.key][0].extend(e.tokens)
            if e.logprobs is not None:
                assert len(e.logprobs) == len(e.top_logprobs) == len(e.tokens)
                got[e.key][1].extend(e.logprobs)
                got[e.key][2].extend(e.top_logprobs)
    for i, p in enumerate(prompts):
        tokens, logprobs, tops = got[i]
        assert tokens == specdec.generate(target, p, drafter=specdec.DraftModel(draft), gamma=3,
                                          max_new_tokens=16).tokens
        if i == 2:
            assert logprobs == []
            continue
        with torch.no_grad():
            full = torch.log_softmax(target(torch.tensor([p + tokens])).logits[0], dim=-1)  # [n, V]
        want = full[len(p) - 1 : len(p) - 1 + len(tokens)]  # [m, V]: position j scores token j
        chosen = want.gather(1, torch.tensor(tokens)[:, None])[:, 0]  # [m]
        assert torch.allclose(torch.tensor(logprobs, dtype=want.dtype), chosen, atol=1e-9)
        best = want.topk(3, dim=-1)
        assert [[t for t, _ in top] for top in tops] == best.indices.tolist()
        assert torch.allclose(torch.tensor([[v for _, v in top] for top in tops], dtype=want.dtype), best.values,
                              atol=1e-9)
        assert all(top[0][0] == t for top, t in zip(tops, tokens))  # greedy: the emitted token is the best one


@pytest.mark.parametrize("arch,path", [("llama", "eager"), ("qwen2", "eager"), ("qwen2", "static")])
def test_tree_rows_match_lone_requests_across_joins_and_leaves(pairs, arch, path):
    """Each row grows its own DraftTree; the target scores every row's tree in one pass (per-row tree blocks in a
    4-D mask). Token-identical to lone generate in float64, rows joining mid-way, cache lengths every round."""
    target, draft = pairs[arch]
    make = lambda: specdec.DraftTree(draft, top_k=2, depth=3, max_nodes=6)  # noqa: E731
    opts = dict(max_new_tokens=20)
    lone = [specdec.generate(target, p, drafter=make(), **opts) for p in PROMPTS]
    decoder = decoder_on(path, target, make())
    assert decoder.trees
    got = {i: [] for i in range(len(PROMPTS))}
    pending = list(enumerate(PROMPTS))
    decoder.add_many([(i, p, opts) for i, p in pending[:3]])
    pending = pending[3:]
    rounds = 0
    while len(decoder) or pending:
        if rounds % 2 == 1 and pending:
            decoder.add(*pending.pop(0), **opts)
        for event in decoder.step():
            assert event.error is None
            got[event.key].extend(event.tokens)
        rounds += 1
        # Every row's cache holds exactly its committed context but the last token (the next root).
        lengths = decoder.target.lengths.tolist()
        assert lengths == [row.n - 1 for row in decoder.rows]
    for i, want in enumerate(lone):
        assert got[i] == want.tokens
    assert max(o.stats.accepted / o.stats.rounds for o in lone) > 1  # trees accepted several tokens per round


def test_multidraft_rows_draw_what_a_lone_request_draws(pairs):
    """T > 0, top-k/top-p: seeded MultiDraft rows (sampled trees) make the lone seeded request's draws."""
    target, draft = pairs["llama"]
    opts = dict(gamma=3, max_new_tokens=16, temperature=0.8, top_k=30, top_p=0.95)
    seeds = [5, 6, 7]
    lone = [specdec.generate(target, p, drafter=specdec.MultiDraft(draft, num_drafts=2), seed=s, **opts).tokens
            for p, s in zip(PROMPTS[:3], seeds)]
    batched = generate_batch(target, PROMPTS[:3], drafter=specdec.MultiDraft(draft, num_drafts=2), seed=seeds, **opts)
    assert [o.tokens for o in batched] == lone


def test_static_batched_cache_rows_match_lone_requests(pairs):
    """The fast path's preallocated batched cache (run eagerly): greedy rows token-identical to lone requests
    (GPT-2 here: llama rows are checked joining and leaving above, qwen2 with trees)."""
    target, draft = pairs["gpt2"]
    lone = [specdec.generate(target, p, drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=24) for p in PROMPTS]
    batched = generate_batch(target, PROMPTS, drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=24,
                             compile="static")
    for got, want in zip(batched, lone):
        assert got.tokens == want.tokens
        assert got.stats.accepted == want.stats.accepted


@pytest.mark.parametrize("compile,lm", [(False, BatchedCausalLM), ("static", StaticBatchedCausalLM)])
def test_the_batched_draft_model_runs_on_the_target_s_path(pairs, compile, lm):
    """The draft model's batched LM takes the path the batch's target takes (the slot cache, compiled with
    compile=True), so the fast path speeds up its γ passes a round as well as the verification pass."""
    target, draft = pairs["llama"]
    decoder = BatchDecoder(target, specdec.DraftModel(draft), compile=compile, max_len=64)
    assert type(decoder.target) is lm and type(decoder.drafters.lm) is lm
    if compile:
        assert decoder.drafters.lm.max_len == 64 and not decoder.drafters.lm.compile  # "static": eager passes


def test_the_batched_draft_catches_up_after_plain_rounds_in_its_few_widths(pairs):
    """Rounds with nothing drafted (γ = 0 under load) leave the draft behind; it catches up in passes of at most
    `CATCH_UP` tokens a row, so its passes keep to `WIDTHS` (the shapes the server compiles). The target drafting
    for itself accepts every draft only if the draft's cache holds exactly each row's committed tokens."""
    target, _ = pairs["llama"]
    decoder = BatchDecoder(target, specdec.DraftModel(target), compile="static")
    lm = decoder.drafters.lm
    widths, pass_for = [], lm._fn
    lm._fn = lambda rows, width: widths.append(width) or pass_for(rows, width)
    decoder.add_many([(i, p, dict(gamma=3, max_new_tokens=30)) for i, p in enumerate(PROMPTS)])
    got = {i: [] for i in range(len(PROMPTS))}
    drafted = accepted = 0
    for round in range(40):
        for event in decoder.step(gamma_cap=0 if round < 11 else None):  # 11 plain rounds, then speculation
            got[event.key].extend(event.tokens)
            drafted, accepted = drafted + event.drafted, accepted + event.accepted
    assert got == {i: specdec.generate(target, p, max_new_tokens=30).tokens for i, p in enumerate(PROMPTS)}
    assert set(widths) <= set(WIDTHS) and CATCH_UP in widths  # 11 behind: one pass of 8, then the usual 2 + 1
    assert drafted > 0 and accepted == drafted


def test_static_batched_cache_sampled_rows_draw_what_a_lone_request_draws(pairs):
    target, draft = pairs["llama"]
    opts = dict(gamma=4, max_new_tokens=20, temperature=0.9, top_k=40, top_p=0.9)
    seeds = [11, 12, 13]
    lone = [specdec.generate(target, p, drafter=specdec.DraftModel(draft), seed=s, **opts).tokens
            for p, s in zip(PROMPTS[:3], seeds)]
    batched = generate_batch(target, PROMPTS[:3], drafter=specdec.DraftModel(draft), seed=seeds, compile="static",
                             **opts)
    assert [o.tokens for o in batched] == lone


@pytest.mark.compile
@pytest.mark.slow  # one inductor compile: ~30 s idle, ~85 s on the loaded CI machine
def test_compiled_batched_pass_rows_match_lone_requests(pairs):
    """The batched fast path compiled: one shape (rows padded to 8, inputs to 5) serves every round while rows
    join, accept ragged amounts and leave, and the draft's `WIDTHS` compiled up front serve its passes, the catch-up
    after plain rounds included; each row token-identical to its lone request."""
    target, draft = pairs["llama"]
    decoder = BatchDecoder(target, specdec.DraftModel(draft), compile=True)
    assert isinstance(decoder.target, StaticBatchedCausalLM) and decoder.target.compile
    decoder.target.batch_buckets, decoder.target.query_buckets = (8,), (5,)
    lone = {i: specdec.generate(target, p, drafter=specdec.DraftModel(draft), gamma=3, max_new_tokens=12).tokens
            for i, p in enumerate(PROMPTS)}
    got = {i: [] for i in range(len(PROMPTS))}
    pending = list(enumerate(PROMPTS))
    decoder.drafters.lm.batch_buckets = (8,)  # the draft's, on its path
    decoder.target.precompile([1], [5])  # the one shape, before any row; then no pass may (re)compile
    decoder.drafters.precompile([1])  # the draft's: one a width
    decoder.add_many([(i, p, dict(gamma=3, max_new_tokens=12)) for i, p in pending[:3]])
    pending = pending[3:]
    rounds = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        while len(decoder) or pending:
            if pending:
                decoder.add(*pending.pop(0), gamma=3, max_new_tokens=12)
            rounds += 1
            for event in decoder.step(gamma_cap=0 if rounds <= 4 else None):  # plain rounds, then drafts
                got[event.key].extend(event.tokens)
            assert decoder.target.lengths.tolist() == [row.n - 1 for row in decoder.rows]
    assert got == lone
    for model, widths in ((target, {5}), (draft, set(WIDTHS))):
        compiled = {k[2] for k in specdec.runtime.compiled.COMPILED[model].fns if k[0] == "batch-pass"}
        assert compiled == widths


@pytest.mark.compile
def test_a_compiled_batch_that_shrinks_and_grows_again_keeps_its_buffers(pairs):
    """`precompile` reserves the buffers of the largest bucket (`reserve_rows`); rows join, leave until the batch
    falls to a smaller bucket, then join again: the cache stays a view of the first rows of those buffers (no
    allocation, no copy), one compiled pass (its rows symbolic) serves both buckets without recompiling, and every
    row is its lone request's tokens."""
    target, _ = pairs["llama"]
    decoder = BatchDecoder(target, compile=True)
    lm = decoder.target
    lm.batch_buckets, lm.query_buckets = (2, 4), (1,)
    lm.precompile([1, 3], [1])
    assert lm.reserved_rows == 4 and lm.capacity_rows == 0
    buffers = lm.buffers.layers[0].keys
    budget = {0: 4, 1: 12, 2: 4, 3: 12, 4: 6}
    lone = {i: specdec.generate(target, PROMPTS[i], max_new_tokens=n).tokens for i, n in budget.items()}
    got = {i: [] for i in budget}
    decoder.add_many([(i, PROMPTS[i], dict(max_new_tokens=budget[i])) for i in range(4)])
    assert lm.capacity_rows == 4 and lm.buffers.layers[0].keys is buffers
    with torch._dynamo.config.patch(error_on_recompile=True):
        while len(decoder) > 2:
            for event in decoder.step():
                got[event.key].extend(event.tokens)
        assert lm.capacity_rows == 2  # the smaller bucket's passes, over the same memory
        assert lm.cache.layers[0].keys.data_ptr() == buffers.data_ptr()
        decoder.add(4, PROMPTS[4], max_new_tokens=budget[4])
        assert lm.capacity_rows == 4 and lm.buffers.layers[0].keys is buffers
        while len(decoder):
            for event in decoder.step():
                got[event.key].extend(event.tokens)
    assert lm.buffers.layers[0].keys is buffers  # never reallocated
    assert got == lone
    # both buckets ran one graph, its row count symbolic (`SYMBOLIC_MIN_ROWS`): none was compiled per bucket
    assert {k[1] for k in specdec.runtime.compiled.COMPILED[target].fns if k[0] == "batch-pass"} <= {1, "2+"}


def _padded_pair(target_rows: int, draft_rows: int):
    """A target and a draft whose LM heads differ in width by padding only (the draft is the target on the rows
    both have; extra draft rows are large random padding)."""
    target = tiny("llama", vocab=target_rows, hidden=32, layers=2)
    draft = tiny("llama", vocab=draft_rows, hidden=32, layers=2)
    state = {}
    for key, value in target.state_dict().items():
        if value.shape[0] == target_rows:
            extra = torch.randn(max(0, draft_rows - target_rows), *value.shape[1:], dtype=value.dtype,
                                generator=torch.Generator().manual_seed(3)) * 9
            value = torch.cat([value[:draft_rows], extra])
        state[key] = value
    draft.load_state_dict(state)
    if target_rows > draft_rows:  # a trained target never picks its padding rows: give them a very low logit
        head = torch.nn.Linear(32, target_rows, bias=True, dtype=torch.float64)
        with torch.no_grad():
            head.weight.copy_(target.lm_head.weight)
            head.bias.zero_()
            head.bias[draft_rows:] = -1e4
        target.lm_head = head
    return target, perturbed(draft, 0.05)


@pytest.mark.parametrize(("target_rows", "draft_rows"), [(704, 700), (700, 704)])
def test_a_padded_lm_head_draft_is_accepted_batched_as_alone(target_rows, draft_rows):
    """One vocabulary rule: a draft whose LM head is padded to another width drafts batched as it does alone
    (its rows fitted to the target's width); greedy rows token-identical, seeded sampled rows the same draws."""
    target, draft = _padded_pair(target_rows, draft_rows)
    prompts = [[(i * 7 + 5) % 600 for i in range(n)] for n in (12, 3, 20)]
    for opts in (dict(gamma=3, max_new_tokens=16), dict(gamma=3, max_new_tokens=16, temperature=1.2, top_k=50)):
        seeds = [4, 5, 6]
        lone = [specdec.generate(target, p, drafter=specdec.DraftModel(draft), seed=s, **opts)
                for p, s in zip(prompts, seeds)]
        batched = generate_batch(target, prompts, drafter=specdec.DraftModel(draft), seed=seeds, **opts)
        assert [o.tokens for o in batched] == [o.tokens for o in lone]
        assert [o.stats.accepted for o in batched] == [o.stats.accepted for o in lone]
    assert sum(o.stats.accepted for o in lone) > 0


def test_gamma_auto_is_shared_per_drafter_and_target_alone_and_batched():
    """One γ-policy rule: gamma="auto" gives every request of a (drafter, target model, target adapter) a fork of
    one AdaptiveGamma (its measured costs shared), alone and over a batch's rows alike."""
    target = tiny("llama", hidden=32, layers=2)
    drafter = specdec.DraftModel(perturbed(target, 0.1))
    decoder = BatchDecoder(target, drafter)
    decoder.add_many([(i, [1, 2, 3 + i], dict(gamma="auto", max_new_tokens=4)) for i in range(2)])
    first, second = (row.gamma_policy for row in decoder.rows)
    assert first is not second and first.round_base is second.round_base  # forks sharing the measurements
    again = BatchDecoder(target, drafter)
    again.add(0, [4, 5], gamma="auto", max_new_tokens=4)
    assert again.rows[0].gamma_policy.round_base is first.round_base  # the same pair: the same policy
    lone = specdec.SpeculativeDecoder(target, drafter, gamma="auto")
    assert lone.gamma_policy.round_base is not first.round_base  # another adapter: its own costs
    assert specdec.SpeculativeDecoder(target, drafter, gamma="auto").gamma_policy.round_base is \
        lone.gamma_policy.round_base


def test_a_sliding_window_model_is_batched_when_requests_fit_inside_the_window(pairs):
    """A model whose config names a sliding window (MistralConfig's default is 4096) is batched when prompt +
    max_new_tokens fits inside the window (rows ragged, holes compacted before the window could count them),
    token-identical to lone requests; a request past the window is refused with a clear error, batched only (a
    lone request's cache is position-exact, so the model's own window mask applies)."""
    assert BatchDecoder(tiny("mistral", hidden=32, layers=2)).window == 4096
    target = tiny("mistral", hidden=32, layers=2, sliding_window=32)
    draft = perturbed(target, 0.3)  # many rejections: many holes
    prompts = [LONG[:14], [7], LONG[20:35], LONG[3:9], LONG[50:60]]
    for make in (lambda: specdec.DraftModel(draft), lambda: specdec.DraftTree(draft, top_k=2, depth=3, max_nodes=6)):
        lone = [specdec.generate(target, p, drafter=make(), gamma=4, max_new_tokens=32 - len(p)).tokens
                for p in prompts]
        decoder = BatchDecoder(target, make())
        for i, p in enumerate(prompts):
            decoder.add(i, p, gamma=4, max_new_tokens=32 - len(p))
        got = {i: [] for i in range(len(prompts))}
        while len(decoder):
            for event in decoder.step():
                assert event.error is None
                got[event.key].extend(event.tokens)
        assert [got[i] for i in range(len(prompts))] == lone
    with pytest.raises(specdec.PromptError, match="sliding attention window of 32 tokens"):
        BatchDecoder(target).add(0, LONG[:30], max_new_tokens=3)
    assert len(specdec.generate(target, LONG[:30], max_new_tokens=3).tokens) == 3  # alone: past the window
