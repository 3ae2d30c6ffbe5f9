"""A lone request: `generate`, `stream` and `SpeculativeDecoder`, the round of `round.py` over one row.

The target is the request's fast single-row adapter (`CachedCausalLM`, the fast path's `StaticCausalLM`, an
encoder-decoder's `CachedSeq2SeqLM`) wrapped as a batch of one (`targets.OneRow`), and the drafter drives its
one row itself (`PerRow.alone`); the round, the verification, the tree check and the γ rule are the batch's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing

import torch
from transformers import PreTrainedModel

from specdec.core.stats import DecodeStats
from specdec.core.verify import verify_tree
from specdec.drafters.base import Drafter, DrafterCapabilities
from specdec.drafters.per_row import PerRow
from specdec.engine import shapes
from specdec.engine.options import DecodeOptions, check_compile
from specdec.engine.pairing import check_drafter, check_encoder_pairing
from specdec.engine.policies import gamma_policy
from specdec.engine.request import GenerationOutput, Row, eos_ids, new_row, seeded_generator
from specdec.engine.round import Engine, RowEvent
from specdec.engine.targets import OneRow
from specdec.engine.verification import TreeVerifyFn, Verifier, VerifyFn, verify_round
from specdec.runtime.causal_lm import CachedCausalLM
from specdec.runtime.compiled import compile_seconds
from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, is_encoder_decoder, seq2seq_adapter
from specdec.runtime.static_lm import StaticCausalLM, fast_adapter
from specdec.runtime.threads import scoped_stream


def single_adapter(target: PreTrainedModel | object, compile: bool | str):
    """A lone request's target adapter: `target` itself when it is one, else the adapter `compile` picks (an
    encoder-decoder model's `CachedSeq2SeqLM`; the fast path's `StaticCausalLM`, or `CachedCausalLM`)."""
    if isinstance(target, (CachedCausalLM, StaticCausalLM, CachedSeq2SeqLM)):
        return target
    if is_encoder_decoder(target):  # T5, BART, Marian, Whisper: the decoder is driven (docs/seq2seq.md)
        return seq2seq_adapter(target, compile)
    return fast_adapter(target, compile)


class SpeculativeDecoder:
    """One request's decode loop. Use `stream()` to iterate final tokens; `stats` fills as it runs. The decoder
    keeps its random generator and γ policy across `stream` calls (each call is one request)."""

    def __init__(
        self,
        target: PreTrainedModel | CachedCausalLM,
        drafter: Drafter | None = None,
        *,
        gamma: int | str | object | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        verify_fn: VerifyFn = verify_round,
        tree_verify_fn: TreeVerifyFn = verify_tree,
        compile: bool | str = False,
        encoder_inputs: Mapping[str, object] | None = None,
        options: DecodeOptions | None = None,
    ):
        """options: the request's options as one `DecodeOptions` (then leave gamma ... seed unset)."""
        options = DecodeOptions.given(options, gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, seed=seed)
        self.options = options
        self.compile = check_compile(compile)
        self.target = single_adapter(target, compile)
        self.drafter = check_drafter(drafter, self.target.vocab_size)
        self.capabilities = drafter.capabilities if drafter is not None else DrafterCapabilities()
        self.encoder_inputs = check_encoder_pairing(self.target, drafter, encoder_inputs)
        if drafter is not None:
            drafter.use_fast_path(compile)
        self.sampling = options.sampling
        self.max_new_tokens = options.max_new_tokens
        self.gamma_policy = gamma_policy(options.gamma, self.target, drafter)
        self.eos = eos_ids(self.target.model, options.eos_token_id)
        self.generator = seeded_generator(options.seed, self.target.device)
        self.verify_fn, self.tree_verify_fn = verify_fn, tree_verify_fn
        drafters = PerRow.alone(drafter) if drafter is not None else None
        self.engine = Engine(OneRow(self.target, self.capabilities.needs_hidden), drafters,
                             Verifier(verify_fn, tree_verify_fn))
        self.stats = DecodeStats()
        # Where the token just yielded came from: "accepted" (a verified draft token), "recovered" (the
        # correction after a rejection), "bonus" (after full acceptance) or "target" (nothing was drafted).
        self.last_token_source = ""

    @property
    def fused_verify(self) -> bool:
        """Are this decoder's chains verified inside the target's own pass (the default rule, a target that can:
        the fast path)? Settable (False: verify after a plain pass, e.g. to measure the difference)."""
        return self.engine.verifier.fused and self.target.verifies_in_graph

    @fused_verify.setter
    def fused_verify(self, value: bool) -> None:
        self.engine.verifier.fused = bool(value) and self.engine.verifier.default

    def stream(self, prompt_ids: Sequence[int] | torch.Tensor | None) -> Iterator[int]:
        """Yield each new token as soon as it is final. An encoder-decoder target: prompt_ids is the decoder
        prompt (None: its decoder start token). Runs with specdec's thread count (`threads.decode_threads`),
        the caller's torch setting back in force at every yield."""
        return self._tokens(scoped_stream(self._rounds(prompt_ids), self.target.model))

    def _rounds(self, prompt_ids: Sequence[int] | torch.Tensor | None) -> Iterator[tuple[Row, RowEvent]]:
        """The loop of `stream`: the request's start, then the round over its one row until it finishes; each
        round's event (with the row)."""
        row, compiled = self._start(prompt_ids)
        stats = self.stats
        engine = self.engine
        while True:
            event = engine.run([row], engine.gammas([row]))[0]
            stats.compile_s = compile_seconds() - compiled
            if event.error is not None:
                raise event.error
            yield row, event
            if event.finished:
                break

    def _tokens(self, rounds: Iterator[tuple[Row, RowEvent]]) -> Iterator[int]:
        """Each round's tokens one at a time (the rounds run under specdec's thread count, the tokens are yielded
        outside it), with the stats and `last_token_source` of the token just yielded."""
        with closing(rounds):
            for row, event in rounds:
                stats = row.stats
                before = row.produced - len(event.tokens)
                for i, token in enumerate(event.tokens):
                    self.last_token_source = "accepted" if i < event.accepted else event.outcome
                    stats.new_tokens = before + i + 1
                    stats.wall_s = time.perf_counter() - row.started
                    yield token
            stats.wall_s = time.perf_counter() - row.started

    def _start(self, prompt_ids: Sequence[int] | torch.Tensor | None) -> tuple[Row, float]:
        """A request's start: the prompt checked, the caches sized (or a PromptError before any work), the target
        reset and prefilled (with the features of drafters that read them), the drafter reset, shapes compiled
        up front (their time in stats.prefill_compile_s). Returns the request's row and the process's compile
        seconds before it (`compile_seconds`: the request's compile time is the growth of that total)."""
        if prompt_ids is None and is_encoder_decoder(self.target.model):
            prompt_ids = self.target.decoder_prompt()
        row = new_row(0, prompt_ids, self.options, self.engine.target, self.gamma_policy, self.generator,
                      self.encoder_inputs)
        self.stats = stats = row.stats
        buckets = shapes.plan(self.target, self.drafter, self.gamma_policy, row.n, self.max_new_tokens)
        row.started = time.perf_counter()
        compiled = compile_seconds()  # compile time paid by this call: the growth of this total
        self.engine.add_rows([row])
        shapes.precompile(self.target, self.drafter, self.gamma_policy, buckets, self.sampling, self.fused_verify,
                          row.context[: row.n])
        stats.prefill_s = time.perf_counter() - row.started
        stats.prefill_compile_s = stats.compile_s = compile_seconds() - compiled
        return row, compiled


def stream(
    target: PreTrainedModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | None = None,
    gamma: int | str | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    compile: bool | str = False,
    encoder_inputs: Mapping[str, object] | None = None,
) -> Iterator[int]:
    """Yield new token ids as soon as they are final (same arguments as `generate`)."""
    options = DecodeOptions(gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, eos_token_id=eos_token_id, seed=seed)
    decoder = SpeculativeDecoder(target, drafter, options=options, compile=compile, encoder_inputs=encoder_inputs)
    yield from decoder.stream(prompt_ids)


def generate(
    target: PreTrainedModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | None = None,
    gamma: int | str | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    compile: bool | str = False,
    encoder_inputs: Mapping[str, object] | None = None,
) -> GenerationOutput:
    """Continue `prompt_ids` with `target`, speculatively when a drafter is given; exact either way.

    Returns the new tokens (up to and including an EOS) and the decoding statistics. `gamma` is the number
    of draft tokens per round for a chain drafter (default 4); a tree drafter (`DraftTree`, `MultiDraft`)
    uses its own depth by default, and an explicit `gamma` caps the tree's depth. The options are checked
    once, as a `specdec.DecodeOptions`.
    compile=True runs target and DraftModel on the fast path (slot KV cache, compiled fixed-shape passes;
    the first call of each shape compiles, see docs/fastpath.md); "static" is the slot cache without
    compiling. Models that cannot take it decode eagerly with a FastPathWarning; tokens never differ.
    An encoder-decoder target (T5, BART, Marian, Whisper): `encoder_inputs` is what its encoder takes
    ({"input_ids": ..., "attention_mask": ...} or {"input_features": ...}), `prompt_ids` the decoder prompt
    (None: the decoder start token); see docs/seq2seq.md.
    """
    options = DecodeOptions(gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                            top_p=top_p, eos_token_id=eos_token_id, seed=seed)
    decoder = SpeculativeDecoder(target, drafter, options=options, compile=compile, encoder_inputs=encoder_inputs)
    tokens = list(decoder.stream(prompt_ids))
    return GenerationOutput(tokens=tokens, stats=decoder.stats)
