"""`check_greedy`: is a method's greedy output token-identical to plain decoding on the same path?

    report = specdec.check_greedy(target, prompts, specdec.DraftModel(draft), gamma=4, max_new_tokens=128)
    report.identical_fraction, report.divergences, report.to_dict()

Each prompt is decoded at temperature 0 twice with the same target (so the same dtype) and the same `compile`:
once with the method (a drafter and its γ; or, with `batch_size`, `generate_batch` over groups of that many
prompts), once plainly and alone, as `specdec.generate(target, prompt, compile=compile)` decodes it
(`plain_reference`: once for several methods). The first position where the outputs differ is a divergence. For
it the report gives the plain pass's logits there: the top-2 gap (its best logit minus its second-best) and the
margin (its best logit minus its logit of the method's token), also in units of the last place (ulp) of the
model's dtype. A margin of a few ulp is a near-tie that a pass of another shape rounded the other way; a large
one is a token the target does not pick: a bug.

The plain logits come through the decoder's `verify_fn` hook, which plain decoding calls once per token with the
target's logits [1, V]: `PlainScores` records them and verifies with the default rule, so the plain decode is
the one `specdec.generate` runs. See docs/exactness.md, "Greedy divergence check".
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig
from specdec.core.stats import DecodeStats
from specdec.core.verify import Verdict, verify_tree
from specdec.drafters.base import Drafter
from specdec.engine.batch import generate_batch
from specdec.engine.decoding import SpeculativeDecoder
from specdec.engine.verification import TreeVerifyFn, VerifyFn, verify_round
from specdec.errors import ConfigError, PromptError

#: A divergence whose margin is at most this many ulp of the model's dtype (at the best logit) is a near-tie:
#: within what a pass of another shape can round differently. Plain steps whose top-2 gap is that small are
#: counted too (`GreedyReport.near_ties`): the chances a run had to diverge.
NEAR_TIE_ULPS = 4


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers at `value`: one unit in the last place (bfloat16 at 12.5: 0.0625)."""
    info = torch.finfo(dtype)
    if value == 0.0 or not math.isfinite(value):
        return float(info.tiny)
    _, exponent = math.frexp(abs(value))  # |value| in [2^(e-1), 2^e)
    return float(info.eps) * 2.0 ** (exponent - 1)


@dataclass(frozen=True)
class Divergence:
    """The first position where a prompt's method output left its plain output, and the plain pass there.

    `plain_token` / `method_token`: None where that output had already ended. `gap`: the plain pass's best logit
    minus its second-best (None if plain had ended); `margin`: its best logit minus its logit of `method_token`
    (>= gap; None if either token is None); `ulp`: the spacing of the model's dtype at the best logit."""

    prompt: str
    position: int  # index of the first differing new token
    plain_token: int | None
    method_token: int | None
    gap: float | None
    margin: float | None
    ulp: float | None

    @property
    def ulps(self) -> float | None:
        """The margin in ulp of the model's dtype (None when there is no margin)."""
        return None if self.margin is None else self.margin / self.ulp

    @property
    def near_tie(self) -> bool:
        """Was the method's token within NEAR_TIE_ULPS roundings of plain decoding's (rounding, not a bug)?"""
        return self.ulps is not None and self.ulps <= NEAR_TIE_ULPS

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "position": self.position, "plain_token": self.plain_token,
                "method_token": self.method_token, "gap": self.gap, "margin": self.margin, "ulp": self.ulp,
                "ulps": self.ulps, "near_tie": self.near_tie}


@dataclass(frozen=True)
class GreedyReport:
    """`check_greedy`'s result: how many prompts were identical, and each divergence with the plain pass there."""

    method: str
    dtype: str
    compile: bool | str
    batch_size: int | None  # None: the method decoded each prompt alone
    max_new_tokens: int
    prompts: int
    divergences: tuple[Divergence, ...]
    tokens_compared: int  # positions compared, all prompts (up to and including a first difference)
    drafted: int
    accepted: int
    plain_steps: int  # plain decoding's passes, all prompts (one per plain token)
    near_ties: int  # ... whose top-2 gap was at most NEAR_TIE_ULPS ulp (exact ties included)
    elapsed_s: float
    notes: tuple[str, ...] = ()

    @property
    def identical(self) -> int:
        return self.prompts - len(self.divergences)

    @property
    def identical_fraction(self) -> float:
        return self.identical / self.prompts

    @property
    def passed(self) -> bool:
        return not self.divergences

    def to_dict(self) -> dict:
        return {"method": self.method, "passed": self.passed, "dtype": self.dtype, "compile": self.compile,
                "batch_size": self.batch_size, "max_new_tokens": self.max_new_tokens, "prompts": self.prompts,
                "identical": self.identical, "identical_fraction": self.identical_fraction,
                "divergences": [d.to_dict() for d in self.divergences], "tokens_compared": self.tokens_compared,
                "drafted": self.drafted, "accepted": self.accepted, "plain_steps": self.plain_steps,
                "near_ties": self.near_ties, "near_tie_ulps": NEAR_TIE_ULPS, "elapsed_s": self.elapsed_s,
                "notes": list(self.notes)}


class PlainScores:
    """A `VerifyFn` for plain decoding: per step it records the best and second-best logits and the logit of the
    token the method emitted there (`watch`), then verifies with `verify_round`."""

    def __init__(self) -> None:
        self.start(())

    def start(self, watch: Sequence[int]) -> None:
        """A new prompt; `watch`: the method's tokens."""
        self.watch = watch
        self.best: list[float] = []
        self.second: list[float] = []
        self.watched: list[float | None] = []

    def __call__(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                 sampling: SamplingConfig, generator: torch.Generator | None) -> Verdict:
        row = target_logits[0]  # [V]: plain decoding scores one token per pass
        top = row.topk(2).values.tolist()  # [2]
        step = len(self.best)
        self.best.append(top[0])
        self.second.append(top[1])
        self.watched.append(float(row[self.watch[step]]) if step < len(self.watch) else None)
        return verify_round(draft_tokens, draft_probs, target_logits, sampling, generator)

    def divergence(self, prompt: str, position: int, plain: list[int], method: list[int],
                   dtype: torch.dtype) -> Divergence:
        """The divergence at `position` of the prompt just decoded."""
        plain_token = plain[position] if position < len(plain) else None
        method_token = method[position] if position < len(method) else None
        if position >= len(self.best):  # plain decoding had ended: no plain pass there
            return Divergence(prompt, position, plain_token, method_token, None, None, None)
        best, watched = self.best[position], self.watched[position]
        return Divergence(prompt, position, plain_token, method_token, best - self.second[position],
                          None if watched is None else best - watched, ulp(best, dtype))


def _named(prompts: object) -> list[tuple[str, list[int]]]:
    """prompts (a list of token-id lists, or a mapping name -> ids) as (name, ids) pairs."""
    if isinstance(prompts, Mapping):
        items = [(str(name), ids) for name, ids in prompts.items()]
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        items = [(str(i), ids) for i, ids in enumerate(prompts)]
    else:
        raise ConfigError(f"prompts must be a list of token-id lists (or a dict name -> ids), got "
                          f"{type(prompts).__name__}")
    if not items:
        raise PromptError("no prompts to check: pass at least one prompt (a list of token ids)")
    out = []
    for name, ids in items:
        if isinstance(ids, torch.Tensor) and ids.dim() == 1:
            ids = ids.tolist()
        if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)) or not all(
                isinstance(i, int) for i in ids):
            raise PromptError(f"prompt {name!r} is not a list of token ids; check_greedy takes a list of prompts "
                              "(for one prompt pass [prompt_ids]; text: tokenizer.encode(text) first)")
        out.append((name, list(ids)))
    return out


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class PlainReference:
    """Plain greedy decoding of a prompt set, for `check_greedy` to reuse across methods (`plain_reference`)."""

    names: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    tokens: tuple[tuple[int, ...], ...]  # per prompt, the plain output
    gaps: tuple[tuple[float, ...], ...]  # per prompt and step, the top-2 gap in ulp of `dtype`
    dtype: torch.dtype
    settings: tuple  # (max_new_tokens, eos_token_id, compile) it was decoded with


def plain_reference(target: PreTrainedModel, prompts: Sequence | Mapping, *, max_new_tokens: int = 128,
                    eos_token_id: int | Sequence[int] | None = None, compile: bool | str = False) -> PlainReference:
    """Decode each prompt plainly and alone (as `specdec.generate` does) once; pass the result to `check_greedy`
    as `reference` to compare several methods with it."""
    named = _named(prompts)
    scores = PlainScores()
    plain = SpeculativeDecoder(target, None, verify_fn=scores, max_new_tokens=max_new_tokens, temperature=0.0,
                               eos_token_id=eos_token_id, compile=compile)
    tokens, gaps = [], []
    for _, ids in named:
        scores.start(())
        tokens.append(tuple(plain.stream(ids)))
        gaps.append(tuple((b - s) / ulp(b, target.dtype) for b, s in zip(scores.best, scores.second)))
    return PlainReference(tuple(n for n, _ in named), tuple(tuple(ids) for _, ids in named), tuple(tokens),
                          tuple(gaps), target.dtype, _settings(max_new_tokens, eos_token_id, compile))


def _settings(max_new_tokens: int, eos_token_id: int | Sequence[int] | None, compile: bool | str) -> tuple:
    eos = tuple(eos_token_id) if isinstance(eos_token_id, Sequence) else eos_token_id
    return max_new_tokens, eos, compile


def check_greedy(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int] | torch.Tensor] | Mapping[str, Sequence[int] | torch.Tensor],
    drafter: Drafter | None = None,
    *,
    method: str | None = None,
    gamma: int | str | object | None = None,
    max_new_tokens: int = 128,
    eos_token_id: int | Sequence[int] | None = None,
    compile: bool | str = False,
    batch_size: int | None = None,
    reference: PlainReference | None = None,
    verify_fn: VerifyFn = verify_round,
    tree_verify_fn: TreeVerifyFn = verify_tree,
) -> GreedyReport:
    """Decode each prompt greedily with `drafter` (γ, `verify_fn`, `tree_verify_fn`) and plainly, both with
    `target` as given (its dtype) and the same `compile`, and compare the outputs token by token (see the module
    docstring). `prompts`: token-id lists, or a mapping name -> ids (names appear in the report). `batch_size`:
    the method is `generate_batch` over groups of that many prompts (`drafter` None: batched plain decoding),
    each row compared with its prompt decoded alone. Stops at EOS like `generate` (`eos_token_id=[]`: never).
    `reference`: `plain_reference(target, prompts, ...)` with the same prompts and settings, decoded once for
    several methods; plain decoding then reruns only for a diverging prompt (for the logits there)."""
    start = time.perf_counter()
    named = _named(prompts)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ConfigError(f"batch_size must be a positive int (rows per generate_batch call), got {batch_size!r}")
    if batch_size is not None and (verify_fn is not verify_round or tree_verify_fn is not verify_tree):
        raise ConfigError("generate_batch verifies with the default rules: pass verify_fn / tree_verify_fn "
                          "without batch_size")
    if reference is None:
        reference = plain_reference(target, dict(named), max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                    compile=compile)
    elif (reference.names, reference.prompts, reference.dtype, reference.settings) != (
            tuple(n for n, _ in named), tuple(tuple(ids) for _, ids in named), target.dtype,
            _settings(max_new_tokens, eos_token_id, compile)):
        raise ConfigError("reference was decoded from other prompts or settings (dtype, max_new_tokens, "
                          "eos_token_id, compile): make it with plain_reference(target, prompts, ...) and the "
                          "settings given here")
    options = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "eos_token_id": eos_token_id,
               "compile": compile}
    outputs: list[tuple[list[int], DecodeStats]] = []  # the method's tokens and stats, per prompt
    if batch_size is None:
        spec = SpeculativeDecoder(target, drafter, gamma=gamma, verify_fn=verify_fn, tree_verify_fn=tree_verify_fn,
                                  **options)
        for _, ids in named:
            tokens = list(spec.stream(ids))
            outputs.append((tokens, spec.stats))
    else:
        for i in range(0, len(named), batch_size):
            group = [ids for _, ids in named[i : i + batch_size]]
            outputs += [(o.tokens, o.stats) for o in generate_batch(target, group, drafter, gamma=gamma, **options)]

    divergences, compared = [], 0
    scores = PlainScores()
    plain = SpeculativeDecoder(target, None, verify_fn=scores, **options)
    for (name, ids), (method_tokens, _), plain_tokens in zip(named, outputs, reference.tokens):
        at = _first_difference(method_tokens, plain_tokens)
        compared += len(plain_tokens) if at is None else at + 1
        if at is not None:  # decode it plainly again, watching the method's tokens
            scores.start(method_tokens)
            plain_tokens = list(plain.stream(ids))
            divergences.append(scores.divergence(name, at, plain_tokens, method_tokens, target.dtype))

    drafted = sum(stats.drafted for _, stats in outputs)
    notes = []
    if drafter is None and batch_size is None:
        notes.append("no drafter: plain decoding was compared with itself (a determinism check)")
    elif drafter is not None and not drafted:
        notes.append("the drafter proposed no token on any prompt, so every pass scored one token as plain "
                     "decoding does: this run could not see a difference; choose prompts the drafter can draft on")
    return GreedyReport(
        method=method or ("plain" if drafter is None else drafter.name),
        dtype=str(target.dtype).removeprefix("torch."), compile=compile, batch_size=batch_size,
        max_new_tokens=max_new_tokens, prompts=len(named), divergences=tuple(divergences), tokens_compared=compared,
        drafted=drafted, accepted=sum(stats.accepted for _, stats in outputs),
        plain_steps=sum(len(g) for g in reference.gaps),
        near_ties=sum(g <= NEAR_TIE_ULPS for gaps in reference.gaps for g in gaps),
        elapsed_s=time.perf_counter() - start, notes=tuple(notes))
