"""Batched speculative decoding: the same round as `decoding.py`, over rows that join and leave.

    rows' drafters propose  →  target scores every row in one pass  →  verify each row  →  commit each row

Each row is one request with its own prompt, sampling settings, random generator, γ policy, EOS set and
statistics. Rows accept different numbers of tokens each round; `BatchedCausalLM` keeps per-row cache
lengths (docs/batching.md). Verification is `decoding.verify_round` on the row's own slice of the logits,
with the row's own generator, so a row draws the same random numbers as the same request decoded alone.

Drafters: a `DraftModel` and `LayerSkip` (the target's first layers as a draft model) are batched
(`drafters.batched.BatchedDraftModel`: one draft forward per step for all rows); every other drafter gets one
`fork()` per row: model-free drafters (prompt lookup, bigram), tree drafters (`DraftTree`, `MultiDraft`:
each row grows its own tree with its own draft cache; the target scores every row's tree in one pass with a
per-row tree block in a 4-D mask) and head drafters (`Eagle`, `Medusa`: `drafters.batched_heads.BatchedHeads`, fed the
features of each row's root and accepted path from the target's pass). Other drafters are refused.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.core.tree import TreeMask
from specdec.core.verify import Verdict, greedy_verdict, verify_tree
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal, RowDrafters
from specdec.engine.verification import verify_round
from specdec.engine.options import DecodeOptions, check_compile
from specdec.engine.pairing import batched_form, check_drafter
from specdec.engine.policies import gamma_policy
from specdec.engine.proposals import ready
from specdec.engine.request import GenerationOutput, Row, check_prompt_fits, eos_ids, prompt_tensor, seeded_generator
from specdec.errors import ConfigError, IncompatibleModelsError, PromptError, ProposalError, SpecdecError
from specdec.runtime.base import check_finite
from specdec.runtime.batch_lm import BatchedCausalLM
from specdec.runtime.batch_static import StaticBatchedCausalLM, batched_adapter, no_features
from specdec.runtime.causal_lm import CachedCausalLM, context_length, sliding_window
from specdec.runtime.threads import threads_for


@dataclass
class RowEvent:
    """What one round produced for one row."""

    key: object
    tokens: list[int]  # new final tokens (cut after an EOS)
    accepted: int  # how many of them were accepted drafts
    drafted: int
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    error: SpecdecError | None = None  # decoding failed for this row only; it has been removed
    # With the row's `logprobs` set: per emitted token, its log-probability under the target's raw
    # distribution (the verification pass's logits, before temperature / top-k / top-p), and the
    # `logprobs` most likely (token, log-probability) pairs there.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class BatchDecoder:
    """Continuous batching of speculative decoding: `add` rows, run `step` rounds, rows leave when done."""

    def __init__(self, target: PreTrainedModel, drafter: Drafter | None = None, compile: bool | str = False,
                 max_len: int | None = None):
        # compile: True = the target on the batched fast path (compiled passes over a preallocated cache of
        # max_len slot columns; None: grown as needed), "static" = the same cache eager, False =
        # BatchedCausalLM (batch_static.batched_adapter).
        self.target = batched_adapter(target, check_compile(compile), max_len)
        self.model = target
        self.limit = context_length(target)
        # A sliding window counts cache slots, holes included: a batched request must fit inside it.
        self.window = sliding_window(target)
        self.drafter = check_drafter(drafter, self.target.vocab_size)
        self.capabilities = drafter.capabilities if drafter is not None else DrafterCapabilities()
        # The drafter's form over the rows (one batched draft model, batched heads, or a fork per row).
        self.drafters: RowDrafters | None = batched_form(drafter)
        self.hidden = self.capabilities.needs_hidden  # what the target's passes return besides logits
        if self.hidden and isinstance(self.target, StaticBatchedCausalLM):
            no_features(self.hidden)  # one clear error before any work
        # Can the target score tree proposals (else: their first branch, as generate does)?
        self.trees = self.capabilities.tree and CachedCausalLM(target).supports_tree(2)
        self.rows: list[Row] = []
        self.last_round: dict | None = None  # the last step's draft_s, target_s, pass width (the server's cost model)

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
        with threads_for(self.model):
            self._add_many(requests)

    def _add_many(self, requests: Sequence[tuple[object, Sequence[int] | torch.Tensor, DecodeOptions | dict]]) -> None:
        rows = [self.check(key, prompt, options) if isinstance(options, DecodeOptions) else
                self.check(key, prompt, **options) for key, prompt, options in requests]
        if not rows:
            return
        start = time.perf_counter()
        prefixes = [row.context[: row.n - 1] for row in rows]
        features = self.target.add_rows(prefixes, hidden=self.hidden)  # per row [n-1, H] | None, with heads
        if self.drafters is not None:
            self.drafters.add_rows(rows, features)
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
        prompt = prompt_tensor(prompt_ids, self.target.vocab_size)  # [n0]
        n = prompt.shape[0]
        check_prompt_fits(n, options.max_new_tokens, self.limit)
        if self.window is not None and (self.limit is None or self.window < self.limit):
            check_prompt_fits(n, options.max_new_tokens, self.window, "the target's sliding attention window",
                              "batched rows share cache slots, so the window cannot be passed: shorten the prompt, "
                              "lower max_new_tokens, or decode this request alone with specdec.generate")
        self.target.check_fits(n + options.max_new_tokens)
        generator = seeded_generator(options.seed, self.target.device)
        context = torch.empty(n + options.max_new_tokens + 1, dtype=torch.long, device=self.target.device)
        context[:n] = prompt
        return Row(key, context, n, options, generator, policy, eos_ids(self.model, options.eos_token_id))

    def remove(self, keys: Sequence[object]) -> None:
        """Drop the rows with these keys (finished, cancelled, failed) between rounds."""
        drop = set(keys)
        keep = [i for i, row in enumerate(self.rows) if row.key not in drop]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.target.remove_rows(keep)
        if self.drafters is not None:
            self.drafters.remove_rows(keep)

    # -- one round ------------------------------------------------------------------------------------
    def step(self, gamma_cap: int | dict[object, int | None] | None = None) -> list[RowEvent]:
        """One round for every row: propose, score, verify, commit, emit. Finished rows are removed.

        gamma_cap: an upper bound on every row's γ this round (the server's load-based choice; 0 = plain),
        or a dict from row key to its own bound (None: not bounded). Runs with specdec's thread count
        (`threads.decode_threads`; the server's scheduler thread re-measures it as it ages).
        """
        if not self.rows:
            return []
        with threads_for(self.model):
            return self._step(gamma_cap)

    def _step(self, gamma_cap: int | dict[object, int | None] | None) -> list[RowEvent]:
        rows = self.rows
        keys = [row.key for row in rows]
        gammas = [self._gamma(row, gamma_cap) for row in rows]

        # 1. drafters propose.
        t = time.perf_counter()
        proposals, trees, errors = self._propose(rows, gammas)
        draft_s = time.perf_counter() - t

        # 2. target scores every row: its last committed token and its drafts (a chain, or a tree's nodes).
        t = time.perf_counter()
        inputs = [torch.cat([row.context[row.n - 1 : row.n], p.tokens]) for row, p in zip(rows, proposals)]
        width = max(x.shape[0] for x in inputs)
        if self.window is not None and self.target.slots + width > self.window:
            self.target.compact()  # every row's tokens and inputs then span at most prompt + new tokens <= window
        scores = self.target.score(inputs, trees=trees, hidden=self.hidden)
        target_logits = scores.logits  # [B, W, V]
        width = target_logits.shape[1]
        target_s = time.perf_counter() - t
        self.last_round = {"draft_s": draft_s, "target_s": target_s, "width": int(target_logits.shape[1])}

        # One finiteness check and one argmax for the whole pass (rows are re-checked one by one only if the
        # pass has a non-finite value somewhere, which may be a padding column).
        all_finite = bool(torch.isfinite(target_logits).all())
        greedy = [row.sampling.greedy and tree is None for row, tree in zip(rows, trees)]
        best = target_logits.argmax(dim=-1).tolist() if any(greedy) else None  # [B, W]

        events, kept_lengths, accepted, features, emits = [], [], [], [], []
        for i, (row, proposal) in enumerate(zip(rows, proposals)):
            gamma = len(proposal)
            logits = target_logits[i, : gamma + 1]  # [γ+1, V] (a tree: [N+1, V], row 0 the root)
            try:
                if errors[i] is not None:
                    raise errors[i]
                if not all_finite:
                    check_finite(logits, self.model, f"for request {row.key!r}")
                # 3. verify this row with its own generator.
                verdict, accepted_tokens, keep = self._verify_row(row, proposal, trees[i], logits,
                                                                  best[i] if greedy[i] else None)
                if trees[i] is not None:
                    self.target.keep_new(i, width, keep)  # root + path
            except SpecdecError as exc:
                kept_lengths.append(row.n - 1)
                accepted.append(None)
                features.append(None)
                events.append(RowEvent(row.key, [], 0, gamma, True, None, exc))
                continue
            # 4. commit: the target keeps context + accepted drafts; append the next token.
            kept_lengths.append(row.n + verdict.num_accepted)
            features.append(scores.hidden[i, keep] if self.hidden else None)  # root + accepted path: [k+1, H]
            accepted.append(verdict.num_accepted)
            new_tokens = self._commit_row(row, gamma, verdict, accepted_tokens, target_s, draft_s)
            emits.append((i, new_tokens, verdict.num_accepted, gamma, logits))

        self.target.crop(kept_lengths)
        if self.drafters is not None:
            t = time.perf_counter()
            self.drafters.commit(rows, accepted, features)
            commit_s = time.perf_counter() - t
            for row, k in zip(rows, accepted):
                if k is not None:
                    row.stats.draft_s += commit_s
        for row, k in zip(rows, accepted):
            if k is not None:
                row.gamma_policy.update(row.stats)
        # 5. emit, stopping at the first EOS or max_new_tokens.
        events += [self._emit(rows[i], new_tokens, k, gamma, logits) for i, new_tokens, k, gamma, logits in emits]
        events.sort(key=lambda e: keys.index(e.key))
        done = [e.key for e in events if e.finished]
        self.remove(done)
        return events

    def _gamma(self, row: Row, gamma_cap: int | dict[object, int | None] | None) -> int:
        """γ for `row` this round: its policy's choice, within max_new_tokens and the server's cap."""
        remaining = row.max_new_tokens - row.produced
        gamma = min(row.gamma_policy.choose(row.stats), remaining - 1) if self.drafter is not None else 0
        cap = gamma_cap.get(row.key) if isinstance(gamma_cap, dict) else gamma_cap
        if cap is not None:
            gamma = min(gamma, cap)
        return max(0, gamma)

    @staticmethod
    def _verify_row(row: Row, proposal: Proposal, tree: TreeMask | None, logits: torch.Tensor,
                    best: list[int] | None) -> tuple[Verdict, list[int], list[int]]:
        """3. one row's verdict with its own generator, from logits [γ+1, V] (a tree: [N+1, V]); best: the
        pass's argmax of this row when it is greedy and a chain. Returns (verdict, accepted tokens [k], the
        rows of the pass to keep: root + accepted)."""
        if best is not None:
            drafts = proposal.tokens.tolist()
            verdict = greedy_verdict(drafts, best)
            accepted = drafts[: verdict.num_accepted]
        elif tree is None:
            verdict = verify_round(proposal.tokens, proposal.draft_probs, logits, row.sampling, row.generator)
            accepted = proposal.tokens[: verdict.num_accepted].tolist()  # [k]
        else:
            verdict = verify_tree(proposal, logits, row.sampling, row.generator)
            path = list(verdict.path)  # [k] node indices
            accepted = proposal.tokens[path].tolist()  # [k]
        keep = list(range(len(accepted) + 1)) if tree is None else [0] + [node + 1 for node in verdict.path]
        return verdict, accepted, keep

    @staticmethod
    def _commit_row(row: Row, gamma: int, verdict: Verdict, accepted: list[int], target_s: float,
                    draft_s: float) -> list[int]:
        """4. append the accepted drafts and the next token to the row's context, record the round. Returns the
        new tokens."""
        k = verdict.num_accepted
        new_tokens = accepted + [verdict.next_token]
        row.context[row.n : row.n + k + 1] = torch.tensor(new_tokens, device=row.context.device)
        row.n += k + 1
        stats = row.stats
        stats.record_round(gamma, k, verdict.outcome)
        stats.target_s += target_s
        stats.draft_s += draft_s
        stats.target_forwards += 1
        return new_tokens

    @staticmethod
    def _emit(row: Row, new_tokens: list[int], k: int, gamma: int, logits: torch.Tensor) -> RowEvent:
        """5. the row's event: its new tokens up to the first EOS or max_new_tokens (with their logprobs when
        asked, from logits [γ+1, V])."""
        emitted, reason = [], None
        for token in new_tokens:
            emitted.append(token)
            row.produced += 1
            if token in row.eos:
                reason = "stop"
                break
            if row.produced >= row.max_new_tokens:
                reason = "length"
                break
        stats = row.stats
        stats.new_tokens = row.produced
        stats.wall_s = time.perf_counter() - row.started
        event = RowEvent(row.key, emitted, min(k, len(emitted)), gamma, reason is not None, reason)
        if row.logprobs is not None:
            event.logprobs, event.top_logprobs = _token_logprobs(logits[: len(emitted)], emitted, row.logprobs)
        return event

    def _propose(self, rows: list[Row], gammas: list[int]):
        """Each row's proposal (a chain, or a tree with its mask), and a ProposalError for rows whose drafter
        proposed something invalid (that row alone fails; its proposal is replaced by an empty one)."""
        empty = Proposal(torch.empty(0, dtype=torch.long, device=self.target.device))
        none = [None] * len(rows)
        if self.drafter is None or not any(gammas):
            return [empty for _ in rows], none, none
        raw = self.drafters.propose(rows, gammas)
        out, trees, errors = [], [], []
        for row, gamma, p in zip(rows, gammas, raw):
            tree, error = None, None
            if p.parents is not None:
                try:
                    p, tree = self._check_tree(p, gamma, row.n)
                except ProposalError as exc:
                    p, error = empty, exc
            if tree is None:
                gamma = min(gamma, len(p))
                p = Proposal(p.tokens[:gamma], None if p.draft_probs is None else p.draft_probs[:gamma])
            out.append(p)
            trees.append(tree)
            errors.append(error)
        return out, trees, errors

    def _check_tree(self, proposal: Proposal, gamma: int, n: int) -> tuple[Proposal, TreeMask | None]:
        """As the single-request decoder: validate, cap the depth at γ, and score a chain (or, when the target
        cannot take a 4-D mask, the first branch) as a chain."""
        room = None if self.limit is None else self.limit - n
        proposal, tree, _ = ready(proposal, gamma, self.target.vocab_size, room, lambda rows: self.trees)
        return proposal, tree


def _token_logprobs(logits: torch.Tensor, tokens: list[int], top: int):
    """logits [m, V] (row j scored token j): the tokens' log-probabilities and the `top` best per position."""
    logp = torch.log_softmax(logits, dim=-1)  # [m, V] (float32 or float64, as the forward returned)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()  # [m]
    if top == 0:
        return chosen, [[] for _ in tokens]
    values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [m, top]
    return chosen, [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]


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
