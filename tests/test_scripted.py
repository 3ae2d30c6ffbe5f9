"""Scripted toy models with controlled agreement: every rejection position 0..γ and full acceptance.

A scripted LM's next-token distribution depends only on the position, so we decide exactly where the draft
disagrees with the target, and assert both KV caches' lengths after every round. Every test runs on the
eager adapter (DynamicCache, cropped) and on the fast path's slot cache (compile="static": rollback is a
length-pointer move, verification passes padded to a fixed bucket).
"""

from __future__ import annotations

import pytest
import torch
from models import ScriptedLM, one_hot_table

import specdec
from specdec.engine.decoding import SpeculativeDecoder

V = 8
TARGET_SEQ = [(3 * i + 1) % V for i in range(200)]


class RecordingDraft(specdec.DraftModel):
    """A DraftModel that records after every commit: (accepted, context length, target cache, own cache, γ')."""

    def __init__(self, model):
        super().__init__(model)
        self.decoder = None
        self.rounds: list[tuple[int, int, int, int, int]] = []

    def commit(self, context, num_accepted):
        super().commit(context, num_accepted)
        drafted = self.decoder.stats.gammas[-1]
        self.rounds.append((num_accepted, context.shape[0], self.decoder.target.length, self.lm.length, drafted))


CACHES = pytest.mark.parametrize("compile", [False, "static"], ids=["dynamic-cache", "slot-cache"])


def decode(target_seq, draft_seq, prompt_len, gamma, max_new_tokens, temperature=0.0, seed=0, compile=False,
           eos=()):
    target = ScriptedLM(one_hot_table(target_seq, V), V)
    drafter = RecordingDraft(ScriptedLM(one_hot_table(draft_seq, V), V))
    decoder = SpeculativeDecoder(target, drafter, gamma=gamma, max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed, eos_token_id=list(eos), compile=compile)
    drafter.decoder = decoder
    tokens = list(decoder.stream(target_seq[:prompt_len]))
    return tokens, drafter.rounds, decoder, target


@CACHES
@pytest.mark.parametrize(("gamma", "reject_at"), [(g, j) for g in (1, 4) for j in range(g + 1)])
def test_rejection_at_each_position_then_caches_roll_back(gamma, reject_at, compile):
    prompt_len = 6
    draft_seq = list(TARGET_SEQ)
    if reject_at < gamma:  # reject_at == gamma: every draft agrees (full acceptance + bonus)
        draft_seq[prompt_len + reject_at] = (draft_seq[prompt_len + reject_at] + 1) % V
    tokens, rounds, decoder, _ = decode(TARGET_SEQ, draft_seq, prompt_len, gamma, max_new_tokens=gamma + 1,
                                        compile=compile)

    assert tokens == TARGET_SEQ[prompt_len : prompt_len + gamma + 1]  # all gamma + 1 tokens, none lost
    assert len(rounds) == (1 if reject_at == gamma else 2)  # a rejection leaves room for a second round
    accepted, n, target_len, draft_len, _ = rounds[0]
    assert accepted == reject_at
    assert n == prompt_len + reject_at + 1  # accepted drafts + one recovered/bonus token
    assert target_len == n - 1  # the target holds everything but the newest token
    if reject_at < gamma:
        assert draft_len == n - 1  # rolled back to the committed context
        assert decoder.stats.recovered == 1
    else:
        assert draft_len == n - 2  # never fed its own last draft: catches up next round
        assert decoder.stats.bonus == 1


@CACHES
def test_many_rounds_with_scattered_disagreements_keep_invariants(compile):
    prompt_len, gamma = 3, 4
    draft_seq = list(TARGET_SEQ)
    for pos in (5, 6, 11, 19, 20, 21, 30, 44, 45):
        draft_seq[pos] = (draft_seq[pos] + 3) % V
    tokens, rounds, decoder, target = decode(TARGET_SEQ, draft_seq, prompt_len, gamma, max_new_tokens=50,
                                              compile=compile)

    assert tokens == TARGET_SEQ[prompt_len : prompt_len + 50]
    assert {r[0] for r in rounds} >= {0, gamma}  # saw both an immediate rejection and full acceptance
    for accepted, n, target_len, draft_len, drafted in rounds:
        assert target_len == n - 1
        # The slot-cache drafter drafts a γ it has compiled (4) even when the decoder keeps fewer (the short
        # last round), so after that round it has fed the last accepted draft too.
        fed_last = compile and drafted < gamma
        assert draft_len == (n - 2 if accepted == drafted and not fed_last else n - 1)
    # The prompt was prefilled once and never recomputed: position 0 went through the target once.
    assert target.seen_positions.count(0) == 1
    assert decoder.stats.target_forwards == len(rounds)
    assert decoder.stats.accepted == sum(r[0] for r in rounds)


@CACHES
@pytest.mark.parametrize("eos_at", [0, 1, 2, 3])
def test_eos_inside_an_accepted_run_ends_the_output(eos_at, compile):
    """Every draft agrees and the EOS is the (eos_at+1)-th new token: at eos_at < γ it is an accepted draft
    with more accepted drafts (and a bonus token) after it in the same round; nothing after it is emitted."""
    prompt_len, gamma = 4, 4
    eos = TARGET_SEQ[prompt_len + eos_at]
    assert eos not in TARGET_SEQ[prompt_len : prompt_len + eos_at]  # its first occurrence
    tokens, rounds, decoder, _ = decode(TARGET_SEQ, TARGET_SEQ, prompt_len, gamma, max_new_tokens=20, eos=[eos],
                                        compile=compile)
    assert tokens == TARGET_SEQ[prompt_len : prompt_len + eos_at + 1]
    assert rounds[0][0] == gamma  # the whole round was accepted, tokens after the EOS included
    assert decoder.stats.new_tokens == eos_at + 1
    assert decoder.last_token_source == "accepted"


@CACHES
def test_max_new_tokens_cut_drafts_fewer(compile):
    tokens, rounds, decoder, _ = decode(TARGET_SEQ, TARGET_SEQ, 4, gamma=4, max_new_tokens=7, compile=compile)
    assert len(tokens) == 7
    assert decoder.stats.gammas == [4, 1]  # 5 tokens, then only 2 remain: draft 1 + bonus
    assert (decoder.stats.bonus, decoder.stats.target_only) == (2, 0)


@CACHES
def test_a_round_with_no_room_to_draft_is_a_target_round(compile):
    tokens, _, decoder, _ = decode(TARGET_SEQ, TARGET_SEQ, 4, gamma=4, max_new_tokens=6, compile=compile)
    assert tokens == TARGET_SEQ[4:10]
    s = decoder.stats
    assert s.gammas == [4, 0]  # 5 tokens, then only 1 remains: nothing drafted, the target's own token
    assert (s.bonus, s.recovered, s.target_only) == (1, 0, 1)
    assert decoder.last_token_source == "target"


@CACHES
def test_sampling_mode_keeps_the_same_cache_invariants(compile):
    def target_table(pos):
        g = torch.Generator().manual_seed(pos)
        return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)

    def draft_table(pos):
        g = torch.Generator().manual_seed(pos + (0 if pos % 3 else 1000))
        return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)

    drafter = RecordingDraft(ScriptedLM(draft_table, V))
    decoder = SpeculativeDecoder(ScriptedLM(target_table, V), drafter, gamma=3, max_new_tokens=60,
                                 temperature=1.0, seed=4, eos_token_id=[], compile=compile)
    drafter.decoder = decoder
    tokens = list(decoder.stream([1, 2]))
    assert len(tokens) == 60
    assert 0 < decoder.stats.accepted < decoder.stats.drafted
    for accepted, n, target_len, draft_len, drafted in drafter.rounds:
        assert target_len == n - 1
        fed_last = compile and drafted < 3  # see test_many_rounds_with_scattered_disagreements_keep_invariants
        assert draft_len == (n - 2 if accepted == drafted and not fed_last else n - 1)
