"""The decode loop: ``drafter.propose`` → ``target.score`` → ``verify`` → ``commit`` → emit.

Invariants between rounds (n = committed tokens, prompt included):
- the target's cache holds context[:n-1]; the last committed token is fed in the next round together with
  the draft tokens, so one target pass scores γ drafts and yields the distribution after each of them;
- the drafter's state covers at most context[:n-1] (it catches up itself when it proposes).
Plain decoding is the same loop with nothing drafted.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from transformers import PreTrainedModel

from specdec.core.sampling import SamplingConfig
from specdec.core.stats import DecodeStats
from specdec.core.tree import TreeMask, first_branch, is_chain, validate_proposal
from specdec.core.verify import Verdict, verify_greedy, verify_sampled, verify_tree
from specdec.drafters.base import Drafter, DrafterCapabilities, Proposal
from specdec.engine.options import DecodeOptions, check_compile
from specdec.engine.pairing import check_drafter, check_encoder_pairing
from specdec.engine.policies import FixedGamma, gamma_policy
from specdec.engine.proposals import ready
from specdec.engine.request import GenerationOutput, check_prompt_fits, eos_ids, prompt_tensor, seeded_generator
from specdec.errors import ConfigError, IncompatibleModelsError, PromptError, ProposalError, UnsupportedModelError
from specdec.runtime.base import Scores
from specdec.runtime.causal_lm import CachedCausalLM, context_length
from specdec.runtime.compiled import DEFAULT_BUCKETS, compile_seconds
from specdec.runtime.seq2seq_lm import CachedSeq2SeqLM, is_encoder_decoder, seq2seq_adapter, tree_unsupported_reason
from specdec.runtime.static_lm import StaticCausalLM, fast_adapter
from specdec.runtime.threads import scoped_stream

#: verify_fn(draft_tokens [γ], draft_probs [γ, V] | None, target_logits [γ+1, V], sampling, generator)
VerifyFn = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, SamplingConfig, "torch.Generator | None"], Verdict]
#: tree_verify_fn(proposal (tokens [N], draft_probs [N, V] | None, parents [N]), target_logits [N+1, V], sampling,
#: generator) -> Verdict with the accepted path
TreeVerifyFn = Callable[[Proposal, torch.Tensor, SamplingConfig, "torch.Generator | None"], Verdict]


def verify_round(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> Verdict:
    """Greedy: accept the prefix matching the target's argmax. Sampling: the rejection rule on warped probs."""
    if sampling.greedy:
        return verify_greedy(draft_tokens, target_logits)
    target_probs = sampling.warp(target_logits)  # [γ+1, V]
    return verify_sampled(draft_tokens, draft_probs, target_probs, generator)


class SpeculativeDecoder:
    """One request's decode loop. Use `stream()` to iterate final tokens; `stats` fills as it runs."""

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
        is_adapter = isinstance(target, (CachedCausalLM, StaticCausalLM, CachedSeq2SeqLM))
        if is_adapter:
            self.target = target
        elif is_encoder_decoder(target):  # T5, BART, Marian, Whisper: the decoder is driven (docs/seq2seq.md)
            self.target = seq2seq_adapter(target, compile)
        else:
            self.target = fast_adapter(target, compile)
        self.drafter = check_drafter(drafter, self.target.vocab_size)
        self.sampling = options.sampling
        self.capabilities = drafter.capabilities if drafter is not None else DrafterCapabilities()
        self.gamma_policy = gamma_policy(options.gamma, self.target, drafter)
        self.max_new_tokens = options.max_new_tokens
        self.encoder_inputs = check_encoder_pairing(self.target, drafter, encoder_inputs)
        if drafter is not None:
            drafter.use_fast_path(compile)
        self.eos = eos_ids(self.target.model, options.eos_token_id)
        self.generator = seeded_generator(options.seed, self.target.device)
        self.verify_fn = verify_fn
        self.tree_verify_fn = tree_verify_fn
        # A target that can verify a chain inside its own pass (the fast path) does so for the default rule
        # when sampling; any other verify_fn (e.g. the exactness suite's faulty ones) gets the logits.
        self.fused_verify = (verify_fn is verify_round and not self.sampling.greedy
                             and self.target.verifies_in_graph)
        self._warned_chain_fallback = False
        self.stats = DecodeStats()
        # Where the token just yielded came from: "accepted" (a verified draft token), "recovered" (the
        # correction after a rejection), "bonus" (after full acceptance) or "target" (nothing was drafted).
        self.last_token_source = ""

    def _check_fits(self, prompt_len: int) -> None:
        check_prompt_fits(prompt_len, self.max_new_tokens, self.target.context_limit)

    def _check_tree(self, proposal: Proposal, gamma: int, n: int) -> tuple[Proposal, TreeMask | None]:
        """Validate a tree proposal before any target pass and build its mask; fall back to its first branch
        (a chain, mask None) when the proposal is a chain or the target cannot score a tree now."""
        capacity = self.target.capacity or context_length(self.target.model)
        room = None if capacity is None else capacity - n  # cache slots left after the root
        proposal, tree, fell_back = ready(proposal, gamma, self.target.vocab_size, room, self.target.supports_tree)
        if fell_back and not self._warned_chain_fallback:
            self._warned_chain_fallback = True
            warnings.warn(
                f"{type(self.target.model).__name__} cannot score this token tree in one pass (no 4D-mask "
                "support, or a sliding-window cache would be exceeded): verifying each round's first branch "
                "as a chain instead (exact, fewer tokens per pass)",
                stacklevel=3,
            )
        return proposal, tree

    def _plan_static(self, prompt_len: int) -> None:
        """Size the caches for this request (or raise before any work) and fix the verification shapes: a
        fixed γ pads every pass to γ+1 (one compiled shape), an adaptive one to DEFAULT_BUCKETS."""
        fixed = isinstance(self.gamma_policy, FixedGamma)
        capabilities = self.capabilities
        widest = self.gamma_policy.gamma + 1 if fixed else DEFAULT_BUCKETS[-1]
        tree_nodes = capabilities.max_nodes  # a tree drafter: its node budget sets the width
        if capabilities.nodes_per_level is not None and tree_nodes is None:  # k chains of γ
            tree_nodes = capabilities.nodes_per_level * (self.gamma_policy.gamma if fixed else DEFAULT_BUCKETS[-1])
        # A drafter that picks its node budget per round (DraftTree(max_nodes="auto")) names every budget
        # it may use: each one is a verification shape (budget + 1 rows), fixed before the request.
        budgets = self.drafter.plan(self.target) if self.drafter is not None else ()
        if budgets:
            tree_nodes = max(budgets)
        if tree_nodes is not None:
            widest = max(widest, tree_nodes + 1)
        allowed = getattr(self.gamma_policy, "gammas", None)  # an adaptive policy restricted to a γ set
        if allowed and tree_nodes is None:
            widest = max(allowed) + 1
        need = prompt_len + self.max_new_tokens + widest
        buckets = (widest,) if fixed and self.drafter is not None else (
            (1,) if self.drafter is None else
            (1, *sorted(g + 1 for g in allowed)) if allowed and tree_nodes is None else DEFAULT_BUCKETS)
        if len(budgets) > 1:
            buckets = tuple(sorted({b + 1 for b in budgets} | {widest}))
        self._buckets = buckets
        self.target.prepare(need, buckets)
        if self.drafter is not None:
            self.drafter.ensure_capacity(need)

    def _precompile(self, context: torch.Tensor) -> None:
        """A policy restricted to a γ set on a compiled target (gamma="auto" on the fast path): compile every
        shape it may use now, before the first round, so no round compiles (and no compile time is measured
        as a round's cost). Only the first request of a process pays; later ones find them compiled."""
        allowed = getattr(self.gamma_policy, "gammas", None)
        if not allowed or self.drafter is None:
            return
        if self.capabilities.needs_hidden or self.capabilities.tree:
            return  # their passes have other shapes (hidden states, tree masks): compiled on first use
        self.target.precompile(self._buckets, verify=self.sampling if self.fused_verify else None)
        self.drafter.precompile(allowed, self.sampling, context)

    def stream(self, prompt_ids: Sequence[int] | torch.Tensor | None) -> Iterator[int]:
        """Yield each new token as soon as it is final. An encoder-decoder target: prompt_ids is the decoder
        prompt (None: its decoder start token). Runs with specdec's thread count (`threads.decode_threads`),
        the caller's torch setting back in force at every yield."""
        return scoped_stream(self._tokens(prompt_ids), self.target.model)

    def _tokens(self, prompt_ids: Sequence[int] | torch.Tensor | None) -> Iterator[int]:
        """The decoding loop of `stream`: _start, then per round propose, verify, commit and emit."""
        context, n, needs_hidden, start, compiled = self._start(prompt_ids)
        stats = self.stats
        produced = 0
        while produced < self.max_new_tokens:
            # 1. drafter.propose: at most γ tokens (a tree at most γ deep), never more than fit under max_new_tokens.
            remaining = self.max_new_tokens - produced
            gamma = min(self.gamma_policy.choose(stats), remaining - 1) if self.drafter else 0
            t = time.perf_counter()
            proposal = (
                self.drafter.propose(context[:n], gamma, self.sampling, self.generator)
                if gamma > 0
                else Proposal(context.new_empty(0))
            )
            stats.draft_s += time.perf_counter() - t
            if proposal.parents is not None:
                proposal, tree = self._check_tree(proposal, gamma, n)  # a chain again if the target cannot do trees

            # 2-3. target.score + verify.
            if proposal.parents is None:
                gamma, accepted, keep, scores, verdict = self._verify_chain(context, n, proposal, gamma, needs_hidden)
            else:
                gamma, accepted, keep, scores, verdict = self._verify_tree(context, n, proposal, tree, needs_hidden)
            k = verdict.num_accepted

            # 4. commit.
            new_tokens = self._commit(context, n, gamma, accepted, keep, scores, verdict, needs_hidden)
            stats.compile_s = compile_seconds() - compiled
            n += k + 1

            # 5. emit, stopping at the first EOS.
            last_source = verdict.outcome if gamma else "target"
            for i, token in enumerate(new_tokens):
                self.last_token_source = "accepted" if i < k else last_source
                produced += 1
                stats.new_tokens = produced
                stats.target_forwards = self.target.forwards
                stats.draft_forwards = self.drafter.forwards if self.drafter is not None else 0
                stats.wall_s = time.perf_counter() - start
                yield token
                if token in self.eos:
                    return
        stats.wall_s = time.perf_counter() - start

    def _start(self, prompt_ids: Sequence[int] | torch.Tensor | None) -> tuple[torch.Tensor, int, bool, float, float]:
        """A request's start: the prompt checked, the target reset and prefilled (with the features of drafters
        that read them), the drafter reset, shapes compiled up front (their time in stats.prefill_compile_s).
        Returns context (context[:n] committed; room for the prompt, every new token and one round's drafts), n,
        whether the drafter reads the target's features, the request's start time, and the process's compile
        seconds before it (`compile_seconds`: the request's compile time is the growth of that total)."""
        if prompt_ids is None and isinstance(self.target, CachedSeq2SeqLM):
            prompt_ids = self.target.decoder_prompt()
        prompt = prompt_tensor(prompt_ids, self.target.vocab_size)  # [n0]
        self._check_fits(prompt.shape[0])
        self._plan_static(prompt.shape[0])
        device = self.target.device
        stats = self.stats = DecodeStats()
        start = time.perf_counter()
        compiled = compile_seconds()  # compile time paid by this call: the growth of this total

        context = torch.empty(prompt.shape[0] + self.max_new_tokens + 1, dtype=torch.long, device=device)
        n = prompt.shape[0]
        context[:n] = prompt
        # Drafters that read the target's features (EAGLE, Medusa) get them for every committed token.
        needs_hidden = self.capabilities.needs_hidden
        # An encoder-decoder target runs its encoder here, once per request (encoder_inputs is None otherwise).
        encoder = {} if self.encoder_inputs is None else {"encoder_inputs": self.encoder_inputs}
        self.target.reset(**encoder)
        prefill_hidden = self.target.prefill(context[: n - 1], hidden=needs_hidden)  # [n-1, H] | None
        if self.drafter is not None:
            t = time.perf_counter()
            if encoder:  # the source tokens too, for drafters that look them up (PromptLookup)
                encoder["encoder_input_ids"] = self.target.encoder_input_ids
            if needs_hidden:
                self.drafter.reset(context[:n], hidden=prefill_hidden, **encoder)
            else:
                self.drafter.reset(context[:n], **encoder)
            stats.draft_s += time.perf_counter() - t
        self._precompile(context[:n])
        stats.prefill_s = time.perf_counter() - start
        stats.prefill_compile_s = stats.compile_s = compile_seconds() - compiled
        return context, n, needs_hidden, start, compiled

    def _verify_chain(self, context: torch.Tensor, n: int, proposal: Proposal, gamma: int, needs_hidden: bool):
        """2-3. for a chain: the target scores the last committed token and the drafts, then the accepted prefix
        and a recovered or bonus token. Returns (γ' drafted, accepted [k], None: the prefix is kept by a crop,
        the scores [γ'+1, V], the verdict)."""
        drafted = proposal.tokens[:gamma]  # [γ']
        gamma = drafted.shape[0]
        draft_probs = proposal.draft_probs[:gamma] if proposal.draft_probs is not None else None
        t = time.perf_counter()
        if self.fused_verify:  # the target's pass runs the warp and verify.rejection_rule in its graph
            scores, verdict = self.target.score_and_verify(
                torch.cat([context[n - 1 : n], drafted]), draft_probs, self.sampling, self.generator,
                hidden=needs_hidden)  # [γ'+1, V]
            self.stats.target_s += time.perf_counter() - t
        else:
            scores = self.target.score(torch.cat([context[n - 1 : n], drafted]), hidden=needs_hidden)
            self.stats.target_s += time.perf_counter() - t
            verdict = self.verify_fn(drafted, draft_probs, scores.logits, self.sampling, self.generator)
        return gamma, drafted[: verdict.num_accepted], None, scores, verdict

    def _verify_tree(self, context: torch.Tensor, n: int, proposal: Proposal, tree: TreeMask, needs_hidden: bool):
        """2-3. for a tree: every node in one target pass, then the longest surviving path. Returns (nodes drafted,
        accepted [k], keep [k+1]: the rows to keep, root + path, the scores [N+1, V], the verdict)."""
        gamma = len(proposal)  # nodes drafted
        t = time.perf_counter()
        scores = self.target.score(torch.cat([context[n - 1 : n], proposal.tokens]),
                                   tree=tree, hidden=needs_hidden)  # [N+1, V]
        self.stats.target_s += time.perf_counter() - t
        verdict = self.tree_verify_fn(proposal, scores.logits, self.sampling, self.generator)
        path = torch.tensor(verdict.path, dtype=torch.long)  # [k] node indices
        accepted = proposal.tokens[path.to(proposal.tokens.device)]  # [k]
        keep = torch.cat([torch.zeros(1, dtype=torch.long), path + 1])  # [k+1] rows: root + path
        return gamma, accepted, keep, scores, verdict

    def _commit(self, context: torch.Tensor, n: int, gamma: int, accepted: torch.Tensor, keep: torch.Tensor | None,
                scores: Scores, verdict: Verdict, needs_hidden: bool) -> list[int]:
        """4. the target keeps the root and the accepted drafts (a crop, or the rows `keep` of a tree pass);
        context[n:n+k+1] = the accepted drafts and the next token; the round recorded; the drafter and the γ
        policy told. Returns the new tokens."""
        stats = self.stats
        k = verdict.num_accepted
        if keep is None:
            self.target.crop(n + k)
        else:
            self.target.commit(n - 1, keep)
        context[n : n + k] = accepted
        context[n + k] = verdict.next_token
        new_tokens = context[n : n + k + 1].tolist()
        n += k + 1
        stats.record_round(gamma, k, verdict.outcome)
        if self.drafter is not None:
            t = time.perf_counter()
            if needs_hidden:  # features of the root and the accepted drafts only: [k+1, H]
                rows = scores.hidden[: k + 1] if keep is None else scores.hidden[keep.to(scores.hidden.device)]
                self.drafter.commit(context[:n], k, hidden=rows)
            else:
                self.drafter.commit(context[:n], k)
            stats.draft_s += time.perf_counter() - t
        self.gamma_policy.update(stats)
        return new_tokens


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
