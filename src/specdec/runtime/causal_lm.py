"""`CachedCausalLM`: feed tokens, get logits, roll the cache back.

The adapter owns a `transformers.DynamicCache`. Tokens are appended at explicit position ids (the cache
length), so no model file is forked and no config is touched: the model sees an ordinary incremental call.
Rolling back after a rejection crops the cache (`DynamicCache.crop` takes the negative count to drop);
nothing is ever recomputed from the prompt.

A token tree is scored in one pass with a 4D additive attention mask (each row sees the cache and its own
ancestors) and per-row position ids (cache length + depth); `commit` then keeps only the accepted path by
copying its rows down the sequence axis of every layer and cropping the rest. Whether a model honours a 4D
mask is probed once per model (tree pass vs one chain pass per branch); where it does not, or where a
sliding-window cache would be exceeded, `supports_tree` says no and the decoder falls back to chains.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.core.masks import additive_mask
from specdec.core.tree import TreeMask
from specdec.errors import UnsupportedModelError
from specdec.runtime.rowwise import row_invariant
from specdec.runtime.base import Scores, as_float_logits, cache_kwarg, check_finite, select_hidden

#: Dtypes whose eager passes run the row-invariant attention (runtime/attention.py) with an explicit mask, so a
#: token's logits do not depend on how many tokens its pass scored. float32 and float64 keep the model's own
#: kernels: they are the reference plain `generate` is checked against, and their rounding rarely decides a token.
EAGER_INVARIANT_DTYPES = (torch.bfloat16, torch.float16)

#: model -> True/False: does a tree pass with a 4D mask match per-branch chain passes? (probed once)
_TREE_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's logits."""
    from specdec.runtime.weights import PackedLinear  # noqa: PLC0415 (imports the kernels' module lazily)

    head = model.get_output_embeddings()
    if isinstance(head, (torch.nn.Linear, PackedLinear)):
        return int(head.out_features)
    return int(model.config.get_text_config().vocab_size)


def context_length(model: PreTrainedModel) -> int | None:
    """The longest sequence the model's position scheme supports, or None if unbounded/unknown."""
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_rollback_support(model: PreTrainedModel) -> None:
    """Raise unless `model` is a causal LM whose KV cache is a croppable DynamicCache."""
    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a Hugging Face causal LM with an LM head; "
            "load it with AutoModelForCausalLM (or specdec.load)"
        )
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps a recurrent state that cannot be rolled back to an earlier "
            "token, so draft tokens cannot be verified and undone; use an attention model as target "
            "and draft (Llama, Qwen2, Mistral, GPT-2, ...)"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model: pass it to specdec.generate / stream / "
            "DraftModel with encoder_inputs=... (docs/seq2seq.md); token trees, heads, layer-skip, bigram "
            "tables and batched decoding drive decoder-only causal LMs only"
        )


def keep_cache_rows(cache, start: int, keep: torch.Tensor) -> None:
    """Move rows start + keep [k] (increasing, relative to start) of every layer down to slots start..start+k−1;
    the caller crops the tail. A prefix keep (0, 1, ..., k−1) moves nothing."""
    k = int(keep.shape[0])
    keep_list = keep.tolist()
    if keep_list == list(range(k)):
        return
    if hasattr(cache, "keep_rows"):
        cache.keep_rows(start, keep_list)  # a cache that stores something else than keys/values
        return
    for layer in cache.layers:
        index = (start + keep).to(layer.keys.device)  # [k]
        # [B, heads, seq, head_dim]
        layer.keys[:, :, start : start + k] = layer.keys.index_select(2, index)
        layer.values[:, :, start : start + k] = layer.values.index_select(2, index)


class CachedCausalLM:
    """A causal LM and its KV cache. `length` tokens are in the cache."""

    capacity = None  # the cache grows
    verifies_in_graph = False

    def __init__(self, model: PreTrainedModel):
        check_rollback_support(model)
        self.model = model
        self.vocab_size = vocab_size(model)
        self.device = next(model.parameters()).device
        self.cache = DynamicCache()
        self.length = 0
        self.forwards = 0  # decoding forward passes since reset (prefill not counted)
        self.forward_s = 0.0  # wall time spent in them
        self.prefill_s = 0.0

    @property
    def context_limit(self) -> int | None:
        return context_length(self.model)

    def prepare(self, tokens: int, buckets: tuple[int, ...]) -> None:
        """Nothing to size: the cache grows, passes take any width."""

    def precompile(self, sizes, *, verify=None) -> None:
        """Nothing to compile: eager."""

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.length = 0
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = 0.0

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append input_ids [n] to the cache; return logits [n, V] (or [1, V] with last_only)."""
        start = time.perf_counter()
        logits, _ = self._run(input_ids, last_only)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return logits

    def score(self, input_ids: torch.Tensor, *, tree: TreeMask | None = None,
              hidden: bool | tuple[int, ...] = False) -> Scores:
        """Append input_ids [M] (a chain, or a tree whose row 0 is the root); logits [M, V] (+ hidden [M, H])."""
        start = time.perf_counter()
        logits, states = self._run(input_ids, False, tree=tree, hidden=hidden)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return Scores(logits, states)

    def prefill(self, input_ids: torch.Tensor, hidden: bool | tuple[int, ...] = False) -> torch.Tensor | None:
        """Cache input_ids [n] without keeping their logits (n may be 0); not a decoding forward.
        With hidden=True return their final hidden states [n, H]."""
        if not input_ids.shape[-1]:
            return None
        start = time.perf_counter()
        _, states = self._run(input_ids, last_only=not hidden, hidden=hidden)
        self.prefill_s += time.perf_counter() - start
        return states

    def score_visible(self, input_ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Append input_ids [m] at position ids positions [m]; row i attends to the cache slots and new rows
        where visible [m, length+m] is True. Logits [m, V]. (A drafter growing a tree level by level feeds
        only the new level; its rows see earlier levels already in the cache.)"""
        start = time.perf_counter()
        mask = additive_mask(visible, self.model.dtype)  # [m, length+m]
        logits, _ = self._run(input_ids, False, positions=positions, mask=mask[None, None])
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return logits

    @torch.inference_mode()
    def _run(self, input_ids: torch.Tensor, last_only: bool, tree: TreeMask | None = None,
             hidden: bool = False, positions: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = input_ids.shape[-1]
        kwargs = {}
        if mask is not None:
            kwargs["attention_mask"] = mask.to(self.device)  # [1, 1, n, L+n]
            positions = positions.to(self.device)
        elif tree is None:
            positions = torch.arange(self.length, self.length + n, device=self.device)  # [n]
        else:
            positions = (self.length + tree.depths).to(self.device)  # [M]
            kwargs["attention_mask"] = tree.additive(self.length, self.model.dtype, self.device)  # [1, 1, M, L+M]
        if hidden:
            kwargs["output_hidden_states"] = True
        invariant = self.model.dtype in EAGER_INVARIANT_DTYPES and sliding_window(self.model) is None
        if invariant and "attention_mask" not in kwargs:  # a chain: the cache, then causal over the new rows
            visible = torch.arange(self.length + n, device=self.device)[None, :] <= positions[:, None]  # [n, L+n]
            kwargs["attention_mask"] = additive_mask(visible, self.model.dtype)[None, None]  # [1, 1, n, L+n]
        with row_invariant(linear=True) if invariant else contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids.view(1, n).to(self.device),
                position_ids=positions[None],
                **cache_kwarg(self.model, self.cache),
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                **kwargs,
            )
        self.length += n
        logits = as_float_logits(out.logits[0])  # [n or 1, V]
        check_finite(logits, self.model, f"at positions {self.length - n}..{self.length - 1}")
        states = select_hidden(out.hidden_states, hidden) if hidden else None  # [n, H] (or [n, len * H])
        return logits, states

    def crop(self, length: int) -> None:
        """Roll the cache back to its first `length` tokens."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length

    @torch.inference_mode()
    def commit(self, start: int, keep: torch.Tensor) -> None:
        """After a score that began at slot `start`, keep rows keep [k] (increasing, relative to start) at
        slots start..start+k−1; length = start + k. A prefix keep (0, 1, ..., k−1) is a crop."""
        keep_cache_rows(self.cache, start, keep)
        self.crop(start + int(keep.shape[0]))

    def supports_tree(self, num_rows: int, warn: bool = True) -> bool:
        """Can a tree of `num_rows` rows (root included) be scored now? Probed once per model; False past a
        sliding window (the 4D mask would let rows see keys the window must hide)."""
        window = sliding_window(self.model)
        if window is not None and self.length + num_rows > window:
            return False
        supported = _TREE_PROBES.get(self.model)
        if supported is None:
            supported = _TREE_PROBES[self.model] = _probe_tree(self.model, self.device)
            if not supported and warn:
                warnings.warn(
                    f"{type(self.model).__name__} does not honour a 4D attention mask (a tree pass disagrees "
                    "with per-branch passes), so token trees are verified as chains (the first branch) with "
                    "this model; use a Llama/Qwen2/Mistral-style target for tree drafting",
                    stacklevel=3,
                )
        return supported


def sliding_window(model: PreTrainedModel) -> int | None:
    """The attention window of a model whose config names one and whose layers use it (None: full attention)."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None) or []
    if layer_types and not any("sliding" in str(t) for t in layer_types):
        return None
    return window


@torch.inference_mode()
def _probe_tree(model: PreTrainedModel, device: torch.device) -> bool:
    """Score a small tree (two branches of depth 2 under a 3-token context) in one pass with a 4D mask and
    compare every row with a plain chain pass along its branch."""
    vocab = vocab_size(model)
    context = torch.tensor([1, 2, 3], device=device) % vocab  # [3]; the last token is the root
    tokens = torch.tensor([4, 5, 6, 7], device=device) % vocab  # nodes 0..3
    parents = torch.tensor([-1, -1, 0, 1])  # branches root-0-2 and root-1-3
    probe = CachedCausalLM(model)
    probe.prefill(context[:-1])
    tree_logits = probe.score(torch.cat([context[-1:], tokens]), tree=TreeMask.from_parents(parents)).logits
    for branch in ([0, 2], [1, 3]):
        chain = CachedCausalLM(model)
        chain.prefill(context[:-1])
        logits = chain.forward(torch.cat([context[-1:], tokens[branch]]))  # [3, V]
        rows = [0] + [i + 1 for i in branch]
        tol = 1e-4 * max(1.0, float(logits.abs().max()))
        if not torch.allclose(tree_logits[rows], logits, atol=tol, rtol=1e-3):
            return False
    return True
