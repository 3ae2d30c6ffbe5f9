"""SuffixDecoding's index (`SuffixTrie`), its cross-request cache (`SuffixCache`) and the drafter's own rules.

Exactness (greedy identity in float64, the statistical suite) comes from its line in tests/methods.py; the negative
control (frequency estimates reported as q) is at the end of this file.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from faulty import FrequencyQSuffix
from methods import suffix_drafter
from models import tiny

import specdec
from specdec.drafters.suffix import COUNT, FAST_BUDGETS, SuffixCache, SuffixDecoding, SuffixRows, SuffixTrie
from specdec.engine.batch import BatchDecoder, generate_batch
from specdec.errors import ConfigError
from specdec.exactness import check_exactness

# ----------------------------------------------------------------------------------------------- the trie


def brute(sequences, depth, pattern):
    """(occurrences of `pattern`, {token: occurrences followed by it}), each suffix cut to `depth` tokens."""
    m, count, follow = len(pattern), 0, {}
    for s in sequences:
        for p in range(len(s) - m + 1):
            if m <= depth and s[p : p + m] == pattern:
                count += 1
                if m < depth and p + m < len(s):
                    follow[s[p + m]] = follow.get(s[p + m], 0) + 1
    return count, follow


def assert_counts(trie, sequences, vocab):
    """Every pattern up to the trie's depth: its count and continuations are the brute-force ones."""
    for m in range(1, trie.depth + 1):
        for pattern in map(list, itertools.product(range(vocab), repeat=m)):
            count, follow = brute(sequences, trie.depth, pattern)
            assert trie.count(pattern) == count, pattern
            assert trie.continuations(pattern) == follow, pattern


def test_counts_and_continuations_match_brute_force_while_sequences_grow_and_leave():
    """Several sequences growing in turns (a shared node may end another sequence's suffix), some removed midway:
    after every step the trie's counts are the brute-force ones, and removing everything frees every node."""
    rng = random.Random(0)
    for _ in range(60):
        vocab, depth = rng.choice([2, 3]), rng.choice([2, 3, 4, 5])
        trie, live = SuffixTrie(depth), {}
        for step in range(30):
            r = rng.random()
            if r < 0.15 or not live:
                live[step] = (trie.add(), [])
            elif r < 0.25:
                key = rng.choice(list(live))
                trie.remove(live.pop(key)[0])
            else:
                handle, tokens = live[rng.choice(list(live))]
                new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
                trie.extend(handle, new)
                tokens.extend(new)
            if step % 6 == 5:
                assert_counts(trie, [t for _, t in live.values()], vocab)
        assert trie.tokens == sum(len(t) for _, t in live.values())
        for handle, _ in live.values():
            trie.remove(handle)
        assert trie.nodes == 0 and trie.tokens == 0 and trie.root == {COUNT: 0}


def test_text_seen_once_is_leaves_and_repeats_share_nodes():
    trie = SuffixTrie(8)
    trie.add(list(range(50)))  # no token repeats: every suffix is one leaf under the root
    assert trie.nodes == 0 and len(trie.root) == 51
    trie.add(list(range(10)))  # its 10 suffixes share 10 + 9 + ... nodes (cut at depth 8) with the first
    assert trie.count([3, 4, 5]) == 2 and trie.continuations([3, 4]) == {5: 2}
    assert trie.nodes == sum(min(8, 10 - p) for p in range(10))


def test_longest_match_and_repeated_suffix():
    trie = SuffixTrie(6)
    seq = trie.add([5, 1, 2, 3, 9, 1, 2, 3])
    # in its own trie: the longest suffix seen earlier is [1, 2, 3], continued by 9
    m, where = trie.repeated(seq, longest=5)
    assert m == 3 and where[0][9] is not None
    assert trie.repeated(seq, longest=2)[0] == 2  # capped
    other = SuffixTrie(6)
    other.add([7, 1, 2, 3, 4, 4])
    assert other.longest_match([9, 9, 1, 2, 3], longest=5)[0] == 3
    assert other.longest_match([4, 4], longest=5)[0] == 1  # [4, 4] ends the sequence: [4] goes on with 4
    assert other.longest_match([8], longest=5) == (0, None)


def test_grow_scores_continuations_by_frequency():
    """After [1, 2]: 3 three times, 4 once. The tree's nodes score count(child) / count(parent) along the path."""
    trie = SuffixTrie(8)
    for tail in ([3, 5], [3, 5], [3, 6], [4, 7]):
        trie.add([1, 2, *tail])
    m, where = trie.longest_match([0, 1, 2], longest=6)
    assert m == 2
    tokens, parents, scores, _ = trie.grow(where, m, budget=4, max_depth=3, min_prob=0.0)
    assert tokens == [3, 5, 4, 6] and parents == [-1, 0, -1, 0]
    assert scores == pytest.approx([0.75, 0.5, 0.25, 0.25])
    # min_token_prob drops the rare branch; the budget stops the tree; fill takes nodes of any score
    assert trie.grow(where, m, budget=4, max_depth=3, min_prob=0.3)[0] == [3, 5]
    assert trie.grow(where, m, budget=1, max_depth=3, min_prob=0.0)[0] == [3]
    assert trie.grow(where, m, budget=1, max_depth=3, min_prob=0.9, fill=3)[0] == [3, 5, 4]
    assert trie.grow(where, m, budget=4, max_depth=1, min_prob=0.0)[0] == [3, 4]  # one level deep


# ----------------------------------------------------------------------------------------------- the cache


def test_cache_evicts_least_recently_used_requests_within_its_bound():
    cache = SuffixCache(max_tokens=30, depth=8)
    for key in "abc":
        cache.store(key, [ord(key)] * 10)
    assert list(cache.entries) == ["a", "b", "c"] and cache.tokens == 30
    cache.used([cache.entries["a"]])  # "a" drafted a proposal: now the most recently used
    cache.store("d", [1] * 10)
    assert list(cache.entries) == ["c", "a", "d"] and cache.tokens == 30  # "b" left, whole
    assert cache.trie.count([ord("b")]) == 0 and cache.trie.count([ord("a")]) == 10
    cache.store("a", [2] * 25)  # a key stored again replaces its entry; then "c" and "d" make room
    assert list(cache.entries) == ["a"] and cache.tokens == 25
    cache.store("e", list(range(100)))  # longer than the bound: kept cut to it
    assert list(cache.entries) == ["e"] and cache.tokens == 30
    for step in range(50):  # the bound holds whatever is stored
        cache.store(step, [step % 7] * (step % 13 + 1))
        assert cache.tokens <= 30
    cache.clear()
    assert cache.tokens == 0 and cache.trie.nodes == 0 and not cache.entries
    off = SuffixCache(max_tokens=0)
    off.store("x", [1, 2, 3])
    assert off.tokens == 0 and not off.entries


# ---------------------------------------------------------------------------------------------- the drafter


def run_rounds(drafter, context, accepts, gamma=4):
    """Propose / commit as the decode loop does: each round keeps accepts[r] drafts (a rejected draft is
    replaced by another token) and one more token. Returns the context."""
    context = list(context)
    for k in accepts:
        proposal = drafter.propose(torch.tensor(context), gamma, specdec.SamplingConfig(0.0), None)
        drafts = proposal.tokens.tolist()
        if proposal.parents is not None:  # follow the first branch
            path, node = [], -1
            for i, p in enumerate(proposal.parents.tolist()):
                if p == node:
                    path.append(drafts[i])
                    node = i
            drafts = path
        kept = drafts[: min(k, len(drafts))]
        context += kept + [95 - len(context) % 7]  # the recovered / bonus token
        drafter.commit(torch.tensor(context), len(kept))
    return context


def test_the_request_index_is_updated_incrementally_with_committed_tokens_only():
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    drafter = SuffixDecoding(max_nodes=6, max_depth=4, cache=SuffixCache(depth=12))
    drafter.reset(torch.tensor(prompt))
    context = run_rounds(drafter, prompt, accepts=[2, 0, 4, 1, 3])
    fresh = SuffixTrie(12)
    fresh.add(context)
    state = drafter.index  # the drafter's own trie vs one built from scratch on the committed context
    assert state.tokens == len(context)
    for m in (1, 2, 3):
        for start in range(len(context) - m + 1):
            pattern = context[start : start + m]
            assert state.count(pattern) == fresh.count(pattern)
            assert state.continuations(pattern) == fresh.continuations(pattern)


def test_proposes_the_continuation_of_an_earlier_request_and_reruns_are_drafted_afresh():
    cache = SuffixCache(depth=16)
    drafter = SuffixDecoding(max_nodes=8, max_depth=8, max_spec_offset=0, cache=cache)
    first = [10, 11, 12]
    drafter.reset(torch.tensor(first))
    output = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    drafter.commit(torch.tensor(first + output), 0)
    drafter.reset(torch.tensor([30, 31, 20, 21, 22, 23]))  # request 1 is over: its output is in the cache
    assert cache.tokens == len(output) and len(cache) == 1
    proposal = drafter.propose(torch.tensor([30, 31, 20, 21, 22, 23]), 8, specdec.SamplingConfig(0.0), None)
    assert proposal.tokens.tolist() == [24, 25, 26, 27] and proposal.parents is None  # 4 matched: 4 nodes
    assert drafter.last["matched"] == {"cache": 4}  # the request itself has no repeat
    drafter.commit(torch.tensor([30, 31, 20, 21, 22, 23, 24]), 0)
    drafter.reset(torch.tensor(first))  # request 1 again: its cached entry leaves, it drafts as the first time did
    assert len(cache) == 1 and cache.tokens == 1  # request 2's output, [24]
    drafter.commit(torch.tensor(first + [20, 21]), 0)
    assert drafter.propose(torch.tensor(first + [20, 21]), 8, specdec.SamplingConfig(0.0), None).tokens.tolist() == []


def test_a_tree_where_continuations_disagree():
    cache = SuffixCache(depth=16)
    for key, tail in enumerate(([7, 8], [7, 8], [7, 9], [6, 5])):
        cache.store(key, [1, 2, 3, *tail])
    drafter = SuffixDecoding(max_nodes=8, max_depth=4, min_token_prob=0.2, max_spec_offset=2, cache=cache)
    drafter.reset(torch.tensor([4, 1, 2, 3]))
    proposal = drafter.propose(torch.tensor([4, 1, 2, 3]), 4, specdec.SamplingConfig(1.0), None)
    assert proposal.tokens.tolist() == [7, 8, 6, 9, 5] and proposal.parents.tolist() == [-1, 0, -1, 0, 2]
    assert proposal.draft_probs is None  # point masses: exact at every temperature


def test_fast_path_budgets_pad_the_tree_to_the_compiled_widths():
    drafter = SuffixDecoding(max_nodes=12, max_depth=8)
    assert drafter.plan(None) == ()
    assert SuffixDecoding().capabilities.default_gamma == 7  # the default tree (7 nodes) is at most 7 deep
    drafter.use_fast_path(True)
    assert drafter.plan(None) == tuple(b for b in FAST_BUDGETS if b < 12) + (12,)
    cache = SuffixCache(depth=16)
    cache.store(0, [1, 2, 3, 4, 5, 6, 7, 8, 9] * 2)
    for fast, want in ((False, 2), (True, 3)):  # a 2-token match earns 2 nodes; the fast path pays for 3
        drafter = SuffixDecoding(max_nodes=12, max_depth=8, max_spec_offset=0, cache=cache)
        drafter.use_fast_path(fast)
        drafter.reset(torch.tensor([0, 1, 2]))
        assert len(drafter.propose(torch.tensor([0, 1, 2]), 8, specdec.SamplingConfig(0.0), None)) == want


@pytest.mark.parametrize("kwargs", [dict(max_nodes=0), dict(max_depth=0), dict(max_spec_factor=-1),
                                    dict(min_token_prob=1.5), dict(max_depth=40), dict(cache="shared"),
                                    dict(max_nodes=True)])
def test_bad_arguments_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        SuffixDecoding(**kwargs)


def test_bad_cache_arguments_raise_config_error():
    with pytest.raises(ConfigError):
        SuffixCache(max_tokens=-1)
    with pytest.raises(ConfigError):
        SuffixCache(depth=1)


def test_forks_share_the_cache_and_batch_rows_feed_it_when_they_leave():
    """Batched: one fork per row on the drafter's cache; a row's output enters it when the row leaves; each row's
    tokens are the lone request's (greedy)."""
    target = tiny("llama", hidden=32, layers=2)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8, 9], [3, 4, 3]]
    drafter = SuffixDecoding(max_nodes=6, max_depth=4)
    fork = drafter.fork()
    assert fork.cache is drafter.cache and fork.index is not drafter.index
    assert isinstance(drafter.capabilities.batched(drafter), SuffixRows)
    lone = [specdec.generate(target, p, drafter=SuffixDecoding(max_nodes=6, max_depth=4), max_new_tokens=12,
                             eos_token_id=[]).tokens
            for p in prompts]
    out = generate_batch(target, prompts, drafter=drafter, max_new_tokens=12, eos_token_id=[])
    assert [o.tokens for o in out] == lone
    assert len(drafter.cache) == 3 and drafter.cache.tokens == 3 * 12


def test_a_server_decoder_keeps_one_cache_across_requests():
    """The server's decoder (a BatchDecoder over the one drafter it was given): a request that finished is in the
    cache when the next one starts, and the next one's row drafts from that same cache."""
    target = tiny("llama", hidden=32, layers=2)
    drafter = SuffixDecoding(max_nodes=6, max_depth=4, cache=SuffixCache(max_tokens=40))
    decoder = BatchDecoder(target, drafter)
    outputs = []
    for key, prompt in enumerate(([5, 6, 7], [8, 9], [10, 11, 12], [13])):
        decoder.add(key, prompt, gamma=4, max_new_tokens=16, eos_token_id=[])
        got = []
        while len(decoder):
            for event in decoder.step():
                got.extend(event.tokens)
        outputs.append(got)
        assert drafter.cache.entries and drafter.cache.tokens <= 40  # bounded: the oldest requests left
        assert list(drafter.cache.entries.values())[-1] == got  # the request just finished, whole
    assert len(drafter.cache) == 2


# ------------------------------------------------------------------------------------------ negative control


@pytest.mark.statistical
def test_negative_control_frequencies_reported_as_q():
    """The tree's frequency estimates reported as the distribution its siblings were drawn from (they are point
    masses): verification then accepts a child with min(1, r/q) for q < 1, too often. Caught at p < 1e-6."""
    target = tiny("llama", hidden=16, layers=2, vocab=8, seed=0)
    drafter = suffix_drafter(FrequencyQSuffix)
    result = check_exactness(target, [1, 2, 1, 1, 2], drafter, gamma=3, temperature=1.0, max_new_tokens=3,
                             samples=3000, seed=1234, eos_token_id=[])
    assert not result.passed and result.p_value < 1e-6, result.summary()

