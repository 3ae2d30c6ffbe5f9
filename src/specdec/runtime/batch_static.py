"""`StaticBatchedCausalLM`: the batched fast path. `BatchedCausalLM`'s interface over a preallocated cache
and compiled fixed-shape passes (as `static_lm.py` is to `CachedCausalLM` for one row).

Layout: the same shared slot columns and `valid [B, S]` as `BatchedCausalLM` (docs/batching.md), but the
keys and values live in a `SlotCache` allocated once: per layer [R, H, L, D], R rows (a batch bucket) and
L slot columns. `S` (`slots`) is the number of columns in use; a pass of W inputs per row writes columns
S..S+W−1 of every row (`cache.slots`), and every query gets an explicit additive mask [R, 1, W, L]: a row
sees its valid columns and the new columns causally (or its tree block), nothing past them, so stale
columns need no clearing and a rollback is a flip of `valid` plus a move of S.

Shapes are fixed per pass: rows padded to a batch bucket (1, 2, 4, 8, 16, 32, 64: padding rows see only
their own inputs), inputs padded to a query bucket (`compiled.DEFAULT_BUCKETS`; padding columns become
holes), L fixed per adapter. Each (inputs, L) shape is compiled once for a lone row and once for every batch of
`SYMBOLIC_MIN_ROWS` rows or more (its row count symbolic), per model object and process (`compiled.compile_once`:
the fast path's compile options and registry) with a log line and its time; `precompile` does them up front.

Rows join by a prefill whose states are copied into the buffers: compiled, each new row alone through the
single-row fast path's compiled prefill chunks (`StaticCausalLM.prefill`, so a row's keys and values are the bits
the request alone gets); uncompiled, the new rows together in one eager `BatchedCausalLM` pass; rows leave by an index copy of the batch axis. When the next pass would run past L, rows are
compacted (each row's valid columns gathered to the left, one gather per layer); if that is not enough the
cache is reallocated with more columns (between rounds; a new L compiles new shapes, so the server sizes
L for its longest request up front).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from specdec.core.masks import additive_mask
from specdec.core.tree import TreeMask
from specdec.errors import PromptError, UnsupportedModelError
from specdec.runtime.base import Scores, as_float_logits, cache_kwarg
from specdec.runtime.batch_lm import BatchedCausalLM, check_batchable
from specdec.runtime.causal_lm import context_length
from specdec.runtime.compiled import (
    CACHE_ROUND,
    DEFAULT_BUCKETS,
    FastPathWarning,
    compile_once,
    fast_path_problem,
    is_compiled,
)
from specdec.runtime.rowwise import load_kernel, row_invariant
from specdec.runtime.slot_cache import SlotCache, SlotLayer, kv_layout
from specdec.runtime.static_lm import StaticCausalLM


#: Row counts a pass is padded to.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: A compiled pass of at least this many rows runs the one graph per width whose row count is symbolic
#: (`torch._dynamo.mark_dynamic` on the rows of its inputs and of the cache's views): one compile serves every
#: batch bucket, where a graph per bucket made a server's start-up compile each of them. A lone row keeps its
#: static graph (dynamo fixes a dimension of size 1). The rows' kernels are row-invariant, so a row's bits do not
#: depend on the graph that computed them.
SYMBOLIC_MIN_ROWS = 2
#: The symbolic row count's upper bound (dynamo's range for it; a batch past the largest bucket runs unpadded).
MAX_ROWS = 4096


def _rows_symbolic(*tensors: torch.Tensor) -> None:
    """Mark the rows (dimension 0) of `tensors` symbolic for dynamo, from SYMBOLIC_MIN_ROWS to MAX_ROWS."""
    for tensor in tensors:
        torch._dynamo.mark_dynamic(tensor, 0, min=SYMBOLIC_MIN_ROWS, max=MAX_ROWS)


def _batched_pass(model, input_ids, position_ids, slots, mask, cache):
    """input_ids [R, W] at position_ids [R, W], written to cache columns slots [W]; mask [R, 1, W, L]
    additive. Returns logits [R, W, V]."""
    cache.slots = slots
    if not torch.compiler.is_compiling():  # eager only: for models that ask the cache its length; the kernel
        cache.length = int(slots[-1]) + 1
        load_kernel()
    with row_invariant(linear=True):  # each row's logits as a one-row pass would give them
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                    **cache_kwarg(model, cache), use_cache=True)
    return out.logits


@dataclass(frozen=True)
class Prefilled:
    """New rows' prefilled states, right-aligned (each row's tokens end at the last column): per layer keys and
    values [n, H, w, D], valid [n, w]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor

    @property
    def slots(self) -> int:
        return int(self.valid.shape[1])


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (n itself past the largest)."""
    return next((b for b in buckets if b >= n), n)


class StaticBatchedCausalLM(BatchedCausalLM):
    """A causal LM over a batch of rows with their own lengths, on a preallocated cache of `max_len` slot
    columns (None: sized by the first rows, rounded up to CACHE_ROUND; grow=True: a starting size) with
    compiled passes (compile=False: the same code, eager; the tests use it to check the layout without
    compiling)."""

    returns_features = False  # the compiled passes return logits only (`no_features`)

    def __init__(self, model: PreTrainedModel, *, max_len: int | None = None, compile: bool = True,
                 grow: bool = False):
        super().__init__(model)
        self.compile = compile
        self.limit = context_length(model)
        self.max_len = max_len
        # None (no max_len, or grow=True): reallocate with more columns (between rounds) when a row needs them.
        self.fixed_max_len = None if grow else max_len
        self.reserve = 9  # columns kept free for one round: γ + 1 <= 9 inputs per row
        self.cache: SlotCache | None = None  # layers [R, H, max_len, D]: the first R rows of `buffers`
        self.buffers: SlotCache | None = None  # layers [R_max, H, max_len, D]: as many rows as the batch has had
        self.query_buckets: tuple[int, ...] = DEFAULT_BUCKETS
        self.batch_buckets: tuple[int, ...] = BATCH_BUCKETS
        self.last_start = 0  # first column the last pass wrote

    # -- buffers --------------------------------------------------------------------------------------
    @property
    def capacity_rows(self) -> int:
        return int(self.cache.layers[0].keys.shape[0]) if self.cache is not None else 0

    @property
    def reserved_rows(self) -> int:
        """Rows the buffers hold (the largest bucket the batch has had, or `reserve_rows`)."""
        return int(self.buffers.layers[0].keys.shape[0]) if self.buffers is not None else 0

    def _layer_states(self):
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    @torch.inference_mode()  # inference tensors always: a compiled pass guards on it (else it recompiles)
    def _allocate(self, rows: int, columns: int, capacity: int = 0) -> None:
        """(Re)allocate the buffers with max(rows, capacity) rows and `columns` slot columns (each layer's heads,
        head size, dtype and device from `slot_cache.kv_layout`), keeping the first min(rows, old rows) rows'
        columns in use (`slots`; the others are zeros, as stale columns past `slots` may be); the cache is a view
        of their first `rows` rows."""
        old = self._layer_states() if self.cache is not None else None
        buffers = SlotCache(columns)
        for i, layout in enumerate(kv_layout(self.model)):
            layer = SlotLayer(buffers)
            layer.allocate(replace(layout, lead=(max(rows, capacity), *layout.lead[1:])))  # [R, H, L, D]
            if old is not None:
                r, c = min(rows, old[i][0].shape[0]), min(columns, old[i][0].shape[2], self.slots)
                layer.keys[:r, :, :c] = old[i][0][:r, :, :c]
                layer.values[:r, :, :c] = old[i][1][:r, :, :c]
            buffers.layers.append(layer)
        self.buffers, self.max_len = buffers, columns
        self.cache = self._rows_marked(buffers) if capacity <= rows else self._first_rows(rows)

    def _first_rows(self, rows: int) -> SlotCache:
        """A cache over the first `rows` rows of the buffers (the same memory)."""
        cache = SlotCache(self.max_len)
        cache.layers = [layer.first_rows(cache, rows) for layer in self.buffers.layers]
        return self._rows_marked(cache)

    def _rows_marked(self, cache: SlotCache) -> SlotCache:
        """`cache`, its keys' and values' rows marked symbolic for the compiled passes when it has enough of them
        (`SYMBOLIC_MIN_ROWS`): the pass's inputs are marked alike, so one graph serves every bucket."""
        if cache.layers and self._symbolic(int(cache.layers[0].keys.shape[0])):
            _rows_symbolic(*(t for layer in cache.layers for t in (layer.keys, layer.values)))
        return cache

    def reserve_rows(self, rows: int) -> None:
        """Buffers for a batch of up to `rows` rows now (its bucket's), so that the batch grows into them without
        allocating: a server's largest batch at start-up. Memory a process touches for the first time can cost
        a second per 300 MB in a virtual machine (measured on a KVM guest), which a growing batch paid mid-round."""
        want = self._rows_for(rows)
        if self.cache is None:
            self._allocate(0, self.max_len or self._columns_for(1), capacity=want)
        elif self.reserved_rows < want:
            self._allocate(self.capacity_rows, self.max_len, capacity=want)

    def check_fits(self, tokens: int) -> None:
        """With a fixed `max_len` (the server's): raise a PromptError before any work unless a row of `tokens`
        tokens plus one round's padded inputs (`reserve`) fits the cache."""
        if self.fixed_max_len is not None and tokens + self.reserve > self.fixed_max_len:
            raise PromptError(
                f"prompt + max_new_tokens = {tokens} tokens does not fit the batched fast path's cache of "
                f"{self.fixed_max_len} slots ({self.reserve} are kept for one round's drafts); shorten the prompt, "
                "lower max_tokens, or start the server with a larger --max-len (or --no-compile)")

    def pass_tokens(self, rows: int, width: int) -> int:
        """Tokens a pass of `rows` rows x `width` inputs scores, padding to buckets included."""
        return self._rows_for(rows) * bucket(width, self.query_buckets)

    def _rows_for(self, rows: int) -> int:
        return bucket(rows, self.batch_buckets)

    def _fit_rows(self, rows: int) -> None:
        """The cache for `rows` rows (a bucket): a view of the buffers' first rows, which are reallocated only when
        the batch outgrows every bucket it had. A batch that shrinks and grows again between rounds (a server's
        rows leave and join) copies nothing: reallocating a bucket's buffers each time took half the scheduler's
        time at 32 streams. The rows past the batch's hold earlier rows' states, as padding rows do; every pass
        masks them."""
        want = self._rows_for(rows)
        if self.cache is None or self.capacity_rows == want:
            return
        if want > self.reserved_rows:
            self._allocate(want, self.max_len)
        else:
            self.cache = self._first_rows(want)

    def _columns_for(self, tokens: int) -> int:
        size = -(-tokens // CACHE_ROUND) * CACHE_ROUND
        return min(size, max(self.limit, tokens)) if self.limit is not None else size

    def make_room(self, width: int) -> None:
        """Make sure `width` more columns fit after `slots`: compact, then grow if still needed (a pass does it
        first; a draft writing into this cache before the pass, `BatchedSelfDraft`, does it before drafting)."""
        if self.slots + width <= self.max_len:
            return
        self.compact()
        if self.slots + width > self.max_len:
            self._allocate(self.capacity_rows, self._columns_for(self.slots + width), capacity=self.reserved_rows)

    # -- rows join and leave --------------------------------------------------------------------------
    @torch.inference_mode()
    def add_rows(self, inputs: Sequence[torch.Tensor], hidden: bool | tuple[int, ...] = False) -> None:
        """Append rows whose caches hold inputs[i] [n_i]: prefilled eagerly together, copied in. New rows'
        states end at the current write column (or the existing rows get holes on the right when a new row
        is longer), so every row's tokens stay in column order."""
        no_features(hidden)
        start = time.perf_counter()
        fresh = self._prefill_compiled(inputs) if self.compile else self._prefill_eager(inputs)
        if self.cache is None:
            self._allocate(0, self.max_len or self._columns_for(fresh.slots + 2 * DEFAULT_BUCKETS[-1]))
        rows, width = self.rows, fresh.slots
        if width > self.max_len:
            self._allocate(self.capacity_rows, self._columns_for(width + self.query_buckets[-1]),
                           capacity=self.reserved_rows)
        if width > self.slots:  # existing rows get holes up to the new rows' end
            self.valid = torch.cat([self.valid, self.valid.new_zeros(rows, width - self.slots)], dim=1)
        self._fit_rows(rows + len(inputs))
        first = self.slots - width
        for (k, v), (fk, fv) in zip(self._layer_states(), zip(fresh.keys, fresh.values)):
            k[rows : rows + len(inputs), :, first : self.slots] = fk  # [n, H, w, D]
            v[rows : rows + len(inputs), :, first : self.slots] = fv
        new_valid = self.valid.new_zeros(len(inputs), self.slots)
        new_valid[:, first:] = fresh.valid
        self.valid = torch.cat([self.valid, new_valid])
        self.prefill_s += time.perf_counter() - start

    def _prefill_eager(self, inputs: Sequence[torch.Tensor]) -> Prefilled:
        """The new rows prefilled together in one eager pass (as the uncompiled single-row slot cache does)."""
        fresh = BatchedCausalLM(self.model)
        fresh.valid = self.valid.new_zeros(len(inputs), 0)
        if any(x.shape[0] for x in inputs):
            fresh.forward(inputs, last_only=True)
        return Prefilled(fresh.keys, fresh.values, fresh.valid)

    def _prefill_compiled(self, inputs: Sequence[torch.Tensor]) -> Prefilled:
        """Each new row prefilled alone by the compiled single-row fast path (`StaticCausalLM.prefill`: the same
        compiled chunks a request alone runs, so the row's keys and values are the bits it gets there)."""
        width = max(x.shape[0] for x in inputs)
        valid = torch.zeros(len(inputs), width, dtype=torch.bool, device=self.device)  # [n, w]
        if not width:
            return Prefilled([], [], valid)
        layouts = kv_layout(self.model)
        keys = [torch.zeros((len(inputs), layout.lead[1], width, layout.key_dim), dtype=layout.dtype,
                            device=layout.device) for layout in layouts]  # per layer [n, H, w, D]
        values = [torch.zeros((len(inputs), layout.lead[1], width, layout.value_dim), dtype=layout.dtype,
                              device=layout.device) for layout in layouts]
        for i, x in enumerate(inputs):
            n = x.shape[0]
            if not n:
                continue
            alone = StaticCausalLM(self.model, compile=True)
            alone.ensure_capacity(n)
            alone.prefill(x)
            for k, v, layer in zip(keys, values, alone.cache.layers):  # right-aligned: ends at column w
                k[i, :, width - n :] = layer.keys[0, :, :n]
                v[i, :, width - n :] = layer.values[0, :, :n]
            valid[i, width - n :] = True
        return Prefilled(keys, values, valid)

    @torch.inference_mode()
    def remove_rows(self, keep: Sequence[int]) -> None:
        """Keep only the rows at indices `keep` (in that order), moved to the front of the buffers: an index copy
        of the rows that move, of the columns in use."""
        keep = list(keep)
        index = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        moved = [(row, source) for row, source in enumerate(keep) if row != source]
        if self.cache is not None and moved:
            rows, sources = (torch.as_tensor(x, dtype=torch.long, device=self.device) for x in zip(*moved))
            for k, v in self._layer_states():  # [R, H, L, D]; the sources are read before any row is written
                for states in (k[:, :, : self.slots], v[:, :, : self.slots]):
                    states.index_copy_(0, rows, states.index_select(0, sources))
        self.valid = self.valid.index_select(0, index)
        if self.cache is not None:
            self._fit_rows(len(keep))
        self.crop(self.lengths)

    # -- decoding -------------------------------------------------------------------------------------
    def score(self, inputs: Sequence[torch.Tensor], last_only: bool = False,
              trees: Sequence[TreeMask | None] | None = None, hidden: bool | tuple[int, ...] = False) -> Scores:
        """As `BatchedCausalLM.score`, logits only: the compiled passes do not return features."""
        no_features(hidden)
        return Scores(self.forward(inputs, last_only=last_only, trees=trees))

    @torch.inference_mode()
    def forward(self, inputs: Sequence[torch.Tensor], last_only: bool = False,
                trees: Sequence[TreeMask | None] | None = None) -> torch.Tensor:
        """As `BatchedCausalLM.forward`: append inputs[i] [n_i] to row i; logits [B, W, V], W = max n_i."""
        start = time.perf_counter()
        rows = self.rows
        counts = [int(x.shape[0]) for x in inputs]
        width = max(1, max(counts) if rows else 1)
        w = bucket(width, self.query_buckets)
        self.make_room(w)
        r = self.capacity_rows
        used = self.slots
        input_ids = torch.zeros(r, w, dtype=torch.long, device=self.device)  # [R, w]
        for i, ids in enumerate(inputs):
            input_ids[i, : ids.shape[0]] = ids
        count = torch.tensor(counts + [0] * (r - rows), device=self.device)  # [R]
        lengths = torch.cat([self.lengths, count.new_zeros(r - rows)])  # [R]
        steps = torch.arange(w, device=self.device)  # [w]
        # Padding columns repeat the row's last real position (as BatchedCausalLM: never a position it
        # does not own); padding rows sit at positions 0..w−1.
        last = (lengths + count - 1).clamp_min(0)  # [R]
        position_ids = torch.minimum(lengths[:, None] + steps[None], last[:, None])  # [R, w]
        position_ids[rows:] = steps
        allowed = torch.zeros(r, w, self.max_len, dtype=torch.bool, device=self.device)  # [R, w, L]
        allowed[:rows, :, :used] = self.valid[:, None, :]
        allowed[:, :, used : used + w] = torch.ones(w, w, dtype=torch.bool, device=self.device).tril()
        for i, tree in enumerate(trees or ()):
            if tree is not None:
                m = tree.size
                allowed[i, :m, used : used + m] = tree.ancestors.to(self.device)  # [M, M]
                depths = tree.depths.to(self.device)  # [M]
                position_ids[i, :m] = lengths[i] + depths
                position_ids[i, m:] = lengths[i] + depths.max()
        mask = additive_mask(allowed, self.dtype)[:, None]  # [R, 1, w, L]
        slots = torch.arange(used, used + w, device=self.device)  # [w]
        if self._symbolic(r):
            _rows_symbolic(input_ids, position_ids, mask)
        logits = self._fn(r, w)(self.model, input_ids, position_ids, slots, mask, self.cache)  # [R, w, V]
        self.valid = torch.cat([self.valid, steps[None] < count[:rows, None]], dim=1)  # [B, S + w]
        self.last_start = used
        logits = as_float_logits(logits[:rows, -1:] if last_only else logits[:rows, :width])
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return logits

    def _fn(self, rows: int, width: int):
        """The pass for this shape: compiled once per model object (shared by its adapters), or eager."""
        if not self.compile:
            return _batched_pass
        return compile_once(self.model, self._key(rows, width), _batched_pass, dynamic=self._symbolic(rows))

    def _symbolic(self, rows: int) -> bool:
        """Whether a compiled pass of `rows` rows (a bucket) runs the graph whose row count is symbolic."""
        return self.compile and rows >= SYMBOLIC_MIN_ROWS

    def _key(self, rows: int, width: int) -> tuple:
        """The compiled pass's shape key: its rows (`SYMBOLIC_MIN_ROWS`+ for the symbolic graph), width and L."""
        return ("batch-pass", f"{SYMBOLIC_MIN_ROWS}+" if self._symbolic(rows) else rows, width, self.max_len)

    # -- rolling back ---------------------------------------------------------------------------------
    def keep_new(self, row: int, width: int, keep: Sequence[int]) -> None:
        """Of row `row`'s inputs in the last pass (which began at column `last_start`; `width` real inputs
        at most, padding columns are holes already), keep only the columns in `keep`."""
        start = self.last_start
        columns = torch.as_tensor([start + j for j in keep], dtype=torch.long, device=self.device)
        slots = torch.arange(self.slots, device=self.device)  # [S]
        drop = (slots >= start) & ~torch.isin(slots, columns)  # [S]
        rows = torch.arange(self.rows, device=self.device) == row  # [B]
        self.valid = self.valid & ~(rows[:, None] & drop[None])  # [B, S]

    def crop(self, lengths: Sequence[int] | torch.Tensor) -> None:
        """Roll row i back to its first lengths[i] tokens: a flip of `valid`; trailing columns no row uses
        are given back (the next pass overwrites them)."""
        keep = torch.as_tensor(lengths, device=self.device)[:, None]  # [B, 1]
        self.valid = self.valid & (self.valid.long().cumsum(dim=1) <= keep)
        used = self.valid.any(dim=0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 0
        self.valid = self.valid[:, :width]

    @torch.inference_mode()
    def compact(self) -> None:
        """Gather each row's valid columns to the right end of the first max-length columns (one gather per
        layer, in place)."""
        if not self.rows or self.cache is None:
            self.valid = self.valid[:, :0]
            return
        lengths = self.lengths  # [B]
        width = int(lengths.max())
        order = torch.argsort(self.valid.long() * (1 + torch.arange(self.slots, device=self.device)), dim=1,
                              stable=True)
        index = order[:, self.slots - width :]  # [B, width]
        for k, v in self._layer_states():
            gather = index[:, None, :, None].expand(self.rows, k.shape[1], width, k.shape[3])
            k[: self.rows, :, :width] = k[: self.rows].gather(2, gather)
            v[: self.rows, :, :width] = v[: self.rows].gather(2, gather)
        self.valid = torch.arange(width, device=self.device)[None] >= (width - lengths)[:, None]  # [B, width]

    # -- compiling up front ---------------------------------------------------------------------------
    @torch.inference_mode()
    def precompile(self, rows: Sequence[int], widths: Sequence[int]) -> None:
        """Compile now the passes of every batch bucket in `rows` x query bucket in `widths` (no later
        request waits for one), and `reserve_rows` for the largest. A no-op when eager."""
        if not self.compile:
            return
        self.reserve_rows(max(rows))
        for r in sorted({self._rows_for(n) for n in rows}):
            for w in sorted({bucket(n, self.query_buckets) for n in widths}):
                if is_compiled(self.model, self._key(r, w)):  # the symbolic graph: once, at its smallest bucket
                    continue
                scratch = StaticBatchedCausalLM(self.model, max_len=self.max_len, compile=True)
                scratch.query_buckets = self.query_buckets  # pads as this adapter pads: w stays w
                if self.rows:
                    scratch._allocate(r, self.max_len)
                else:  # the reserved buffers hold no row yet: the passes may write into them
                    scratch.buffers = self.buffers
                    scratch.cache = scratch._first_rows(r)
                scratch.valid = self.valid.new_zeros(r, 0)
                scratch.forward([torch.zeros(w, dtype=torch.long, device=self.device)] * r)


def no_features(hidden: bool | tuple[int, ...]) -> None:
    if hidden:
        raise UnsupportedModelError(
            "the compiled batched cache does not return the target's features, which EAGLE, Medusa and LayerSkip "
            "read; run those drafters batched with compile=False (specdec serve --no-compile)"
        )


def batched_adapter(model: PreTrainedModel, compile: bool | str = False, max_len: int | None = None):
    """The batched target adapter for `compile` (True: compiled static; "static": static, eager; False:
    `BatchedCausalLM`), falling back to `BatchedCausalLM` with one `FastPathWarning` naming why when the
    model or machine cannot take the fast path."""
    if not compile:
        return BatchedCausalLM(model)
    check_batchable(model)  # what batching refuses, it refuses on either path
    problem = fast_path_problem(model, compile is True)
    if problem is not None:
        warnings.warn(f"specdec batched fast path unavailable, decoding eagerly instead (same tokens): {problem}",
                      FastPathWarning, stacklevel=3)
        return BatchedCausalLM(model)
    return StaticBatchedCausalLM(model, max_len=max_len, compile=compile is True)
