"""Candidate exact decoding methods for `specdec demo`, and the short calibration that picks one by measurement.

A candidate is one entry of `CANDIDATES`: how to build the drafter and the γ policy for one request, and
(optionally) which target adapter it decodes with, so that a method with its own fast path (a compiled
target, token trees, EAGLE heads) is one more entry, and the demo's "plain" baseline runs on the same path
as the method it is compared with. Every candidate must be exact: in `tests/methods.py` too.

`calibrate` times every available candidate on a few held-out prompts that the demo does not show, interleaved,
against one reference (plain decoding on the eager path), so that methods on different paths are ranked by
absolute speed: a compiled method that gains less over its own (compiled) plain decoding can still be the
fastest. `Calibration.best` keeps the fastest (geometric mean over the prompts, so that one prompt cannot
dominate).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import ConfigError


@dataclass
class Models:
    """What candidates build from: the models, the tokenizer, and adapters shared across runs.

    capacity: the cache slots of the largest request these models will serve (None: each request sizes its own).
    With it, the compiled target and the compiled candidates' drafters size their slot caches once for every
    request, so each compiled shape compiles once: caches sized per request differ with the prompt's length, and
    each size is a shape of its own."""

    target: Any
    draft: Any | None
    tokenizer: Any
    adapters: dict[str, Any] = field(default_factory=dict)  # one per decode path, built on first use
    capacity: int | None = None
    drafters: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # a compiled candidate's, reused

    def adapter(self, path: str = "eager") -> Any:
        """The target adapter of a decode path: "eager" (CachedCausalLM), "compiled" (the fast path's slot
        cache with compiled passes; eager, with a warning, where the model or machine cannot take it) or "static"
        (the same slot cache and kernels, its passes run eagerly: nothing compiles)."""
        if path not in self.adapters:
            from specdec.runtime.static_lm import fast_adapter

            if path not in ("eager", "compiled", "static"):
                raise ConfigError(f"unknown decode path {path!r}")
            adapter = fast_adapter(self.target, {"eager": False, "compiled": True, "static": "static"}[path])
            if path != "eager" and self.capacity is not None:
                adapter.ensure_capacity(self.capacity)
            self.adapters[path] = adapter
        return self.adapters[path]


@dataclass(frozen=True)
class Candidate:
    """One exact method. `drafter(models)` -> (drafter, gamma) for a single request (fresh state each time)."""

    name: str  # accepted by `specdec demo --method`
    summary: str  # one line shown on screen
    drafter: Callable[[Models], tuple[Any, Any]]
    needs_draft: bool = False
    target: Callable[[Models], Any] = lambda models: models.adapter("eager")
    options: tuple[tuple[str, Any], ...] = ()  # extra SpeculativeDecoder options, for plain and speculative alike
    setup_note: str | None = None  # said on screen before its first use when that is slow (e.g. a compile)
    compiled: bool = False  # on the fast path: it compiles first (`specdec demo --no-compile` leaves it out)
    calibrated: bool = True  # timed when the demo chooses (else only run by name: `specdec demo --method NAME`)
    needs_heads: bool = False  # the draft heads shipped for the default target (so: that target only)
    needs_ranking: bool = False  # the default pair's token ranking (a draft of its vocabulary's width only)

    def available(self, models: Models) -> bool:
        if self.needs_heads and _default_heads(models.target) is None:
            return False
        if self.needs_ranking and not _ranked(models.draft):
            return False
        return models.draft is not None or not self.needs_draft

    def decoder(self, models: Models, *, speculative: bool = True, uncompiled: bool = False, **settings):
        """A SpeculativeDecoder for one request: this method's, or plain decoding on the same target path.
        `uncompiled`: a compiled method runs on the fast path's caches and kernels with its passes eager
        (compile="static"): the same method, exact as ever, for a run that is not timed and would otherwise
        compile shapes of its own (sampling at T > 0)."""
        from specdec.engine.decoding import SpeculativeDecoder

        if uncompiled and self.compiled:
            drafter, gamma = self.drafter(models) if speculative else (None, 1)
            options = {**dict(self.options), "compile": "static"}
            return SpeculativeDecoder(models.adapter("static"), drafter, gamma=gamma, **options, **settings)
        drafter, gamma = self.build(models) if speculative else (None, 1)
        return SpeculativeDecoder(self.target(models), drafter, gamma=gamma, **dict(self.options), **settings)

    def build(self, models: Models) -> tuple[Any, Any]:
        """(drafter, gamma) for a request: a fresh drafter, or on the fast path with `models.capacity` set one
        drafter kept for every request, its caches sized once (drafters are reset between requests)."""
        if not self.compiled or models.capacity is None:
            return self.drafter(models)
        if self.name not in models.drafters:
            drafter, gamma = self.drafter(models)
            if drafter is not None:
                drafter.use_fast_path(True)
                drafter.ensure_capacity(models.capacity)
            models.drafters[self.name] = (drafter, gamma)
        return models.drafters[self.name]


def draft_model_candidate(gamma_policy: Callable[[], Any]) -> Callable[[Models], tuple[Any, Any]]:
    def build(models: Models):
        from specdec.drafters import DraftModel

        return DraftModel(models.draft), gamma_policy()
    return build


def draft_vocab_candidate(gamma: int) -> Callable[[Models], tuple[Any, Any]]:
    """The draft model over the default pair's DRAFT_VOCAB most frequent tokens, at γ (one reduced-head copy of
    the draft, shared by every request)."""
    def build(models: Models):
        from specdec.drafters import make_drafter

        return make_drafter("draft-vocab", draft=models.draft), gamma
    return build


def _ranked(draft) -> bool:
    """Whether `draft` has the width of the default pair's vocabulary, which its shipped token ranking covers."""
    from specdec.hub.default_pair import token_ranking
    from specdec.runtime.causal_lm import vocab_size

    return draft is not None and vocab_size(draft) == len(token_ranking())


def _heuristic():
    from specdec.engine.adaptive import HeuristicGamma

    return HeuristicGamma()


def _draft_tree(models: Models):
    from specdec.drafters import DraftTree

    tree = DraftTree(models.draft)
    return tree, tree.depth


def _prompt_lookup(models: Models):
    from specdec.drafters import PromptLookup

    return PromptLookup(), "auto"


_HEADS: dict[int, Any] = {}  # id(target) -> its shipped heads (or None: not the default target)


def _default_heads(target) -> dict[str, Any] | None:
    if id(target) not in _HEADS:
        from specdec.hub.default_pair import load_default_heads
        from specdec.errors import SpecdecError

        try:
            _HEADS[id(target)] = load_default_heads(target)
        except SpecdecError:
            _HEADS[id(target)] = None
    return _HEADS[id(target)]


def _eagle_tree(models: Models):
    from specdec.drafters import EAGLE_TREE, Eagle

    eagle = Eagle(models.target, _default_heads(models.target)["eagle"], **EAGLE_TREE)
    return eagle, eagle.depth


def _compiled(models: Models):
    return models.adapter("compiled")


_COMPILING = ("compiling the target's and the draft's passes (once per shape; seconds each once inductor's disk "
              "cache is warm, a minute or two on a cold one)...")

#: The registry. A method that lands later (a compiled fast path, `specdec.DraftTree`, EAGLE heads) is one
#: more entry here, with `target=` for its own decode path and `setup_note=` when its first use is slow.
#: On the fast path the demo times two by default (`calibrated`): the draft model at γ = 6, over its whole
#: vocabulary and over its most frequent tokens. They share every target shape, and each other compiled
#: candidate would add shapes of its own to a cold start (a few minutes on a slow CPU); on every CPU class
#: measured a γ of 6-7 was the best fixed one (BENCHMARKS.md). The others run by name.
CANDIDATES: list[Candidate] = [
    Candidate("draft-g3", "draft model, γ = 3", draft_model_candidate(lambda: 3), needs_draft=True),
    Candidate("draft-heuristic", "draft model, γ +2/−1 schedule (transformers' heuristic)",
              draft_model_candidate(_heuristic), needs_draft=True),
    Candidate("draft-auto", "draft model, γ chosen each round from measured α and cost (gamma='auto')",
              draft_model_candidate(lambda: "auto"), needs_draft=True),
    Candidate("prompt-lookup-auto", "prompt lookup (n-grams of the prompt and output), gamma='auto'",
              _prompt_lookup),
    Candidate("draft-tree", "draft model proposing a token tree (EAGLE-2-style, top-k 4, depth 6, 24 nodes)",
              _draft_tree, needs_draft=True),
    *(Candidate(f"draft-g{gamma}-compiled", f"draft model, γ = {gamma}, on the fast path (slot KV cache, compiled "
                "passes)", draft_model_candidate(lambda gamma=gamma: gamma), needs_draft=True,
                target=_compiled, options=(("compile", True),), compiled=True, setup_note=_COMPILING,
                calibrated=gamma == 6)
      for gamma in (3, 6)),
    Candidate("draft-vocab-g6-compiled", "draft model over its 2048 most frequent tokens (a cheaper draft step), "
              "γ = 6, on the fast path", draft_vocab_candidate(6), needs_draft=True, needs_ranking=True,
              target=_compiled, options=(("compile", True),), compiled=True, setup_note=_COMPILING),
    Candidate("draft-auto-compiled", "draft model, γ chosen each round from measured α and cost, on the fast path",
              draft_model_candidate(lambda: "auto"), needs_draft=True, target=_compiled,
              options=(("compile", True),), compiled=True, setup_note=_COMPILING, calibrated=False),
    Candidate("eagle-compiled", "the shipped EAGLE head's dynamic tree, on the fast path (one compiled graph "
              "per drafting round)", _eagle_tree, needs_heads=True, target=_compiled,
              options=(("compile", True),), compiled=True, calibrated=False,
              setup_note="compiling the target's tree pass and the EAGLE head's drafting round (once per shape; "
              "seconds each once inductor's disk cache is warm)..."),
]


#: The reference every candidate is ranked against: plain decoding on the eager path.
EAGER_PLAIN = Candidate("plain", "plain decoding on the eager path", lambda models: (None, 1))


def get_candidate(name: str, candidates: Sequence[Candidate] = CANDIDATES) -> Candidate:
    for candidate in candidates:
        if candidate.name == name:
            return candidate
    raise ConfigError(f"unknown method {name!r}; choose one of: {', '.join(c.name for c in candidates)}")


def timed_run(decoder, prompt_ids: Sequence[int]) -> tuple[list[int], float]:
    """(tokens, wall seconds) of one request, prefill included."""
    start = time.perf_counter()
    tokens = list(decoder.stream(prompt_ids))
    return tokens, time.perf_counter() - start


@dataclass
class Calibration:
    """Speed of each candidate relative to plain decoding on the eager path, per calibration prompt (the
    reference's wall time over the candidate's), and the geometric mean."""

    speedups: dict[str, list[float]]

    def score(self, name: str) -> float:
        values = self.speedups[name]
        return math.exp(statistics.fmean(math.log(v) for v in values))

    def best(self) -> str:
        return max(self.speedups, key=self.score)


def calibrate(models: Models, candidates: Sequence[Candidate], prompts: Sequence[Sequence[int]],
              max_new_tokens: int = 64, on_setup: Callable[[str], None] | None = None) -> Calibration:
    """Time each candidate and plain decoding on the eager path (the one reference every candidate is ranked
    against: absolute speed, whichever path a candidate runs on), greedy, EOS off, once per prompt after an
    untimed warm-up of each on every prompt (any one-off setup happens there, e.g. a compile, which a compiled
    method needs again for a prompt whose length asks for a larger cache); the order is rotated from prompt to
    prompt."""
    settings = dict(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=[], seed=0)
    for candidate in candidates:
        if candidate.setup_note and on_setup:
            on_setup(candidate.setup_note)
        for prompt in prompts:
            timed_run(candidate.decoder(models, **settings), prompt)
    timed_run(EAGER_PLAIN.decoder(models, speculative=False, **settings), prompts[0])
    speedups: dict[str, list[float]] = {c.name: [] for c in candidates}
    for i, prompt in enumerate(prompts):
        order = list(candidates[i % len(candidates):]) + list(candidates[: i % len(candidates)])
        plain = timed_run(EAGER_PLAIN.decoder(models, speculative=False, **settings), prompt)[1]
        for candidate in order:
            wall = timed_run(candidate.decoder(models, **settings), prompt)[1]
            speedups[candidate.name].append(plain / wall)
    return Calibration(speedups)
