"""`StaticCausalLM`: the fast path. A preallocated, slot-indexed KV cache and compiled fixed-shape forwards.

Same interface as `CachedCausalLM` (forward / prefill / score / commit / crop / length / forwards), but:

- the cache (`SlotCache`, a `transformers.Cache` passed as `past_key_values`; no model file forked, nothing
  written on the config) holds `max_len` slots per layer, allocated once. A call writes its rows at explicit
  slots (`cache.slots`), and every query row gets an explicit additive mask over all `max_len` slots, so a
  rollback is only a move of the `length` pointer: stale slots beyond `length` are hidden by the mask and
  overwritten by the next write. Keeping a non-prefix path of a tree (`commit`) is one index copy.
- decoding passes run at a few fixed query lengths ("buckets"): a pass over M tokens is padded at the END to
  the smallest bucket >= M. Padded rows sit at later positions than every real row, so the causal mask
  already hides them from the real rows; their slots are overwritten later. Each (bucket, max_len) shape is
  compiled once per model object and process (`torch.compile`, inductor, fullgraph, static shapes; a model
  compiled by layer runs every pass of `SYMBOLIC_MIN_ROWS` rows or more on one graph of each kind whose row
  count is symbolic); a log line says when a compile happens and how long it took. Inductor's on-disk
  cache makes a second process's compile a cache load.
- `compile=False` runs exactly the same code without torch.compile (the static cache alone): the test suites
  use it for most cases, and it is the fallback where compiling is impossible.

The draft side (`draft_steps`, `draft_tree`) runs the graphs of `draft_graphs`. The cache is
`slot_cache.SlotCache`; compiled callables come from `compiled.compile_once`.
"""

from __future__ import annotations

import functools
import time
import warnings
import weakref

import torch
from transformers import PreTrainedModel

from specdec.core.masks import additive_mask
from specdec.core.sampling import SamplingConfig
from specdec.core.tree import TreeMask
from specdec.core.verify import Verdict, chain_verdict, draw_uniforms, greedy_rule, rejection_rule
from specdec.errors import PromptError
from specdec.runtime import draft_graphs
from specdec.runtime.base import Scores, numerical_error
from specdec.runtime.causal_lm import CachedCausalLM, check_rollback_support, context_length, vocab_size
from specdec.runtime.compiled import (
    CACHE_ROUND,
    DEFAULT_BUCKETS,
    FastPathWarning,
    by_layer,
    compile_once,
    entry_for,
    fast_path_problem,
    is_compiled,
)
from specdec.runtime.draft_graphs import draft_chain, expand_tree, tree_level, tree_root
from specdec.runtime.slot_cache import POOL, SlotCache, run_model

#: Chunk size of `StaticCausalLM.catch_up` (tokens a drafter skipped while the policy decoded plainly).
CATCH_UP_ROWS = 8
#: Rows per compiled prefill pass (`StaticCausalLM.prefill`): one shape for every prompt length...
PREFILL_ROWS = 32
#: ... and a second one for long prompts: passes of this many rows while more than 3 * PREFILL_ROWS rows remain.
#: A pass reads every weight once, so fewer, wider passes read less: on the default target in bf16 (one thread,
#: AMD EPYC Zen 5) a 127-token prefill takes 10.2 ms in 32-row passes, 8.2 ms in one 128-row pass, which costs
#: about three 32-row passes.
LONG_PREFILL_ROWS = 128
#: On a model compiled one graph per decoder layer (runtime/layer_graphs.py), a pass of at least this many rows runs
#: a graph whose row count is symbolic: one graph of each kind (prefill, pass, verification) serves every such width,
#: where each width was a compile of its own (17-20 s at the Qwen2.5-1.5B shape on one Zen 3 core; the symbolic graph
#: compiled in 14-20 s and ran each width as fast, docs/fastpath.md). Fewer rows keep static graphs: dynamo fixes a
#: dimension of size 1, which a verification pass of 2 rows has (its one draft), and one row is plain decoding's
#: step, which stays as tuned.
SYMBOLIC_MIN_ROWS = 3
#: On a model compiled by layer, a request whose passes include that symbolic graph (a drafted request's
#: verification) runs its one-row passes (a round that drafts nothing) on it too, padded, and compiles no one-row
#: graph: at the Qwen2.5-1.5B shape in bfloat16 on one Zen 4 core, the first request of a self-drafted target took
#: 57-58 s instead of 73 (with inductor's ISA probe skipped, `rowwise.vector_isa_proven`), and a padded one-row pass
#: took what its own graph's took (medians 107.0 / 113.1 against 107.3 / 113.7 ms in two interleaved runs; minimums
#: 1-3% more; docs/bench/layer-graphs-zen4-1.5b). Once this many padded one-row passes of the model have run in the
#: process (the policy found speculation not paying), the next request compiles the one-row graph up front and runs
#: them on it, as every request does once the model has a one-row graph (plain decoding's).
ONE_ROW_GRAPH_AFTER = 16


def _verify_pass(model, input_ids, position_ids, slots, cache, hidden, draft_probs, uniforms, sampling: SamplingConfig):
    """A chain pass and its verification in one graph: `run_model` over input_ids [1, G+1] (the last
    committed token, then the G drafts), the target's warp over those rows (`SamplingConfig.warp`) and the
    rejection rule (`verify.rejection_rule`) with draft_probs [G+1, V] (the drafts' distributions, a point mass as a
    one-hot row, then a row the rule does not read: every input counts the pass's G+1 rows, one symbolic size where
    the row count is symbolic) and uniforms [G+1] drawn beforehand from the request's generator.
    Returns logits [G+1, V], hidden | None, whether every logit is finite, and (k, next_token) as [2]."""
    logits, states, finite, best = run_model(model, input_ids, position_ids, slots, None, cache, hidden)
    k, next_token = _rule(input_ids[0, 1:], draft_probs[:-1], logits, uniforms, sampling, best)
    return logits, states, finite, torch.stack([k, next_token])


def _rows_symbolic(max_len: int, *dims: tuple[torch.Tensor | None, int]) -> tuple[torch.Tensor | None, ...]:
    """The tensors of (tensor, dim) as new views, their dimension `dim` (the pass's rows) marked for dynamo as
    symbolic, from SYMBOLIC_MIN_ROWS to max_len; None stays None. Views, so that a tensor made once and shared
    (`_zeros`) is not marked for other graphs."""
    out = []
    for tensor, dim in dims:
        if tensor is not None:
            tensor = tensor.view(tensor.shape)
            torch._dynamo.mark_dynamic(tensor, dim, min=SYMBOLIC_MIN_ROWS, max=max_len)
        out.append(tensor)
    return tuple(out)


def _draft_key(gamma: int, sampling: SamplingConfig, max_len: int, vocab: torch.Tensor | None, feed: int) -> tuple:
    """The shape key of a draft chain graph (a reduced vocabulary's size and the tokens it feeds first are part of
    its shape)."""
    return ("draft", gamma, sampling, max_len, None if vocab is None else vocab.shape[0], feed)


@functools.cache
def _zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float64 zeros of `shape` on `device`, made once: the uniforms and q that a greedy rule takes but never reads
    (an inference tensor, as every compiled call expects; nothing writes it)."""
    with torch.inference_mode():
        return torch.zeros(shape, dtype=torch.float64, device=device)


def _rule(draft_tokens, draft_probs, logits, uniforms, sampling: SamplingConfig, best=None):
    """The default verification rule of a chain: greedy (argmax, `best` [G+1] when the pass has it; draft_probs
    and uniforms unused), or the rejection rule on the target's warped probabilities [G+1, V]."""
    if sampling.greedy:
        return greedy_rule(draft_tokens, logits, best)
    return rejection_rule(draft_tokens, draft_probs, sampling.warp(logits), uniforms)


class StaticCausalLM:
    """A causal LM with a preallocated slot cache and (optionally) compiled fixed-shape passes.

    max_len: slots in the cache; None sizes it per request (`ensure_capacity`), rounded up to CACHE_ROUND.
    compile: torch.compile the decoding passes (False: the same code, eager).
    """

    verifies_in_graph = True  # score_and_verify: a chain's verification rule in the pass's graph

    def __init__(self, model: PreTrainedModel, *, compile: bool = True, max_len: int | None = None):
        check_rollback_support(model)
        self.model = model
        self.vocab_size = vocab_size(model)
        self.device = next(model.parameters()).device
        self.compile = compile
        self.fixed_max_len = max_len
        self.buckets: tuple[int, ...] = DEFAULT_BUCKETS
        self.pad_one_row = False  # this request's one-row passes run padded (`prepare`, ONE_ROW_GRAPH_AFTER)
        self.draft_gammas: set[int] = set()
        self._graphs: dict[tuple, object] = {}  # shape key -> its compiled callable (`compile_once`'s), once found
        self.cache: SlotCache | None = None
        self.borrowed = False  # the cache is another adapter's (`share_cache`), not this one's
        self._give_back: weakref.finalize | None = None
        if max_len is not None:
            self.cache = self._new_cache(max_len)
        self.length = 0
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0

    # -- capacity ---------------------------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        return self.cache.max_len if self.cache is not None else 0

    @property
    def capacity(self) -> int | None:
        """Slots the cache holds (None before the first request sized it)."""
        return self.max_len or None

    @property
    def context_limit(self) -> int | None:
        return context_length(self.model)

    def prepare(self, tokens: int, buckets: tuple[int, ...]) -> None:
        """Before a request: pad its passes to `buckets` (its one-row passes to the next one up where they run on
        the graph of symbolic row count, `ONE_ROW_GRAPH_AFTER`), and make room for `tokens` slots (or raise)."""
        entry = entry_for(self.model)
        one_row_graph = any(is_compiled(self.model, key) for key in entry.fns
                            if key[0] in ("pass", "verify") and key[1] == 1)  # plain decoding's, say
        self.pad_one_row = (1 in buckets and len(buckets) > 1 and self._symbolic(max(buckets)) and not one_row_graph
                            and entry.padded_one_rows < ONE_ROW_GRAPH_AFTER)
        self.buckets = tuple(b for b in buckets if b != 1) if self.pad_one_row else buckets
        self.ensure_capacity(tokens)

    def supports_tree(self, num_rows: int, warn: bool = True) -> bool:
        """A tree pass is one explicit 4D mask over the slots: any architecture the slot cache takes can
        score one (sliding-window models never reach this adapter)."""
        return True

    def ensure_capacity(self, tokens: int) -> None:
        """Make room for `tokens` slots (prompt + new tokens + one padded round); raise if a fixed size or
        the model's context cannot hold them. Call before any work of a request."""
        limit = context_length(self.model)
        if self.fixed_max_len is not None:
            if tokens > self.fixed_max_len:
                raise PromptError(
                    f"this request needs {tokens} cache slots (prompt + max_new_tokens + one padded round) but "
                    f"the static cache holds {self.fixed_max_len}; create it with a larger max_len, or "
                    "shorten the prompt / lower max_new_tokens")
            return
        if self.borrowed:  # drafting into another adapter's cache ended: this adapter writes its own again
            self.cache, self.borrowed = None, False
        size = -(-tokens // CACHE_ROUND) * CACHE_ROUND
        if limit is not None:
            size = min(size, max(limit, tokens))
        if self.cache is None or self.cache.max_len < tokens:
            self.cache = self._new_cache(size)
            self.length = 0

    def _new_cache(self, size: int) -> SlotCache:
        """A cache of `size` slots; compiled, allocated up front, so that every pass runs compiled (the
        prefill's first chunk too: eager and compiled passes may round differently), taken from the pool of
        allocated caches and given back when this adapter is dropped or takes a larger one."""
        if not self.compile:
            return SlotCache(size)
        if self._give_back is not None:
            self._give_back()  # the cache this one replaces
        cache = POOL.take(self.model, size)
        self._give_back = weakref.finalize(self, POOL.give_back, weakref.ref(self.model), cache)
        return cache

    def share_cache(self, host: StaticCausalLM) -> None:
        """Read and write `host`'s cache from now on, at its length: a self-draft drafting on the keys and values
        the target wrote for the committed tokens (`SelfDraft`). Its passes then write only past that length
        (`draft_steps(feed=1)`), slots the target's next pass overwrites before it reads them. The cache this
        adapter held goes back to the pool; `ensure_capacity` gives it its own again."""
        if self._give_back is not None:
            self._give_back()
            self._give_back = None
        self.cache, self.borrowed, self.length = host.cache, True, host.length

    # -- bookkeeping ------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.length = 0
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0

    def crop(self, length: int) -> None:
        """Roll back to the first `length` tokens: a pointer move."""
        if length < self.length:
            self.length = length

    def commit(self, start: int, keep: torch.Tensor) -> None:
        """After a pass that began at slot `start`, keep rows keep [k] (increasing, relative to start) at
        slots start..start+k-1; length = start + k."""
        k = int(keep.shape[0])
        chain = bool((keep == torch.arange(k, device=keep.device)).all()) if k else True
        if not chain:
            src = (start + keep).to(self.device)
            self.cache.move(torch.arange(start, start + k, device=self.device), src)
        self.length = start + k

    # -- passes -----------------------------------------------------------------------------------------
    def _bucket(self, m: int) -> int:
        for b in self.buckets:
            if b >= m:
                return b
        return m

    def _fn(self, key: tuple, fn, symbolic: bool = False):
        """The callable for a shape key: compiled once per model object, or `fn` itself when eager. symbolic: the
        graph's row count is symbolic (`SYMBOLIC_MIN_ROWS`)."""
        compiled = self._graphs.get(key)
        if compiled is not None:
            return compiled
        if not self.compile or not self.cache.ready:
            return fn
        compiled = self._graphs[key] = compile_once(self.model, key, fn, dynamic=symbolic)
        return compiled

    def _symbolic(self, rows: int) -> bool:
        """Whether a compiled pass of `rows` rows runs the graph whose row count is symbolic (`SYMBOLIC_MIN_ROWS`)."""
        return self.compile and rows >= SYMBOLIC_MIN_ROWS and by_layer(self.model)

    @torch.inference_mode()
    def _pass(self, *args, **kwargs):
        """`_run` in inference mode, for callers not in it already."""
        return self._run(*args, **kwargs)

    def _run(self, input_ids: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor] | None, hidden: bool,
             pad: bool, rule: tuple | None = None, keep: int = 0, rows: int | None = None):
        """A pass, in inference mode (the caller's). Rows input_ids [M], written to slots length..length+M-1
        (padded to a bucket): a chain (tree None), row i at position length + i seeing the slots up to its own,
        or a tree = (positions [M], visible [M, L]), row i at positions[i] seeing the slots where visible[i] is
        True.
        Returns logits [M, V] and hidden | None; with `rule` = (draft_probs [M, V] (the last row unread), uniforms
        [M] float64, sampling) for a chain, also the rejection rule's (k, next_token) [2] from the same graph
        (`_verify_pass`), or None for a padded pass (whose graph verified the padding as drafts). keep > 0 (a
        prefill): the logits of the last `keep` rows only (of the padded pass). rows: pad to this many rows
        instead of a bucket."""
        m = input_ids.shape[0]
        b = rows if rows is not None else self._bucket(m) if pad else m
        if self.pad_one_row and m == 1 and rows is None and pad:  # on the symbolic graph (`prepare`)
            entry_for(self.model).padded_one_rows += 1
        if self.length + b > self.max_len:
            raise PromptError(
                f"the static cache of {self.max_len} slots is full (length {self.length} + {b} new rows); "
                "create the adapter with a larger max_len or lower max_new_tokens")
        ids = input_ids.to(self.device).clone()  # an inference tensor, as every compiled call expects
        slots = torch.arange(self.length, self.length + b, device=self.device)  # [b]
        if b > m:
            ids = torch.cat([ids, ids.new_zeros(b - m)])
        mask = None
        if tree is None:  # a chain: each row at its slot's position (padded rows continue the chain)
            positions = torch.arange(self.length, self.length + b, device=self.device)  # [b]
        else:
            positions, visible = tree
            if b > m:  # a tree: each padded row sees the cache and itself, one position past the cache
                positions = torch.cat([positions, positions.new_full((b - m,), self.length)])
                full = visible.new_zeros((b, self.max_len))  # [b, L]
                full[:m] = visible
                full[m:, : self.length] = True
                full[torch.arange(m, b), slots[m:]] = True
                visible = full
            mask = additive_mask(visible, self.model.dtype)[None, None]  # [1, 1, b, L]
            positions = positions.to(self.device).clone()  # [b] inference tensors, as above
        decided = None
        symbolic = self._symbolic(b)
        width = f"{SYMBOLIC_MIN_ROWS}+" if symbolic else b  # the key's rows: any number from SYMBOLIC_MIN_ROWS
        ids, positions = ids[None], positions[None]  # [1, b]
        if rule is None:
            key = ("prefill", width, self.max_len, hidden) if keep else ("pass", width, self.max_len, hidden,
                                                                         mask is not None)
            if symbolic:
                ids, positions, slots, mask = _rows_symbolic(self.max_len, (ids, 1), (positions, 1), (slots, 0),
                                                             (mask, 2))
            fn = self._fn(key, run_model, symbolic)
            logits, states, finite, _ = fn(self.model, ids, positions, slots, mask, self.cache, hidden, keep)
        else:  # a chain verified in the same graph: padded rows are drafted with q = 0, their result unused
            draft_probs, uniforms, sampling = rule  # [m, V], [m]
            if b > m:
                draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(b - m, draft_probs.shape[-1])])  # [b, V]
                uniforms = torch.cat([uniforms, uniforms.new_zeros(b - m)])  # [b]
            if symbolic:
                ids, positions, slots, draft_probs, uniforms = _rows_symbolic(
                    self.max_len, (ids, 1), (positions, 1), (slots, 0), (draft_probs, 0), (uniforms, 0))
            fn = self._fn(("verify", width, self.max_len, hidden, sampling), _verify_pass, symbolic)
            logits, states, finite, decided = fn(self.model, ids, positions, slots, self.cache, hidden, draft_probs,
                                                 uniforms, sampling)
            decided = decided if b == m else None
        if not bool(finite):
            raise numerical_error(self.model, f"at positions {self.length}..{self.length + m - 1}")
        self.length += m
        if b > m:
            logits, states = logits[:m], (states[:m] if states is not None else None)
        if rule is not None:
            return logits, states, decided
        return logits, states

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append input_ids [n] to the cache; return logits [n, V] (or [1, V] with last_only)."""
        start = time.perf_counter()
        logits, _ = self._pass(input_ids, None, False, pad=True)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return logits[-1:] if last_only else logits

    def score(self, input_ids: torch.Tensor, *, tree: TreeMask | None = None,
              hidden: bool | tuple[int, ...] = False) -> Scores:
        """Append input_ids [M] (a chain, or a tree whose row 0 is the root); logits [M, V] (+ hidden)."""
        start = time.perf_counter()
        m = input_ids.shape[0]
        placed = None  # a chain
        if tree is not None:
            positions = self.length + tree.depths.to(self.device)  # [M]
            visible = torch.zeros(m, self.max_len, dtype=torch.bool, device=self.device)  # [M, L]
            visible[:, : self.length] = True
            visible[:, self.length : self.length + m] = tree.ancestors.to(self.device)
            placed = (positions, visible)
        logits, states = self._pass(input_ids, placed, hidden, pad=True)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return Scores(logits, states)

    @torch.inference_mode()
    def score_and_verify(self, input_ids: torch.Tensor, draft_probs: torch.Tensor | None, sampling: SamplingConfig,
                         generator: torch.Generator | None, *,
                         hidden: bool | tuple[int, ...] = False) -> tuple[Scores, Verdict]:
        """`score` a chain input_ids [γ+1] (the last committed token, then γ drafts with draft_probs [γ, V], or
        None for a point mass) and verify it in the same pass: greedy, `verify.greedy_rule` (the target's
        argmax); at temperature > 0 the target's warp and `verify.rejection_rule`, with uniforms drawn here from
        `generator` exactly as `verify.verify_sampled` draws them, so the tokens are the eager rule's. Both run
        inside the (compiled) graph."""
        start = time.perf_counter()
        m = input_ids.shape[0]
        drafts = input_ids[1:]  # [γ]
        if sampling.greedy:  # the rule reads neither q nor uniforms: nothing is drawn from the generator
            uniforms, q = _zeros((m,), self.device), _zeros((m, 0), self.device)  # [γ+1], [γ+1, 0]
        else:
            drafts = drafts.to(self.device)
            uniforms = draw_uniforms(m - 1, generator, self.device)  # [γ+1]
            # q in float64 whatever the drafter's dtype (one graph per shape; the ratio is float64 anyway), and
            # a point mass as its one-hot row: the same ratio p(x) and residual as draft_probs=None. Its last
            # row is not read (`_verify_pass`).
            if draft_probs is None:
                q = torch.zeros(m, self.vocab_size, dtype=torch.float64, device=self.device)  # [γ+1, V]
                q[torch.arange(m - 1, device=self.device), drafts] = 1.0
            else:  # one copy of the drafter's rows, no fill of the whole buffer; the unread row zeroed
                q = torch.empty(m, draft_probs.shape[-1], dtype=torch.float64, device=self.device)  # [γ+1, V]
                q[:-1] = draft_probs
                q[-1] = 0.0
        logits, states, decided = self._run(input_ids, None, hidden, pad=True, rule=(q, uniforms, sampling))
        self.forwards += 1
        if decided is None:  # a padded (short) round: the same rule on the scored rows, eagerly
            k, next_token = _rule(drafts.to(self.device), q[:-1], logits, uniforms, sampling)
            decided = torch.stack([k, next_token])
        verdict = chain_verdict(m - 1, decided)
        self.forward_s += time.perf_counter() - start
        return Scores(logits, states), verdict

    def prefill(self, input_ids: torch.Tensor, hidden: bool | tuple[int, ...] = False) -> torch.Tensor | None:
        """Cache input_ids [n] (any n; not a decoding pass). Returns hidden [n, H] when asked.

        Compiled: in passes of LONG_PREFILL_ROWS rows while more than 3 * PREFILL_ROWS rows remain (and they fit
        the cache), then of PREFILL_ROWS rows, the last one padded, so that two compiled shapes serve every prompt
        length. Every kernel computes each row on its own, so the chunks leave each row's keys and values (and
        states) the bits one pass over the whole prompt gives it. Eager: one pass."""
        n = input_ids.shape[-1]
        if not n:
            return None
        start = time.perf_counter()
        if not self.compile:
            _, states = self._pass(input_ids, None, hidden, pad=False, keep=1)  # logits unused
        else:
            parts, s = [], 0
            while s < n:
                size = PREFILL_ROWS
                if n - s > 3 * PREFILL_ROWS and self.length + LONG_PREFILL_ROWS <= self.max_len:
                    size = LONG_PREFILL_ROWS
                rows, back = size, 0
                over = self.length + size - self.max_len
                if over > 0:  # the last chunk's padding would run past the cache:
                    if over <= s:  # re-feed rows before it (the same rows at the same slots give the same bits)
                        back = over
                    else:  # or, with too few before it, pass it unpadded (its own compiled shape)
                        rows = min(size, n - s)
                self.length -= back
                chunk = input_ids[s - back : s + size]
                _, states = self._pass(chunk, None, hidden, pad=True, keep=1, rows=rows)
                parts.append(None if states is None else states[back:])
                s += size
            states = None if parts[0] is None else torch.cat(parts)
        self.prefill_s += time.perf_counter() - start
        return states

    @torch.inference_mode()
    def draft_steps(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                    generator: torch.Generator | None, vocab: torch.Tensor | None = None, *, feed: int = 2,
                    per_step: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Propose γ tokens continuing context [n] (n >= feed, cache holding at least context[:n-feed]) in one
        pass of the compiled draft graph, which first feeds the last `feed` committed tokens: 2 in a cache of its
        own (the second-last may be missing after a fully accepted round), 1 in a shared one (`share_cache`),
        which holds context[:n-1] already and keeps it. vocab [N] (on the model's device): the token ids of the
        model's logits columns when its LM head is reduced (`DraftModel(draft_vocab=...)`).
        per_step=True: γ calls of a one-step graph instead (the first feeds `feed` tokens, the others one): one
        compile serves every γ, for a draft whose step is long beside a call's overhead (SelfDraft's).
        Returns tokens [γ], draft_probs [γ, V] | None (V: the model's logits width, N with a vocab)."""
        n = context.shape[0]
        asked = gamma
        if not per_step:  # draft the smallest γ already compiled that covers this one (the decoder keeps the first
            done = [g for g in self.draft_gammas if g >= gamma]  # γ'): a short last round must not compile a graph
            gamma = min(done) if done else gamma
            self.draft_gammas.add(gamma)
        start_slot = n - feed
        if n - 1 + gamma > self.max_len:
            raise PromptError(f"the draft's static cache of {self.max_len} slots is full; lower max_new_tokens")
        # [γ] (greedy: unread). Only the asked-for drafts draw from the request's generator (the decoder keeps those),
        # so a short round leaves it where drafting alone or batched leaves it; the rest draw 0, and are dropped.
        uniforms = (torch.cat([torch.rand(asked, dtype=torch.float64, device=self.device, generator=generator),
                               _zeros((gamma - asked,), self.device)])
                    if not sampling.greedy else _zeros((gamma,), self.device))
        t = time.perf_counter()
        ids = context[start_slot:n].to(self.device).clone()  # [feed]
        slot0 = torch.scalar_tensor(start_slot, dtype=torch.long, device=self.device)  # [] (cheaper than tensor())
        if per_step:
            tokens, probs, finite = self._draft_by_steps(ids, slot0, uniforms, gamma, sampling, vocab)
        else:
            fn = self._fn(_draft_key(gamma, sampling, self.max_len, vocab, feed), draft_chain)
            tokens, probs, finite = fn(self.model, ids, slot0, self.cache, uniforms, gamma, sampling, vocab)
        self.forward_s += time.perf_counter() - t
        if not bool(finite):
            raise numerical_error(self.model, f"at positions {start_slot}..{n + gamma - 2} (drafting)")
        self.forwards += gamma
        self.length = n + gamma - 1  # context[:n] and the first γ-1 drafts
        return tokens, probs

    def _draft_by_steps(self, ids, slot0, uniforms, gamma: int, sampling: SamplingConfig, vocab):
        """`draft_steps(per_step=True)`'s γ calls of the one-step graph of ids' width, then of width 1, each feeding
        the token the last one drew. Returns tokens [γ], draft_probs [γ, V] | None, finite []."""
        tokens, probs, finite = [], [], None
        for i in range(gamma):
            fn = self._fn(_draft_key(1, sampling, self.max_len, vocab, ids.shape[0]), draft_chain)
            token, prob, step_finite = fn(self.model, ids, slot0, self.cache, uniforms[i : i + 1], 1, sampling, vocab)
            slot0 = slot0 + ids.shape[0]
            ids = token  # [1]: a token id (the graph maps a reduced vocabulary's columns)
            tokens.append(token)
            probs.append(prob)
            finite = step_finite if finite is None else finite & step_finite
        return torch.cat(tokens), (torch.cat(probs) if not sampling.greedy else None), finite

    def catch_up(self, input_ids: torch.Tensor) -> None:
        """Append input_ids [n] (committed tokens a drafter skipped) in chunks of CATCH_UP_ROWS rows, then one
        row at a time: two compiled shapes (`catch_up_sizes`) whatever n is."""
        done = 0
        while done < input_ids.shape[0]:
            step = CATCH_UP_ROWS if input_ids.shape[0] - done >= CATCH_UP_ROWS else 1
            self.forward(input_ids[done : done + step])
            done += step

    @property
    def catch_up_sizes(self) -> tuple[int, int]:
        """The padded pass sizes `catch_up` uses."""
        return (self._bucket(1), self._bucket(CATCH_UP_ROWS))

    # -- compiling up front -------------------------------------------------------------------------------
    def _compiled(self, key: tuple) -> bool:
        return is_compiled(self.model, key)

    def precompile(self, sizes, draft_gammas=(), sampling: SamplingConfig | None = None,
                   context: torch.Tensor | None = None, verify: SamplingConfig | None = None,
                   vocab: torch.Tensor | None = None, feed: int = 2, per_step: bool = False) -> None:
        """Compile now the chain passes of `sizes` rows and (with `context` [n], n >= 2, the committed tokens
        the cache holds all but the last of) the draft graphs of `draft_gammas`, so that no later round of
        any request compiles. Runs after the prefill, past the cache's length, then restores it: the slots
        it wrote are hidden by the mask and overwritten later. A no-op when eager or already compiled.
        verify: the sampling config whose verifying passes (`score_and_verify`) of `sizes` rows to compile
        instead of the plain ones. vocab, feed, per_step: as `draft_steps`'.
        """
        if not self.compile or self.cache is None or not self.cache.ready:
            return
        length, forwards, forward_s = self.length, self.forwards, self.forward_s
        sizes = sorted({self._bucket(b) for b in sizes})  # a one-row pass may run padded (`prepare`)
        try:
            for b in sizes if verify is not None else ():
                if not self._compiled(("verify", b, self.max_len, False, verify)) and length + b <= self.max_len:
                    self.score_and_verify(torch.zeros(b, dtype=torch.long), None, verify,
                                          torch.Generator(device=self.device).manual_seed(0))
                    self.length = length
            for b in sizes if verify is None else ():
                if not self._compiled(("pass", b, self.max_len, False, False)) and length + b <= self.max_len:
                    self._pass(torch.zeros(b, dtype=torch.long), None, False, pad=False)
                    self.length = length
            if context is None or context.shape[0] < feed or sampling is None:
                return
            generator = torch.Generator(device=self.device).manual_seed(0)  # not the request's generator
            if per_step:  # two steps compile both one-step graphs (width feed, then 1), whatever the γ
                if (draft_gammas and not self._compiled(_draft_key(1, sampling, self.max_len, vocab, 1))
                        and context.shape[0] + 1 <= self.max_len):
                    self.draft_steps(context, 2, sampling, generator, vocab=vocab, feed=feed, per_step=True)
                return
            for gamma in sorted(draft_gammas):
                if not self._compiled(_draft_key(gamma, sampling, self.max_len, vocab, feed)):
                    self.draft_gammas.add(gamma)
                    if context.shape[0] - 1 + gamma <= self.max_len:
                        self.draft_steps(context, gamma, sampling, generator, vocab=vocab, feed=feed)
                    self.length = length
        finally:
            self.length, self.forwards, self.forward_s = length, forwards, forward_s

    @torch.inference_mode()
    def draft_tree(self, context: torch.Tensor, top_k: int, depth: int, max_depth: int,
                   sampling: SamplingConfig) -> tuple[list[int], list[int], list[float], list[int]]:
        """Grow a fixed-shape dynamic tree under context [n] (`draft_graphs.expand_tree`) in one compiled graph per
        (top_k, depth, sampling, cache size); the tree rows are discarded afterwards (length n − 1).
        Returns the candidates as lists: tokens, parents, scores, rank (see `draft_graphs.select_tree`)."""
        n = context.shape[0]
        width = depth + 2  # a round commits at most depth + 1 tokens: re-feed that many plus the root
        slot0 = max(0, n - width)
        if self.length < slot0:  # only after an external crop: catch up plainly
            self.forward(context[self.length : slot0])
        if slot0 + max(width, n - slot0 + (depth - 1) * top_k) > self.max_len:
            raise PromptError(f"the draft's static cache of {self.max_len} slots is full; lower max_new_tokens")
        ids = context[slot0:n].to(self.device)
        if ids.shape[0] < width:  # a short prompt: pad after the root (those slots belong to the tree)
            ids = torch.cat([ids, ids.new_zeros(width - ids.shape[0])])
        args = (self.model, ids.clone(), torch.tensor(slot0, device=self.device),
                torch.tensor(n, device=self.device), torch.tensor(max_depth, device=self.device), self.cache,
                top_k, depth, sampling)
        t = time.perf_counter()
        if draft_graphs.TREE_GRAPH == "whole":
            fn = self._fn(("tree", top_k, depth, sampling, self.max_len), expand_tree)
            tokens, parents, scores, rank, finite = fn(*args)
        else:
            root_fn = self._fn(("tree-root", top_k, depth, sampling, self.max_len), tree_root)
            level_fn = self._fn(("tree-level", top_k, depth, sampling, self.max_len), tree_level)
            tokens, parents, scores, rank, finite = expand_tree(*args, root_fn=root_fn, level_fn=level_fn)
        if not bool(finite):
            raise numerical_error(self.model, f"while drafting a tree after position {n - 1}")
        out = tokens.tolist(), parents.tolist(), scores.tolist(), rank.tolist()
        self.forward_s += time.perf_counter() - t
        self.forwards += depth
        self.length = n - 1  # context[:n−1]; the root is re-fed next round
        return out


def fast_adapter(model: PreTrainedModel, compile: bool | str):
    """The adapter for `compile` (True: compiled static; "static": static, eager; False: CachedCausalLM),
    falling back to the eager adapter with one warning naming why when the model cannot take it."""
    if not compile:
        return CachedCausalLM(model)
    problem = fast_path_problem(model, compile is True)
    if problem is not None:
        warnings.warn(f"specdec fast path unavailable, decoding eagerly instead (same tokens): {problem}",
                      FastPathWarning, stacklevel=3)
        return CachedCausalLM(model)
    return StaticCausalLM(model, compile=compile is True)

