"""`check_exactness`: do a decoding method's continuations follow the exact warped target distribution?

Draw `samples` continuations of one prompt through the real decode loop (`SpeculativeDecoder` with the
method's drafter, γ, warp, EOS and max_new_tokens), compute the reference from the target, and test:

- ``mode="enumerate"``: the reference is every continuation with its exact probability
  (`reference.enumerate_continuations`); Pearson chi-square test of the draws' counts (`gof.multinomial_test`).
- ``mode="conditional"``: for vocabularies / lengths too large to enumerate, each drawn token is compared
  with the target's next-token distribution after the prefix it was drawn after
  (`reference.iter_conditionals`), pooled across prefixes (`gof.pooled_conditional_test`). Groups: one per
  prefix seen at least `node_min` times (a plain multinomial test of that node), and one per depth for all
  rarer prefixes. Cells are tokens, rare ones pooled (to expected >= 5; a depth group to at most
  `MAX_POOLED_CELLS` cells, which bounds the cost of its covariance). Structural errors (a draw longer than
  max_new_tokens, shorter without ending in EOS, or going on after an EOS) count as impossible outcomes.
- ``mode="auto"``: enumerate when the continuations can be at most `max_enumeration`, else conditional.

The verdict is FAIL when p < alpha (or an impossible outcome was seen).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import sparse
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig
from specdec.core.verify import verify_tree
from specdec.drafters.base import Drafter
from specdec.engine.decoding import SpeculativeDecoder
from specdec.engine.verification import TreeVerifyFn, VerifyFn, verify_round
from specdec.engine.policies import DEFAULT_GAMMA
from specdec.engine.request import eos_ids
from specdec.errors import ConfigError
from specdec.exactness.engine import Draws, draw, find_models, torch_threads
from specdec.exactness.gof import (
    DEFAULT_POWER,
    MIN_EXPECTED,
    Group,
    TestOutcome,
    multinomial_test,
    pool_cells,
    pooled_conditional_test,
)
from specdec.exactness.reference import Enumeration, enumerate_continuations, iter_conditionals
from specdec.runtime.causal_lm import CachedCausalLM
from specdec.runtime.causal_lm import vocab_size as model_vocab_size
from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, FixedSourceDecoder

MODES = ("auto", "enumerate", "conditional")
DEFAULT_ALPHA = 1e-3
#: Largest number of continuations `mode="auto"` enumerates.
MAX_ENUMERATION = 50_000
#: Prefixes seen at least this often get their own group in conditional mode.
NODE_MIN = 200
#: Cells of a depth group in conditional mode are pooled to at most about this many.
MAX_POOLED_CELLS = 400
#: Keep the conditional mode's per-prefix distributions in memory up to this many floats (else recompute).
_KEEP_FLOATS = 10_000_000


@dataclass
class ExactnessResult:
    """One method checked on one prompt. `passed`: p >= alpha and no impossible outcome."""

    method: str
    settings: dict
    mode: str
    samples: int
    test: TestOutcome
    acceptance_rate: float  # α over all draws (0 for plain decoding)
    tokens_per_round: float
    drafted: int  # draft tokens proposed over all draws
    accepted: int  # ... and accepted
    draws_per_s: float
    engine: str
    timings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Why the run could not test the drafting path (it drafted nothing, or accepted nothing), or None; also a note.
    power_warning: str | None = None

    @property
    def p_value(self) -> float:
        return self.test.p_value

    @property
    def tv(self) -> float:
        return self.test.tv

    @property
    def tv_ci(self) -> tuple[float, float]:
        return self.test.tv_ci

    @property
    def detectable_tv(self) -> float:
        return self.test.detectable_tv

    @property
    def passed(self) -> bool:
        return self.test.impossible == 0 and self.test.p_value >= self.test.alpha

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict:
        return {
            "method": self.method, "settings": dict(self.settings), "mode": self.mode, "samples": self.samples,
            "verdict": self.verdict, "passed": self.passed, "p_value": self.p_value, "tv": self.tv,
            "tv_ci": list(self.tv_ci), "detectable_tv": self.detectable_tv, "test": self.test.to_dict(),
            "acceptance_rate": self.acceptance_rate, "tokens_per_round": self.tokens_per_round,
            "drafted": self.drafted, "accepted": self.accepted,
            "draws_per_s": self.draws_per_s, "engine": self.engine, "timings": dict(self.timings),
            "notes": list(self.notes), "power_warning": self.power_warning,
        }

    def summary(self) -> str:
        lo, hi = self.tv_ci
        return (
            f"{self.verdict} {self.method} [{settings_text(self.settings)}] n={self.samples} "
            f"p={self.p_value:.3g} TV={self.tv:.4f} [{lo:.4f}, {hi:.4f}] detectable={self.detectable_tv:.4f} "
            f"α={self.acceptance_rate:.2f}" + (" (no power: see power_warning)" if self.power_warning else "")
        )


def power_warning(drafted: int, accepted: int) -> str | None:
    """Why a check of a drafter had no power against a broken speculative path, or None: nothing drafted
    (every token came from the target alone, as plain decoding), or nothing accepted (the accept path never
    ran)."""
    if drafted == 0:
        return ("the drafter proposed no token in any draw, so every token came from the target alone: this run "
                "tested plain decoding, and had no power against a wrong drafter or acceptance rule; choose a "
                "prompt the drafter can draft on (prompt lookup: one that repeats itself) or more tokens")
    if accepted == 0:
        return (f"none of the {drafted} drafted tokens was accepted, so the accept path never ran: the test had no "
                "power against a wrong acceptance rule; choose a prompt where the drafter agrees with the target "
                "more often, or a higher temperature")
    return None


def settings_text(s: dict) -> str:
    parts = [f"γ={s.get('gamma')}", f"T={s.get('temperature')}"]
    if s.get("top_k") is not None:
        parts.append(f"top-k={s['top_k']}")
    if s.get("top_p") is not None:
        parts.append(f"top-p={s['top_p']}")
    parts.append(f"L={s.get('max_new_tokens')}")
    if s.get("eos"):
        parts.append(f"eos={','.join(map(str, s['eos']))}")
    if s.get("verify_fn"):
        parts.append(f"verify={s['verify_fn']}")
    return " ".join(parts)


def _unwrap(target) -> PreTrainedModel:
    return target.model if isinstance(target, (CachedCausalLM, CachedSeq2SeqLM)) else target


def check_exactness(
    target: PreTrainedModel,
    prompt_ids: Sequence[int],
    drafter: Drafter | Callable[[], Drafter | None] | None = None,
    *,
    method: str | None = None,
    gamma: int | str | object = DEFAULT_GAMMA,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    max_new_tokens: int = 3,
    samples: int = 20_000,
    seed: int = 0,
    alpha: float = DEFAULT_ALPHA,
    power: float = DEFAULT_POWER,
    mode: str = "auto",
    engine: str = "auto",
    verify_fn: VerifyFn = verify_round,
    tree_verify_fn: TreeVerifyFn = verify_tree,
    max_enumeration: int = MAX_ENUMERATION,
    node_min: int = NODE_MIN,
    threads: int | None = 1,
    compile: bool | str = False,
    encoder_inputs: dict | None = None,
) -> ExactnessResult:
    """Check that `drafter` (+ γ, warp, EOS, max_new_tokens) samples continuations of `prompt_ids` exactly
    from the warped `target`. Deterministic for a given seed (except with timing-driven policies such as
    gamma="auto", whose γ choices depend on measured costs). See the module docstring for the tests.

    threads: torch intra-op threads for the whole check (reference, draws), restored afterwards; None leaves
    the setting alone. Default 1: the work is many tiny ops, which extra threads slow down on a busy CPU.
    encoder_inputs: an encoder-decoder target's source (as `specdec.generate`); `prompt_ids` is then the
    decoder prompt.
    """
    with torch_threads(threads):
        return _check(target, prompt_ids, drafter, method, gamma, temperature, top_k, top_p, eos_token_id,
                      max_new_tokens, samples, seed, alpha, power, mode, engine, verify_fn, max_enumeration,
                      node_min, tree_verify_fn, compile, encoder_inputs)


def _check(target, prompt_ids, drafter, method, gamma, temperature, top_k, top_p, eos_token_id, max_new_tokens,
           samples, seed, alpha, power, mode, engine, verify_fn, max_enumeration, node_min,
           tree_verify_fn=verify_tree, compile=False, encoder_inputs=None) -> ExactnessResult:
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    if not 0.0 < alpha < 1.0:
        raise ConfigError(f"alpha must be in (0, 1), got {alpha!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"samples must be an integer >= 1, got {samples!r}")
    model = _unwrap(target)
    prompt = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
    sampling = SamplingConfig(temperature, top_k, top_p)
    eos = eos_ids(model, eos_token_id)
    if not isinstance(drafter, Drafter) and callable(drafter):
        drafter = drafter()
    vocab = model_vocab_size(model)
    # An encoder-decoder target: the reference reads its decoder conditioned on the fixed source.
    reference_model = model if encoder_inputs is None else FixedSourceDecoder(model, encoder_inputs)
    timings: dict[str, float] = {}
    notes: list[str] = []

    # Reference (enumeration) first: it also tells the engine which prefixes are worth precomputing.
    support = min(vocab, top_k) if top_k else vocab
    if sampling.greedy:
        support = 1
    if mode == "auto":
        mode = "enumerate" if support ** max_new_tokens <= max_enumeration else "conditional"
    enum: Enumeration | None = None
    if mode == "enumerate":
        t = time.perf_counter()
        enum = enumerate_continuations(reference_model, prompt, sampling, eos, max_new_tokens,
                                       max_sequences=max(max_enumeration, 1))
        timings["reference_s"] = time.perf_counter() - t

    def make_decoder() -> SpeculativeDecoder:
        return SpeculativeDecoder(
            target, drafter, gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_token_id=sorted(eos), seed=seed, verify_fn=verify_fn,
            tree_verify_fn=tree_verify_fn, compile=compile, encoder_inputs=encoder_inputs,
        )

    # Precompute (batched) what the draws will ask the models for, when that is cheaper than lazy misses:
    # the reference's continuations, or in conditional mode every prefix of max_new_tokens - 1 tokens.
    prefetch: list[list[int]] = []
    if enum is not None and len(enum) <= 2 * samples:
        prefetch = [prompt + list(s) for s in enum.sequences]
    elif enum is None and 1 < max_new_tokens and vocab ** (max_new_tokens - 1) <= 2 * samples:
        prefetch = [prompt + list(s) for s in itertools.product(range(vocab), repeat=max_new_tokens - 1)]
    draws: Draws = draw(make_decoder, prompt, samples, models=find_models(model, drafter), engine=engine,
                        prefetch=prefetch, threads=None, encoder_inputs=encoder_inputs, compiled=compile is True)
    timings["draw_s"] = draws.elapsed_s

    t = time.perf_counter()
    rng = np.random.default_rng(seed)
    if enum is not None:
        counts = Counter(draws.sequences)
        observed = np.zeros(len(enum) + 1)
        for seq, c in counts.items():
            observed[enum.index.get(seq, len(enum))] += c
        probs = np.append(enum.probs, 0.0)
        test = multinomial_test(observed, probs, alpha=alpha, power=power, rng=rng)
        if observed[-1]:
            bad = [s for s in counts if s not in enum.index][:3]
            notes.append(f"{int(observed[-1])} draws are continuations of probability 0, e.g. {bad}")
        if abs(enum.probs.sum() - 1.0) > 1e-6:
            notes.append(f"the reference sums to {enum.probs.sum():.8f}, not 1")
    else:
        test = _conditional(reference_model, prompt, draws.sequences, sampling, eos, max_new_tokens, alpha, power, rng,
                            node_min, notes)
    timings["test_s"] = time.perf_counter() - t

    settings = {
        "gamma": gamma if isinstance(gamma, (int, str)) else "default" if gamma is None else type(gamma).__name__,
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "max_new_tokens": max_new_tokens,
        "eos": sorted(eos), "prompt_length": len(prompt), "seed": seed, "alpha": alpha,
    }
    if verify_fn is not verify_round:
        settings["verify_fn"] = getattr(verify_fn, "__name__", type(verify_fn).__name__)
    if tree_verify_fn is not verify_tree:
        settings["tree_verify_fn"] = getattr(tree_verify_fn, "__name__", type(tree_verify_fn).__name__)
    if method is None:
        method = "plain" if drafter is None else drafter.name
    warning = power_warning(draws.drafted, draws.accepted) if drafter is not None else None
    if warning is not None:
        notes.append(warning)
    return ExactnessResult(
        method=method, settings=settings, mode=mode, samples=samples, test=test,
        acceptance_rate=draws.acceptance_rate, tokens_per_round=draws.tokens_per_round,
        drafted=draws.drafted, accepted=draws.accepted,
        draws_per_s=draws.draws_per_s, engine=draws.engine, timings=timings, notes=notes, power_warning=warning,
    )


def _well_formed(seq: tuple[int, ...], eos: frozenset[int], max_new_tokens: int) -> bool:
    if not 1 <= len(seq) <= max_new_tokens:
        return False
    if any(t in eos for t in seq[:-1]):
        return False
    return len(seq) == max_new_tokens or seq[-1] in eos


def _conditional(model, prompt, sequences, sampling, eos, max_new_tokens, alpha, power, rng, node_min,
                 notes) -> TestOutcome:
    """The pooled per-position test (see the module docstring)."""
    malformed = [s for s in sequences if not _well_formed(s, eos, max_new_tokens)]
    if malformed:
        notes.append(f"{len(malformed)} draws violate the EOS / max_new_tokens stopping rule, e.g. {malformed[:3]}")
    good = [s for s in sequences if _well_formed(s, eos, max_new_tokens)]
    nexts: dict[tuple[int, ...], Counter] = {}
    for s in good:
        for j in range(len(s)):
            nexts.setdefault(s[:j], Counter())[s[j]] += 1
    n_h = {h: sum(c.values()) for h, c in nexts.items()}

    def key(h):
        return (len(h), h) if n_h[h] >= node_min else (len(h), None)

    distinct = list({s for s in good})
    vocab = None
    expected: dict = {}
    kept: dict[tuple[int, ...], np.ndarray] = {}
    impossible = len(malformed)
    budget = _KEEP_FLOATS
    for prefixes, probs in iter_conditionals(model, prompt, distinct, sampling):
        vocab = probs.shape[1]
        for h, row in zip(prefixes, probs):
            g = key(h)
            if g not in expected:
                expected[g] = np.zeros(vocab)
            expected[g] += n_h[h] * row
            for x, c in nexts[h].items():
                if row[x] <= 0:
                    impossible += c
            if budget >= vocab:
                kept[h] = row
                budget -= vocab
    if impossible > len(malformed):
        notes.append(f"{impossible - len(malformed)} drawn tokens have probability 0 under the warped target")
    if vocab is None:  # nothing drawn
        return pooled_conditional_test([], impossible=impossible, alpha=alpha, power=power, rng=rng)

    labels = {g: pool_cells(e, MIN_EXPECTED if g[1] is not None else max(MIN_EXPECTED, e.sum() / MAX_POOLED_CELLS))
              for g, e in expected.items()}
    ncells = {g: int(lab.max()) + 1 for g, lab in labels.items()}
    onehot = {g: sparse.csr_matrix((np.ones(int((lab >= 0).sum())), (np.flatnonzero(lab >= 0), lab[lab >= 0])),
                                   shape=(vocab, ncells[g])) for g, lab in labels.items()}
    observed = {g: np.zeros(k) for g, k in ncells.items()}
    mean = {g: np.zeros(k) for g, k in ncells.items()}
    outer = {g: np.zeros((k, k)) if g[1] is None else None for g, k in ncells.items()}

    def accumulate(prefixes, probs):
        by_group: dict = {}
        for h, row in zip(prefixes, probs):
            by_group.setdefault(key(h), []).append((h, row))
        for g, items in by_group.items():
            rows = np.stack([row for _, row in items])  # [m, V]
            weights = np.array([n_h[h] for h, _ in items], dtype=np.float64)  # [m]
            cell_p = np.asarray(onehot[g].T @ rows.T).T  # [m, K]
            mean[g] += weights @ cell_p
            if g[1] is None:  # a node group is one distribution: its covariance needs no accumulation
                outer[g] += (cell_p * weights[:, None]).T @ cell_p
            lab = labels[g]
            for (h, row) in items:
                for x, c in nexts[h].items():
                    if row[x] > 0 and lab[x] >= 0:
                        observed[g][lab[x]] += c

    if len(kept) == len(nexts):
        items = list(kept.items())
        for start in range(0, len(items), 4096):
            chunk = items[start : start + 4096]
            accumulate([h for h, _ in chunk], np.stack([r for _, r in chunk]))
    else:
        for prefixes, probs in iter_conditionals(model, prompt, distinct, sampling):
            accumulate(prefixes, probs)
    groups = [Group(observed[g], mean[g], None if g[1] is not None else np.diag(mean[g]) - outer[g]) for g in ncells]
    return pooled_conditional_test(groups, impossible=impossible, alpha=alpha, power=power, rng=rng)

