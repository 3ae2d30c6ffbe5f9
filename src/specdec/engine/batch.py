"""Batched speculative decoding: the round of `round.py` over rows that join and leave.

Each row is one request with its own prompt, `DecodeOptions` (sampling settings, EOS set, seed), random
generator, γ policy and statistics; rows accept different numbers of tokens each round (the batched target
keeps per-row cache lengths: `BatchedCausalLM`, docs/batching.md). The round, the verification, the tree check,
the vocabulary rule and the γ rule are a lone request's, so a row is what the same request decoded alone gives
(token-identical at T = 0; at T > 0 a seeded row makes the lone request's draws).

The drafter runs in the batched form its capabilities declare (`DrafterCapabilities.batched`): a `DraftModel`
or `LayerSkip` as one batched draft model for every row (`BatchedDraftModel`), `Eagle` and `Medusa` as a fork
per row fed the target's features, their head passes batched (`BatchedEagle`, `BatchedMedusa`), model-free and
tree drafters as a fork per row (`PerRow`; every row's tree scored in the one target pass). A drafter that
declares no batched form (a draft with another tokenizer, a user's drafter) is refused.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from specdec.drafters.base import BatchSetting, Drafter, DrafterCapabilities, RowDrafters
from specdec.engine.options import DecodeOptions, check_compile
from specdec.engine.pairing import batched_form, check_drafter
from specdec.engine.policies import gamma_policy
from specdec.engine.request import GenerationOutput, Row, new_row
from specdec.engine.round import Engine, RowEvent
from specdec.engine.targets import ManyRows
from specdec.engine.verification import Verifier
from specdec.errors import ConfigError, PromptError
from specdec.runtime.batch_static import batched_adapter
from specdec.runtime.threads import threads_for

__all__ = ["BatchDecoder", "RowEvent", "generate_batch"]


class BatchDecoder:
    """Continuous batching of speculative decoding: `add` rows, run `step` rounds, rows leave when done."""

    def __init__(self, target: PreTrainedModel, drafter: Drafter | None = None, compile: bool | str = False,
                 max_len: int | None = None):
        # compile: True = the target on the batched fast path (compiled passes over a preallocated cache of
        # max_len slot columns; None: grown as needed), "static" = the same cache eager, False =
        # BatchedCausalLM (batch_static.batched_adapter).
        compile = check_compile(compile)
        adapter = batched_adapter(target, compile, max_len)
        self.model = target
        self.drafter = check_drafter(drafter, adapter.vocab_size)
        self.capabilities = drafter.capabilities if drafter is not None else DrafterCapabilities()
        self.setting = BatchSetting(compile, max_len, adapter)  # the draft on the target's path (or in its cache)
        drafters = batched_form(drafter, self.setting)
        self.engine = Engine(ManyRows(adapter, self.capabilities.needs_hidden), drafters, Verifier())
        self.rows: list[Row] = []
        self.last_round: dict | None = None  # the last step's draft_s, target_s, pass width (the server's cost model)

    # -- the parts ------------------------------------------------------------------------------------
    @property
    def target(self):
        """The batched target adapter (`BatchedCausalLM`, `StaticBatchedCausalLM`); assignable before rows join."""
        return self.engine.target.adapter

    @target.setter
    def target(self, adapter) -> None:
        self.engine.target = ManyRows(adapter, self.capabilities.needs_hidden)
        self.setting = replace(self.setting, target=adapter)
        self.engine.drafters = batched_form(self.drafter, self.setting)  # a form drafting in the old one's cache

    @property
    def drafters(self) -> RowDrafters | None:
        """The drafter's batched form over the rows (None: plain decoding)."""
        return self.engine.drafters

    @property
    def trees(self) -> bool:
        """Are tree proposals scored as trees (else: their first branch, as a lone request's target would)?"""
        return self.capabilities.tree and self.engine.target.scores_tree(None, 2)

    @property
    def window(self) -> int | None:
        """The target's sliding attention window (None: full attention): a batched request must fit inside it."""
        return self.engine.target.window

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def keys(self) -> list[object]:
        return [row.key for row in self.rows]

    # -- rows join and leave --------------------------------------------------------------------------
    def add(self, key: object, prompt_ids: Sequence[int] | torch.Tensor, options: DecodeOptions | None = None,
            **kwargs) -> None:
        """Prefill a new row and splice it into the batch; the others' caches are untouched.

        options: a `DecodeOptions`, or its fields as keyword arguments (gamma, max_new_tokens, temperature,
        top_k, top_p, eos_token_id, seed, logprobs).
        """
        self.add_many([(key, prompt_ids, options if options is not None else kwargs)])

    def add_many(self, requests: Sequence[tuple[object, Sequence[int] | torch.Tensor, DecodeOptions | dict]]) -> None:
        """Add several rows (key, prompt_ids, options: a `DecodeOptions` or a dict of its fields) with one
        batched prefill. Raises before prefilling anything if one request is invalid (call `check` first to
        reject requests one by one). Runs with specdec's thread count (`threads.decode_threads`)."""
        rows = [self.check(key, prompt, options) if isinstance(options, DecodeOptions) else
                self.check(key, prompt, **options) for key, prompt, options in requests]
        if not rows:
            return
        start = time.perf_counter()
        with threads_for(self.model):
            self.engine.add_rows(rows)
        prefill_s = time.perf_counter() - start
        for row in rows:
            row.stats.prefill_s = prefill_s
        self.rows.extend(rows)

    def check(self, key: object, prompt_ids: Sequence[int] | torch.Tensor, options: DecodeOptions | None = None,
              **kwargs) -> Row:
        """Validate one request and build its (not yet prefilled) row; raises a SpecdecError if invalid.

        options: a `DecodeOptions`, or its fields as keyword arguments (logprobs: None (off) or k >= 0: each
        event carries the emitted tokens' target log-probabilities and the k most likely alternatives)."""
        options = DecodeOptions.given(options, **kwargs)
        policy = gamma_policy(options.gamma, self.target, self.drafter)  # as a lone request's
        return new_row(key, prompt_ids, options, self.engine.target, policy)

    def remove(self, keys: Sequence[object]) -> None:
        """Drop the rows with these keys (finished, cancelled, failed) between rounds. The last rows move into
        the places freed (a row's output does not depend on its place), so the caches copy only those rows."""
        drop = set(keys)
        gone = [i for i, row in enumerate(self.rows) if row.key in drop]
        if not gone:
            return
        keep = fill_from_the_end(len(self.rows), gone)
        self.rows = [self.rows[i] for i in keep]
        self.engine.remove_rows(keep)

    # -- one round ------------------------------------------------------------------------------------
    def step(self, gamma_cap: int | dict[object, int | None] | None = None) -> list[RowEvent]:
        """One round for every row: propose, score, verify, commit, emit (`round.Engine.run`). Finished and
        failed rows are removed.

        gamma_cap: an upper bound on every row's γ this round (the server's load-based choice; 0 = plain),
        or a dict from row key to its own bound (None: not bounded). Runs with specdec's thread count
        (`threads.decode_threads`; the server's scheduler thread re-measures it as it ages).
        """
        if not self.rows:
            return []
        rows = self.rows
        with threads_for(self.model):
            events = self.engine.run(rows, self.engine.gammas(rows, gamma_cap))
        self.last_round = self.engine.last_round
        self.remove([event.key for event in events if event.finished])
        return events


def fill_from_the_end(count: int, gone: Sequence[int]) -> list[int]:
    """The rows kept when the rows at indices `gone` of `count` leave: each freed place below the new count
    takes a kept row from the end; every other row stays where it is."""
    left = count - len(gone)
    keep = list(range(left))
    leaving = set(gone)
    tail = [i for i in range(left, count) if i not in leaving]  # kept rows past the new end
    for place in gone:
        if place < left:
            keep[place] = tail.pop()
    return keep


def generate_batch(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    drafter: Drafter | None = None,
    gamma: int | str | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | Sequence[int] | None = None,
    compile: bool | str = False,
) -> list[GenerationOutput]:
    """`specdec.generate` for several prompts at once, batched: one output per prompt, in order.

    Each output is what `generate` gives for that prompt alone (token-identical at temperature 0; at T > 0
    exactly distributed, and with the same seed the same draws as a lone request). `seed`: one seed for
    every row, or one per prompt. `gamma` left unset: a tree drafter's own depth, else the chain default.
    compile=True: the target's passes run compiled over a preallocated cache (`StaticBatchedCausalLM`; the
    same tokens; falls back to eager with a `FastPathWarning` where the model cannot); "static": that cache, eager.
    """
    if isinstance(prompts, torch.Tensor) and prompts.dim() == 1:
        raise PromptError("generate_batch takes a list of prompts; for a single prompt use specdec.generate")
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    if len(seeds) != len(prompts):
        raise ConfigError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed or one per prompt")
    options = [DecodeOptions(gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, eos_token_id=eos_token_id, seed=s) for s in seeds]
    decoder = BatchDecoder(target, drafter, compile=compile)
    decoder.add_many([(i, prompt, options[i]) for i, prompt in enumerate(prompts)])
    stats = {row.key: row.stats for row in decoder.rows}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while len(decoder):
        for event in decoder.step():
            if event.error is not None:
                raise event.error
            tokens[event.key].extend(event.tokens)
    return [GenerationOutput(tokens=tokens[i], stats=stats[i]) for i in range(len(prompts))]
