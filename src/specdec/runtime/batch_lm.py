"""`BatchedCausalLM`: one causal LM and one KV cache shared by rows of different lengths.

Layout (docs/batching.md): the cache is a tensor per layer of shape [B, H, S, D] over S shared *slots*.
`valid [B, S]` says which slots hold a token of that row; a row's tokens are its valid slots in slot order,
so its i-th valid slot holds its i-th token and is fed at position id i. A forward appends W slots to every
row (rows with fewer inputs are padded at the end); afterwards only each row's real inputs stay valid.
Rolling a row back (`crop`) turns its trailing slots into holes; `compact` gathers every row's valid slots
to the right end of a shorter cache (one index copy per layer), so holes never accumulate.

The model sees ordinary HF inputs: input_ids [B, W], position_ids [B, W] (each row's own lengths), a 2-D
attention mask [B, S + W] over the slots and a `DynamicCache`; causality is by slot, which is the order of
each row's tokens. No model file is forked and nothing is stored on the config.

Token trees: a row may append a tree (root + nodes, `TreeMask`) instead of a chain. Its nodes take new slots
in node order, sit at position id `length + depth`, and the mask becomes 4-D [B, 1, W, S + W]: the tree
row's block of new slots is its ancestor matrix instead of the causal triangle. After verification
`keep_new` turns the nodes off the accepted path into holes; as the path is in node order, "i-th valid slot
= i-th token" still holds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specdec.core.masks import additive_mask
from specdec.core.tree import TreeMask
from specdec.runtime.base import Scores, as_float_logits, cache_kwarg, select_hidden
from specdec.runtime.causal_lm import EAGER_INVARIANT_DTYPES, check_rollback_support, vocab_size
from specdec.runtime.rowwise import row_invariant


def check_batchable(model: PreTrainedModel) -> None:
    """Raise unless `model` is a causal LM whose cache rows can be rolled back. (A sliding attention window counts
    cache slots, holes included: the engine admits a batched request only when it fits inside the window.)"""
    check_rollback_support(model)


class _AppendLayer(DynamicLayer):
    """A `DynamicLayer` that appends into the spare capacity of preallocated buffers [B, H, capacity, D]
    instead of concatenating (which copies the whole cache on every forward)."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, used: int):
        super().__init__()
        self.key_buffer, self.value_buffer, self.used = key_buffer, value_buffer, used
        self.dtype, self.device = key_buffer.dtype, key_buffer.device
        self.is_initialized = True
        self.keys, self.values = key_buffer[:, :, :used], value_buffer[:, :, :used]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self.used + n > self.key_buffer.shape[2]:
            capacity = max(2 * self.key_buffer.shape[2], self.used + n + 64)
            self.key_buffer = _with_capacity(self.key_buffer[:, :, : self.used], capacity)
            self.value_buffer = _with_capacity(self.value_buffer[:, :, : self.used], capacity)
        self.key_buffer[:, :, self.used : self.used + n] = key_states
        self.value_buffer[:, :, self.used : self.used + n] = value_states
        self.used += n
        self.keys, self.values = self.key_buffer[:, :, : self.used], self.value_buffer[:, :, : self.used]
        return self.keys, self.values


#: Spare slot columns a new cache buffer gets past the states copied into it (the next passes append there).
SPARE_SLOTS = 64


def _with_capacity(states: torch.Tensor, capacity: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """states [B, H, S, D] (rows [B']: only those rows, in that order) copied into the front of a new buffer
    [B | B', H, capacity, D]: one copy."""
    count = states.shape[0] if rows is None else rows.shape[0]
    buffer = states.new_empty(count, states.shape[1], capacity, states.shape[3])
    if rows is None:
        buffer[:, :, : states.shape[2]] = states
    else:
        torch.index_select(states, 0, rows, out=buffer[:, :, : states.shape[2]])
    return buffer


def _gathered(states: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """states [B, H, S, D] at slot columns index [B, width], per row, in the front of a new buffer
    [B, H, width + SPARE_SLOTS, D]: one copy."""
    buffer = states.new_empty(states.shape[0], states.shape[1], width + SPARE_SLOTS, states.shape[3])
    torch.gather(states, 2, index[:, None, :, None].expand(*states.shape[:2], width, states.shape[3]),
                 out=buffer[:, :, :width])
    return buffer


def _stacked(parts: Sequence[tuple[torch.Tensor | None, int]], like: torch.Tensor, width: int) -> torch.Tensor:
    """Row blocks parts[i] = (states [B_i, H, S_i, D] or None: B_i rows without states) right-aligned in one new
    buffer [sum B_i, H, width + SPARE_SLOTS, D]; the holes to their left are zeros (a masked slot must hold
    finite values: 0 * NaN would still spread through attention). One copy."""
    total = sum(rows for _, rows in parts)
    buffer = like.new_empty(total, like.shape[1], width + SPARE_SLOTS, like.shape[3])
    start = 0
    for states, rows in parts:
        filled = 0 if states is None else states.shape[2]
        buffer[start : start + rows, :, : width - filled].zero_()
        if filled:
            buffer[start : start + rows, :, width - filled : width] = states
        start += rows
    return buffer


def _is_prefix_view(states: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    return (buffer is not None and states.data_ptr() == buffer.data_ptr() and states.stride() == buffer.stride()
            and states.shape[:2] == buffer.shape[:2] and states.shape[2] <= buffer.shape[2])


class BatchedCausalLM:
    """A causal LM over a batch of rows with their own lengths. `lengths[i]` tokens are cached for row i."""

    returns_features = True  # score(..., hidden=) returns the features heads read
    compile = False  # eager passes (StaticBatchedCausalLM may compile its own)

    def __init__(self, model: PreTrainedModel):
        check_batchable(model)
        self.model = model
        self.vocab_size = vocab_size(model)
        self.device = next(model.parameters()).device
        self.dtype = model.dtype  # asked by every pass; HF's `model.dtype` walks the model's parameters each time
        self.keys: list[torch.Tensor] = []  # per layer [B, H, S, D]
        self.values: list[torch.Tensor] = []
        # Per layer, the buffers self.keys / self.values are prefix views of when they are (appends go there).
        self.key_buffers: list[torch.Tensor | None] = []
        self.value_buffers: list[torch.Tensor | None] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [B, S]
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0
        self.max_holes = 0.25  # compact once more than this fraction of the cache's slots are holes

    # -- shape ----------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return int(self.valid.shape[0])

    @property
    def slots(self) -> int:
        return int(self.valid.shape[1])

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens cached per row: [B] long."""
        return self.valid.sum(dim=1)

    def check_fits(self, tokens: int) -> None:
        """Raise a PromptError before any work if a row of `tokens` tokens cannot fit (never here: the cache
        grows; the model's context is checked by the decoder)."""

    def pass_tokens(self, rows: int, width: int) -> int:
        """Tokens a pass of `rows` rows x `width` inputs scores (the server's cost model): no padding here."""
        return rows * width

    # -- rows join and leave --------------------------------------------------------------------------
    @torch.inference_mode()
    def add_rows(self, inputs: Sequence[torch.Tensor],
                 hidden: bool | tuple[int, ...] = False) -> list[torch.Tensor | None] | None:
        """Append rows whose caches hold inputs[i] [n_i]: prefilled together in one forward of their own
        (right-padded), then spliced in. The existing rows' caches are not recomputed. With `hidden` (as
        `score`), return each new row's features [n_i, H] (None where n_i = 0)."""
        start = time.perf_counter()
        fresh = BatchedCausalLM(self.model)
        fresh.valid = self.valid.new_zeros(len(inputs), 0)
        features = [None] * len(inputs) if hidden else None
        if any(x.shape[0] for x in inputs):
            states = fresh.score(inputs, last_only=True, hidden=hidden).hidden  # [B_new, W, H] | None
            if hidden:
                features = [states[i, : x.shape[0]] if x.shape[0] else None for i, x in enumerate(inputs)]
            fresh.forwards, fresh.forward_s = 0, 0.0
        # Splice: both blocks right-aligned (holes on the left) in one new buffer per layer with spare columns.
        width = max(self.slots, fresh.slots)
        layers = [None] * len(self.keys or fresh.keys)

        def spliced(own: list, new: list) -> list[torch.Tensor]:
            return [_stacked([(a, self.rows), (b, fresh.rows)], a if a is not None else b, width)
                    for a, b in zip(own or layers, new or layers)]

        self._adopt(spliced(self.keys, fresh.keys), spliced(self.values, fresh.values), width)
        self.valid = torch.cat([self._valid_padded(width), fresh._valid_padded(width)])
        self.prefill_s += time.perf_counter() - start
        return features

    def precompile(self, rows: Sequence[int], widths: Sequence[int]) -> None:
        """Nothing to compile: eager passes (`StaticBatchedCausalLM.precompile` compiles its shapes)."""

    @torch.inference_mode()  # the buffers are inference tensors (written in place)
    def remove_rows(self, keep: Sequence[int]) -> None:
        """Keep only the rows at indices `keep` (in that order); the others' caches are dropped.

        When the rows that move come from past the kept count (`BatchDecoder.remove` orders them so) they are
        copied in place into their buffers, the slot columns in use only; otherwise one index copy per layer,
        of the columns the kept rows use, into buffers with spare columns (the next pass appends there). The
        holes left are compacted away only past `max_holes`, as in `crop`."""
        keep = list(keep)
        index = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        valid = self.valid.index_select(0, index)  # [B', S]
        used = valid.any(dim=0).nonzero()
        first, end = (int(used.min()), int(used.max()) + 1) if used.numel() else (0, 0)
        moved = [(row, source) for row, source in enumerate(keep) if row != source]
        if all(source >= len(keep) for _, source in moved) and self._appendable():
            if moved:
                rows, sources = (torch.as_tensor(x, dtype=torch.long, device=self.device) for x in zip(*moved))
                for buffer in (*self.key_buffers, *self.value_buffers):  # [B, H, capacity, D]
                    buffer[:, :, :end].index_copy_(0, rows, buffer[:, :, :end].index_select(0, sources))
            self.valid = valid[:, :end]
            self._adopt([b[: len(keep)] for b in self.key_buffers], [b[: len(keep)] for b in self.value_buffers],
                        end)
        else:
            self.valid, width = valid[:, first:end], end - first
            self._adopt([_with_capacity(k[:, :, first:end], width + SPARE_SLOTS, index) for k in self.keys],
                        [_with_capacity(v[:, :, first:end], width + SPARE_SLOTS, index) for v in self.values],
                        width)
        if self.rows and self.slots and 1 - float(self.valid.sum()) / self.valid.numel() > self.max_holes:
            self.compact()

    def _appendable(self) -> bool:
        """Are the states prefix views of their buffers (as after a pass, a crop or `_adopt`)?"""
        return len(self.key_buffers) == len(self.keys) and all(
            _is_prefix_view(k, kb) and _is_prefix_view(v, vb)
            for k, v, kb, vb in zip(self.keys, self.values, self.key_buffers, self.value_buffers))

    def _adopt(self, key_buffers: list[torch.Tensor], value_buffers: list[torch.Tensor], width: int) -> None:
        """Make these buffers [B, H, capacity, D] the cache: its states are their first `width` slot columns,
        and the next pass appends in place after them."""
        self.key_buffers, self.value_buffers = key_buffers, value_buffers
        self.keys = [buffer[:, :, :width] for buffer in key_buffers]
        self.values = [buffer[:, :, :width] for buffer in value_buffers]

    def _valid_padded(self, width: int) -> torch.Tensor:
        """valid [B, width]: holes prepended up to `width` slots."""
        return torch.cat([self.valid.new_zeros(self.rows, width - self.slots), self.valid], dim=1)

    # -- decoding -------------------------------------------------------------------------------------
    def forward(self, inputs: Sequence[torch.Tensor], last_only: bool = False,
                trees: Sequence[TreeMask | None] | None = None) -> torch.Tensor:
        """Append inputs[i] [n_i] (n_i may be 0) to row i; return logits [B, W, V], W = max n_i.

        Row i's logits are meaningful at [i, :n_i] only (last_only: [B, 1, V] of the last column, for a
        prefill that needs none). The cache keeps exactly the real inputs. trees[i] (optional): inputs[i] is
        a root and its tree's nodes (trees[i].size == n_i), scored in this one pass.
        """
        return self.score(inputs, last_only, trees).logits

    @torch.inference_mode()
    def score(self, inputs: Sequence[torch.Tensor], last_only: bool = False,
              trees: Sequence[TreeMask | None] | None = None, hidden: bool | tuple[int, ...] = False) -> Scores:
        """`forward`, and with `hidden` the features heads read: logits [B, W, V] and hidden [B, W, H]
        (hidden=True: the final, normed states; a tuple of layer indices: those side by side [B, W, len * H],
        as `runtime.base.select_hidden`). Row i's features are meaningful at [i, :n_i] only."""
        start = time.perf_counter()
        rows = self.rows
        counts = torch.tensor([int(x.shape[0]) for x in inputs], device=self.device)  # [B]
        width = max(1, int(counts.max()) if rows else 1)
        input_ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)  # [B, W], padded with 0
        for i, ids in enumerate(inputs):
            input_ids[i, : ids.shape[0]] = ids
        steps = torch.arange(width, device=self.device)  # [W]
        # Padding columns repeat the row's last real position: a padded row never reaches positions it does not
        # own (past a short row's end a model may have no position embedding, or produce values that would
        # sit in the row's cache as masked slots, where 0 * NaN still spreads through attention).
        last = (self.lengths + counts - 1).clamp_min(0)  # [B]
        position_ids = torch.minimum(self.lengths[:, None] + steps[None], last[:, None])  # [B, W]
        # Padding inputs sit after a row's real inputs, so causality already hides them from the real ones;
        # they stay visible to themselves so that no query row is fully masked (NaNs would spread via V).
        # bfloat16 / float16: an explicit 4-D mask and the row-invariant attention, so each row's logits are the
        # ones the same tokens get alone (causal_lm.EAGER_INVARIANT_DTYPES).
        invariant = self.dtype in EAGER_INVARIANT_DTYPES
        if invariant or (trees is not None and any(tree is not None for tree in trees)):
            attention_mask = self._tree_mask(trees or [None] * rows, width, position_ids)  # [B, 1, W, S + W]
        else:
            attention_mask = torch.cat(
                [self.valid, self.valid.new_ones(rows, width)], dim=1
            ).long()  # [B, S + W]
        cache = self._dynamic_cache()
        with row_invariant(linear=True) if invariant else contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                **cache_kwarg(self.model, cache),
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                **({"output_hidden_states": True} if hidden else {}),
            )
        layers = cache.layers
        self.keys = [layer.keys for layer in layers]
        self.values = [layer.values for layer in layers]
        self.key_buffers = [getattr(layer, "key_buffer", None) for layer in layers]
        self.value_buffers = [getattr(layer, "value_buffer", None) for layer in layers]
        self.valid = torch.cat([self.valid, steps[None] < counts[:, None]], dim=1)  # [B, S + W]
        logits = as_float_logits(out.logits)  # [B, W, V]
        states = select_hidden(out.hidden_states, hidden, rows=True) if hidden else None  # [B, W, H] (len * H)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return Scores(logits, states)

    def _tree_mask(self, trees: Sequence[TreeMask | None], width: int, position_ids: torch.Tensor) -> torch.Tensor:
        """The 4-D additive mask [B, 1, W, S + W] of a pass where some rows append trees; fills those rows'
        position ids (length + depth; padding repeats the deepest node's) in place."""
        rows, slots = self.rows, self.slots
        allowed = torch.ones(rows, width, slots + width, dtype=torch.bool, device=self.device)  # [B, W, S + W]
        allowed[:, :, :slots] = self.valid[:, None, :]
        allowed[:, :, slots:] = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        lengths = self.lengths
        for i, tree in enumerate(trees):
            if tree is None:
                continue
            m = tree.size
            allowed[i, :m, slots : slots + m] = tree.ancestors.to(self.device)  # [M, M]
            depths = tree.depths.to(self.device)  # [M]
            position_ids[i, :m] = lengths[i] + depths
            position_ids[i, m:] = lengths[i] + depths.max()
        return additive_mask(allowed, self.dtype)[:, None]

    def keep_new(self, row: int, width: int, keep: Sequence[int]) -> None:
        """Of row `row`'s inputs in the last pass (the cache's last `width` slots), keep only the columns in
        `keep` (a tree's root and accepted path); the others become holes."""
        columns = torch.as_tensor([self.slots - width + j for j in keep], dtype=torch.long, device=self.device)
        slots = torch.arange(self.slots, device=self.device)  # [S]
        drop = (slots >= self.slots - width) & ~torch.isin(slots, columns)  # [S]
        rows = torch.arange(self.rows, device=self.device) == row  # [B]
        self.valid = self.valid & ~(rows[:, None] & drop[None])  # [B, S] (a new tensor: no in-place update)

    def _dynamic_cache(self) -> DynamicCache:
        """A DynamicCache over this batch's states whose layers append in place (spare capacity is reused
        while the states are a prefix view of their buffer; after a gather or splice, a new buffer)."""
        cache = DynamicCache()
        if self.keys:
            layers = []
            for i, (k, v) in enumerate(zip(self.keys, self.values)):
                kb = self.key_buffers[i] if i < len(self.key_buffers) else None
                vb = self.value_buffers[i] if i < len(self.value_buffers) else None
                if not (_is_prefix_view(k, kb) and _is_prefix_view(v, vb)):
                    capacity = k.shape[2] + SPARE_SLOTS
                    kb, vb = _with_capacity(k, capacity), _with_capacity(v, capacity)
                layers.append(_AppendLayer(kb, vb, k.shape[2]))
            cache.layers = layers
        return cache

    def crop(self, lengths: Sequence[int] | torch.Tensor) -> None:
        """Roll row i back to its first lengths[i] tokens: the slots past them become holes.

        Trailing slots that no row uses are dropped at once (a slice); the cache is compacted (one gather
        per layer) only once holes make up more than `max_holes` of it, so most rounds copy nothing.
        """
        keep = torch.as_tensor(lengths, device=self.device)[:, None]  # [B, 1]
        self.valid = self.valid & (self.valid.long().cumsum(dim=1) <= keep)
        used = self.valid.any(dim=0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 0
        if width < self.slots:
            self.valid = self.valid[:, :width]
            self.keys = [k[:, :, :width] for k in self.keys]
            self.values = [v[:, :, :width] for v in self.values]
        if self.rows and self.slots and 1 - float(self.valid.sum()) / self.valid.numel() > self.max_holes:
            self.compact()

    def compact(self) -> None:
        """Gather each row's valid slots to the right end of a cache as wide as the longest row."""
        if not self.rows:
            self.valid = self.valid[:, :0]
            self.keys, self.values = [], []
            return
        lengths = self.lengths  # [B]
        width = int(lengths.max())
        if width == self.slots and bool(self.valid[:, self.slots - width :].eq(
            torch.arange(width, device=self.device)[None] >= (width - lengths)[:, None]
        ).all()):
            return  # already right-aligned without holes
        # Sort key: holes first, then valid slots in order; take the last `width` of each row.
        order = torch.argsort(self.valid.long() * (1 + torch.arange(self.slots, device=self.device)), dim=1, stable=True)
        index = order[:, self.slots - width :]  # [B, width]
        new_valid = torch.arange(width, device=self.device)[None] >= (width - lengths)[:, None]  # [B, width]
        # keys [B, H, S, Dk], values [B, H, S, Dv] (MLA: Dv != Dk), gathered into buffers with spare columns
        self._adopt([_gathered(k, index, width) for k in self.keys], [_gathered(v, index, width) for v in self.values],
                    width)
        self.valid = new_valid
