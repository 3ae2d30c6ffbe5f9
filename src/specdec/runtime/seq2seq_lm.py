"""`CachedSeq2SeqLM`: an encoder-decoder model (T5, BART, Marian, Whisper) as a decoder the loop can drive.

The decode loop only ever speaks to a decoder: feed tokens, get logits, roll back. For an encoder-decoder
model the encoder runs once per request (`reset(encoder_inputs=...)`), its output is kept, and each decoder
call attends to it. The model's cache is transformers' `EncoderDecoderCache(self_attention, cross_attention)`:
the cross-attention keys/values are computed on the first decoder call of a request and never change, so a
rollback crops only the self-attention part (`EncoderDecoderCache.crop` does exactly that). Decoder positions
come from the cache length (`cache_position`), so no model file is forked and no config is touched.

Token trees are scored in one pass where the decoder takes each row's position from the caller
(`decoder_position_ids`, Whisper) and honours a 4D self-attention mask (probed once per model): rows get
position length + depth and see the cache and their own ancestors; `commit` keeps the accepted path by
moving its self-attention rows down, as `CachedCausalLM.commit` does. Decoders that derive positions from the
cache length (BART, Marian: absolute positions = slot index; T5: a relative position bias over slot indices)
cannot place sibling nodes at one position: `tree_unsupported_reason` names why, and the decoder refuses tree
drafters for them. The fast path (`compile=True`) is not available and falls back to this adapter with one
`FastPathWarning`. See docs/seq2seq.md.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
import weakref
from collections.abc import Mapping

import torch
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from specdec.core.masks import additive_mask
from specdec.core.tree import TreeMask
from specdec.errors import PromptError, UnsupportedModelError
from specdec.runtime.base import Scores, as_float_logits, cache_kwarg, check_finite, select_hidden
from specdec.runtime.causal_lm import keep_cache_rows, vocab_size
from specdec.runtime.compiled import FastPathWarning

#: model -> True/False: does a decoder tree pass with a 4D mask match per-branch chain passes? (probed once)
_TREE_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_encoder_decoder(model: object) -> bool:
    """True for a Hugging Face encoder-decoder model (T5, BART, Marian, Whisper, ...)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "is_encoder_decoder", False))


def seq2seq_adapter(model: PreTrainedModel, compile: bool | str = False) -> CachedSeq2SeqLM:
    """The adapter for an encoder-decoder model; compile=True/"static" warns once and decodes eagerly."""
    if compile:
        warnings.warn(
            f"specdec fast path unavailable, decoding eagerly instead (same tokens): {type(model).__name__} is an "
            "encoder-decoder model, and the slot cache covers decoder-only models only",
            FastPathWarning, stacklevel=3,
        )
    return CachedSeq2SeqLM(model)


def tree_unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why this encoder-decoder model's decoder cannot score a token tree in one pass (None: it can).

    A tree pass puts sibling nodes at one position while they sit in different cache slots, so the decoder
    must take positions from the caller; HF's T5, BART and Marian decoders compute them from the cache length.
    """
    name = type(model).__name__
    if _takes_decoder_positions(type(model)):
        return None
    config = model.config
    if getattr(config, "relative_attention_num_buckets", None) is not None:
        return (f"{name}'s decoder adds a relative position bias computed from cache slot indices, so tree "
                "nodes (siblings share a position but not a slot) cannot be given their positions without "
                "forking the model")
    return (f"{name}'s decoder derives each token's absolute position from the cache length and takes no "
            "position ids, so tree nodes (siblings share a position but not a slot) would be scored at the "
            "wrong positions")


@functools.cache
def _takes_decoder_positions(cls: type) -> bool:
    """Does the class's forward take decoder_position_ids? (The class, not the instance: a check may patch it.)"""
    return "decoder_position_ids" in inspect.signature(cls.forward).parameters


def decoder_context_length(model: PreTrainedModel) -> int | None:
    """The longest decoder sequence the model's positions support (None: relative positions, unbounded)."""
    config = model.config
    for name in ("max_target_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def decoder_start_ids(model: PreTrainedModel) -> list[int]:
    """The default decoder prompt: [decoder_start_token_id] from the generation config (or the config)."""
    for source in (getattr(model, "generation_config", None), model.config):
        start = getattr(source, "decoder_start_token_id", None)
        if isinstance(start, int):
            return [start]
        if isinstance(start, (list, tuple)) and start and all(isinstance(s, int) for s in start):
            return list(start)
    raise PromptError(
        f"{type(model).__name__} has no decoder_start_token_id in its generation config; pass the decoder "
        "prompt explicitly: specdec.generate(target, [start_token_id, ...], encoder_inputs=...)"
    )


class CachedSeq2SeqLM:
    """An encoder-decoder model, its encoder output for the current request, and its decoder KV cache.
    `length` decoder tokens are in the self-attention cache."""

    capacity = None  # the cache grows
    verifies_in_graph = False

    def __init__(self, model: PreTrainedModel):
        if not isinstance(model, PreTrainedModel) or not is_encoder_decoder(model):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a Hugging Face encoder-decoder model; load it with "
                "AutoModelForSeq2SeqLM / AutoModelForSpeechSeq2Seq (or specdec.load)"
            )
        if model.get_output_embeddings() is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no LM head; load it with AutoModelForSeq2SeqLM / "
                "AutoModelForSpeechSeq2Seq (e.g. T5ForConditionalGeneration, not T5Model)"
            )
        self.model = model
        self.vocab_size = vocab_size(model)
        self.device = next(model.parameters()).device
        self.main_input = model.main_input_name  # "input_ids" (text) or "input_features" (Whisper)
        self.encoder_outputs = None  # this request's encoder output (a BaseModelOutput)
        self.encoder_mask: torch.Tensor | None = None  # [1, S] for text encoders, None for Whisper
        self.encoder_input_ids: torch.Tensor | None = None  # [S] the source tokens (text encoders), for lookup
        self.cache = self._new_cache()
        self.length = 0
        self.forwards = 0  # decoding passes since reset (prefill and encoder not counted)
        self.forward_s = 0.0
        self.prefill_s = 0.0  # encoder + decoder prompt

    @staticmethod
    def _new_cache() -> EncoderDecoderCache:
        return EncoderDecoderCache(DynamicCache(), DynamicCache())

    @property
    def context_limit(self) -> int | None:
        return decoder_context_length(self.model)

    def prepare(self, tokens: int, buckets: tuple[int, ...]) -> None:
        """Nothing to size: the cache grows, passes take any width."""

    def precompile(self, sizes, *, verify=None) -> None:
        """Nothing to compile: eager."""

    def decoder_prompt(self) -> list[int]:
        return decoder_start_ids(self.model)

    def reset(self, encoder_inputs: Mapping[str, object] | None = None) -> None:
        """Start a new request: run the encoder on `encoder_inputs` (required), empty the decoder cache."""
        if encoder_inputs is None:
            raise PromptError(
                f"{type(self.model).__name__} is an encoder-decoder model and needs its encoder's input: pass "
                f"encoder_inputs={{'{self.main_input}': ...}} (e.g. tokenizer(source_text) or a feature "
                "extractor's output) to specdec.generate / stream"
            )
        start = time.perf_counter()
        inputs = check_encoder_inputs(self.model, encoder_inputs)
        self.encoder_mask = inputs.get("attention_mask")
        self.encoder_input_ids = inputs["input_ids"][0] if "input_ids" in inputs else None
        with torch.inference_mode():
            self.encoder_outputs = self.model.get_encoder()(**inputs)
        self.cache = self._new_cache()
        self.length = 0
        self.forwards = 0
        self.forward_s = 0.0
        self.prefill_s = time.perf_counter() - start

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append decoder tokens input_ids [n]; return logits [n, V] (or [1, V] with last_only)."""
        start = time.perf_counter()
        logits, _ = self._run(input_ids, hidden=False)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return logits[-1:] if last_only else logits

    def score(self, input_ids: torch.Tensor, *, tree=None, hidden: bool = False) -> Scores:
        """Append decoder tokens input_ids [M] (a chain, or a tree whose row 0 is the root); logits [M, V]
        (+ decoder hidden states [M, H])."""
        positions = mask = None
        if tree is not None:
            reason = tree_unsupported_reason(self.model)
            if reason is not None:
                raise UnsupportedModelError(f"{reason}; draft chains for this target (DraftModel, PromptLookup)")
            positions = self.length + tree.depths  # [M]
            mask = tree.additive(self.length, self.model.dtype, self.device)  # [1, 1, M, L+M]
        start = time.perf_counter()
        logits, states = self._run(input_ids, hidden=hidden, positions=positions, mask=mask)
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return Scores(logits, states)

    def prefill(self, input_ids: torch.Tensor, hidden: bool = False) -> torch.Tensor | None:
        """Cache decoder tokens input_ids [n] (n may be 0) without keeping their logits."""
        if not input_ids.shape[-1]:
            return input_ids.new_zeros((0, self.model.config.get_text_config().d_model), dtype=torch.float) \
                if hidden else None
        start = time.perf_counter()
        _, states = self._run(input_ids, hidden=hidden)
        self.prefill_s += time.perf_counter() - start
        return states

    def score_visible(self, input_ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Append decoder tokens input_ids [m] at positions [m]; row i sees the cache slots and new rows where
        visible [m, length+m] is True. Logits [m, V] (a tree drafter growing one level per pass)."""
        mask = additive_mask(visible, self.model.dtype)  # [m, length+m]
        start = time.perf_counter()
        logits, _ = self._run(input_ids, hidden=False, positions=positions, mask=mask[None, None].to(self.device))
        self.forwards += 1
        self.forward_s += time.perf_counter() - start
        return logits

    @torch.inference_mode()
    def _run(self, input_ids: torch.Tensor, hidden: bool, positions: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.encoder_outputs is None:
            raise PromptError("call reset(encoder_inputs=...) before decoding with an encoder-decoder model")
        n = input_ids.shape[-1]
        kwargs = {}
        if mask is not None:  # a tree: each row's position and who it sees come from the caller
            kwargs["decoder_attention_mask"] = mask  # [1, 1, n, L+n]
            kwargs["decoder_position_ids"] = positions.to(self.device)[None]  # [1, n]
        out = self.model(
            encoder_outputs=self.encoder_outputs,
            attention_mask=self.encoder_mask,  # [1, S] source padding mask (None: no mask)
            decoder_input_ids=input_ids.view(1, n).to(self.device),
            **cache_kwarg(self.model, self.cache),
            cache_position=torch.arange(self.length, self.length + n, device=self.device),  # [n] cache slots
            use_cache=True,
            output_hidden_states=hidden,
            **kwargs,
        )
        self.length += n
        logits = as_float_logits(out.logits[0])  # [n, V]
        check_finite(logits, self.model, f"at decoder positions {self.length - n}..{self.length - 1}")
        # A memo engine's output (exactness.engine) holds decoder_hidden_states only when they were asked for.
        states = select_hidden(out.decoder_hidden_states, hidden) if hidden else None  # [n, H]
        return logits, states

    def crop(self, length: int) -> None:
        """Roll the decoder's self-attention cache back to its first `length` tokens (cross-attention kept)."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length

    @torch.inference_mode()
    def commit(self, start: int, keep: torch.Tensor) -> None:
        """After a score that began at slot `start`, keep rows keep [k] (increasing, relative to start) at
        slots start..start+k−1 of the self-attention cache (cross-attention untouched); a prefix is a crop."""
        k = int(keep.shape[0])
        keep_cache_rows(self.cache.self_attention_cache, start, keep)
        self.crop(start + k)

    def supports_tree(self, num_rows: int, warn: bool = True) -> bool:
        """Can a tree be scored in one pass? Only where `tree_unsupported_reason` is None and a probe tree pass
        matches per-branch chain passes (once per model)."""
        if tree_unsupported_reason(self.model) is not None:
            return False
        limit = self.context_limit
        if limit is not None and self.length + num_rows > limit:
            return False
        supported = _TREE_PROBES.get(self.model)
        if supported is None:
            supported = _TREE_PROBES[self.model] = self._probe_tree()
        return supported

    def _probe_tree(self) -> bool:
        """Score a small tree (two branches of depth 2 after the decoder start) in one pass on this request's
        encoder output and compare every row with a chain pass along its branch."""
        probe = CachedSeq2SeqLM(self.model)
        if self.encoder_outputs is None:
            raise PromptError("call reset(encoder_inputs=...) before asking an encoder-decoder model for trees")

        def restart() -> None:
            probe.encoder_outputs, probe.encoder_mask = self.encoder_outputs, self.encoder_mask
            probe.cache, probe.length = probe._new_cache(), 0

        root = torch.tensor(self.decoder_prompt()[-1:])  # [1]
        tokens = torch.tensor([4, 5, 6, 7]) % self.vocab_size  # nodes 0..3
        restart()
        tree = TreeMask.from_parents(torch.tensor([-1, -1, 0, 1]))  # branches root-0-2 and root-1-3
        tree_logits = probe.score(torch.cat([root, tokens]), tree=tree).logits  # [5, V]
        for branch in ([0, 2], [1, 3]):
            restart()
            logits = probe.forward(torch.cat([root, tokens[branch]]))  # [3, V]
            rows = [0] + [i + 1 for i in branch]
            tol = 1e-4 * max(1.0, float(logits.abs().max()))
            if not torch.allclose(tree_logits[rows], logits, atol=tol, rtol=1e-3):
                return False
        return True


def check_encoder_inputs(model: PreTrainedModel, encoder_inputs: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """`encoder_inputs` as the batch-of-one tensors the encoder takes, or a PromptError naming the fix.

    Text encoders: input_ids [S] or [1, S] (ids inside the vocabulary) and an optional attention_mask.
    Whisper: input_features [num_mel_bins, frames] or [1, num_mel_bins, frames] with the model's frame count.
    """
    if not isinstance(encoder_inputs, Mapping):
        raise PromptError(
            f"encoder_inputs must be a mapping such as {{'input_ids': ...}} or a tokenizer's / feature extractor's "
            f"output, got {type(encoder_inputs).__name__}"
        )
    device = next(model.parameters()).device
    main = model.main_input_name
    allowed = {main, "attention_mask"}
    unknown = sorted(set(encoder_inputs) - allowed)
    if unknown:
        raise PromptError(
            f"encoder_inputs has {unknown}, which {type(model).__name__}'s encoder does not take; pass only "
            f"{sorted(allowed)}"
        )
    if main not in encoder_inputs:
        raise PromptError(
            f"encoder_inputs lacks '{main}', the input {type(model).__name__}'s encoder reads; pass "
            f"encoder_inputs={{'{main}': ...}}"
        )
    value = encoder_inputs[main]
    out: dict[str, torch.Tensor] = {}
    if main == "input_features":
        feats = torch.as_tensor(value)
        if feats.dim() == 2:
            feats = feats[None]
        config = model.config
        mels = getattr(config, "num_mel_bins", None)
        frames = 2 * getattr(config, "max_source_positions", 0) or None  # the encoder's conv stride 2 halves them
        if feats.dim() != 3 or feats.shape[0] != 1 or (mels is not None and feats.shape[1] != mels) or (
                frames is not None and feats.shape[2] != frames) or not feats.dtype.is_floating_point:
            raise PromptError(
                f"input_features must be one log-mel spectrogram of shape [{mels}, {frames}] (or [1, {mels}, "
                f"{frames}]) for this model, got shape {tuple(feats.shape)} and dtype {feats.dtype}; compute it with "
                "the model's feature extractor (specdec.load returns it), padded or trimmed to "
                f"{frames} frames"
            )
        out[main] = feats.to(device, model.dtype)
    else:
        ids = torch.as_tensor(value)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.numel() == 0:
            raise PromptError(
                f"encoder_inputs['{main}'] must be one non-empty sequence of token ids (a list, a 1-D tensor or a "
                f"batch of one), got shape {tuple(ids.shape)}; pass tokenizer(source_text).input_ids"
            )
        vocab = model.config.get_text_config().vocab_size
        if bool(((ids < 0) | (ids >= vocab)).any()):
            raise PromptError(
                f"encoder input ids must lie in [0, {vocab}); tokenize the source with the model's own tokenizer"
            )
        out[main] = ids.to(device, torch.long)[None]  # [1, S]
    mask = encoder_inputs.get("attention_mask")
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.dim() == 1:
            mask = mask[None]
        if main == "input_features":
            mask = None  # Whisper's encoder takes no mask (features are padded to a fixed length)
        elif tuple(mask.shape) != tuple(out[main].shape):
            raise PromptError(
                f"encoder attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(out[main].shape)}; "
                "pass the mask the tokenizer returned with these ids, or none"
            )
        if mask is not None:
            out["attention_mask"] = mask.to(device, torch.long)
    return out


class FixedSourceDecoder(torch.nn.Module):
    """An encoder-decoder model conditioned on one fixed encoder input, called like a causal LM on decoder
    ids: `forward(input_ids=[b, m], use_cache=False, logits_to_keep=k)` -> an output with `.logits`. The
    exactness reference (teacher-forced, uncached) computes the target's distributions through it."""

    def __init__(self, model: PreTrainedModel, encoder_inputs: Mapping[str, object]):
        super().__init__()
        self.model = model
        self.config = model.config
        self.generation_config = model.generation_config
        self.inputs = check_encoder_inputs(model, encoder_inputs)  # batch of one

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, logits_to_keep: int = 0, **_):
        b = input_ids.shape[0]
        inputs = {k: v.expand(b, *v.shape[1:]) for k, v in self.inputs.items()}  # [b, ...]
        out = self.model(**inputs, decoder_input_ids=input_ids, use_cache=False)
        if logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]  # [b, k, V]
        return out
