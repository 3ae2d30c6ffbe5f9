"""Drawing many continuations fast, through the real decode loop.

Every draw runs `SpeculativeDecoder.stream` unchanged: the drafter's `propose`/`commit`, the target pass, the
`verify_fn` and the EOS / max_new_tokens logic are the code under test. What is made cheap is the models'
forward pass, by patching `forward` on the model *instances* for the duration of a run (nothing global, nothing
in the core touched). Two engines:

``"memo"`` (default for small vocabularies)
    A model's output at a position depends only on the tokens before it, so each model keeps a table
    ``prefix -> logits of the next token``. The KV cache handed to the model is turned, in place, into a
    `TokenCache` that records token ids instead of keys and values; `crop` drops ids exactly as a
    DynamicCache drops keys. A call is answered from the table (a miss runs the real model once, without a
    cache, on the whole prefix, and stores every position). So the loop, the cache bookkeeping of the
    drafters (what is cropped, what is re-fed, at which positions: position ids must equal the cache length
    or the call is refused) and all sampling are exercised for real, while the model cost vanishes after
    warm-up. Not covered: numerical differences between incremental and full-sequence forwards, which the
    greedy-equality suite and the ``"cache"`` engine cover.
``"cache"``
    Real KV-cached forwards. Only the prompt prefill is shared: the first prefill of each model is kept
    (cache and logits) and every later prefill of the same ids gets a copy instead of a forward.

The fast path's slot cache (`compile="static"`) is answered the same way: an empty `SlotCache` becomes, in
place, a `SlotTokens` that records, per slot, the position and the whole prefix (token ids, its own last) of
the row written there, and `SlotCache.move` (a tree commit) moves those records. A query row's prefix is read
from the slots its explicit additive mask lets it see, which must end at the row's own slot and hold, in slot
order, positions 0, 1, ... with each slot's recorded prefix the visible one up to it (so a key computed in
another context, which real forwards would read, is refused rather than answered); else the call is refused. When the adapters compile their passes (`draw(..., compiled=True)`), slot-cache calls run the real
model instead, so that the compiled graphs are what is checked.

Encoder-decoder targets (`draw(..., encoder_inputs=)`): the source is fixed for a whole check, so a decoder
output depends only on the decoder prefix and the same table applies. The memo answers calls that pass the
check's own encoder output (compared exactly) and an `EncoderDecoderCache` whose self-attention part becomes
the `TokenCache` (decoder positions are checked through `cache_position`); the cross-attention part stays
empty. The encoder is memoised too: called on the check's source it returns the output stored up front.

A causal model's hidden states (EAGLE and Medusa read the target's features) come from the same table: each
prefix's entry keeps the states at its last token, every layer's, from the same full-sequence pass.

A call the memo cannot answer (a batch, another attention mask, an encoder-decoder's hidden states, a cache that
already holds real keys) goes to the real forward when that is safe and raises `MemoUnsupported` when it is not (a real call
on a `TokenCache`); `draw(..., engine="auto")` then starts over with ``"cache"``.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from specdec.runtime.base import cache_kwarg
from specdec.runtime.slot_cache import SlotCache

ENGINES = ("auto", "memo", "cache")

#: Keyword arguments a standard incremental call passes; anything else is not answered from the memo.
_STANDARD_KWARGS = {"return_dict", "output_attentions", "output_hidden_states", "cache_position"}


class _Output:
    """The fields callers read from a causal LM's output (a ModelOutput costs ~30 µs to build): hidden_states
    only when asked for (a tuple over the embeddings and every layer of [1, n, H])."""

    __slots__ = ("logits", "past_key_values", "hidden_states")

    def __init__(self, logits: torch.Tensor, past_key_values, hidden_states: tuple[torch.Tensor, ...] | None = None):
        self.logits = logits
        self.past_key_values = past_key_values
        self.hidden_states = hidden_states

    def __getitem__(self, index):
        return (self.logits, self.past_key_values)[index] if isinstance(index, int) else getattr(self, index)


class MemoUnsupported(RuntimeError):
    """The memo engine met a model call it cannot answer from token ids alone."""


class TokenCache(DynamicCache):
    """A DynamicCache stand-in that holds the token ids fed so far, not their keys and values."""

    tokens: list[int]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.tokens)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # same contract as DynamicCache.crop in transformers 5
            raise ValueError("crop takes the negative number of tokens to remove")
        if tokens_to_remove:
            del self.tokens[tokens_to_remove:]

    def keep_rows(self, start: int, keep: list[int]) -> None:
        """Tree commit: move entries start + keep[j] to start + j (the caller crops the rest)."""
        self.tokens[start : start + len(keep)] = [self.tokens[start + j] for j in keep]

    def update(self, *args, **kwargs):
        raise MemoUnsupported(
            "a real model layer wrote into a memo TokenCache: this method calls model internals that the "
            "memo engine cannot serve; use engine='cache'"
        )


def _as_token_cache(cache) -> TokenCache | None:
    """Turn an empty DynamicCache into a TokenCache in place (so callers keeping a reference see it)."""
    if isinstance(cache, TokenCache):
        return cache
    if type(cache) is DynamicCache and cache.get_seq_length() == 0:
        cache.__class__ = TokenCache
        cache.tokens = []
        return cache
    return None


class SlotTokens(SlotCache):
    """A SlotCache stand-in that holds, per slot, (position, prefix) of the row written there (the prefix: the
    token ids it saw, its own last; None: never written), not keys and values."""

    written: list[tuple[int, tuple[int, ...]] | None]

    def update(self, *args, **kwargs):
        raise MemoUnsupported(
            "a real model layer wrote into a memo SlotTokens cache: this method calls model internals that the "
            "memo engine cannot serve; use engine='cache'"
        )

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy slots src [k] to slots dst [k], as `SlotCache.move` copies keys and values."""
        moved = [self.written[s] for s in src.tolist()]
        for d, entry in zip(dst.tolist(), moved):
            self.written[d] = entry


def _as_slot_tokens(cache: SlotCache) -> SlotTokens | None:
    """Turn a SlotCache without layers (nothing real written yet) into SlotTokens in place."""
    if isinstance(cache, SlotTokens):
        return cache
    if type(cache) is SlotCache and not cache.layers:
        cache.__class__ = SlotTokens
        cache.written = [None] * cache.max_len
        return cache
    return None


class _Memo:
    """prefix (tuple of ids) -> next-token logits [V], for one model; filled lazily or by `prefetch`.
    slot_cache: answer the fast path's slot-cache calls too (False: they run the real model)."""

    def __init__(self, model: PreTrainedModel, forward: Callable, encoder_inputs: dict | None = None,
                 slot_cache: bool = True):
        self.model = model
        self.forward = forward  # the unpatched bound forward
        self.slot_cache = slot_cache
        self.table: dict[tuple[int, ...], torch.Tensor] = {}
        #: prefix -> the hidden states at its last token, per layer ([1, 1, H] each; causal models only)
        self.states: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
        self.misses = 0
        self.hits = 0
        self.source: dict[str, torch.Tensor] | None = None  # an encoder-decoder model's fixed encoder input
        self.source_hidden: torch.Tensor | None = None  # [1, S, H] its encoder output
        self.encoder_output = None
        if encoder_inputs is not None and getattr(model.config, "is_encoder_decoder", False):
            from specdec.runtime.seq2seq_lm import check_encoder_inputs  # noqa: PLC0415

            self.source = check_encoder_inputs(model, encoder_inputs)
            with torch.inference_mode():
                self.encoder_output = model.get_encoder()(**self.source)
            self.source_hidden = self.encoder_output.last_hidden_state

    def encoder_forward(self, real: Callable) -> Callable:
        """The encoder's forward: the stored output for the check's own source, the real one otherwise."""
        source = self.source
        main = self.model.main_input_name

        def forward(*args, **kwargs):
            if args:  # Whisper's model calls its encoder with the features as the first positional argument
                kwargs = {main: args[0], **kwargs}
            kwargs = {k: v for k, v in kwargs.items() if v is not None or k in source}  # unset options
            same = set(kwargs) == set(source) and all(
                isinstance(kwargs[k], torch.Tensor) and kwargs[k].shape == v.shape and torch.equal(kwargs[k], v)
                for k, v in source.items())
            return self.encoder_output if same else real(**kwargs)

        return forward

    def same_source(self, encoder_outputs) -> bool:
        """Was this decoder call given the check's own encoder output?"""
        hidden = getattr(encoder_outputs, "last_hidden_state", None)
        return self.source_hidden is not None and isinstance(hidden, torch.Tensor) and torch.equal(
            hidden, self.source_hidden)

    @torch.inference_mode()
    def _compute(self, batch: torch.Tensor) -> None:
        """Run the real model (no cache) on sequences batch [b, m]; store the logits after every prefix (and, for a
        causal model, the hidden states at its last token)."""
        device = next(self.model.parameters()).device
        b, m = batch.shape
        if self.source is not None:  # decoder sequences of an encoder-decoder model, on the fixed source
            source = {k: v.expand(b, *v.shape[1:]) for k, v in self.source.items()}  # [b, ...]
            out = self.forward(**source, decoder_input_ids=batch.to(device), use_cache=False)
        else:
            positions = torch.arange(m, device=device).expand(b, m)
            out = self.forward(input_ids=batch.to(device), position_ids=positions, use_cache=False,
                               output_hidden_states=True)
        rows = out.logits.detach().reshape(b * m, 1, 1, -1).unbind(0)  # b*m views of [1, 1, V]
        layers = [h.detach().reshape(b * m, 1, 1, -1).unbind(0) for h in out.hidden_states] \
            if self.source is None else []  # per layer, b*m views of [1, 1, H]
        table, states = self.table, self.states
        for r, ids in enumerate(batch.tolist()):
            for j in range(m):
                key = tuple(ids[: j + 1])
                table.setdefault(key, rows[r * m + j])
                if layers:
                    states.setdefault(key, tuple(layer[r * m + j] for layer in layers))

    def prefetch(self, sequences: Sequence[Sequence[int]], batch_size: int = 1024) -> None:
        """Compute the logits after every prefix of `sequences` (batched by length)."""
        by_length: dict[int, list[Sequence[int]]] = {}
        for seq in sequences:
            if tuple(seq) not in self.table:
                by_length.setdefault(len(seq), []).append(seq)
        for group in by_length.values():
            for i in range(0, len(group), batch_size):
                self._compute(torch.tensor(group[i : i + batch_size], dtype=torch.long))

    def rows(self, prefix: list[int], new: list[int], keep: int) -> torch.Tensor:
        """Logits after prefix+new[:1], ..., prefix+new: [1, len(new), V] (the last `keep` only, if keep)."""
        full = prefix + new
        total = len(full)
        last = tuple(full)
        table = self.table
        if last not in table:
            self.misses += 1
            self._compute(torch.tensor([full], dtype=torch.long))
        else:
            self.hits += 1
        first = total - (keep if 0 < keep < len(new) else len(new)) + 1
        if first == total:
            return table[last]  # [1, 1, V], no copy
        return torch.cat([table[tuple(full[:j])] for j in range(first, total + 1)], dim=1)

    def hidden_rows(self, prefix: list[int], new: list[int]) -> tuple[torch.Tensor, ...]:
        """The hidden states at new's tokens after prefix, per layer [1, len(new), H] (after `rows` of the same)."""
        full = prefix + new
        per_token = [self.states[tuple(full[:j])] for j in range(len(prefix) + 1, len(full) + 1)]
        return tuple(torch.cat(layer, dim=1) for layer in zip(*per_token))


def _memo_forward(memo: _Memo) -> Callable:
    real = memo.forward

    def forward(input_ids=None, position_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0,
                attention_mask=None, cache=None, **kwargs):
        past_key_values = cache if cache is not None else past_key_values  # the keyword's name by version
        if memo.source is not None and isinstance(past_key_values, EncoderDecoderCache):
            return _seq2seq_forward(memo, real, input_ids=input_ids, past_key_values=past_key_values,
                                    use_cache=use_cache, attention_mask=attention_mask, **kwargs)
        if memo.slot_cache and isinstance(past_key_values, SlotCache):
            return _slot_forward(memo, real, input_ids=input_ids, position_ids=position_ids,
                                 past_key_values=past_key_values, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                 attention_mask=attention_mask, **kwargs)
        unusual = (
            input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1
            or (attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[:2] != (1, 1)))
            or any(k not in _STANDARD_KWARGS for k in kwargs) or kwargs.get("output_attentions")
            or (kwargs.get("output_hidden_states") and (memo.source is not None or logits_to_keep))
            or not isinstance(logits_to_keep, int)
        )
        hidden = bool(kwargs.get("output_hidden_states"))
        cache = past_key_values
        if not unusual and (cache is None or isinstance(cache, DynamicCache)):
            if cache is None and use_cache is not False:  # HF would start a new cache and return it
                cache = DynamicCache()
            token_cache = _as_token_cache(cache) if cache is not None else None
            if attention_mask is not None and token_cache is not None:  # a tree pass: one prefix per row
                logits, states = _tree_rows(memo, token_cache, input_ids[0].tolist(), position_ids, attention_mask,
                                            use_cache, hidden)
                return _Output(logits, token_cache, states)
            if attention_mask is None and (cache is None or token_cache is not None):
                prefix = token_cache.tokens if token_cache is not None else []
                new = input_ids[0].tolist()
                if position_ids is not None:
                    expected = list(range(len(prefix), len(prefix) + len(new)))
                    if position_ids.view(-1).tolist() != expected:
                        raise MemoUnsupported(
                            f"position ids {position_ids.reshape(-1).tolist()} do not follow the cache "
                            f"length {len(prefix)}: the caller feeds tokens at the wrong positions"
                        )
                logits = memo.rows(prefix, new, logits_to_keep)  # [1, n or logits_to_keep, V]
                states = memo.hidden_rows(prefix, new) if hidden else None  # per layer [1, n, H]
                if token_cache is not None and use_cache is not False:
                    token_cache.tokens.extend(new)
                return _Output(logits, token_cache, states)
        if isinstance(cache, TokenCache):
            raise MemoUnsupported(
                f"{type(memo.model).__name__} was called in a way the memo engine cannot answer "
                f"(arguments: {sorted(kwargs)}); use engine='cache'"
            )
        return real(input_ids=input_ids, position_ids=position_ids, **cache_kwarg(memo.model, past_key_values),
                    use_cache=use_cache, logits_to_keep=logits_to_keep, attention_mask=attention_mask, **kwargs)

    return forward


def _seq2seq_forward(memo: _Memo, real: Callable, past_key_values: EncoderDecoderCache, **kwargs):
    """An encoder-decoder decoder call: answered from the table when it continues the cached decoder tokens
    on the check's own source; otherwise the real forward (or MemoUnsupported if the cache is a memo one)."""
    cache = past_key_values
    ids = kwargs.get("decoder_input_ids")
    token_cache = _as_token_cache(cache.self_attention_cache)
    usual = (
        token_cache is not None and kwargs.get("input_ids") is None and ids is not None and ids.dim() == 2
        and ids.shape[0] == 1 and not kwargs.get("output_hidden_states") and not kwargs.get("output_attentions")
        and kwargs.get("use_cache") is not False and memo.same_source(kwargs.get("encoder_outputs"))
        and set(kwargs) <= {"decoder_input_ids", "encoder_outputs", "attention_mask", "cache_position", "use_cache",
                            "input_ids", "output_hidden_states", "output_attentions", "return_dict",
                            "decoder_attention_mask", "decoder_position_ids"}
    )
    tree_mask = kwargs.get("decoder_attention_mask")
    if usual and tree_mask is not None:  # a tree pass: one decoder prefix per row
        if tree_mask.dim() != 4 or tree_mask.shape[:2] != (1, 1):
            raise MemoUnsupported(f"a decoder mask of shape {tuple(tree_mask.shape)} is not a tree mask [1, 1, M, L+M]")
        return _Output(_tree_rows(memo, token_cache, ids[0].tolist(), kwargs.get("decoder_position_ids"), tree_mask,
                                  True)[0], cache)
    if usual:
        prefix, new = token_cache.tokens, ids[0].tolist()
        positions = kwargs.get("cache_position")
        if positions is not None and positions.view(-1).tolist() != list(range(len(prefix), len(prefix) + len(new))):
            raise MemoUnsupported(f"decoder positions {positions.view(-1).tolist()} do not follow the cache "
                                  f"length {len(prefix)}: the caller feeds tokens at the wrong positions")
        logits = memo.rows(prefix, new, 0)  # [1, n, V]
        token_cache.tokens.extend(new)
        return _Output(logits, cache)
    if isinstance(cache.self_attention_cache, TokenCache):
        raise MemoUnsupported(f"{type(memo.model).__name__} was called in a way the memo engine cannot answer "
                              f"(arguments: {sorted(kwargs)}); use engine='cache'")
    return real(**cache_kwarg(memo.model, past_key_values), **kwargs)


def _slot_forward(memo: _Memo, real: Callable, input_ids, position_ids, past_key_values: SlotCache, use_cache,
                  logits_to_keep, attention_mask, **kwargs):
    """A slot-cache call (one row of queries at explicit slots and positions, an explicit additive mask over all
    the cache's slots): answered from the table, one prefix per query row; otherwise the real forward (or
    MemoUnsupported if the cache is a memo one)."""
    cache = past_key_values
    usual = (
        input_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] == 1 and position_ids is not None
        and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[:2] == (1, 1)
        and attention_mask.shape[-1] == cache.max_len and use_cache is not False
        and isinstance(logits_to_keep, int) and logits_to_keep >= 0
        and all(k in _STANDARD_KWARGS for k in kwargs) and not kwargs.get("output_attentions")
        and not (kwargs.get("output_hidden_states") and memo.source is not None)
    )
    tokens = _as_slot_tokens(cache) if usual else None
    if tokens is None:
        if isinstance(cache, SlotTokens):
            raise MemoUnsupported(f"{type(memo.model).__name__} was called on the slot cache in a way the memo engine "
                                  f"cannot answer (arguments: {sorted(kwargs)}); use engine='cache'")
        return real(input_ids=input_ids, position_ids=position_ids, **cache_kwarg(memo.model, cache),
                    use_cache=use_cache, logits_to_keep=logits_to_keep, attention_mask=attention_mask, **kwargs)
    slots = cache.slots.tolist()  # [M] where the query rows are written
    ids, positions = input_ids[0].tolist(), position_ids.view(-1).tolist()
    visible = attention_mask[0, 0] == 0  # [M, L] the slots each row sees
    rows: list[torch.Tensor | None] = [None] * len(slots)
    for i in sorted(range(len(slots)), key=slots.__getitem__):  # an earlier slot (an ancestor) first
        seen = visible[i].nonzero().view(-1).tolist()
        before = [tokens.written[s] for s in seen[:-1]]
        prefix = before[-1][1] if before and before[-1] is not None else ()
        if not seen or seen[-1] != slots[i] or positions[i] != len(before) or any(
                entry is None or entry[0] != j or entry[1] != prefix[: j + 1] for j, entry in enumerate(before)):
            raise MemoUnsupported(f"row {i} (slot {slots[i]}, position {positions[i]}) sees slots {seen}, which do "
                                  "not hold one prefix in order ending at its own slot")
        tokens.written[slots[i]] = (positions[i], (*prefix, ids[i]))
        rows[i] = memo.rows(list(prefix), [ids[i]], 1)  # [1, 1, V]
    states = None
    if kwargs.get("output_hidden_states"):  # per layer [1, M, H]: each row's state after its own prefix
        per_row = [memo.states[tokens.written[slot][1]] for slot in slots]
        states = tuple(torch.cat(layer, dim=1) for layer in zip(*per_row))
    logits = torch.cat(rows, dim=1)  # [1, M, V]
    return _Output(logits[:, -logits_to_keep:] if logits_to_keep else logits, cache, states)


def _tree_rows(memo: _Memo, cache: TokenCache, new: list[int], position_ids, attention_mask, use_cache,
               hidden: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Logits [1, M, V] of a 4D-masked pass: row i continues the tokens it may attend to (mask entry 0); with
    `hidden`, each row's hidden states too (per layer [1, M, H]; else None)."""
    tokens = cache.tokens + new
    visible = attention_mask[0, 0] == 0  # [M, L+M]
    if visible.shape[1] != len(tokens):
        raise MemoUnsupported(f"a {tuple(attention_mask.shape)} mask does not cover the {len(tokens)} cached + new tokens")
    positions = position_ids.view(-1).tolist() if position_ids is not None else None
    rows, per_row = [], []
    for i, allowed in enumerate(visible.tolist()):
        prefix = [t for t, a in zip(tokens, allowed) if a]
        if positions is not None and positions[i] != len(prefix) - 1:
            raise MemoUnsupported(f"row {i} is at position {positions[i]} but sees {len(prefix)} tokens")
        rows.append(memo.rows(prefix[:-1], prefix[-1:], 1))  # [1, 1, V]
        if hidden:
            per_row.append(memo.states[tuple(prefix)])
    if use_cache is not False:
        cache.tokens.extend(new)
    states = tuple(torch.cat(layer, dim=1) for layer in zip(*per_row)) if hidden else None
    return torch.cat(rows, dim=1), states


def _snapshot_forward(model: PreTrainedModel, real: Callable) -> Callable:
    """Serve repeated prefills of the same ids into an empty cache from a stored copy."""
    store: dict[tuple[int, ...], tuple[DynamicCache, object]] = {}

    def forward(input_ids=None, past_key_values=None, cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values  # the keyword's name by version
        key = None
        if (
            input_ids is not None and input_ids.dim() == 2 and input_ids.shape[0] == 1 and input_ids.shape[1] > 1
            and type(cache) is DynamicCache and cache.get_seq_length() == 0
            and kwargs.get("attention_mask") is None and not kwargs.get("output_hidden_states")
        ):
            key = (tuple(input_ids[0].tolist()), repr(kwargs.get("position_ids")), kwargs.get("logits_to_keep"))
            if key in store:
                saved_cache, saved_out = store[key]
                cache.__dict__.update(copy.deepcopy(saved_cache).__dict__)
                return _Output(saved_out, cache)
        out = real(input_ids=input_ids, **cache_kwarg(model, cache), **kwargs)
        if key is not None:  # the real forward filled the cache it was given
            store[key] = (copy.deepcopy(cache), out.logits)
        return out

    return forward


def find_models(*roots: object, depth: int = 3) -> list[PreTrainedModel]:
    """Causal LMs reachable from `roots` through plain attributes (a drafter's model, its cached wrapper...)."""
    found: dict[int, PreTrainedModel] = {}
    seen: set[int] = set()

    def visit(obj: object, level: int) -> None:
        if obj is None or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, PreTrainedModel):
            found.setdefault(id(obj), obj)
            return
        if isinstance(obj, (nn.Module, torch.Tensor, str, bytes, int, float)) or level >= depth:
            return
        if isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, level + 1)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                visit(item, level + 1)
            return
        for item in getattr(obj, "__dict__", {}).values():
            visit(item, level + 1)

    for root in roots:
        visit(root, 0)
    return list(found.values())


@contextlib.contextmanager
def patched_models(models: Sequence[PreTrainedModel], engine: str, encoder_inputs: dict | None = None,
                   compiled: bool = False) -> Iterator[dict[int, _Memo]]:
    """Patch `forward` on each model instance for the block; yields the memos (empty for "cache").
    compiled: the adapters compile their passes, so slot-cache calls run the real model."""
    memos: dict[int, _Memo] = {}
    patched = []
    encoders = []
    try:
        for model in models:
            if "forward" in model.__dict__:  # already patched (same model twice) or patched by someone else
                continue
            real = model.forward
            if engine == "memo":
                memo = memos[id(model)] = _Memo(model, real, encoder_inputs, slot_cache=not compiled)
                model.forward = _memo_forward(memo)
                encoder = model.get_encoder() if memo.source is not None else None
                if encoder is not None and "forward" not in encoder.__dict__:
                    encoder.forward = memo.encoder_forward(encoder.forward)
                    encoders.append(encoder)
            else:
                model.forward = _snapshot_forward(model, real)
            patched.append(model)
        yield memos
    finally:
        for model in patched:
            del model.forward
        for encoder in encoders:
            del encoder.forward


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch intra-op threads (None: unchanged), then restore the setting.

    The draws' one-token forwards and tiny tensor ops gain nothing from a second thread, and on a busy
    machine OpenMP's spinning threads make them far slower: measured on the shared 2-core CPU, a batched
    forward of a tiny model took 0.9 s with 2 threads and 11 ms with 1.
    """
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Draws:
    """`sequences[i]`: the new tokens of draw i. Decoding counters are summed over all draws."""

    sequences: list[tuple[int, ...]]
    engine: str
    elapsed_s: float
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    new_tokens: int = 0
    memo_misses: int = 0

    @property
    def draws_per_s(self) -> float:
        return len(self.sequences) / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0


def draw(
    make_decoder: Callable[[], object],
    prompt_ids: Sequence[int],
    n: int,
    *,
    models: Sequence[PreTrainedModel] = (),
    engine: str = "auto",
    prefetch: Sequence[Sequence[int]] = (),
    threads: int | None = 1,
    encoder_inputs: dict | None = None,
    compiled: bool = False,
) -> Draws:
    """`n` continuations of `prompt_ids`, each a full `decoder.stream(prompt_ids)` of one decoder.

    make_decoder() builds the `SpeculativeDecoder` (seeded once; successive streams continue its generator,
    so the draws are independent). `models`: the models whose forward is patched (target, draft...);
    `prefetch`: full sequences (prompt included) whose prefixes are computed in batches up front (memo).
    `threads`: torch intra-op threads while drawing (None: leave the current setting); see `torch_threads`.
    `encoder_inputs`: an encoder-decoder request's fixed source (the memo keys decoder prefixes on it).
    `compiled`: the decoder compiles its passes (compile=True); the memo then leaves slot-cache calls to the
    real model, so that the compiled graphs are what is drawn through.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        try:
            return draw(make_decoder, prompt_ids, n, models=models, engine="memo", prefetch=prefetch,
                        threads=threads, encoder_inputs=encoder_inputs, compiled=compiled)
        except MemoUnsupported:
            return draw(make_decoder, prompt_ids, n, models=models, engine="cache", threads=threads,
                        encoder_inputs=encoder_inputs, compiled=compiled)
    with torch_threads(threads):
        return _draw(make_decoder, list(prompt_ids), n, models, engine, prefetch, encoder_inputs, compiled)


def _draw(make_decoder, prompt, n, models, engine, prefetch, encoder_inputs=None, compiled=False) -> Draws:
    with patched_models(models, engine, encoder_inputs, compiled) as memos:
        if prefetch:
            for memo in memos.values():
                memo.prefetch(prefetch)
        decoder = make_decoder()
        start = time.perf_counter()
        sequences = []
        drafted = accepted = rounds = new_tokens = 0
        for _ in range(n):
            sequences.append(tuple(decoder.stream(prompt)))
            stats = decoder.stats
            drafted += stats.drafted
            accepted += stats.accepted
            rounds += stats.rounds
            new_tokens += stats.new_tokens
        elapsed = time.perf_counter() - start
    return Draws(sequences, engine, elapsed, drafted, accepted, rounds, new_tokens,
                 sum(m.misses for m in memos.values()))
