"""The decode round, once, over rows: ``drafter.propose`` → ``target.score`` → ``verify`` → ``commit`` → emit.

`generate`, `stream` and `SpeculativeDecoder` run it over one row (a lone request is a batch of one), and
`generate_batch`, `BatchDecoder` and the server's scheduler over the rows of a batch. One round, for every row:

1. drafter.propose: at most γ tokens (a tree at most γ deep), made ready for the pass (`proposals.ready`);
2. target.score: every row's last committed token (the root) and its drafts, in one pass;
3. verify: each row's accepted drafts and next token (recovered or bonus), with its own generator
   (`verification.Verifier`; inside the target's pass where it can);
4. commit: the target keeps each row's root and accepted drafts, the row's context grows, the drafters and
   the γ policies are told;
5. emit: each row's new tokens, up to its first EOS or max_new_tokens.

Invariants between rounds, per row (n = committed tokens, prompt included): the target's cache holds
context[:n-1] (the last committed token is the next round's root, fed with the drafts, so one pass scores γ
drafts and yields the distribution after each); the drafter's state covers at most context[:n-1] (it catches
up itself when it proposes). Plain decoding is the same round with nothing drafted.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.drafters.base import Proposal, RowDrafters
from specdec.engine.proposals import ready
from specdec.engine.request import Row
from specdec.engine.targets import RowTarget
from specdec.engine.verification import Verified, Verifier
from specdec.errors import ProposalError, SpecdecError
from specdec.runtime.base import Scores


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
    # Where the last token came from: "recovered" (a rejected draft corrected), "bonus" (every draft
    # accepted) or "target" (nothing was drafted); the tokens before it are accepted drafts.
    outcome: str = "target"


class Engine:
    """The round over rows for one target (a `RowTarget`) and one drafter (its `RowDrafters` form, or None for
    plain decoding); rows join (`add_rows`) and leave (`remove_rows`) between rounds."""

    def __init__(self, target: RowTarget, drafters: RowDrafters | None, verifier: Verifier):
        self.target = target
        self.drafters = drafters
        self.verifier = verifier
        self.last_round: dict | None = None  # the last round's draft_s, target_s and pass width
        self._warned_chain_fallback = False

    def add_rows(self, rows: Sequence[Row]) -> None:
        """New rows: the target prefills them, then their drafters start (the reset counts as drafting time)."""
        features = self.target.add_rows(rows)  # per row [n-1, F] | None
        if self.drafters is not None:
            start = time.perf_counter()
            self.drafters.add_rows(rows, features)
            for row in rows:
                row.stats.draft_s += time.perf_counter() - start

    def remove_rows(self, keep: Sequence[int]) -> None:
        self.target.remove_rows(keep)
        if self.drafters is not None:
            self.drafters.remove_rows(keep)

    def gammas(self, rows: Sequence[Row], cap: int | dict[object, int | None] | None = None) -> list[int]:
        """Each row's γ this round: its policy's choice, leaving room in max_new_tokens for the round's last
        token, and within `cap` (one bound for every row, or a bound per row key; None: unbounded; 0: plain)."""
        if self.drafters is None:
            return [0] * len(rows)
        out = []
        for row in rows:
            gamma = min(row.gamma_policy.choose(row.stats), row.max_new_tokens - row.produced - 1)
            bound = cap.get(row.key) if isinstance(cap, dict) else cap
            out.append(max(0, gamma if bound is None else min(gamma, bound)))
        return out

    def run(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[RowEvent]:
        """One round for `rows`, drafting gammas[i] tokens for row i. A row that fails (an invalid proposal,
        non-finite logits) gets an event with the error; the others go on."""
        proposals, trees, errors, draft_s = self._propose(rows, gammas)  # 1. drafter.propose
        scores, outcomes, target_s = self._score_and_verify(rows, proposals, trees, errors)  # 2-3. score, verify
        width = max(len(p) for p in proposals) + 1
        self.last_round = {"draft_s": draft_s, "target_s": target_s, "width": width}
        self._commit(rows, proposals, trees, scores, outcomes, draft_s, target_s)  # 4. commit
        return [self._emit(i, row, len(p), outcome, scores)  # 5. emit
                for i, (row, p, outcome) in enumerate(zip(rows, proposals, outcomes))]

    def _propose(self, rows: Sequence[Row], gammas: Sequence[int]):
        """1. Each row's proposal ready for the pass (a chain, or a tree with its mask), and a ProposalError for a
        row whose drafter proposed something invalid (that row alone fails: an empty proposal stands in)."""
        none = [None] * len(rows)
        if self.drafters is None or not any(gammas):
            return [Proposal(row.context[:0]) for row in rows], none, none, 0.0
        start = time.perf_counter()
        raw = self.drafters.propose(rows, gammas)
        draft_s = time.perf_counter() - start
        proposals, trees, errors = [], [], []
        for row, gamma, proposal in zip(rows, gammas, raw):
            tree = error = None
            try:
                room = self.target.room(row) if proposal.parents is not None else None
                proposal, tree, fell_back = ready(proposal, gamma, self.target.vocab_size, room,
                                                  lambda num_rows, row=row: self.target.scores_tree(row, num_rows))
                if fell_back:
                    self._warn_chain_fallback()
            except ProposalError as exc:
                proposal, error = Proposal(row.context[:0]), exc
            proposals.append(proposal)
            trees.append(tree)
            errors.append(error)
        return proposals, trees, errors, draft_s

    def _score_and_verify(self, rows, proposals, trees, errors):
        """2-3. One target pass over every row's root and drafts, then each row's verification (inside the pass
        where the target can). Returns (scores [B, W, ...] or None when every row failed, a `Verified` or an
        error per row, the pass's seconds)."""
        if all(error is not None for error in errors):
            return None, list(errors), 0.0
        inputs = [torch.cat([row.context[row.n - 1 : row.n], p.tokens]) for row, p in zip(rows, proposals)]
        start = time.perf_counter()
        if self.verifier.fuses(rows, trees, self.target):
            scores, verdicts = self.target.score_and_verify(rows, inputs, proposals)
            target_s = time.perf_counter() - start
            return scores, [Verified.of(p, None, v) for p, v in zip(proposals, verdicts)], target_s
        scores = self.target.score(rows, inputs, trees)
        target_s = time.perf_counter() - start
        failed = self.target.row_errors(rows, scores, [x.shape[0] for x in inputs])
        errors = [error or fail for error, fail in zip(errors, failed)]
        return scores, self.verifier.verify(rows, proposals, trees, scores.logits, errors), target_s

    def _commit(self, rows, proposals, trees, scores: Scores | None, outcomes, draft_s: float,
                target_s: float) -> None:
        """4. The target keeps each row's root and accepted drafts (a failed row: nothing of the pass); each
        row's context gets its accepted drafts and next token and its round is recorded; the drafters are told
        (with the target's features of the root and the accepted drafts, for drafters that read them); then
        each row's γ policy."""
        keeps = [o.keep if isinstance(o, Verified) else [] for o in outcomes]
        self.target.commit(rows, keeps, trees)
        accepted: list[int | None] = []
        for row, proposal, outcome in zip(rows, proposals, outcomes):
            if not isinstance(outcome, Verified):
                accepted.append(None)
                continue
            verdict = outcome.verdict
            k = verdict.num_accepted
            row.context[row.n : row.n + k + 1] = torch.tensor(outcome.accepted + [verdict.next_token],
                                                              device=row.context.device)
            row.n += k + 1
            stats = row.stats
            stats.record_round(len(proposal), k, verdict.outcome)
            stats.target_s += target_s
            stats.draft_s += draft_s
            stats.target_forwards += 1
            accepted.append(k)
        if self.drafters is not None:
            hidden = scores.hidden if scores is not None and self.target.hidden else None
            features = None if hidden is None else [hidden[i, keep] for i, keep in enumerate(keeps)]  # [k+1, F]
            start = time.perf_counter()
            self.drafters.commit(rows, accepted, features)
            commit_s = time.perf_counter() - start
            for row, k in zip(rows, accepted):
                if k is not None:
                    row.stats.draft_s += commit_s
        for row, k in zip(rows, accepted):
            if k is not None:
                row.gamma_policy.update(row.stats)

    @staticmethod
    def _emit(i: int, row: Row, drafted: int, outcome: Verified | SpecdecError, scores: Scores | None) -> RowEvent:
        """5. Row i's event: its new tokens up to its first EOS or max_new_tokens (with their log-probabilities
        from the pass's logits when the request asked)."""
        if not isinstance(outcome, Verified):
            return RowEvent(row.key, [], 0, drafted, True, None, outcome)
        verdict = outcome.verdict
        emitted, reason = [], None
        for token in [*outcome.accepted, verdict.next_token]:
            emitted.append(token)
            row.produced += 1
            if token in row.eos:
                reason = "stop"
                break
            if row.produced >= row.max_new_tokens:
                reason = "length"
                break
        row.stats.new_tokens = row.produced
        row.stats.wall_s = time.perf_counter() - row.started
        event = RowEvent(row.key, emitted, min(verdict.num_accepted, len(emitted)), drafted, reason is not None,
                         reason, outcome=verdict.outcome if drafted else "target")
        if row.logprobs is not None:  # row j of the pass scored emitted token j
            event.logprobs, event.top_logprobs = token_logprobs(scores.logits[i, : len(emitted)], emitted,
                                                               row.logprobs)
        return event

    def _warn_chain_fallback(self) -> None:
        if not self._warned_chain_fallback:
            self._warned_chain_fallback = True
            warnings.warn(
                f"{type(self.target.model).__name__} cannot score this token tree in one pass (no 4D-mask "
                "support, or a sliding-window cache would be exceeded): verifying each round's first branch "
                "as a chain instead (exact, fewer tokens per pass)",
                stacklevel=4,
            )


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int):
    """logits [m, V] (row j scored token j): the tokens' log-probabilities and the `top` best per position."""
    logp = torch.log_softmax(logits, dim=-1)  # [m, V] (float32 or float64, as the forward returned)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()  # [m]
    if top == 0:
        return chosen, [[] for _ in tokens]
    values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [m, top]
    return chosen, [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
