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
  compiled once per model object and process (`torch.compile`, inductor, fullgraph, dynamic=False); a log
  line says when a compile happens and how long it took. Inductor's on-disk cache makes a second process's
  compile a cache load.
- `compile=False` runs exactly the same code without torch.compile (the static cache alone): the test suites
  use it for most cases, and it is the fallback where compiling is impossible.

The draft side (`draft_steps`) runs γ autoregressive draft steps, argmax or sampling, as ONE compiled graph:
per-call overhead, not arithmetic, dominates a small draft model. Sampling uses uniforms drawn beforehand from
the request's generator and the same warp as `SamplingConfig.warp` inside the graph, so the returned
`draft_probs` are exactly the distributions the tokens were drawn from.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.errors import NumericalError, PromptError
from specdec.models.base import Scores, cache_kwarg, select_hidden
from specdec.models.causal_lm import check_rollback_support, context_length, vocab_size
from specdec.sampling import SamplingConfig
from specdec.tree import TreeMask
from specdec.verify import Verdict, chain_verdict, draw_uniforms, rejection_rule

log = logging.getLogger("specdec.fastpath")

#: Query lengths a verification pass is padded to when the decoder has not planned its own.
DEFAULT_BUCKETS = (1, 2, 3, 5, 9, 17, 33)
#: Chunk size of `StaticCausalLM.catch_up` (tokens a drafter skipped while the policy decoded plainly).
CATCH_UP_ROWS = 8
#: Cache sizes are rounded up to a multiple of this, so nearby requests share compiled shapes.
CACHE_ROUND = 256

#: Inductor options measured on the default pair (docs/fastpath.md); freezing folds the weights in as
#: constants, which is only valid while they do not change (inference).
COMPILE_OPTIONS = {"freezing": True, "cpp_wrapper": True}


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values: [1, heads, max_len, head_dim], written at the owner's `slots`."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotCache):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        shape = (key_states.shape[0], key_states.shape[1], self.owner.max_len)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros((*shape, key_states.shape[-1]))
        self.values = value_states.new_zeros((*shape, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.slots  # [M]
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_len, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.max_len


class SlotCache(Cache):
    """A preallocated KV cache written at explicit slots. `length` (slots in use once the current write is
    done) is bookkeeping for models that ask; the masks alone decide what a query sees."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.slots = torch.zeros(1, dtype=torch.long)
        super().__init__(layers=[])

    @property
    def ready(self) -> bool:
        """Every layer allocated (by a first, eager write): from then on a pass can run compiled."""
        return bool(self.layers) and all(layer.is_initialized for layer in self.layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:  # layers appear on the first (eager) pass
            self.layers.append(_SlotLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    @torch.inference_mode()
    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy slots src [k] to slots dst [k] in every layer (the accepted path of a tree)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[:, :, dst] = layer.keys[:, :, src]
                layer.values[:, :, dst] = layer.values[:, :, src]


def static_cache_problem(model: PreTrainedModel) -> str | None:
    """Why `model` cannot run on the static cache, or None when it can."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    limit = context_length(model)
    # A window at least as long as the model's context never hides a key: plain causal attention.
    if window and getattr(config, "use_sliding_window", True) is not False and (limit is None or window < limit):
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None or any(t != "full_attention" for t in layer_types):
            return (f"{type(model).__name__} uses sliding-window attention (window {window} < context "
                    f"{limit}), whose rolling cache the slot cache does not model")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return f"{type(model).__name__} mixes attention types {sorted(set(layer_types))}"
    if getattr(config, "add_cross_attention", False):
        return f"{type(model).__name__} has cross-attention"
    return None


def compiler_problem() -> str | None:
    """Why torch.compile cannot run here, or None."""
    import shutil  # noqa: PLC0415

    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++/clang++) on PATH, which inductor needs on a CPU"
    return None


class _Compiled:
    """Compiled callables of one model, keyed by shape; shared by every adapter of that model object."""

    def __init__(self):
        self.fns: dict[tuple, object] = {}
        self.compile_s: dict[tuple, float] = {}


_COMPILED: weakref.WeakKeyDictionary[PreTrainedModel, _Compiled] = weakref.WeakKeyDictionary()


def compile_seconds() -> float:
    """Seconds this process has spent so far compiling fast-path passes (the first call of each shape, for
    every model): the difference across a call is the compile time it paid."""
    return sum(sum(entry.compile_s.values()) for entry in list(_COMPILED.values()))


def _raise_recompile_limit() -> None:
    # One code object serves every shape (each its own cache entry), so allow more than dynamo's default 8.
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < 64:
            setattr(cfg, name, 64)
    if hasattr(cfg, "accumulated_recompile_limit") and cfg.accumulated_recompile_limit < 1024:
        cfg.accumulated_recompile_limit = 1024


def _run_model(model, input_ids, position_ids, slots, mask, cache, hidden: bool):
    """One pass: input_ids [1, M] at position_ids [1, M], written to cache slots [M]; mask [1, 1, M, L]
    additive, or None for a chain (row i sees slots <= slots[i]). Returns logits [M, V], hidden | None,
    and whether every logit is finite."""
    cache.slots = slots
    if not torch.compiler.is_compiling():  # for models that ask the cache its length (eager only)
        cache.length = int(slots[-1]) + 1
    if mask is None:
        visible = torch.arange(cache.max_len, device=slots.device)[None, :] <= slots[:, None]  # [M, L]
        dtype = model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=slots.device).masked_fill(
            ~visible, torch.finfo(dtype).min)[None, None]  # [1, 1, M, L]
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **cache_kwarg(model, cache),
                use_cache=True, output_hidden_states=bool(hidden))
    logits = out.logits[0]  # [M, V]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    states = select_hidden(out.hidden_states, hidden) if hidden else None  # [M, H] (or [M, len * H])
    return logits, states, torch.isfinite(logits).all()


def _verify_pass(model, input_ids, position_ids, slots, cache, hidden, draft_tokens, draft_probs, uniforms,
                 sampling: SamplingConfig):
    """A chain pass and its verification in one graph: `_run_model` over input_ids [1, G+1] (the last
    committed token, then the drafts), the target's warp over those rows (`SamplingConfig.warp`) and the
    rejection rule (`verify.rejection_rule`) with draft_tokens [G], draft_probs [G, V] (a point mass as a
    one-hot row) and uniforms [G+1] drawn beforehand from the request's generator.
    Returns logits [G+1, V], hidden | None, whether every logit is finite, and (k, next_token) as [2]."""
    logits, states, finite = _run_model(model, input_ids, position_ids, slots, None, cache, hidden)
    target_probs = sampling.warp(logits)  # [G+1, V]
    k, next_token = rejection_rule(draft_tokens, draft_probs, target_probs, uniforms)
    return logits, states, finite, torch.stack([k, next_token])


def _draft_steps(model, tokens, slot0, cache, uniforms, gamma: int, sampling: SamplingConfig):
    """γ draft steps in one graph. tokens [2] = the last two committed tokens at slots slot0, slot0+1
    (re-writing the first is harmless: same token, same position); uniforms [γ] float64 (sampling only).
    Returns proposed tokens [γ], draft_probs [γ, V] when sampling, and whether every logit was finite."""
    ids = tokens[None]  # [1, 2]
    slots = slot0 + torch.arange(2, device=tokens.device)  # [2]
    logits, _, finite = _run_model(model, ids, slots[None], slots, None, cache, False)
    logits = logits[-1:]  # [1, V]
    out_tokens, out_probs = [], []
    slot = slots[-1:]  # [1]
    for i in range(gamma):
        if sampling.greedy:
            token = logits.argmax(dim=-1)  # [1]
        else:
            probs = sampling.warp(logits)  # [1, V]
            cdf = probs.double().cumsum(dim=-1)  # [1, V]
            token = torch.searchsorted(cdf, uniforms[i].view(1, 1) * cdf[:, -1:], right=True)[:, 0]
            token = token.clamp_max(probs.shape[-1] - 1)  # [1]
            out_probs.append(probs)
        out_tokens.append(token)
        if i + 1 < gamma:
            slot = slot + 1
            logits, _, step_finite = _run_model(model, token[None], slot[None], slot, None, cache, False)
            finite = finite & step_finite
    tokens_out = torch.cat(out_tokens)  # [γ]
    return tokens_out, (torch.cat(out_probs) if out_probs else None), finite


def tree_log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Scores of a tree's children: the draft's log-probabilities [F, V] float64 (warped at T > 0, −inf
    outside top-k / top-p). The same rule as the eager `DraftTree`."""
    if sampling.greedy:
        return torch.log_softmax(logits.double(), dim=-1)
    return sampling.warp(logits).double().log()


def _tree_root(model, ids, slot0, n, cache, top_k: int, sampling: SamplingConfig):
    """The root's top_k children. ids [W] are committed tokens at slots slot0..slot0+W−1, the root
    (context[n−1]) among them at slot n−1 (rows past it, if any, are padding whose slots the tree
    overwrites; re-writing cached tokens is harmless: same token, same position).
    Returns tokens [k], scores [k] float64, and whether every logit was finite."""
    slots = slot0 + torch.arange(ids.shape[0], device=ids.device)  # [W]
    logits, _, finite = _run_model(model, ids[None], slots[None], slots, None, cache, False)  # [W, V]
    root = logits.index_select(0, (n - 1 - slot0).view(1))  # [1, V]
    values, index = tree_log_probs(root, sampling).topk(top_k, dim=-1)  # [1, k]
    return index[0], values[0], finite


def _tree_level(model, frontier_tokens, frontier_scores, seen, n, level, cache, top_k: int, depth: int,
                sampling: SamplingConfig):
    """One level: feed the frontier [k] (nodes `level` below the root) at slots n + (level−1)·k + j, each
    row seeing the context, the root and its ancestors (seen [k, R] over the R = (depth−1)·k frontier
    slots), and take each one's top_k children. Returns the level's candidates (tokens [k²], scores [k²],
    in (frontier row, rank) order), the next frontier (its top_k candidates by score, ties to the earlier
    candidate, in candidate order: chosen [k], and seen [k, R] for it), and whether the logits were finite."""
    k, device = top_k, frontier_tokens.device
    region = (depth - 1) * k
    rows = torch.arange(k, device=device)  # [k]
    row_slots = n + (level - 1) * k + rows  # [k]
    positions = (n - 1 + level).expand(k)  # [k]
    columns = torch.arange(cache.max_len, device=device) - n  # [L] slot − n
    in_region = (columns >= 0) & (columns < region)  # [L]
    visible = (columns < 0)[None, :] | (seen[:, columns.clamp(0, region - 1)] & in_region[None, :])  # [k, L]
    dtype = model.dtype
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
        ~visible, torch.finfo(dtype).min)[None, None]  # [1, 1, k, L]
    logits, _, finite = _run_model(model, frontier_tokens[None], positions[None], row_slots, mask, cache,
                                   False)  # [k, V]
    values, index = tree_log_probs(logits, sampling).topk(k, dim=-1)  # [k, k]
    level_scores = (frontier_scores[:, None] + values).reshape(-1)  # [k²]
    level_tokens = index.reshape(-1)  # [k²]
    best = torch.sort(level_scores, descending=True, stable=True).indices[:k]  # [k]
    chosen = torch.sort(best).values  # [k]
    own = torch.arange(region, device=device)[None, :] == (level * k + rows)[:, None]  # [k, R]
    return level_tokens, level_scores, chosen, seen[chosen // k] | own, finite


def _expand_tree(model, ids, slot0, n, max_depth, cache, top_k: int, depth: int, sampling: SamplingConfig,
                 root_fn=_tree_root, level_fn=_tree_level):
    """An EAGLE-2-style dynamic tree of fixed shape: level 0 is the root's top_k children; each later level
    feeds its frontier (the top_k nodes of the level before) and adds their top_k children, so there are
    C = top_k + (depth−1)·top_k² candidates. Candidates deeper than max_depth get score −inf (one shape
    serves a round whose γ caps the depth). Run whole as one graph, or with root_fn / level_fn compiled.

    Returns candidates ranked by score (a stable sort: ties to the earlier candidate, so a parent, which
    never scores below its child, ranks before it): tokens [C], parents [C] (candidate index, −1 = root),
    scores [C] float64 (−inf = not a node), rank [C] (candidate indices, best first), and whether every
    logit was finite.
    """
    k = top_k
    device = ids.device
    frontier_tokens, frontier_scores, finite = root_fn(model, ids, slot0, n, cache, k, sampling)  # [k], [k]
    tokens, scores = [frontier_tokens], [frontier_scores]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
    frontier_index = torch.arange(k, device=device)  # [k] candidate indices: level 0 is the whole frontier
    seen = torch.eye(k, (depth - 1) * k, dtype=torch.bool, device=device)  # [k, R] each row's own slot
    offset = k
    for level in range(1, depth):
        level_tokens, level_scores, chosen, seen, step_finite = level_fn(
            model, frontier_tokens, frontier_scores, seen, n, torch.tensor(level, device=device), cache, k,
            depth, sampling)
        finite = finite & step_finite
        tokens.append(level_tokens)
        parents.append(frontier_index.repeat_interleave(k))
        scores.append(level_scores.masked_fill(max_depth <= level, float("-inf")))
        frontier_tokens, frontier_scores = level_tokens[chosen], level_scores[chosen]
        frontier_index = offset + chosen
        offset += k * k
    all_scores = torch.cat(scores)  # [C]
    rank = torch.sort(all_scores, descending=True, stable=True).indices  # [C]
    return torch.cat(tokens), torch.cat(parents), all_scores, rank, finite


#: How a fixed-shape tree is compiled: "whole" = the entire tree as one graph; "level" = one graph for the
#: root pass and one for a level (shared by every level), the levels looped in Python. Measured on the
#: default pair, interleaved (BENCHMARKS.md, "Token trees on the fast path"): whole 11.8 ms vs level
#: 13.7 ms a tree (top_k=2, depth=6), but whole compiles in ~52 s vs ~18 s for level.
TREE_GRAPH = "whole"


def tree_candidates(top_k: int, depth: int) -> int:
    """Candidates C a fixed-shape tree of `depth` levels expanding `top_k` frontier nodes produces."""
    return top_k + (depth - 1) * top_k * top_k


def select_tree(tokens: list[int], parents: list[int], scores: list[float], rank: list[int],
                max_nodes: int) -> tuple[list[int], list[int], list[int]]:
    """The best `max_nodes` candidates (by `rank`, −inf scores dropped) as a tree in node order: tokens [N],
    parents [N] (−1 = root), and the candidate index of each node. Connected because a parent ranks before
    its children."""
    keep = sorted(i for i in rank[:max_nodes] if scores[i] > float("-inf"))
    new_index = {node: j for j, node in enumerate(keep)}
    return [tokens[i] for i in keep], [new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep], keep


class StaticCausalLM:
    """A causal LM with a preallocated slot cache and (optionally) compiled fixed-shape passes.

    max_len: slots in the cache; None sizes it per request (`ensure_capacity`), rounded up to CACHE_ROUND.
    compile: torch.compile the decoding passes (False: the same code, eager).
    """

    def __init__(self, model: PreTrainedModel, *, compile: bool = True, max_len: int | None = None):
        check_rollback_support(model)
        self.model = model
        self.vocab_size = vocab_size(model)
        self.device = next(model.parameters()).device
        self.compile = compile
        self.fixed_max_len = max_len
        self.buckets: tuple[int, ...] = DEFAULT_BUCKETS
        self.draft_gammas: set[int] = set()
        self.cache: SlotCache | None = None
        if max_len is not None:
            self.cache = SlotCache(max_len)
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
        size = -(-tokens // CACHE_ROUND) * CACHE_ROUND
        if limit is not None:
            size = min(size, max(limit, tokens))
        if self.cache is None or self.cache.max_len < tokens:
            self.cache = SlotCache(size)
            self.length = 0

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

    def _fn(self, key: tuple, fn):
        """The callable for a shape key: compiled once per model object, or `fn` itself when eager."""
        if not self.compile or not self.cache.ready:
            return fn
        entry = _COMPILED.setdefault(self.model, _Compiled())
        compiled = entry.fns.get(key)
        if compiled is None:
            _raise_recompile_limit()
            compiled = entry.fns[key] = _Timed(
                torch.compile(fn, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS), key,
                type(self.model).__name__, entry)
        return compiled

    @torch.inference_mode()
    def _pass(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
              hidden: bool, pad: bool, rule: tuple | None = None):
        """Rows input_ids [M] at positions [M], written to slots length..length+M-1 (padded to a bucket).
        Returns logits [M, V] and hidden | None; with `rule` = (draft_probs [M-1, V], uniforms [M] float64,
        sampling) for a chain, also the rejection rule's (k, next_token) [2] from the same graph
        (`_verify_pass`), or None for a padded pass (whose graph verified the padding as drafts)."""
        m = input_ids.shape[0]
        b = self._bucket(m) if pad else m
        if self.length + b > self.max_len:
            raise PromptError(
                f"the static cache of {self.max_len} slots is full (length {self.length} + {b} new rows); "
                "create the adapter with a larger max_len or lower max_new_tokens")
        ids = input_ids.to(self.device).clone()  # an inference tensor, as every compiled call expects
        slots = torch.arange(self.length, self.length + b, device=self.device)  # [b]
        if b > m:
            ids = torch.cat([ids, ids.new_zeros(b - m)])
            if mask is None:  # a chain: padded rows continue it
                positions = torch.cat([positions, positions[-1] + torch.arange(1, b - m + 1, device=self.device)])
            else:  # a tree: each padded row sees the cache and itself, one position past the cache
                positions = torch.cat([positions, positions.new_full((b - m,), self.length)])
                full = mask.new_full((b, self.max_len), torch.finfo(mask.dtype).min)
                full[:m] = mask
                full[m:, : self.length] = 0
                full[torch.arange(m, b), slots[m:]] = 0
                mask = full
        if mask is not None:
            mask = mask[None, None]  # [1, 1, b, L]
        positions = positions.to(self.device).clone()  # [b] inference tensors, as above
        decided = None
        if rule is None:
            fn = self._fn(("pass", b, self.max_len, hidden, mask is not None), _run_model)
            logits, states, finite = fn(self.model, ids[None], positions[None], slots, mask, self.cache, hidden)
        else:  # a chain verified in the same graph: padded rows are drafted with q = 0, their result unused
            draft_probs, uniforms, sampling = rule
            if b > m:
                draft_probs = torch.cat([draft_probs, draft_probs.new_zeros(b - m, draft_probs.shape[-1])])
                uniforms = torch.cat([uniforms, uniforms.new_zeros(b - m)])
            fn = self._fn(("verify", b, self.max_len, hidden, sampling), _verify_pass)
            logits, states, finite, decided = fn(self.model, ids[None], positions[None], slots, self.cache, hidden,
                                                 ids[1:], draft_probs, uniforms, sampling)
            decided = decided if b == m else None
        if not bool(finite):
            raise NumericalError(
                f"{type(self.model).__name__} produced NaN or infinite logits at positions "
                f"{self.length}..{self.length + m - 1}; this usually means float16 overflow or broken "
                "weights: load the model in float32 or bfloat16")
        self.length += m
        if rule is not None:
            return logits[:m], (states[:m] if states is not None else None), decided
        return logits[:m], (states[:m] if states is not None else None)

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append input_ids [n] to the cache; return logits [n, V] (or [1, V] with last_only)."""
        start = time.perf_counter()
        n = input_ids.shape[-1]
        positions = torch.arange(self.length, self.length + n, device=self.device)
        logits, _ = self._pass(input_ids, positions, None, False, pad=True)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return logits[-1:] if last_only else logits

    def score(self, input_ids: torch.Tensor, *, tree: TreeMask | None = None,
              hidden: bool | tuple[int, ...] = False) -> Scores:
        """Append input_ids [M] (a chain, or a tree whose row 0 is the root); logits [M, V] (+ hidden)."""
        start = time.perf_counter()
        m = input_ids.shape[0]
        if tree is None:
            positions = torch.arange(self.length, self.length + m, device=self.device)
            mask = None
        else:
            positions = self.length + tree.depths.to(self.device)
            dtype = self.model.dtype
            visible = torch.zeros(m, self.max_len, dtype=torch.bool, device=self.device)
            visible[:, : self.length] = True
            visible[:, self.length : self.length + m] = tree.ancestors.to(self.device)
            mask = torch.zeros(m, self.max_len, dtype=dtype, device=self.device).masked_fill(
                ~visible, torch.finfo(dtype).min)  # [M, L]
        logits, states = self._pass(input_ids, positions, mask, hidden, pad=True)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return Scores(logits, states)

    @torch.inference_mode()
    def score_and_verify(self, input_ids: torch.Tensor, draft_probs: torch.Tensor | None, sampling: SamplingConfig,
                         generator: torch.Generator | None, *,
                         hidden: bool | tuple[int, ...] = False) -> tuple[Scores, Verdict]:
        """`score` a chain input_ids [γ+1] (the last committed token, then γ drafts with draft_probs [γ, V], or
        None for a point mass) and verify it at temperature > 0 in the same pass: the target's warp and
        `verify.rejection_rule` run inside the (compiled) graph, with uniforms drawn here from `generator`
        exactly as `verify.verify_sampled` draws them, so the tokens are the eager rule's."""
        start = time.perf_counter()
        m = input_ids.shape[0]
        drafts = input_ids[1:].to(self.device)  # [γ]
        uniforms = draw_uniforms(m - 1, generator, self.device)  # [γ+1]
        # q in float64 whatever the drafter's dtype (one graph per shape; the ratio is float64 anyway), and a
        # point mass as its one-hot row: the same ratio p(x) and residual as draft_probs=None.
        if draft_probs is None:
            q = torch.nn.functional.one_hot(drafts, self.vocab_size).double()  # [γ, V]
        else:
            q = draft_probs.to(self.device, torch.float64, copy=True)  # [γ, V]
        positions = torch.arange(self.length, self.length + m, device=self.device)
        logits, states, decided = self._pass(input_ids, positions, None, hidden, pad=True,
                                             rule=(q, uniforms, sampling))
        self.forwards += 1
        if decided is None:  # a padded (short) round: the same rule on the scored rows, eagerly
            k, next_token = rejection_rule(drafts, q, sampling.warp(logits), uniforms)
            decided = torch.stack([k, next_token])
        verdict = chain_verdict(m - 1, decided)
        self.forward_s += time.perf_counter() - start
        return Scores(logits, states), verdict

    def prefill(self, input_ids: torch.Tensor, hidden: bool | tuple[int, ...] = False) -> torch.Tensor | None:
        """Cache input_ids [n] (eager, any n; not a decoding pass). Returns hidden [n, H] when asked."""
        n = input_ids.shape[-1]
        if not n:
            return None
        start = time.perf_counter()
        positions = torch.arange(self.length, self.length + n, device=self.device)
        compile, self.compile = self.compile, False  # prompt lengths vary: never compile a prefill
        try:
            _, states = self._pass(input_ids, positions, None, hidden, pad=False)
        finally:
            self.compile = compile
        self.prefill_s += time.perf_counter() - start
        return states

    @torch.inference_mode()
    def draft_steps(self, context: torch.Tensor, gamma: int, sampling: SamplingConfig,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Propose γ tokens continuing context [n] (n >= 2, cache holding at least context[:n-2]) in one
        pass of the compiled draft graph. Returns tokens [γ], draft_probs [γ, V] | None."""
        n = context.shape[0]
        # Draft the smallest γ already compiled that covers this one (the decoder keeps the first γ'):
        # the short last round of a request must not compile a new graph.
        done = [g for g in self.draft_gammas if g >= gamma]
        gamma = min(done) if done else gamma
        self.draft_gammas.add(gamma)
        start_slot = n - 2
        if start_slot + 1 + gamma > self.max_len:
            raise PromptError(f"the draft's static cache of {self.max_len} slots is full; lower max_new_tokens")
        uniforms = (torch.rand(gamma, dtype=torch.float64, device=self.device, generator=generator)
                    if not sampling.greedy else torch.zeros(gamma, dtype=torch.float64, device=self.device))
        key = ("draft", gamma, sampling, self.max_len)
        fn = self._fn(key, _draft_steps)
        t = time.perf_counter()
        tokens, probs, finite = fn(self.model, context[n - 2 : n].to(self.device).clone(),
                                   torch.tensor(start_slot, device=self.device), self.cache, uniforms, gamma,
                                   sampling)
        self.forward_s += time.perf_counter() - t
        if not bool(finite):
            raise NumericalError(
                f"{type(self.model).__name__} produced NaN or infinite logits at positions "
                f"{n - 2}..{n + gamma - 2} (drafting); this usually means float16 overflow or broken weights: load the "
                "model in float32 or bfloat16")
        self.forwards += gamma
        self.length = n + gamma - 1  # context[:n] and the first γ-1 drafts
        return tokens, probs

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
        entry = _COMPILED.get(self.model)
        fn = entry.fns.get(key) if entry is not None else None
        return fn is not None and fn.done

    def precompile(self, sizes, draft_gammas=(), sampling: SamplingConfig | None = None,
                   context: torch.Tensor | None = None, verify: SamplingConfig | None = None) -> None:
        """Compile now the chain passes of `sizes` rows and (with `context` [n], n >= 2, the committed tokens
        the cache holds all but the last of) the draft graphs of `draft_gammas`, so that no later round of
        any request compiles. Runs after the prefill, past the cache's length, then restores it: the slots
        it wrote are hidden by the mask and overwritten later. A no-op when eager or already compiled.
        verify: the sampling config whose verifying passes (`score_and_verify`) of `sizes` rows to compile
        instead of the plain ones."""
        if not self.compile or self.cache is None or not self.cache.ready:
            return
        length, forwards, forward_s = self.length, self.forwards, self.forward_s
        try:
            for b in sizes if verify is not None else ():
                if not self._compiled(("verify", b, self.max_len, False, verify)) and length + b <= self.max_len:
                    self.score_and_verify(torch.zeros(b, dtype=torch.long), None, verify,
                                          torch.Generator(device=self.device).manual_seed(0))
                    self.length = length
            for b in sizes if verify is None else ():
                if not self._compiled(("pass", b, self.max_len, False, False)) and length + b <= self.max_len:
                    self._pass(torch.zeros(b, dtype=torch.long), torch.arange(length, length + b), None, False,
                               pad=False)
                    self.length = length
            if context is None or context.shape[0] < 2 or sampling is None:
                return
            generator = torch.Generator(device=self.device).manual_seed(0)  # not the request's generator
            for gamma in sorted(draft_gammas):
                if not self._compiled(("draft", gamma, sampling, self.max_len)):
                    self.draft_gammas.add(gamma)
                    if context.shape[0] - 1 + gamma <= self.max_len:
                        self.draft_steps(context, gamma, sampling, generator)
                    self.length = length
        finally:
            self.length, self.forwards, self.forward_s = length, forwards, forward_s

    @torch.inference_mode()
    def draft_tree(self, context: torch.Tensor, top_k: int, depth: int, max_depth: int,
                   sampling: SamplingConfig) -> tuple[list[int], list[int], list[float], list[int]]:
        """Grow a fixed-shape dynamic tree under context [n] (`_expand_tree`) in one compiled graph per
        (top_k, depth, sampling, cache size); the tree rows are discarded afterwards (length n − 1).
        Returns the candidates as lists: tokens, parents, scores, rank (see `select_tree`)."""
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
        if TREE_GRAPH == "whole":
            fn = self._fn(("tree", top_k, depth, sampling, self.max_len), _expand_tree)
            tokens, parents, scores, rank, finite = fn(*args)
        else:
            root_fn = self._fn(("tree-root", top_k, depth, sampling, self.max_len), _tree_root)
            level_fn = self._fn(("tree-level", top_k, depth, sampling, self.max_len), _tree_level)
            tokens, parents, scores, rank, finite = _expand_tree(*args, root_fn=root_fn, level_fn=level_fn)
        if not bool(finite):
            raise NumericalError(
                f"{type(self.model).__name__} produced NaN or infinite logits while drafting a tree after "
                f"position {n - 1}; this usually means float16 overflow or broken weights: load the model in "
                "float32 or bfloat16")
        out = tokens.tolist(), parents.tolist(), scores.tolist(), rank.tolist()
        self.forward_s += time.perf_counter() - t
        self.forwards += depth
        self.length = n - 1  # context[:n−1]; the root is re-fed next round
        return out


class _Timed:
    """A compiled callable that logs how long its first call (the compile) took."""

    def __init__(self, fn, key: tuple, model_name: str, entry: _Compiled):
        self.fn, self.key, self.model_name, self.entry = fn, key, model_name, entry
        self.done = False

    def __call__(self, *args):
        if self.done:
            return self.fn(*args)
        start = time.perf_counter()
        out = self.fn(*args)
        elapsed = time.perf_counter() - start
        self.done = True
        self.entry.compile_s[self.key] = elapsed
        log.info("compiled %s %s in %.1f s", self.model_name, _describe(self.key), elapsed)
        return out


def _describe(key: tuple) -> str:
    if key[0] == "batch-pass":  # batch_static.StaticBatchedCausalLM
        return f"batched pass of {key[1]} rows x {key[2]} tokens (cache {key[3]} slots)"
    if key[0] == "verify":
        return (f"pass of {key[1]} tokens with warp and rejection rule (T={key[4].temperature}, top_k={key[4].top_k}, "
                f"top_p={key[4].top_p}, cache {key[2]} slots{', hidden' if key[3] else ''})")
    if key[0] == "pass":
        return f"pass of {key[1]} tokens (cache {key[2]} slots{', hidden' if key[3] else ''}{', tree' if key[4] else ''})"
    if key[0].startswith("tree"):
        return (f"{key[0]} draft (top_k={key[1]}, depth={key[2]}, {'greedy' if key[3].greedy else 'sampling'}, "
                f"cache {key[4]} slots)")
    return f"γ={key[1]} draft steps ({'greedy' if key[2].greedy else 'sampling'}, cache {key[3]} slots)"


def fast_path_problem(model: PreTrainedModel, compile: bool) -> str | None:
    """Why `model` cannot take the fast path (static cache, and compiling when asked), or None."""
    problem = static_cache_problem(model)
    if problem is None and compile:
        problem = compiler_problem()
    return problem


def fast_adapter(model: PreTrainedModel, compile: bool | str):
    """The adapter for `compile` (True: compiled static; "static": static, eager; False: CachedCausalLM),
    falling back to the eager adapter with one warning naming why when the model cannot take it."""
    from specdec.models.causal_lm import CachedCausalLM  # noqa: PLC0415

    if not compile:
        return CachedCausalLM(model)
    problem = fast_path_problem(model, compile is True)
    if problem is not None:
        warnings.warn(f"specdec fast path unavailable, decoding eagerly instead (same tokens): {problem}",
                      FastPathWarning, stacklevel=3)
        return CachedCausalLM(model)
    return StaticCausalLM(model, compile=compile is True)


class FastPathWarning(UserWarning):
    """The fast path (compile=True) was asked for but this model or machine cannot take it."""
